//! One test per rule: each bad input names the right line and key.

use super::node::parse_hedge;
use super::*;
use crate::{Hedge, Policy, SourceRef, SsdIo};

const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const D14: &str = "e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4e4";

fn good() -> String {
    format!(
        r#"version = 1

[rack]
name = "demo"
tls = {{ operators = ["alice"] }}
[[table]]
id = 1
layer = 1
path = "tables/layer1.etab"
rows = 384006168
digest = "{D1}"

[[table]]
id = 14
layer = 14
path = "/srv/engram/layer14.etab"
rows = 384016682
digest = "{D14}"

[[donor]]
name = "donor-a"
listen = ["0.0.0.0:7410"]
advertise = ["10.1.0.5:7410"]
tables = [1, 14]
ram_gib = 251.0

[[donor]]
name = "donor-b"
listen = ["127.0.0.2:7410"]
tables = [1]
ram_gib = 125.5
max_rows = 4096
mlock = "require"
idle_timeout_ms = 0

[[node]]
name = "gpu-1"
lookup_timeout_ms = 40

[[node.route]]
table = 1
sources = ["donor-b", "donor-a", "ssd"]
ssd_path = "ssd/layer1.etab"

[[node.route]]
table = 14
sources = ["donor-a", "local"]
"#
    )
}

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("/etc/engram-rack/rack.toml"))
}

fn diags(text: &str) -> Vec<Diagnostic> {
    match parse(text) {
        Err(ConfigError::Invalid(d)) => d,
        other => panic!("expected diagnostics, got {other:?}"),
    }
}

/// Replace `from` (which must occur) in the good config and expect a
/// diagnostic on `line` whose key contains `key` and message contains `msg`.
fn expect(from: &str, to: &str, line: usize, key: &str, msg: &str) {
    let text = good();
    assert!(text.contains(from), "{from:?} not in the good config");
    expect_in(&text.replacen(from, to, 1), line, key, msg);
}

