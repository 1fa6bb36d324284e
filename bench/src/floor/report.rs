//! The floor benchmark's report: the donor/floor ratios of the medians,
//! printed as JSON or as a text table with the target's verdict.

use anyhow::Result;
use inference_node::DEFAULT_BUSY_POLL;
use rack_harness::DonorProcess;
use serde::Serialize;

use super::transports::{RestartResult, SetupResult};
use super::{FloorArgs, SeriesResult};
use crate::stats::print_table;
use cluster_config::Transport;

/// The target: the project client's p50 over the blocking floor's at most this...
const TARGET_P50: f64 = 1.15;
/// ...and its p99 over the floor's at most this.
const TARGET_P99: f64 = 1.3;

/// TLS over plain TCP, through the same client: at most this at p50...
const TLS_P50: f64 = 1.15;
/// ...and this at p99.
const TLS_P99: f64 = 1.3;
/// QUIC over plain TCP, through the same client, at p50.
const QUIC_P50: f64 = 1.6;

/// Series per size: the six floor and donor series, the donor over each
/// secure transport, the QUIC floor when QUIC is measured, the least
/// protocol client's pair, the checksumming floor's pair, the
/// protocol's floor's pair, then the least protocol client and the
/// gathering floor with their clients sleeping in the runtime, and the
/// least protocol client's series again.
pub(super) fn per_size(secure: &[Transport]) -> usize {
    raw_at(secure) + 9
}

/// Where a size's two series through the least protocol client start
/// (blocking, then polling): after the QUIC floor.
fn raw_at(secure: &[Transport]) -> usize {
    6 + secure.len() + usize::from(secure.contains(&Transport::Quic))
}

/// A target's limits: p50, and p99 where it has one.
type Target = (f64, Option<f64>);

/// One ratio of medians at one size.
#[derive(Debug, Serialize)]
pub(super) struct Ratio {
    rows: usize,
    what: String,
    p50: f64,
    p99: f64,
    p999: f64,
    /// The target's limits on p50 and p99, when this ratio has one.
    target: Option<Target>,
}

impl Ratio {
    /// Whether the percentiles are within the target (true without one).
    fn within_target(&self) -> bool {
        self.target
            .is_none_or(|(p50, p99)| self.p50 <= p50 && p99.is_none_or(|l| self.p99 <= l))
    }

    fn verdict(&self) -> String {
        let Some((p50, p99)) = self.target else {
            return String::new();
        };
        let limits = match p99 {
            Some(l) => format!("p50 <= {p50:.2}, p99 <= {l:.2}"),
            None => format!("p50 <= {p50:.2}"),
        };
        let word = if self.within_target() {
            "met"
        } else {
            "MISSED"
        };
        format!("  {word} ({limits})")
    }
}

/// Where a series sits within a size's block of series: at a fixed
/// index, or after the donor over each secure transport (the least
/// protocol client's pair, the checksumming floor's pair, then the
/// protocol's floor's pair).
#[derive(Debug, Clone, Copy)]
enum At {
    Fixed(usize),
    Raw(usize),
    Summed(usize),
    Proto(usize),
    /// The least protocol client sleeping in the runtime.
    Runtime,
    /// The gathering floor, its client sleeping in the runtime.
    GatheringRuntime,
    /// [`At::Runtime`]'s series again.
    RuntimeAgain,
}

impl At {
    fn index(self, secure: &[Transport]) -> usize {
        match self {
            Self::Fixed(i) => i,
            Self::Raw(i) => raw_at(secure) + i,
            Self::Summed(i) => raw_at(secure) + 2 + i,
            Self::Proto(i) => raw_at(secure) + 4 + i,
            Self::Runtime => raw_at(secure) + 6,
            Self::GatheringRuntime => raw_at(secure) + 7,
            Self::RuntimeAgain => raw_at(secure) + 8,
        }
    }
}

