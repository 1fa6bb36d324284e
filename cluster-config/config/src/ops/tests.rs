//! Tests of `ops`.

use super::*;
use engram_protocol::control::{Connections, LoadState, ServiceTime, TableStatus};

fn config(tls: &str) -> Config {
    let text = format!(
        "version = 1\n[rack]\nname = \"r\"\n{tls}\n\
             [[table]]\nid = 1\nlayer = 1\npath = \"/t/l1.etab\"\nrows = 10\ndigest = \"{}\"\n\
             [[donor]]\nname = \"d\"\nlisten = [\"127.0.0.1:7410\"]\ntables = [1]\nram_gib = 1.0\n\
             control = \"127.0.0.1:7411\"\n",
        "ab".repeat(32)
    );
    Config::parse(&text, std::path::Path::new("/etc/engram-rack/rack.toml")).expect("config")
}

#[test]
fn the_operator_is_the_only_one_unless_named() {
    let plain = config("");
    assert_eq!(operator(&plain, None).expect("plaintext"), None);
    assert_eq!(operator(&plain, Some("ops")).expect("ignored"), None);
    let one = config("[rack.tls]\noperators = [\"ops\"]");
    assert_eq!(operator(&one, None).expect("one"), Some("ops".into()));
    assert_eq!(
        operator(&one, Some("other")).expect("named"),
        Some("other".into())
    );
    let two = config("[rack.tls]\noperators = [\"ops\", \"ops-2\"]");
    let e = operator(&two, None).expect_err("two");
    assert!(
        e.to_string()
            .contains("several operators (ops, ops-2): choose one with --as"),
        "{e}"
    );
    let none = config("[rack.tls]\noperators = []");
    let e = operator(&none, None).expect_err("none");
    assert!(e.to_string().contains("names no operators"), "{e}");
}

#[test]
fn refusals_name_the_donor() {
    let e = call_error(
        "donor-a",
        "Drain",
        &tonic::Status::permission_denied("n is a node"),
    );
    assert_eq!(e.to_string(), "donor-a refused: n is a node");
    let e = call_error("donor-a", "SwapTable", &tonic::Status::not_found("table 9"));
    assert_eq!(
        e.to_string(),
        "donor-a: SwapTable failed: NotFound: table 9"
    );
}

#[test]
fn without_a_config_donors_are_addresses() {
    let dialer = Dialer {
        config: None,
        material: None,
    };
    let t = dialer.target("127.0.0.1:7411").expect("an address");
    assert_eq!((t.name.as_str(), t.addr.port()), ("127.0.0.1:7411", 7411));
    let e = dialer.target("donor-a").expect_err("a name");
    assert!(
        e.to_string()
            .contains("\"donor-a\" is not a control address (HOST:PORT)")
            && e.to_string().contains("pass --config FILE"),
        "{e}"
    );
    let e = dialer.all().expect_err("no config, no list");
    assert!(e.to_string().contains("name the donors to ask"), "{e}");
    let named = Dialer {
        config: Some(config("")),
        material: None,
    };
    assert_eq!(named.all().expect("all"), vec!["d".to_string()]);
    let t = named.target("d").expect("d");
    assert_eq!(t.addr.to_string(), "127.0.0.1:7411");
    let e = named.target("127.0.0.1:7411").expect_err("not a name");
    assert!(e.to_string().contains("no donor named"), "{e}");
}

#[test]
fn status_is_a_short_table() {
    let state = DonorReport {
        donor: "donor-a".into(),
        addr: "10.0.0.11:7411".parse().expect("addr"),
        health: "SERVING".into(),
        tables: ListTablesResponse {
            donor: "donor-a".into(),
            tables: vec![TableStatus {
                id: 1,
                digest: "0123456789abcdef".repeat(4),
                state: LoadState::Ready.into(),
                ..TableStatus::default()
            }],
            draining: false,
        },
        stats: StatsResponse {
            lookups: 42,
            connections: Some(Connections {
                open: 3,
                ..Connections::default()
            }),
            service_time: Some(ServiceTime {
                p99_us: 87.0,
                ..ServiceTime::default()
            }),
            uptime_seconds: 3725.0,
            ..StatsResponse::default()
        },
    };
    let out = render(&[
        ("donor-a".into(), Ok(state)),
        ("donor-b".into(), Err("refused: no".into())),
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("DONOR    CONTROL"), "{out}");
    assert!(
        lines[1].starts_with("donor-a  10.0.0.11:7411  SERVING")
            && lines[1].contains("1:ready:0123456789ab")
            && lines[1].contains(" 42 ")
            && lines[1].contains("87.0")
            && lines[1].ends_with("1h02m"),
        "{out}"
    );
    assert_eq!(lines[2], "donor-b: refused: no");
}

#[test]
fn detail_shows_every_table_and_counter() {
    let state = DonorReport {
        donor: "donor-a".into(),
        addr: "10.0.0.11:7411".parse().expect("addr"),
        health: "NOT_SERVING".into(),
        tables: ListTablesResponse {
            donor: "donor-a".into(),
            tables: vec![TableStatus {
                id: 1,
                layer: 1,
                rows: 10,
                state: LoadState::Loading.into(),
                bytes_done: 1,
                bytes_total: 4,
                path: "/t/l1.etab".into(),
                ..TableStatus::default()
            }],
            draining: true,
        },
        stats: StatsResponse {
            lookups: 3,
            rows: 72,
            errors: vec![engram_protocol::control::ErrorCount {
                name: "row_out_of_range".into(),
                code: 3,
                count: 1,
            }],
            uptime_seconds: 61.0,
            ..StatsResponse::default()
        },
    };
    let out = render_detail(&state);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "donor-a (10.0.0.11:7411): NOT_SERVING (draining)",
            "  table 1 layer 1 rows 10 digest - loading 25.0% /t/l1.etab",
            "  lookups 3 rows 72 bytes 0",
            "  errors row_out_of_range (3): 1",
            "  uptime 1m01s",
        ]
    );
}