/// Expect a diagnostic on `line` whose key contains `key` and message
/// contains `msg` for config `text`.
fn expect_in(text: &str, line: usize, key: &str, msg: &str) {
    let d = diags(text);
    assert!(
        d.iter()
            .any(|d| d.line == line && d.key.contains(key) && d.message.contains(msg)),
        "no diagnostic at line {line} for {key:?} containing {msg:?}; got:\n{}",
        d.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_good_config_parses_with_defaults_and_resolved_paths() {
    let c = parse(&good()).expect("valid");
    assert_eq!(c.rack, "demo");
    assert_eq!(c.tables.len(), 2);
    assert_eq!(
        c.table(1).map(|t| t.path.clone()),
        Some(PathBuf::from("/etc/engram-rack/tables/layer1.etab"))
    );
    assert_eq!(
        c.table(14).map(|t| t.path.clone()),
        Some(PathBuf::from("/srv/engram/layer14.etab"))
    );
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(
        a.advertise,
        vec![Endpoint::new(
            Transport::Tls,
            "10.1.0.5:7410".parse::<SocketAddr>().expect("addr")
        )]
    );
    assert_eq!(
        (a.max_connections, a.max_rows, a.mlock),
        (256, DEFAULT_MAX_ROWS, MlockMode::Try)
    );
    assert_eq!(a.hello_timeout, Duration::from_secs(5));
    assert_eq!(
        (a.fd_store, a.map_files, a.load_threads, a.busy_poll),
        (true, true, 0, Duration::ZERO),
        "fd store on, the files' pages, every core, no busy-poll by default"
    );
    let b = c.donor("donor-b").expect("donor-b");
    assert_eq!(
        b.advertise, b.listen,
        "advertise defaults to a concrete listen address"
    );
    assert_eq!(
        (b.max_rows, b.mlock, b.idle_timeout),
        (4096, MlockMode::Require, Duration::ZERO)
    );
    let n = c.node("gpu-1").expect("node");
    assert_eq!(n.lookup_timeout, Duration::from_millis(40));
    assert_eq!(n.connect_timeout, Duration::from_secs(1));
    assert_eq!(
        n.routes[0].sources,
        vec![
            SourceRef::Donor("donor-b".into()),
            SourceRef::Donor("donor-a".into()),
            SourceRef::Ssd
        ]
    );
    assert_eq!(
        n.routes[0].ssd_path,
        PathBuf::from("/etc/engram-rack/ssd/layer1.etab")
    );
    assert_eq!(
        n.routes[1].ssd_path,
        PathBuf::from("/srv/engram/layer14.etab"),
        "defaults to the table path"
    );
}

#[test]
fn syntax_errors_and_unknown_keys_point_at_their_line() {
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nram = 3",
        26,
        "ram",
        "unknown field",
    );
    expect(
        "name = \"gpu-1\"",
        "name = \"gpu-1\"\nlookup_timeout = 40",
        38,
        "lookup_timeout",
        "unknown field",
    );
    expect("layer = 14", "layer = = 14", 15, "", "");
    expect(
        "version = 1",
        "version = 1\nversion = 2",
        2,
        "",
        "duplicate",
    );
    expect(
        "rows = 384006168",
        "rows = \"many\"",
        10,
        "many",
        "expected i64",
    );
}

#[test]
fn schema_version_and_rack_name() {
    expect("version = 1", "version = 2", 1, "version", "not supported");
    expect(
        "name = \"demo\"",
        "name = \"\"",
        4,
        "rack.name",
        "not a name",
    );
    expect(
        "name = \"demo\"",
        "name = \"de mo\"",
        4,
        "rack.name",
        "not a name",
    );
}

#[test]
fn table_rules() {
    expect("id = 14", "id = 1", 14, "table[1].id", "defined twice");
    expect("id = 14", "id = -3", 14, "table[1].id", "out of range");
    expect(
        "layer = 14",
        "layer = 5000",
        15,
        "table[1].layer",
        "out of range",
    );
    expect(
        "rows = 384016682",
        "rows = 0",
        17,
        "table[1].rows",
        "out of range",
    );
    expect(
        &format!("digest = \"{D14}\""),
        "digest = \"abc\"",
        18,
        "table[1].digest",
        "64 hex",
    );
    expect(
        "path = \"/srv/engram/layer14.etab\"",
        "path = \" \"",
        16,
        "table[1].path",
        "empty",
    );
}

#[test]
fn donor_rules() {
    expect(
        "name = \"donor-b\"",
        "name = \"donor-a\"",
        28,
        "donor[1].name",
        "defined twice",
    );
    expect(
        "name = \"donor-b\"",
        "name = \"ssd\"",
        28,
        "donor[1].name",
        "reserved",
    );
    expect(
        "listen = [\"127.0.0.2:7410\"]",
        "listen = [\"127.0.0.2\"]",
        29,
        "donor[1].listen[0]",
        "IP:PORT",
    );
    expect(
        "listen = [\"127.0.0.2:7410\"]",
        "listen = []",
        29,
        "donor[1].listen",
        "at least one",
    );
    expect(
        "listen = [\"127.0.0.2:7410\"]",
        "listen = [\"127.0.0.2:7410\", \"127.0.0.2:7410\"]",
        29,
        "donor[1].listen[1]",
        "twice",
    );
    expect(
        "advertise = [\"10.1.0.5:7410\"]\n",
        "",
        22,
        "donor[0].listen",
        "needs `advertise`",
    );
    expect(
        "advertise = [\"10.1.0.5:7410\"]",
        "advertise = [\"0.0.0.0:7410\"]",
        23,
        "donor[0].advertise[0]",
        "cannot be dialled",
    );
    expect(
        "tables = [1, 14]",
        "tables = [1, 7]",
        24,
        "donor[0].tables[1]",
        "table 7 is not defined (defined: 1, 14)",
    );
    expect(
        "tables = [1, 14]",
        "tables = [1, 1]",
        24,
        "donor[0].tables[1]",
        "listed twice",
    );
    expect(
        "tables = [1]",
        "tables = []",
        30,
        "donor[1].tables",
        "at least one",
    );
    expect(
        "ram_gib = 125.5",
        "ram_gib = -1.0",
        31,
        "donor[1].ram_gib",
        "not a RAM size",
    );
    expect(
        "max_rows = 4096",
        "max_rows = 10",
        32,
        "donor[1].max_rows",
        "out of range",
    );
    expect(
        "mlock = \"require\"",
        "mlock = \"always\"",
        33,
        "donor[1].mlock",
        "not one of",
    );
    expect(
        "idle_timeout_ms = 0",
        "idle_timeout_ms = -5",
        34,
        "donor[1].idle_timeout_ms",
        "out of range",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nhello_timeout_ms = 0",
        26,
        "donor[0].hello_timeout_ms",
        "out of range",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nmax_connections = 0",
        26,
        "donor[0].max_connections",
        "out of range",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nbusy_poll_us = 20000",
        26,
        "donor[0].busy_poll_us",
        "out of range",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nload_threads = -1",
        26,
        "donor[0].load_threads",
        "out of range",
    );
    let c = parse(&good().replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nbusy_poll_us = 50\nload_threads = 3\nfd_store = false\nmap_files = true",
        1,
    ))
    .expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(
        (a.fd_store, a.map_files, a.load_threads, a.busy_poll),
        (false, true, 3, Duration::from_micros(50))
    );
}