/// The ratios at each size that do not depend on the transports: what,
/// numerator, denominator, target. A size's block is [floor blocking,
/// floor polling, donor, donor not polling, gathering floor blocking,
/// gathering floor polling, then the donor over each secure transport,
/// then the QUIC floor with QUIC, then the donor through the least
/// protocol client blocking and polling, the floor that also checksums,
/// blocking and polling, the least protocol client against the protocol's
/// floor, blocking and polling, the donor through the least protocol
/// client sleeping in the runtime, the gathering floor, its client
/// sleeping in the runtime, then the least protocol client's again].
const PAIRS: [(&str, At, At, Option<Target>); 26] = [
    (
        "project client / blocking floor (the target)",
        At::Fixed(2),
        At::Fixed(0),
        Some((TARGET_P50, Some(TARGET_P99))),
    ),
    ("both clients polling", At::Fixed(2), At::Fixed(1), None),
    ("neither client polling", At::Fixed(3), At::Fixed(0), None),
    (
        "both clients polling, against the floor gathering rows",
        At::Fixed(2),
        At::Fixed(5),
        None,
    ),
    (
        "neither client polling, against the floor gathering rows",
        At::Fixed(3),
        At::Fixed(4),
        None,
    ),
    (
        "both polling: donor through the least protocol client / floor gathering rows (the donor's share)",
        At::Raw(1),
        At::Fixed(5),
        None,
    ),
    (
        "neither polling: donor through the least protocol client / floor gathering rows (the donor's share)",
        At::Raw(0),
        At::Fixed(4),
        None,
    ),
    (
        "both polling: floor gathering and checksumming / floor gathering (the checksums' share)",
        At::Summed(1),
        At::Fixed(5),
        None,
    ),
    (
        "neither polling: floor gathering and checksumming / floor gathering (the checksums' share)",
        At::Summed(0),
        At::Fixed(4),
        None,
    ),
    (
        "both clients polling, against the floor gathering and checksumming rows (what the protocol requires)",
        At::Fixed(2),
        At::Summed(1),
        None,
    ),
    (
        "neither client polling, against the floor gathering and checksumming rows (what the protocol requires)",
        At::Fixed(3),
        At::Summed(0),
        None,
    ),
    (
        "both polling: project client / least protocol client, same donor (the client's share)",
        At::Fixed(2),
        At::Raw(1),
        None,
    ),
    (
        "neither polling: project client / least protocol client, same donor (the client's share)",
        At::Fixed(3),
        At::Raw(0),
        None,
    ),
    (
        "both polling: protocol's floor / floor gathering rows, least clients (the protocol's own share)",
        At::Proto(1),
        At::Fixed(5),
        None,
    ),
    (
        "neither polling: protocol's floor / floor gathering rows, least clients (the protocol's own share)",
        At::Proto(0),
        At::Fixed(4),
        None,
    ),
    (
        "both polling: donor / protocol's floor, through the least protocol client (what the donor adds to the protocol)",
        At::Raw(1),
        At::Proto(1),
        None,
    ),
    (
        "neither polling: donor / protocol's floor, through the least protocol client (what the donor adds to the protocol)",
        At::Raw(0),
        At::Proto(0),
        None,
    ),
    (
        "both clients polling, against the protocol's floor (the target's gap beyond what the protocol requires)",
        At::Fixed(2),
        At::Proto(1),
        None,
    ),
    (
        "neither client polling, against the protocol's floor (the target's gap beyond what the protocol requires)",
        At::Fixed(3),
        At::Proto(0),
        None,
    ),
    (
        "neither polling: least protocol client sleeping in the runtime / blocking, same donor (what waiting in the runtime's reactor costs)",
        At::Runtime,
        At::Raw(0),
        None,
    ),
    (
        "neither polling: project client / least protocol client sleeping in the runtime, same donor (the client's share beyond the runtime)",
        At::Fixed(3),
        At::Runtime,
        None,
    ),
    (
        "neither polling: donor through the least protocol client sleeping in the runtime / floor gathering rows (the least a client in the runtime gets)",
        At::Runtime,
        At::Fixed(4),
        None,
    ),
    (
        "neither polling: floor gathering rows, client sleeping in the runtime / blocking (what waiting in the runtime's reactor costs the floor)",
        At::GatheringRuntime,
        At::Fixed(4),
        None,
    ),
    (
        "neither polling: least protocol client / floor gathering rows, both sleeping in the runtime (the donor's share in the runtime)",
        At::Runtime,
        At::GatheringRuntime,
        None,
    ),
    (
        "neither client polling, against the floor gathering rows with its client sleeping in the runtime too (like for like)",
        At::Fixed(3),
        At::GatheringRuntime,
        None,
    ),
    (
        "neither polling: least protocol client sleeping in the runtime, again / the first series (two identical series: what the run resolves)",
        At::RuntimeAgain,
        At::Runtime,
        None,
    ),
];

