//! Rules for `[[node]]` and its `[[node.route]]` tables.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use super::{Ctx, MAX_TIMEOUT_MS};
use crate::raw::{RawLink, RawNode, RawRoute};
use crate::{
    Donor, Hedge, Link, MAX_INTERFACE_NAME, Node, Policy, Route, SourceRef, SsdIo, SsdIoprio,
    Table, Transport,
};
use toml::Spanned;

/// Fastest token rate accepted (a 100 us token).
pub const MAX_TOKENS_PER_SECOND: f64 = 10_000.0;
/// Most consecutive failures a breaker may be set to tolerate.
pub const MAX_BREAKER_FAILURES: i64 = 1_000;
/// Most sequences a node daemon batches (the model loop's `MAX_BATCH`).
pub const MAX_BATCH: i64 = 1_024;
/// Sequences a node daemon batches by default.
pub const DEFAULT_MAX_BATCH: u32 = 16;
/// Default `prefill_budget`: 256 positions (6,144 rows per table, about
/// 1.6 MB) beside the decoders' rows in a step.
pub const DEFAULT_PREFILL_BUDGET: usize = 256;
/// A node's hard timeout for a lookup unless its config says
/// (`lookup_timeout_ms`); the client library's default too.
pub const DEFAULT_LOOKUP_TIMEOUT_MS: u64 = 100;
/// A node's connect timeout unless its config says (`connect_timeout_ms`);
/// the client library's default too.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Largest `prefill_budget`.
pub const MAX_PREFILL_BUDGET: i64 = 65_536;
/// Longest grace accepted, in microseconds (one second).
pub const MAX_GRACE_US: i64 = 1_000_000;

pub(super) fn nodes(
    cx: &mut Ctx<'_>,
    raw: &[Spanned<RawNode>],
    tables: &[Table],
    donors: &[Donor],
    base: &Path,
) -> Vec<Node> {
    let mut out = Vec::new();
    let mut names = HashSet::new();
    for (i, n) in raw.iter().enumerate() {
        let n = n.get_ref();
        let k = |f: &str| format!("node[{i}].{f}");
        let name = cx.name(&n.name, &k("name"));
        if !names.insert(name.clone()) {
            cx.at(
                n.name.span(),
                k("name"),
                format!("node {name:?} is defined twice"),
            );
        }
        out.push(node(cx, i, n, name, tables, donors, base));
    }
    out
}

/// One node's entry, its name checked already.
fn node(
    cx: &mut Ctx<'_>,
    i: usize,
    n: &RawNode,
    name: String,
    tables: &[Table],
    donors: &[Donor],
    base: &Path,
) -> Node {
    let k = |f: &str| format!("node[{i}].{f}");
    let lookup_timeout = cx.opt_ms(
        &n.lookup_timeout_ms,
        &k("lookup_timeout_ms"),
        i64::try_from(DEFAULT_LOOKUP_TIMEOUT_MS).unwrap_or(i64::MAX),
        false,
    );
    let routes = routes(cx, i, n, tables, donors, base, lookup_timeout);
    let tokens_per_second = tokens_per_second(cx, n, &k);
    let breaker_failures = super::opt_int(
        cx,
        &n.breaker_failures,
        &k("breaker_failures"),
        1,
        MAX_BREAKER_FAILURES,
    )
    .unwrap_or(3) as u32;
    let max_batch = super::opt_int(cx, &n.max_batch, &k("max_batch"), 1, MAX_BATCH)
        .map_or(DEFAULT_MAX_BATCH, |v| v as u32);
    let prefill_budget = super::opt_int(
        cx,
        &n.prefill_budget,
        &k("prefill_budget"),
        0,
        MAX_PREFILL_BUDGET,
    )
    .map_or(DEFAULT_PREFILL_BUDGET, |v| v as usize);
    let metrics = n
        .metrics
        .as_ref()
        .and_then(|v| super::addr(cx, v, &k("metrics"), true));
    let api = n
        .api
        .as_ref()
        .and_then(|v| super::addr(cx, v, &k("api"), true))
        .unwrap_or(crate::DEFAULT_NODE_API);
    let log_level = super::log_level(cx, &n.log_level, &k("log_level"));
    let ssd_io = ssd_io(cx, n, &k);
    let links = links(cx, i, n, donors);
    let tls_cert = n
        .tls_cert
        .as_ref()
        .map(|p| cx.path(p, &k("tls_cert"), base));
    let tls_key = n.tls_key.as_ref().map(|p| cx.path(p, &k("tls_key"), base));
    Node {
        name,
        routes,
        connect_timeout: cx.opt_ms(
            &n.connect_timeout_ms,
            &k("connect_timeout_ms"),
            i64::try_from(DEFAULT_CONNECT_TIMEOUT_MS).unwrap_or(i64::MAX),
            false,
        ),
        lookup_timeout,
        tokens_per_second,
        probe_interval: cx.opt_ms(&n.probe_interval_ms, &k("probe_interval_ms"), 1_000, false),
        breaker_failures,
        max_batch,
        prefill_budget,
        metrics,
        api,
        log_level,
        ssd_io,
        ssd_direct: n.ssd_direct.unwrap_or(true),
        links,
        tls_cert,
        tls_key,
    }
}