#[test]
fn all_problems_are_reported_at_once() {
    let text = good().replacen("layer = 14", "layer = 5000", 1).replacen(
        "mlock = \"require\"",
        "mlock = \"x\"",
        1,
    );
    assert_eq!(diags(&text).len(), 2);
    let shown = ConfigError::Invalid(diags(&text)).to_string();
    assert!(
        shown.contains("/etc/engram-rack/rack.toml:15:9: table[1].layer: 5000 is out of range"),
        "{shown}"
    );
}

#[test]
fn load_reads_files_and_refuses_missing_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("rack.toml");
    std::fs::write(&p, good()).expect("write");
    let c = Config::load(&p).expect("loads");
    assert_eq!(
        c.table(1).map(|t| t.path.clone()),
        Some(dir.path().join("tables/layer1.etab"))
    );
    assert!(matches!(
        Config::load(&dir.path().join("nope.toml")),
        Err(ConfigError::Io { .. })
    ));
}

#[test]
fn credentials_are_read_trimmed_and_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("rack.toml");
    let text = good().replacen(
        "name = \"demo\"",
        "name = \"demo\"\ncredential_file = \"secret\"",
        1,
    );
    std::fs::write(&p, text).expect("write");
    let c = Config::load(&p).expect("loads");
    assert!(
        c.credential().is_err(),
        "a missing credential file is an error"
    );
    std::fs::write(dir.path().join("secret"), "s3cret\n").expect("write");
    assert_eq!(c.credential().expect("reads"), Some(b"s3cret".to_vec()));
    std::fs::write(dir.path().join("secret"), "\n").expect("write");
    assert!(c.credential().is_err(), "an empty credential is an error");
}

#[test]
fn control_and_metrics_addresses() {
    let text = good().replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\ncontrol = \"0.0.0.0:7411\"\nmetrics = \"127.0.0.1:9410\"",
        1,
    );
    let c = parse(&text).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    let addr = |s: &str| s.parse::<SocketAddr>().expect("addr");
    assert_eq!(a.control, Some(addr("0.0.0.0:7411")));
    assert_eq!(a.metrics, Some(addr("127.0.0.1:9410")));
    assert_eq!(
        a.control_endpoint(),
        Some(addr("10.1.0.5:7411")),
        "a wildcard control address is dialled at the advertised IP"
    );
    let b = c.donor("donor-b").expect("donor-b");
    assert_eq!(
        (b.control, b.metrics, b.control_endpoint()),
        (None, None, None)
    );
    // Another IP on the data plane's port is its own address.
    let other_ip = good().replacen(
        "ram_gib = 125.5",
        "ram_gib = 125.5\ncontrol = \"127.0.0.3:7410\"",
        1,
    );
    let c = parse(&other_ip).expect("valid");
    let b = c.donor("donor-b").expect("donor-b");
    assert_eq!(b.control_endpoint(), Some(addr("127.0.0.3:7410")));

    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\ncontrol = \"localhost:7411\"",
        26,
        "donor[0].control",
        "not IP:PORT",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nmetrics = \"9410\"",
        26,
        "donor[0].metrics",
        "not IP:PORT",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\ncontrol = \"10.1.0.5:7410\"",
        26,
        "donor[0].control",
        "collides with listen address 0.0.0.0:7410",
    );
    expect(
        "ram_gib = 125.5",
        "ram_gib = 125.5\nmetrics = \"0.0.0.0:7410\"",
        32,
        "donor[1].metrics",
        "collides with listen address 127.0.0.2:7410",
    );
    expect(
        "ram_gib = 125.5",
        "ram_gib = 125.5\ncontrol = \"127.0.0.2:7411\"\nmetrics = \"127.0.0.2:7411\"",
        33,
        "donor[1].metrics",
        "collides with control address 127.0.0.2:7411",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\ncontrol = [\"0.0.0.0:7411\"]",
        26,
        "",
        "invalid type",
    );
}

