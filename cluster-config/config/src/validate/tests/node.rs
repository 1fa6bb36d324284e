//! Rules of `[[node]]` and its routes.

use super::*;
use crate::{IoClass, SsdIoprio};

#[test]
fn node_rules() {
    expect(
        "name = \"gpu-1\"",
        "name = \"gpu 1\"",
        37,
        "node[0].name",
        "not a name",
    );
    expect(
        "lookup_timeout_ms = 40",
        "lookup_timeout_ms = 0",
        38,
        "node[0].lookup_timeout_ms",
        "out of range",
    );
    expect(
        "table = 14\nsources",
        "table = 99\nsources",
        46,
        "node[0].route[1].table",
        "not defined",
    );
    expect(
        "table = 14\nsources",
        "table = 1\nsources",
        46,
        "node[0].route[1].table",
        "two routes",
    );
    expect(
        "sources = [\"donor-b\", \"donor-a\", \"ssd\"]",
        "sources = [\"donor-b\", \"donor-c\", \"ssd\"]",
        42,
        "node[0].route[0].sources[1]",
        "neither a donor",
    );
    expect(
        "sources = [\"donor-a\", \"local\"]",
        "sources = [\"donor-b\", \"local\"]",
        47,
        "node[0].route[1].sources[0]",
        "does not hold table 14",
    );
    expect(
        "sources = [\"donor-a\", \"local\"]",
        "sources = [\"local\", \"local\"]",
        47,
        "node[0].route[1].sources[1]",
        "twice",
    );
    expect(
        "sources = [\"donor-a\", \"local\"]",
        "sources = []",
        47,
        "node[0].route[1].sources",
        "at least one",
    );
}

#[test]
fn node_knobs_have_defaults_and_windows_follow_the_layers() {
    let c = parse(&good()).expect("valid");
    let n = c.node("gpu-1").expect("node");
    assert_eq!(n.tokens_per_second, 100.0);
    assert_eq!(n.probe_interval, Duration::from_secs(1));
    assert_eq!(n.breaker_failures, 3);
    assert_eq!(n.max_batch, 16);
    assert_eq!(n.prefill_budget, 256);
    assert_eq!(
        (n.metrics, n.ssd_io, n.ssd_direct),
        (None, SsdIo::Auto, true)
    );
    let r = &n.routes[0];
    assert_eq!(r.hard_timeout, n.lookup_timeout, "defaults to the node's");
    assert_eq!(r.grace, Duration::from_micros(100));
    assert_eq!(r.hedge, Hedge::Percentile(99.0));
    assert_eq!((r.policy, r.trust_digest), (Policy::Fail, false));
    assert_eq!(r.ssd_ioprio, SsdIoprio::DEFAULT);
    assert_eq!(r.ssd_ioprio.to_string(), "realtime:4");
    // 100 tokens/s: W = 10 ms; table 1 (layer 1) gets W/40, table 14 13W/40.
    assert_eq!(n.window(&c, 1), Some(Duration::from_micros(250)));
    assert_eq!(n.window(&c, 14), Some(Duration::from_micros(3250)));

    let text = good().replacen(
        "lookup_timeout_ms = 40",
        "lookup_timeout_ms = 40\ntokens_per_second = 400\nprobe_interval_ms = 250\n\
         breaker_failures = 5\nmax_batch = 64\nprefill_budget = 32\nmetrics = \"127.0.0.1:9100\"\nssd_io = \"pread\"\nssd_direct = false",
        1,
    );
    let text = text.replacen(
        "ssd_path = \"ssd/layer1.etab\"",
        "ssd_path = \"ssd/layer1.etab\"\ngrace_us = 0\nhard_timeout_ms = 7\nhedge = \"150us\"\n\
         policy = \"zeros\"\ntrust_digest = true\nssd_ioprio = \"best-effort:2\"",
        1,
    );
    let c = parse(&text).expect("valid");
    let n = c.node("gpu-1").expect("node");
    assert_eq!(n.tokens_per_second, 400.0);
    assert_eq!(n.probe_interval, Duration::from_millis(250));
    assert_eq!(n.breaker_failures, 5);
    assert_eq!(n.max_batch, 64);
    assert_eq!(n.prefill_budget, 32);
    assert_eq!(n.metrics, Some("127.0.0.1:9100".parse().expect("addr")));
    assert_eq!((n.ssd_io, n.ssd_direct), (SsdIo::Pread, false));
    let r = &n.routes[0];
    assert_eq!(r.grace, Duration::ZERO);
    assert_eq!(r.hard_timeout, Duration::from_millis(7));
    assert_eq!(r.hedge, Hedge::Fixed(Duration::from_micros(150)));
    assert_eq!((r.policy, r.trust_digest), (Policy::Zeros, true));
    assert_eq!(
        r.ssd_ioprio,
        SsdIoprio {
            class: IoClass::BestEffort,
            level: 2
        }
    );
    // Both print as the config spells them (a reload's log line).
    assert_eq!(
        (r.hedge.to_string(), r.policy.to_string()),
        ("150us".into(), "zeros".into())
    );
    assert_eq!(
        n.window(&c, 1),
        Some(Duration::from_micros(62) + Duration::from_nanos(500))
    );
}