/// The ratios of the medians, per size: the donor against the floor, and
/// each secure transport against plain TCP through the same client.
pub(super) fn ratios(results: &[SeriesResult], secure: &[Transport]) -> Vec<Ratio> {
    let block = per_size(secure);
    let mut ratios = Vec::new();
    for (k, rows) in [(0usize, 24usize), (block, 48)] {
        let m = |i: usize| results[k + i].median;
        let mut pairs: Vec<(String, usize, usize, Option<Target>)> = PAIRS
            .iter()
            .map(|&(what, num, den, target)| {
                (
                    what.to_string(),
                    num.index(secure),
                    den.index(secure),
                    target,
                )
            })
            .collect();
        pairs.extend(transport_pairs(secure));
        for (what, num, den, target) in pairs {
            ratios.push(Ratio {
                rows,
                what,
                p50: m(num).p50_us / m(den).p50_us,
                p99: m(num).p99_us / m(den).p99_us,
                p999: m(num).p999_us / m(den).p999_us,
                target,
            });
        }
    }
    ratios.extend(bulk_ratios(results, block));
    ratios
}

/// Each secure transport against plain TCP through the same client, and
/// QUIC against quinn alone.
fn transport_pairs(secure: &[Transport]) -> Vec<(String, usize, usize, Option<Target>)> {
    let mut pairs = Vec::new();
    for (i, t) in secure.iter().enumerate() {
        let target = match t {
            Transport::Tls => Some((TLS_P50, Some(TLS_P99))),
            Transport::Quic => Some((QUIC_P50, None)),
            Transport::Tcp | Transport::Rdma => None,
        };
        pairs.push((format!("{t} / tcp, same client"), 6 + i, 2, target));
        if *t == Transport::Quic {
            let quinn = 6 + secure.len();
            pairs.push((
                "QUIC floor (quinn alone) / polling TCP floor (the floor of quic / tcp)".into(),
                quinn,
                1,
                None,
            ));
            pairs.push(("donor over quic / QUIC floor".into(), 6 + i, quinn, None));
        }
    }
    pairs
}

/// After both sizes: the bulk floor, the donor's bulk lookup, and the
/// floor that also gathers the same number of random rows.
fn bulk_ratios(results: &[SeriesResult], block: usize) -> Vec<Ratio> {
    let mut ratios = Vec::new();
    if let [floor, donor, gathering] = results.get(2 * block..2 * block + 3).unwrap_or_default() {
        let (f, d, g) = (&floor.median, &donor.median, &gathering.median);
        let ratio = |what: &str, num: &super::Summary, den: &super::Summary, target| Ratio {
            rows: super::BULK_ROWS,
            what: what.into(),
            p50: num.p50_us / den.p50_us,
            p99: num.p99_us / den.p99_us,
            p999: num.p999_us / den.p999_us,
            target,
        };
        ratios.push(ratio(
            "bulk, one connection: donor / raw ping-pong of the same bytes",
            d,
            f,
            Some((BULK_P50, None)),
        ));
        ratios.push(ratio(
            "bulk: floor gathering the rows / raw ping-pong (the gather's own cost)",
            g,
            f,
            None,
        ));
        ratios.push(ratio(
            "bulk: donor / floor gathering the same rows",
            d,
            g,
            None,
        ));
    }
    ratios
}

/// The bulk lookup at 0.7x of the raw ping-pong's rate or better: its
/// time at most 1 / 0.7 of the ping-pong's.
const BULK_P50: f64 = 1.0 / 0.7;

/// The host source at most this over the node's own local copy (p50).
const HOST_OVER_LOCAL_P50: f64 = 1.5;
/// The host source at most this over the donor on loopback TCP (p50):
/// at least 10x faster.
const HOST_OVER_TCP_P50: f64 = 0.1;

/// The host source against its floor (the node's own copy) and against
/// the donor over loopback TCP and each secure transport, per size.
pub(super) fn host_ratios(
    host: &super::host::HostReport,
    results: &[SeriesResult],
    secure: &[Transport],
) -> Vec<Ratio> {
    // Network series per size: [.., donor over TCP at 2, .., each secure at 6 + i].
    let block = per_size(secure);
    let mut out = Vec::new();
    for (j, (k, rows)) in [(0usize, 24usize), (block, 48)].into_iter().enumerate() {
        let (local, mapped) = (&host.series[2 * j].median, &host.series[2 * j + 1].median);
        let ratio = |what: String, num: &super::Summary, den: &super::Summary, target| Ratio {
            rows,
            what,
            p50: num.p50_us / den.p50_us,
            p99: num.p99_us / den.p99_us,
            p999: num.p999_us / den.p999_us,
            target,
        };
        out.push(ratio(
            "host source / node's own local copy (the floor)".into(),
            mapped,
            local,
            Some((HOST_OVER_LOCAL_P50, None)),
        ));
        out.push(ratio(
            "host source / donor over loopback tcp".into(),
            mapped,
            &results[k + 2].median,
            Some((HOST_OVER_TCP_P50, None)),
        ));
        // What no source of these rows can beat: a gather from this
        // process's own RAM, against the same TCP series.
        out.push(ratio(
            "the floor (own local copy) / donor over loopback tcp".into(),
            local,
            &results[k + 2].median,
            None,
        ));
        for (i, t) in secure.iter().enumerate() {
            out.push(ratio(
                format!("host source / donor over loopback {t}"),
                mapped,
                &results[k + 6 + i].median,
                None,
            ));
        }
    }
    out
}