#[test]
fn headroom_and_log_level() {
    let c = parse(&good()).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!((a.headroom_gib, a.log_level.as_deref()), (2.0, None));
    assert_eq!(a.table_budget_bytes(), (249u64) << 30);
    let text = good().replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nheadroom_gib = 10.5\nlog_level = \"memory_donor=debug,info\"",
        1,
    );
    let c = parse(&text).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(a.headroom_gib, 10.5);
    assert_eq!(a.log_level.as_deref(), Some("memory_donor=debug,info"));
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nheadroom_gib = 251.0",
        26,
        "donor[0].headroom_gib",
        "not a headroom",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nlog_level = \"x=loud\"",
        26,
        "donor[0].log_level",
        "not a log filter",
    );
}

mod node;
mod security;

#[test]
fn log_filters_are_validated() {
    assert!(valid_log_filter("info").is_ok());
    assert!(valid_log_filter("memory_donor=debug,warn").is_ok());
    assert!(valid_log_filter("memory_donor=loud").is_err());
}

#[test]
fn host_layout_is_planar_only_beside_a_host_socket_and_a_copy() {
    let a = |c: &Config| c.donor("donor-a").expect("donor-a").host_layout;
    assert_eq!(a(&parse(&good()).expect("valid")), KeptLayout::Packed);
    let host = good().replacen(
        r#"listen = ["0.0.0.0:7410"]"#,
        r#"listen = ["0.0.0.0:7410", "unix:///run/engram-rack/d.sock"]"#,
        1,
    );
    let planar = host.replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nhost_layout = \"planar\"",
        1,
    );
    assert_eq!(a(&parse(&planar).expect("valid")), KeptLayout::Planar);
    let odd = planar.replacen("\"planar\"", "\"rows\"", 1);
    expect_in(&odd, 26, "donor[0].host_layout", "not one of");
    let no_socket = good().replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nhost_layout = \"planar\"",
        1,
    );
    expect_in(
        &no_socket,
        26,
        "donor[0].host_layout",
        "needs a host socket",
    );
    let mapped = planar.replacen("host_layout", "map_files = true\nhost_layout", 1);
    expect_in(&mapped, 27, "donor[0].host_layout", "map_files");
}

/// A table declares its rows' encoding (V4.1's by default); a name that is
/// not one is refused at its line, and a node routes only tables of the
/// `[model] family`'s encoding (V4.1's by default).
#[test]
fn a_table_declares_its_encoding_and_nodes_route_their_familys_tables() {
    let c = parse(&good()).expect("valid");
    assert_eq!(c.table(1).map(|t| t.encoding), Some(RowEncoding::V41));
    let qwen = good().replacen(
        "rows = 384016682\n",
        "rows = 384016682\nencoding = \"nvfp4_e4m3_16x160\"\n",
        1,
    );
    // Table 14 is routed by gpu-1: refused there, at the route's table.
    let route_line = qwen.lines().position(|l| l == "table = 14").expect("route") + 1;
    expect_in(&qwen, route_line, "route[1].table", "nvfp4_e4m3_16x160");
    expect_in(
        &qwen,
        route_line,
        "route[1].table",
        "family = \"deepseek_v41\"",
    );
    let unrouted = qwen.replacen(
        "\n[[node.route]]\ntable = 14\nsources = [\"donor-a\", \"local\"]\n",
        "\n",
        1,
    );
    let c = parse(&unrouted).expect("a donor may serve it");
    assert_eq!(
        c.table(14).map(|t| t.encoding.row_bytes()),
        Some(90),
        "NVFP4: 80 bytes of values and 10 scales"
    );
    expect(
        "rows = 384016682\n",
        "rows = 384016682\nencoding = \"fp8x160\"\n",
        18,
        "table[1].encoding",
        "is not a row encoding",
    );
}