#[test]
fn node_knob_rules() {
    let add = |line: &str| format!("lookup_timeout_ms = 40\n{line}");
    let cases: [(&str, &str, &str); 10] = [
        (
            "tokens_per_second = 0.0",
            "tokens_per_second",
            "not a token rate",
        ),
        (
            "tokens_per_second = 1e9",
            "tokens_per_second",
            "not a token rate",
        ),
        ("probe_interval_ms = 0", "probe_interval_ms", "out of range"),
        ("breaker_failures = 0", "breaker_failures", "out of range"),
        ("max_batch = 0", "max_batch", "out of range"),
        ("max_batch = 1025", "max_batch", "out of range"),
        ("prefill_budget = -1", "prefill_budget", "out of range"),
        ("prefill_budget = 65537", "prefill_budget", "out of range"),
        ("metrics = \"localhost\"", "metrics", "not IP:PORT"),
        ("ssd_io = \"aio\"", "ssd_io", "not one of"),
    ];
    for (line, key, msg) in cases {
        expect(
            "lookup_timeout_ms = 40",
            &add(line),
            39,
            &format!("node[0].{key}"),
            msg,
        );
    }
    let route = |line: &str| format!("ssd_path = \"ssd/layer1.etab\"\n{line}");
    let cases: [(&str, &str, &str); 12] = [
        ("grace_us = -1", "grace_us", "out of range"),
        ("hard_timeout_ms = 0", "hard_timeout_ms", "out of range"),
        ("hedge = \"p100\"", "hedge", "not a hedge"),
        ("hedge = \"p0\"", "hedge", "not a hedge"),
        ("hedge = \"0us\"", "hedge", "not a hedge"),
        ("hedge = \"5s\"", "hedge", "not a hedge"),
        ("hedge = \"99999999999ms\"", "hedge", "not a hedge"),
        ("policy = \"drop\"", "policy", "not one of"),
        ("ssd_ioprio = \"rt\"", "ssd_ioprio", "not an I/O priority"),
        (
            "ssd_ioprio = \"realtime:8\"",
            "ssd_ioprio",
            "not an I/O priority",
        ),
        (
            "ssd_ioprio = \"idle:3\"",
            "ssd_ioprio",
            "not an I/O priority",
        ),
        (
            "ssd_ioprio = \"best-effort:\"",
            "ssd_ioprio",
            "not an I/O priority",
        ),
    ];
    for (line, key, msg) in cases {
        expect(
            "ssd_path = \"ssd/layer1.etab\"",
            &route(line),
            44,
            &format!("node[0].route[0].{key}"),
            msg,
        );
    }
    for (text, class, level) in [
        ("realtime", IoClass::RealTime, 4),
        ("realtime:0", IoClass::RealTime, 0),
        ("best-effort:7", IoClass::BestEffort, 7),
        ("idle", IoClass::Idle, 0),
    ] {
        let p = SsdIoprio::parse(text).expect(text);
        assert_eq!((p.class, p.level), (class, level), "{text}");
    }
    assert_eq!(parse_hedge("off"), Ok(Hedge::Off));
    assert_eq!(parse_hedge("p99.9"), Ok(Hedge::Percentile(99.9)));
    assert_eq!(
        parse_hedge("2ms"),
        Ok(Hedge::Fixed(Duration::from_millis(2)))
    );
}

#[test]
fn node_api_and_log_level() {
    let c = parse(&good()).expect("valid");
    let n = c.node("gpu-1").expect("gpu-1");
    assert_eq!(
        (n.api, n.log_level.as_deref()),
        (crate::DEFAULT_NODE_API, None)
    );
    let text = good().replacen(
        "name = \"gpu-1\"",
        "name = \"gpu-1\"\napi = \"127.0.0.1:9000\"\nlog_level = \"inference_node=debug\"",
        1,
    );
    let c = parse(&text).expect("valid");
    let n = c.node("gpu-1").expect("gpu-1");
    assert_eq!(n.api.port(), 9000);
    assert_eq!(n.log_level.as_deref(), Some("inference_node=debug"));
    for (bad, key) in [
        ("api = \"nowhere\"", "node[0].api"),
        ("log_level = \"x=loud\"", "node[0].log_level"),
    ] {
        let text = good().replacen("name = \"gpu-1\"", &format!("name = \"gpu-1\"\n{bad}"), 1);
        let d = diags(&text);
        assert!(d.iter().any(|d| d.key == key), "{bad}: {d:?}");
    }
}