/// The node's routes: at most one per table.
#[allow(clippy::too_many_arguments)]
fn routes(
    cx: &mut Ctx<'_>,
    i: usize,
    n: &RawNode,
    tables: &[Table],
    donors: &[Donor],
    base: &Path,
    lookup_timeout: Duration,
) -> Vec<Route> {
    let mut routes: Vec<Route> = Vec::new();
    for (j, r) in n.routes.iter().enumerate() {
        if let Some(route) = route(
            cx,
            r.get_ref(),
            (i, j),
            tables,
            donors,
            base,
            lookup_timeout,
        ) {
            if routes.iter().any(|x| x.table == route.table) {
                cx.at(
                    r.get_ref().table.span(),
                    format!("node[{i}].route[{j}].table"),
                    format!("table {} has two routes on this node", route.table),
                );
            }
            routes.push(route);
        }
    }
    routes
}

fn tokens_per_second(cx: &mut Ctx<'_>, n: &RawNode, k: &dyn Fn(&str) -> String) -> f64 {
    match &n.tokens_per_second {
        None => 100.0,
        Some(v) => {
            let x = *v.get_ref();
            if x.is_finite() && x > 0.0 && x <= MAX_TOKENS_PER_SECOND {
                x
            } else {
                cx.at(
                    v.span(),
                    k("tokens_per_second"),
                    format!("{x} is not a token rate (0 < rate <= {MAX_TOKENS_PER_SECOND})"),
                );
                100.0
            }
        }
    }
}

fn ssd_io(cx: &mut Ctx<'_>, n: &RawNode, k: &dyn Fn(&str) -> String) -> SsdIo {
    match n.ssd_io.as_ref().map(|m| (m, m.get_ref().as_str())) {
        None | Some((_, "auto")) => SsdIo::Auto,
        Some((_, "uring")) => SsdIo::Uring,
        Some((_, "pread")) => SsdIo::Pread,
        Some((m, other)) => {
            cx.at(
                m.span(),
                k("ssd_io"),
                format!("{other:?} is not one of \"auto\", \"uring\", \"pread\""),
            );
            SsdIo::Auto
        }
    }
}

/// The node's links: at most one per donor.
fn links(cx: &mut Ctx<'_>, i: usize, n: &RawNode, donors: &[Donor]) -> Vec<(String, Link)> {
    let mut links: Vec<(String, Link)> = Vec::new();
    for (j, l) in n.links.iter().enumerate() {
        if let Some((donor, link)) = link(cx, l.get_ref(), (i, j), donors) {
            if links.iter().any(|(d, _)| *d == donor) {
                cx.at(
                    l.get_ref().donor.span(),
                    format!("node[{i}].link[{j}].donor"),
                    format!("donor {donor:?} has two links on this node"),
                );
                continue;
            }
            links.push((donor, link));
        }
    }
    links
}