/// Everything the report shows.
pub(super) struct Report<'a> {
    pub(super) args: &'a FloorArgs,
    /// Size of each table in GiB.
    pub(super) gib: f64,
    pub(super) pinned: bool,
    pub(super) results: Vec<SeriesResult>,
    pub(super) ratios: Vec<Ratio>,
    /// Connection set-up times per transport.
    pub(super) setup: Vec<SetupResult>,
    /// A restarted donor's ready line to its first served lookup, per transport.
    pub(super) restart: Vec<RestartResult>,
    /// Whether the donor exited cleanly on SIGTERM.
    pub(super) clean: bool,
    /// `--transports rdma`: its hardware series (or why skipped) and CPU costs.
    pub(super) rdma: Option<super::rdma::RdmaReport>,
    /// `--transports unix`: the host source and its floor.
    pub(super) host: Option<super::host::HostReport>,
    /// With QUIC: what quinn's UDP layer uses on this kernel.
    pub(super) udp: Option<super::quic::UdpOffloads>,
}

/// A series whose lookups started late more often than this is named
/// under the series table.
const LATE_NOTED: f64 = 0.01;

impl Report<'_> {
    /// Print the report as JSON.
    pub(super) fn print_json(&self) -> Result<()> {
        let args = self.args;
        let met = self.ratios.iter().all(Ratio::within_target);
        let v = serde_json::json!({
            "benchmark": "floor",
            "rows_per_table": args.rows_per_table,
            "table_gib": self.gib,
            "lookups_per_series": args.lookups,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "in_flight": 1,
            "pinned": self.pinned,
            "busy_poll_us": DEFAULT_BUSY_POLL.as_micros() as u64,
            "server_busy_poll_us": args.server_busy_poll_us,
            "pause_us": args.pause_us,
            "series": self.results,
            "ratios": self.ratios,
            "target": { "p50": TARGET_P50, "p99": TARGET_P99, "met": met },
            "transports": args.transports.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "setup": self.setup,
            "restart": self.restart,
            "donor_exit_clean": self.clean,
            "rdma": self.rdma,
            "host": self.host,
            "quic_udp": self.udp,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        Ok(())
    }

    /// Print the report as text; `donor`'s log follows when it did not exit cleanly.
    pub(super) fn print_text(&self, donor: &DonorProcess) {
        self.print_heading();
        self.print_series();
        if let Some(u) = self.udp {
            println!(
                "QUIC's UDP (quinn-udp on this kernel): GSO up to {} segments a send, GRO up to {} a receive, {} datagrams a recvmmsg",
                u.gso_segments, u.gro_segments, u.recv_batch
            );
        }
        println!(
            "(polling clients poll for up to {} us before sleeping)",
            DEFAULT_BUSY_POLL.as_micros()
        );
        for r in &self.ratios {
            println!(
                "{} rows, {}: p50 {:.3}x, p99 {:.3}x, p99.9 {:.3}x{}",
                r.rows,
                r.what,
                r.p50,
                r.p99,
                r.p999,
                r.verdict()
            );
        }
        self.print_connections();
        if let Some(r) = &self.rdma {
            r.print_text();
        }
        if !self.clean {
            println!(
                "warning: the donor did not exit cleanly on SIGTERM; its log:\n{}",
                donor.log()
            );
        }
    }

    /// Where each series' lookups spent their time, both ends.
    fn print_split(&self) {
        let rows: Vec<Vec<String>> = self
            .results
            .iter()
            .filter_map(|r| {
                let p = r.split?;
                Some(vec![
                    r.series.clone(),
                    format!("{:.1}", p.wall_us),
                    format!("{:.1}", p.client_cpu_us),
                    format!("{:.1}", p.server_cpu_us),
                    format!("{:.1}", p.server_waiting_us),
                    format!("{:.1}", p.neither_us),
                ])
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        println!(
            "where a lookup's time goes (means per lookup over the rounds, from the kernel's schedstat of every thread of the client's and the serving process; wall includes the untimed work and the pause between lookups):"
        );
        print_table(
            &[
                "series",
                "wall us",
                "client CPU us",
                "server CPU us",
                "server waiting for a CPU us",
                "neither on a CPU us",
            ],
            &rows,
        );
    }

    fn print_heading(&self) {
        let args = self.args;
        println!(
            "engram-bench floor: 2 tables x {} rows ({:.2} GiB each), {} timed lookups per series after {} warm-up, \
             1 in flight, {}, loopback TCP{}{}; medians of {} rounds",
            args.rows_per_table,
            self.gib,
            args.lookups,
            args.warmup,
            if args.pause_us > 0 {
                format!(
                    "each {} us after the last one's answer (--pause-us)",
                    args.pause_us
                )
            } else {
                "back to back".to_string()
            },
            if self.pinned {
                ", client and servers pinned to separate CPUs"
            } else {
                ""
            },
            if args.server_busy_poll_us > 0 {
                format!(
                    ", both servers polling {} us before a read (donor --busy-poll-us)",
                    args.server_busy_poll_us
                )
            } else {
                String::new()
            },
            args.rounds
        );
    }

    /// Every series' medians, and the host-local ones.
    fn print_series(&self) {
        let rows: Vec<Vec<String>> = self
            .results
            .iter()
            .map(|r| {
                vec![
                    r.series.clone(),
                    format!("{}/{}", r.request_bytes, r.answer_bytes),
                    format!("{:.1}", r.median.p50_us),
                    format!("{:.1}", r.median.p99_us),
                    format!("{:.1}", r.median.p999_us),
                ]
            })
            .collect();
        print_table(
            &["series", "req/ans bytes", "p50 us", "p99 us", "p99.9 us"],
            &rows,
        );
        let late: Vec<String> = self
            .results
            .iter()
            .filter(|r| r.pause_overran > LATE_NOTED)
            .map(|r| format!("{} ({:.0}%)", r.series, r.pause_overran * 100.0))
            .collect();
        if self.args.pause_us > 0 && !late.is_empty() {
            println!(
                "lookups that started later than the pause after the last, their series' own work between lookups being longer: {}",
                late.join(", ")
            );
        }
        self.print_split();
        if let Some(h) = &self.host {
            println!(
                "host-local (gathered in this process, no request): the donor's mapping{}",
                match h.page_kib {
                    Some(k) if k >= 2048 => format!(", on {k} KiB pages (hugetlb)"),
                    Some(k) => format!(", on {k} KiB pages"),
                    None => String::new(),
                }
            );
            let rows: Vec<Vec<String>> = h
                .series
                .iter()
                .map(|r| {
                    vec![
                        r.series.clone(),
                        format!("{:.2}", r.median.p50_us),
                        format!("{:.2}", r.median.p99_us),
                        format!("{:.2}", r.median.p999_us),
                    ]
                })
                .collect();
            print_table(&["series", "p50 us", "p99 us", "p99.9 us"], &rows);
        }
    }

    /// Connection set-up and restarts.
    fn print_connections(&self) {
        if !self.setup.is_empty() {
            println!("connection set-up (connect to Welcome):");
            let rows: Vec<Vec<String>> = self
                .setup
                .iter()
                .map(|s| {
                    vec![
                        s.transport.clone(),
                        s.what.to_string(),
                        s.connects.to_string(),
                        format!("{:.1}", s.summary.p50_us),
                        format!("{:.1}", s.summary.p99_us),
                    ]
                })
                .collect();
            print_table(&["transport", "set-up", "n", "p50 us", "p99 us"], &rows);
        }
        if !self.restart.is_empty() {
            println!("restarted donor (kill -9): ready line to first served lookup:");
            let rows: Vec<Vec<String>> = self
                .restart
                .iter()
                .map(|r| {
                    let each: Vec<String> = r.ms.iter().map(|m| format!("{m:.1}")).collect();
                    vec![
                        r.transport.clone(),
                        format!("{:.1}", r.median_ms),
                        each.join(", "),
                    ]
                })
                .collect();
            print_table(&["transport", "median ms", "each ms"], &rows);
        }
    }
}