/// `[model] family = "qwen4exp"`: its routes take tables of FP8, BF16 or
/// NVFP4 rows and refuse V4.1's; it needs `eos_token` and refuses V4.1's
/// hashing keys; an unknown family is named at its line.
#[test]
fn a_qwen4exp_family_routes_its_own_tables_and_needs_an_eos_token() {
    use crate::model::Family;
    let both = good().replace(
        "rows = 384016682\n",
        "rows = 384016682\nencoding = \"fp8_per_tensorx160\"\n",
    );
    let qwen = format!("{both}\n[model]\nfamily = \"qwen4exp\"\neos_token = 248044\n");
    // Table 1 (V4.1's rows) is routed too: refused under qwen4exp.
    let route_line = qwen.lines().position(|l| l == "table = 1").expect("route") + 1;
    expect_in(&qwen, route_line, "route[0].table", "e4m3_ue8m0_32x256");
    let drop1 = qwen
        .split("\n[[node.route]]\n")
        .filter(|part| !part.starts_with("table = 1\n"))
        .collect::<Vec<_>>()
        .join("\n[[node.route]]\n");
    let c = parse(&drop1).expect("a qwen4exp node routes its FP8 table");
    assert_eq!(c.family(), Family::Qwen4Exp);
    assert_eq!(c.model.as_ref().and_then(|m| m.eos_token), Some(248_044));
    let no_eos = drop1.replacen("eos_token = 248044\n", "", 1);
    let line = no_eos
        .lines()
        .position(|l| l.starts_with("family"))
        .expect("family")
        + 1;
    expect_in(&no_eos, line, "model.eos_token", "needs eos_token");
    let hashed = drop1.replacen(
        "eos_token = 248044\n",
        "eos_token = 248044\npad_token = 2\n",
        1,
    );
    let line = hashed
        .lines()
        .position(|l| l.starts_with("pad_token"))
        .expect("pad")
        + 1;
    expect_in(&hashed, line, "model.pad_token", "DeepSeek V4.1's");
    // Its tokenizer (raw ids, no token map): taken.
    let tokenized = drop1.replacen(
        "eos_token = 248044\n",
        "eos_token = 248044\ntokenizer = \"/models/q/tokenizer.json\"\n",
        1,
    );
    let c = parse(&tokenized).expect("a qwen4exp tokenizer");
    assert_eq!(
        c.model.as_ref().map(|m| m.token_map.clone()),
        Some(crate::model::TokenMapSource::Tokenizer(
            "/models/q/tokenizer.json".into()
        ))
    );
    let mapped = tokenized.replacen("tokenizer =", "token_map =", 1);
    let line = mapped
        .lines()
        .position(|l| l.starts_with("token_map"))
        .expect("map")
        + 1;
    expect_in(&mapped, line, "model.token_map", "DeepSeek V4.1's");
    let v41_eos = good() + "\n[model]\neos_token = 1\n";
    let line = v41_eos
        .lines()
        .position(|l| l.starts_with("eos_token"))
        .expect("eos")
        + 1;
    expect_in(&v41_eos, line, "model.eos_token", "qwen4exp");
    // A table scale for an encoding with one; refused for one without,
    // or when it is no scale.
    let scaled = drop1.replacen(
        "encoding = \"fp8_per_tensorx160\"\n",
        "encoding = \"fp8_per_tensorx160\"\ntensor_scale = 0.0123\n",
        1,
    );
    let c = parse(&scaled).expect("a table scale");
    assert_eq!(c.table(14).and_then(|t| t.tensor_scale), Some(0.0123));
    let line = scaled
        .lines()
        .position(|l| l.starts_with("tensor_scale"))
        .expect("scale")
        + 1;
    let zero = scaled.replacen("tensor_scale = 0.0123", "tensor_scale = 0.0", 1);
    expect_in(&zero, line, "table[1].tensor_scale", "not a table scale");
    let bf16 = scaled.replacen("fp8_per_tensorx160", "bf16x160", 1);
    expect_in(&bf16, line, "table[1].tensor_scale", "no table scale");
    let odd = good() + "\n[model]\nfamily = \"llama\"\n";
    let line = odd
        .lines()
        .position(|l| l.starts_with("family"))
        .expect("family")
        + 1;
    expect_in(&odd, line, "model.family", "\"qwen4exp\"");
    assert_eq!(parse(&good()).expect("valid").family(), Family::DeepseekV41);
}