/// `[[node.link]]`: a donor of the rack, one of its advertised transports,
/// an IP to bind and an interface name Linux would accept.
fn link(
    cx: &mut Ctx<'_>,
    l: &RawLink,
    (i, j): (usize, usize),
    donors: &[Donor],
) -> Option<(String, Link)> {
    let lk = |f: &str| format!("node[{i}].link[{j}].{f}");
    let name = l.donor.get_ref();
    let Some(donor) = donors.iter().find(|d| &d.name == name) else {
        cx.at(
            l.donor.span(),
            lk("donor"),
            format!("{name:?} is not a donor of this rack"),
        );
        return None;
    };
    let transport = link_transport(cx, l, donor, &lk);
    let bind = l.bind.as_ref().and_then(|b| match b.get_ref().parse() {
        Ok(ip) => Some(ip),
        Err(_) => {
            cx.at(
                b.span(),
                lk("bind"),
                format!(
                    "{:?} is not an IP address (the source address of the link)",
                    b.get_ref()
                ),
            );
            None
        }
    });
    let interface = interface(cx, l, &lk);
    Some((
        name.clone(),
        Link {
            transport,
            bind,
            interface,
        },
    ))
}

fn route(
    cx: &mut Ctx<'_>,
    r: &RawRoute,
    (i, j): (usize, usize),
    tables: &[Table],
    donors: &[Donor],
    base: &Path,
    lookup_timeout: Duration,
) -> Option<Route> {
    let rk = |f: &str| format!("node[{i}].route[{j}].{f}");
    let id = *r.table.get_ref();
    let Some(table) = tables.iter().find(|t| i64::from(t.id) == id) else {
        cx.at(
            r.table.span(),
            rk("table"),
            format!("table {id} is not defined"),
        );
        return None;
    };
    let sources = sources(cx, r, (i, j), table, donors);
    let ssd_path = match &r.ssd_path {
        Some(p) => cx.path(p, &rk("ssd_path"), base),
        None => table.path.clone(),
    };
    let grace = match &r.grace_us {
        Some(v) => cx.int(v, &rk("grace_us"), 0, MAX_GRACE_US).unwrap_or(0) as u64,
        None => 100,
    };
    let hedge = match &r.hedge {
        None => Hedge::Percentile(99.0),
        Some(h) => parse_hedge(h.get_ref()).unwrap_or_else(|why| {
            cx.at(h.span(), rk("hedge"), why);
            Hedge::Off
        }),
    };
    let policy = policy(cx, r, &rk);
    let ssd_ioprio = match &r.ssd_ioprio {
        None => SsdIoprio::DEFAULT,
        Some(p) => SsdIoprio::parse(p.get_ref()).unwrap_or_else(|why| {
            cx.at(p.span(), rk("ssd_ioprio"), why);
            SsdIoprio::DEFAULT
        }),
    };
    Some(Route {
        table: table.id,
        sources,
        ssd_path,
        trust_digest: r.trust_digest.unwrap_or(false),
        grace: Duration::from_micros(grace),
        hard_timeout: cx.opt_ms(
            &r.hard_timeout_ms,
            &rk("hard_timeout_ms"),
            lookup_timeout.as_millis() as i64,
            false,
        ),
        hedge,
        policy,
        ssd_ioprio,
    })
}

/// A route's sources: each a donor holding the table, `ssd` or `local`,
/// once; at least one.
fn sources(
    cx: &mut Ctx<'_>,
    r: &RawRoute,
    (i, j): (usize, usize),
    table: &Table,
    donors: &[Donor],
) -> Vec<SourceRef> {
    let rk = |f: &str| format!("node[{i}].route[{j}].{f}");
    let mut sources = Vec::new();
    if r.sources.get_ref().is_empty() {
        cx.at(
            r.sources.span(),
            rk("sources"),
            "a route needs at least one source",
        );
    }
    for (s_i, s) in r.sources.get_ref().iter().enumerate() {
        let key = format!("node[{i}].route[{j}].sources[{s_i}]");
        let src = match s.get_ref().as_str() {
            "ssd" => SourceRef::Ssd,
            "local" => SourceRef::Local,
            d => match donors.iter().find(|x| x.name == d) {
                Some(donor) if donor.tables.contains(&table.id) => SourceRef::Donor(d.to_string()),
                Some(_) => {
                    cx.at(
                        s.span(),
                        key,
                        format!("donor {d:?} does not hold table {}", table.id),
                    );
                    continue;
                }
                None => {
                    cx.at(
                        s.span(),
                        key,
                        format!("{d:?} is neither a donor nor \"ssd\" or \"local\""),
                    );
                    continue;
                }
            },
        };
        if sources.contains(&src) {
            cx.at(s.span(), key, format!("source {src} is listed twice"));
            continue;
        }
        sources.push(src);
    }
    sources
}

fn policy(cx: &mut Ctx<'_>, r: &RawRoute, rk: &dyn Fn(&str) -> String) -> Policy {
    match r.policy.as_ref().map(|m| (m, m.get_ref().as_str())) {
        None | Some((_, "fail")) => Policy::Fail,
        Some((_, "zeros")) => Policy::Zeros,
        Some((m, other)) => {
            cx.at(
                m.span(),
                rk("policy"),
                format!("{other:?} is not one of \"fail\", \"zeros\""),
            );
            Policy::Fail
        }
    }
}

/// A link's transport: one the donor advertises.
fn link_transport(
    cx: &mut Ctx<'_>,
    l: &RawLink,
    donor: &Donor,
    lk: &dyn Fn(&str) -> String,
) -> Option<Transport> {
    let name = &donor.name;
    l.transport
        .as_ref()
        .and_then(|t| match Transport::parse(t.get_ref()) {
            Some(tr) if donor.advertise.iter().any(|e| e.transport == tr) => Some(tr),
            Some(tr) => {
                let offered: Vec<String> = donor.advertise.iter().map(|e| e.to_string()).collect();
                cx.at(
                    t.span(),
                    lk("transport"),
                    format!(
                        "donor {name:?} advertises no {tr} address (it advertises {})",
                        offered.join(", ")
                    ),
                );
                None
            }
            None => {
                cx.at(
                    t.span(),
                    lk("transport"),
                    format!(
                        "{:?} is not one of \"tcp\", \"tls\", \"quic\", \"rdma\"",
                        t.get_ref()
                    ),
                );
                None
            }
        })
}

/// A link's interface: a name Linux would accept.
fn interface(cx: &mut Ctx<'_>, l: &RawLink, lk: &dyn Fn(&str) -> String) -> Option<String> {
    l.interface.as_ref().and_then(|f| {
        let name = f.get_ref();
        let ok = !name.is_empty()
            && name.len() <= MAX_INTERFACE_NAME
            && name != "."
            && name != ".."
            && name
                .chars()
                .all(|c| c.is_ascii_graphic() && c != '/' && c != ':');
        if ok {
            Some(name.clone())
        } else {
            cx.at(
                f.span(),
                lk("interface"),
                format!(
                    "{name:?} is not a network interface name: 1 to {MAX_INTERFACE_NAME} printable \
                     characters without '/', ':' or spaces"
                ),
            );
            None
        }
    })
}

/// `off`, `pNN` (a percentile of recent latencies, e.g. `p99`, `p99.9`), or
/// a fixed delay: `250us`, `2ms`.
pub fn parse_hedge(s: &str) -> Result<Hedge, String> {
    let bad = || {
        format!(
            "{s:?} is not a hedge: \"off\", a percentile like \"p99\" (0 < p < 100), \
             or a delay like \"250us\" or \"2ms\" (up to {MAX_TIMEOUT_MS} ms)"
        )
    };
    if s == "off" {
        return Ok(Hedge::Off);
    }
    if let Some(p) = s.strip_prefix('p') {
        return match p.parse::<f64>() {
            Ok(p) if p > 0.0 && p < 100.0 => Ok(Hedge::Percentile(p)),
            _ => Err(bad()),
        };
    }
    let (num, unit_us) = if let Some(n) = s.strip_suffix("us") {
        (n, 1)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1_000)
    } else {
        return Err(bad());
    };
    match num.parse::<u64>() {
        Ok(n) if n > 0 && n.saturating_mul(unit_us) <= MAX_TIMEOUT_MS as u64 * 1_000 => {
            Ok(Hedge::Fixed(Duration::from_micros(n * unit_us)))
        }
        _ => Err(bad()),
    }
}
