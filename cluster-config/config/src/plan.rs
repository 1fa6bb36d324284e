//! The rack's capacity and timing plan (`engram-cluster plan`): per donor,
//! the RAM its tables need plus headroom against the RAM it declares (and
//! whether it could hot-swap its largest table alongside the old version);
//! per node, each table's sources in order, its window at the node's token
//! rate, and the slowdown predicted from assumed per-source latencies with
//! seed 000's model: a table whose rows arrive `f` after the token starts,
//! with a window `w`, adds `max(0, f - w)` to the token time `W`;
//! `T = W + extra`, tokens/s = 1000 / T (ms).
//!
//! A table's fetch time is its first source's latency (the plan is for the
//! healthy rack; failover adds the next source's latency on top).

use std::collections::HashMap;
use std::time::Duration;

use engram_protocol::encoding::RowEncoding;
use serde::Serialize;
use thiserror::Error;

use crate::{Config, GIB, SourceRef};

/// Seed 000's timing model for one token of `token_ms` (`W`): each table
/// `(window_ms, fetch_ms)` adds its overshoot `max(0, f - w)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// `W`, in milliseconds.
    pub token_ms: f64,
    /// Sum of the tables' overshoots, in milliseconds.
    pub extra_ms: f64,
    /// `T = W + extra`, in milliseconds.
    pub time_ms: f64,
    /// `1000 / T`.
    pub tokens_per_second: f64,
    /// `extra / W`.
    pub slowdown: f64,
}

/// Apply seed 000's formula: `extra = sum max(0, f_i - w_i)`, `T = W + extra`.
pub fn predict(token_ms: f64, tables: &[(f64, f64)]) -> Prediction {
    let extra_ms: f64 = tables.iter().map(|&(w, f)| (f - w).max(0.0)).sum();
    let time_ms = token_ms + extra_ms;
    Prediction {
        token_ms,
        extra_ms,
        time_ms,
        tokens_per_second: if time_ms > 0.0 { 1000.0 / time_ms } else { 0.0 },
        slowdown: if token_ms > 0.0 {
            extra_ms / token_ms
        } else {
            0.0
        },
    }
}

/// The V4.1 windows (layers 1 and 14) of a token of `token_ms`: `W/40` and `13W/40`.
pub fn v41_windows_ms(token_ms: f64) -> [f64; 2] {
    let blocks = f64::from(crate::MODEL_BLOCKS);
    crate::V41_ENGRAM_LAYERS.map(|l| {
        let n = crate::window_blocks(l, crate::V41_ENGRAM_LAYERS);
        f64::from(n) * token_ms / blocks
    })
}

/// Assumed latency of one table's fetch, per kind of source.
#[derive(Debug, Clone, PartialEq)]
pub struct Latencies {
    /// The node's own RAM.
    pub local: Duration,
    /// Any donor without a latency of its own.
    pub donor: Duration,
    /// The node's SSD copy (a whole batch, its rows read in parallel).
    pub ssd: Duration,
    /// Per donor, by name.
    pub donors: HashMap<String, Duration>,
}

impl Default for Latencies {
    fn default() -> Self {
        Self {
            local: Duration::from_micros(5),
            donor: Duration::from_micros(100),
            ssd: Duration::from_micros(400),
            donors: HashMap::new(),
        }
    }
}

/// A `--latency-us` value that is not `NAME=MICROS[,NAME=MICROS...]`.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0:?} is not NAME=MICROSECONDS (NAME: local, ssd, donor, or a donor's name)")]
pub struct LatencyError(pub String);

impl Latencies {
    /// Apply `local=5,ssd=350,donor=100,donor-a=80` over the current values.
    pub fn apply(&mut self, spec: &str) -> Result<(), LatencyError> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = || LatencyError(item.to_string());
            let (name, us) = item.split_once('=').ok_or_else(bad)?;
            let us: f64 = us.trim().parse().map_err(|_| bad())?;
            if !(us.is_finite() && (0.0..=1e9).contains(&us)) {
                return Err(bad());
            }
            let d = Duration::from_secs_f64(us / 1e6);
            match name.trim() {
                "" => return Err(bad()),
                "local" => self.local = d,
                "ssd" => self.ssd = d,
                "donor" => self.donor = d,
                donor => {
                    self.donors.insert(donor.to_string(), d);
                }
            }
        }
        Ok(())
    }

    /// The latency assumed for `source`.
    pub fn of(&self, source: &SourceRef) -> Duration {
        match source {
            SourceRef::Local => self.local,
            SourceRef::Ssd => self.ssd,
            SourceRef::Donor(d) => self.donors.get(d).copied().unwrap_or(self.donor),
        }
    }
}

/// One donor's RAM.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DonorPlan {
    /// The donor's name in the config.
    pub name: String,
    /// `(table id, bytes)` for each table it holds.
    pub tables: Vec<(u32, u64)>,
    /// Bytes of all its tables as it holds them (rows x 264; file pages
    /// with `map_files`; planar with a planar `host_layout`).
    pub table_bytes: u64,
    /// Headroom kept free, in bytes.
    pub headroom_bytes: u64,
    /// Check words beside the rows of a donor that serves RDMA (8 bytes a
    /// row); 0 otherwise.
    pub rdma_check_bytes: u64,
    /// Memory registered with its RDMA device (pinned: tables and check
    /// words); 0 without RDMA.
    pub registered_bytes: u64,
    /// `table_bytes + rdma_check_bytes + headroom_bytes`.
    pub need_bytes: u64,
    /// The RAM it declares (`ram_gib`), in bytes.
    pub ram_bytes: u64,
    /// True when the tables and headroom fit.
    pub fits: bool,
    /// True when its largest table could also be loaded a second time (a
    /// hot swap keeps both versions until the switch).
    pub swap_fits: bool,
    /// The NUMA node its tables are bound to (`numa_node`): that node's
    /// memory, not the host's, must hold `table_bytes`.
    pub numa_node: Option<u32>,
    /// Its host socket, when the host's processes map its tables.
    pub host_socket: Option<String>,
}

/// One table on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TablePlan {
    /// Table id.
    pub table: u32,
    /// Model layer the table serves (0 when the config has no such table).
    pub layer: u32,
    /// Sources in order of preference.
    pub sources: Vec<String>,
    /// Time its rows have, at the node's rate, in microseconds.
    pub window_us: f64,
    /// Assumed fetch time (its first source's latency), in microseconds.
    pub fetch_us: f64,
    /// `max(0, fetch - window)`, in microseconds.
    pub over_us: f64,
}

/// One node's predicted token time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodePlan {
    /// The node's name in the config.
    pub name: String,
    /// The token rate the node's model runs at (`tokens_per_second`).
    pub tokens_per_second: f64,
    /// `W`, in milliseconds.
    pub token_ms: f64,
    /// Each table it routes, in config order.
    pub tables: Vec<TablePlan>,
    /// Sum of the tables' overshoots, in milliseconds.
    pub extra_ms: f64,
    /// `extra / W`.
    pub slowdown: f64,
    /// `1000 / (W + extra)`.
    pub predicted_tokens_per_second: f64,
}

/// The whole rack's plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The rack's name.
    pub rack: String,
    /// Each donor's memory, in config order.
    pub donors: Vec<DonorPlan>,
    /// Each node's predicted token time, in config order.
    pub nodes: Vec<NodePlan>,
}

/// The memory a table of `rows` takes on donor `d`: with `map_files` its
/// file's pages (15 rows and slack to 4 KiB); else its rows, back to back
/// or, for a planar `host_layout`, planar (values, then the scales from
/// the next 4 KiB boundary). What the donor reports as
/// `engram_donor_table_memory_bytes` once it serves the table.
fn resident_bytes(rows: u64, d: &crate::Donor, encoding: RowEncoding) -> u64 {
    use engram_protocol::etab::{PAGE_BYTES, ROWS_PER_PAGE};
    if encoding != RowEncoding::V41 {
        // Rows of another encoding: packed, in the donor's own memory,
        // whatever `map_files` and `host_layout` say (docs/models.md).
        return rows.saturating_mul(encoding.row_bytes() as u64);
    }
    if d.map_files {
        rows.div_ceil(ROWS_PER_PAGE) * PAGE_BYTES
    } else {
        d.host_layout
            .rows_len(rows)
            .unwrap_or(rows * engram_protocol::ROW_BYTES as u64)
    }
}

impl Plan {
    /// Plan `config` with these latencies.
    pub fn new(config: &Config, lat: &Latencies) -> Self {
        let donors = config
            .donors
            .iter()
            .map(|d| DonorPlan::of(config, d))
            .collect();
        let nodes = config
            .nodes
            .iter()
            .map(|n| NodePlan::of(config, n, lat))
            .collect();
        Self {
            rack: config.rack.clone(),
            donors,
            nodes,
        }
    }

    /// True when every donor's tables and headroom fit its RAM.
    pub fn fits(&self) -> bool {
        self.donors.iter().all(|d| d.fits)
    }

    /// The plan as a readable table.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "rack {}", self.rack);
        let _ = writeln!(s, "\ndonors (GiB)");
        let _ = writeln!(
            s,
            "  {:<16} {:<12} {:>9} {:>9} {:>9} {:>9} {:>9}  {:<9} fits",
            "donor", "tables", "tables", "headroom", "need", "ram", "free", "swap room"
        );
        self.render_donors(&mut s);
        for n in &self.nodes {
            let _ = writeln!(
                s,
                "\nnode {} at {} tokens/s (W = {:.3} ms)",
                n.name, n.tokens_per_second, n.token_ms
            );
            let _ = writeln!(
                s,
                "  {:<6} {:<6} {:<32} {:>10} {:>10} {:>10}",
                "table", "layer", "sources", "window us", "fetch us", "over us"
            );
            for t in &n.tables {
                let _ = writeln!(
                    s,
                    "  {:<6} {:<6} {:<32} {:>10.1} {:>10.1} {:>10.1}",
                    t.table,
                    t.layer,
                    t.sources.join(" -> "),
                    t.window_us,
                    t.fetch_us,
                    t.over_us
                );
            }
            let _ = writeln!(
                s,
                "  predicted: extra {:.3} ms, T = {:.3} ms, {:.1} tokens/s ({:.2}% slower)",
                n.extra_ms,
                n.token_ms + n.extra_ms,
                n.predicted_tokens_per_second,
                n.slowdown * 100.0
            );
        }
        s
    }
    /// The donors' lines of [`Self::render`]: one per donor, then what RDMA
    /// pins, NUMA binds and host sockets share.
    fn render_donors(&self, s: &mut String) {
        use std::fmt::Write;
        let gib = |b: u64| b as f64 / GIB;
        for d in &self.donors {
            let ids: Vec<String> = d.tables.iter().map(|t| t.0.to_string()).collect();
            let free = gib(d.ram_bytes) - gib(d.need_bytes);
            let _ = writeln!(
                s,
                "  {:<16} {:<12} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}  {:<9} {}",
                d.name,
                ids.join(","),
                gib(d.table_bytes),
                gib(d.headroom_bytes),
                gib(d.need_bytes),
                gib(d.ram_bytes),
                free,
                if d.swap_fits { "yes" } else { "in place" },
                if d.fits { "ok" } else { "NO: does not fit" }
            );
        }
        for d in self.donors.iter().filter(|d| d.registered_bytes > 0) {
            let _ = writeln!(
                s,
                "  {}: RDMA registers (pins) {:.2} GiB: its tables and {:.2} GiB of row check \
                 words (counted in need); its memlock limit must allow it (LimitMEMLOCK=infinity)",
                d.name,
                gib(d.registered_bytes),
                gib(d.rdma_check_bytes),
            );
        }
        for d in &self.donors {
            if let Some(n) = d.numa_node {
                let _ = writeln!(
                    s,
                    "  {}: its tables ({:.2} GiB) are bound to NUMA node {n}: that node's memory \
                     must hold them",
                    d.name,
                    gib(d.table_bytes)
                );
            }
            if let Some(p) = &d.host_socket {
                let _ = writeln!(
                    s,
                    "  {}: processes on its host map its tables through {p} (one copy for the host)",
                    d.name
                );
            }
        }
    }
}

impl DonorPlan {
    /// What donor `d` of `config` needs.
    fn of(config: &Config, d: &crate::Donor) -> Self {
        let held: Vec<&crate::Table> = d.tables.iter().filter_map(|id| config.table(*id)).collect();
        let tables: Vec<(u32, u64)> = held
            .iter()
            .map(|t| (t.id, resident_bytes(t.rows, d, t.encoding)))
            .collect();
        let table_bytes: u64 = tables.iter().map(|t| t.1).sum();
        // An RDMA donor keeps a check word beside every row, and a
        // swap registers the new version's beside the old; tables
        // served from their files' pages, and tables of other encodings
        // than V4.1's, are not offered over RDMA.
        let rdma = d.rdma.is_some() && !d.map_files;
        let checks = |t: &crate::Table| {
            if rdma && t.encoding == RowEncoding::V41 {
                t.rows * crate::RDMA_CHECK_BYTES
            } else {
                0
            }
        };
        let largest = held
            .iter()
            .zip(&tables)
            .map(|(t, &(_, bytes))| bytes + checks(t))
            .max()
            .unwrap_or(0);
        let headroom_bytes = (d.headroom_gib * GIB) as u64;
        let ram_bytes = (d.ram_gib * GIB) as u64;
        let rdma_check_bytes: u64 = held.iter().map(|t| checks(t)).sum();
        let registered_bytes = if rdma {
            table_bytes + rdma_check_bytes
        } else {
            0
        };
        let need_bytes = table_bytes + rdma_check_bytes + headroom_bytes;
        DonorPlan {
            name: d.name.clone(),
            tables,
            table_bytes,
            headroom_bytes,
            rdma_check_bytes,
            registered_bytes,
            need_bytes,
            ram_bytes,
            fits: need_bytes <= ram_bytes,
            swap_fits: need_bytes + largest <= ram_bytes,
            numa_node: d.numa_node,
            host_socket: d.host_socket.as_ref().map(|p| p.display().to_string()),
        }
    }
}

impl NodePlan {
    /// Node `n`'s tables: windows, fetch times, the predicted rate.
    fn of(config: &Config, n: &crate::Node, lat: &Latencies) -> Self {
        let w = n.token_time().as_secs_f64() * 1e3;
        let tables: Vec<TablePlan> = n
            .routes
            .iter()
            .map(|r| {
                let window_us = n
                    .window(config, r.table)
                    .map_or(0.0, |d| d.as_secs_f64() * 1e6);
                let fetch_us = r
                    .sources
                    .first()
                    .map_or(0.0, |s| lat.of(s).as_secs_f64() * 1e6);
                TablePlan {
                    table: r.table,
                    layer: config.table(r.table).map_or(0, |t| t.layer),
                    sources: r.sources.iter().map(ToString::to_string).collect(),
                    window_us,
                    fetch_us,
                    over_us: (fetch_us - window_us).max(0.0),
                }
            })
            .collect();
        let windows: Vec<(f64, f64)> = tables
            .iter()
            .map(|t| (t.window_us / 1e3, t.fetch_us / 1e3))
            .collect();
        let p = predict(w, &windows);
        NodePlan {
            name: n.name.clone(),
            tokens_per_second: n.tokens_per_second,
            token_ms: w,
            tables,
            extra_ms: p.extra_ms,
            slowdown: p.slowdown,
            predicted_tokens_per_second: p.tokens_per_second,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const D: &str = "1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn the_formula_reproduces_seed_000s_figures() {
        // 100 tokens/s, table 1 fetched in 0.59 ms against a 0.25 ms window:
        // 0.34 ms over a 10 ms token, about 96.7 tokens/s.
        let [w0, w1] = v41_windows_ms(10.0);
        assert!((w0 - 0.25).abs() < 1e-12 && (w1 - 3.25).abs() < 1e-12);
        let p = predict(10.0, &[(w0, 0.59), (w1, 0.59)]);
        assert!((p.extra_ms - 0.34).abs() < 1e-9);
        assert!((p.tokens_per_second - 96.71).abs() < 0.01);
        assert!((p.slowdown - 0.034).abs() < 1e-9);
        // A 4 ms round trip misses both windows: about 69 tokens/s.
        let p = predict(10.0, &[(w0, 4.0), (w1, 4.0)]);
        assert!((p.tokens_per_second - 1000.0 / 14.5).abs() < 1e-9);
        // Nothing late, nothing added.
        assert_eq!(predict(10.0, &[(w0, 0.1), (w1, 1.0)]).extra_ms, 0.0);
    }

    /// Two V4.1 tables, `donor-a` holding table 1 and `big` both.
    fn config(tps: f64, ram_a: f64, sources1: &str) -> Config {
        let text = format!(
            "version = 1\n[rack]\nname = \"r\"\ntls = {{}}\n\
             [[table]]\nid = 1\nlayer = 1\npath = \"/t1\"\nrows = 384006168\ndigest = \"{D}\"\n\
             [[table]]\nid = 14\nlayer = 14\npath = \"/t14\"\nrows = 384016682\ndigest = \"{D}\"\n\
             [[donor]]\nname = \"donor-a\"\nlisten = [\"10.0.0.1:1\"]\ntables = [1]\nram_gib = {ram_a}\n\
             [[donor]]\nname = \"big\"\nlisten = [\"10.0.0.2:1\"]\ntables = [1, 14]\nram_gib = 512.0\nheadroom_gib = 8\n\
             [[node]]\nname = \"n\"\ntokens_per_second = {tps}\n\
             [[node.route]]\ntable = 1\nsources = [{sources1}]\nssd_path = \"/s1\"\n\
             [[node.route]]\ntable = 14\nsources = [\"big\", \"ssd\"]\nssd_path = \"/s14\"\n"
        );
        Config::parse(&text, Path::new("/r.toml")).expect("valid")
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn seed_000_numbers() {
        // 100 tokens/s: W = 10 ms, table 1 has 250 us, table 14 3250 us.
        let c = config(100.0, 128.0, "\"donor-a\", \"ssd\"");
        let mut lat = Latencies::default();
        lat.apply("donor-a=340").expect("latency");
        let p = Plan::new(&c, &lat);
        let n = &p.nodes[0];
        assert!(close(n.token_ms, 10.0));
        assert!(close(n.tables[0].window_us, 250.0), "{:?}", n.tables[0]);
        assert!(close(n.tables[1].window_us, 3250.0), "{:?}", n.tables[1]);
        assert!(close(n.tables[0].over_us, 90.0));
        assert_eq!(n.tables[1].over_us, 0.0, "big's 100 us fits 3250 us");
        assert!(close(n.extra_ms, 0.09));
        // 1000 / 10.09 = 99.108...
        assert!(close(n.predicted_tokens_per_second, 1000.0 / 10.09));
        assert!(p.render().contains("99.1 tokens/s"), "{}", p.render());
        // Seed 000: 0.34 ms over a 10 ms token is about 96.7 tokens/s.
        lat.apply("donor-a=590").expect("latency");
        let n = &Plan::new(&c, &lat).nodes[0];
        assert!(close(n.extra_ms, 0.34));
        assert!((n.predicted_tokens_per_second - 96.7).abs() < 0.05);
        // A 4 ms round trip misses both windows: 3.75 + 0.75 ms.
        lat.apply("donor-a=4000,big=4000").expect("latency");
        let n = &Plan::new(&c, &lat).nodes[0];
        assert!(close(n.extra_ms, 4.5), "{n:?}");
    }

    /// Qwen3.8-Flash-Next's table in FP8 (320,001,536 rows of 160 bytes,
    /// 47.7 GiB) held beside V4.1's layer-1 table: packed at its own row
    /// size whatever `map_files` says, and without RDMA check words.
    #[test]
    fn a_table_of_another_encoding_takes_its_own_row_size() {
        for map_files in [false, true] {
            let text = format!(
                "version = 1\n[rack]\nname = \"r\"\ntls = {{}}\n\
                 [[table]]\nid = 1\nlayer = 1\npath = \"/t1\"\nrows = 384006168\ndigest = \"{D}\"\n\
                 [[table]]\nid = 2\nlayer = 1\npath = \"/q\"\nrows = 320001536\ndigest = \"{D}\"\n\
                 encoding = \"fp8_per_tensorx160\"\n\
                 [[donor]]\nname = \"d\"\nlisten = [{listen}]\n\
                 tables = [1, 2]\nram_gib = 256.0\nheadroom_gib = 0\nmap_files = {map_files}\n",
                listen = if map_files {
                    "\"10.0.0.1:1\""
                } else {
                    "\"tls://10.0.0.1:1\", \"rdma://10.0.0.1:2\""
                },
            );
            let c = Config::parse(&text, Path::new("/r.toml")).expect("valid");
            let d = &Plan::new(&c, &Latencies::default()).donors[0];
            assert_eq!(d.tables[1], (2, 320_001_536 * 160), "map_files {map_files}");
            let gib = d.tables[1].1 as f64 / (1u64 << 30) as f64;
            assert!((gib - 47.68).abs() < 0.01, "{gib}");
            if !map_files {
                assert_eq!(d.tables[0].1, 384_006_168 * 264);
                assert_eq!(d.rdma_check_bytes, 384_006_168 * 8, "V4.1's rows only");
            }
        }
    }

    #[test]
    fn the_first_source_sets_the_fetch_time() {
        let c = config(100.0, 128.0, "\"local\", \"donor-a\"");
        let p = Plan::new(&c, &Latencies::default());
        assert!(close(p.nodes[0].tables[0].fetch_us, 5.0));
        let c = config(100.0, 128.0, "\"ssd\"");
        let p = Plan::new(&c, &Latencies::default());
        assert!(close(p.nodes[0].tables[0].fetch_us, 400.0));
        assert!(close(p.nodes[0].extra_ms, 0.15));
        assert_eq!(p.nodes[0].tables[0].sources, vec!["ssd".to_string()]);
    }

    #[test]
    fn donor_ram_against_tables_and_headroom() {
        // Table 1 served from its file's pages (the default): 384,006,168
        // rows, 15 to a 4 KiB page = 97.66 GiB; + 2 GiB headroom.
        let c = config(100.0, 128.0, "\"donor-a\"");
        assert!(c.donors[0].map_files, "file pages by default");
        let p = Plan::new(&c, &Latencies::default());
        let a = &p.donors[0];
        assert_eq!(a.table_bytes, 25_600_412 * 4096);
        assert_eq!(a.headroom_bytes, 2 << 30);
        assert!(a.fits && !a.swap_fits, "{a:?}");
        let big = &p.donors[1];
        assert_eq!(big.headroom_bytes, 8 << 30);
        assert!(big.fits && big.swap_fits, "{big:?}");
        assert!(p.fits());
        let c = config(96.0, 96.0, "\"donor-a\"");
        let p = Plan::new(&c, &Latencies::default());
        assert!(!p.donors[0].fits && !p.fits());
        assert!(p.render().contains("NO: does not fit"));
        assert_eq!(p.donors[0].registered_bytes, 0);
    }

    #[test]
    fn a_donor_bound_to_a_numa_node_and_sharing_its_host_is_shown() {
        let mut c = config(100.0, 128.0, "\"donor-a\"");
        // Both need a copy, so the config's default is one.
        c.donors[0].map_files = false;
        c.donors[0].numa_node = Some(1);
        c.donors[0].host_socket = Some("/run/engram-rack/a.sock".into());
        let p = Plan::new(&c, &Latencies::default());
        assert_eq!(p.donors[0].numa_node, Some(1));
        let r = p.render();
        assert!(
            r.contains("donor-a: its tables (94.42 GiB) are bound to NUMA node 1"),
            "{r}"
        );
        assert!(
            r.contains(
                "donor-a: processes on its host map its tables through /run/engram-rack/a.sock"
            ),
            "{r}"
        );
    }

    #[test]
    fn an_rdma_donor_registers_its_tables_and_their_check_words() {
        let mut c = config(100.0, 128.0, "\"donor-a\"");
        c.donors[0].rdma = Some(crate::RdmaDevice::default());
        c.donors[0].map_files = false;
        let p = Plan::new(&c, &Latencies::default());
        let a = &p.donors[0];
        assert_eq!(a.rdma_check_bytes, 384_006_168 * 8);
        assert_eq!(a.registered_bytes, 384_006_168 * 272);
        assert_eq!(a.need_bytes, 384_006_168 * 272 + (2 << 30));
        assert!(a.fits);
        let r = p.render();
        assert!(
            r.contains("donor-a: RDMA registers (pins) 97.28 GiB"),
            "{r}"
        );
        assert!(r.contains("2.86 GiB of row check words"), "{r}");
        // 94.41 + 2.86 + 2 GiB no longer fits 99 GiB.
        c.donors[0].ram_gib = 99.0;
        assert!(!Plan::new(&c, &Latencies::default()).donors[0].fits);
        c.donors[0].rdma = None;
        assert!(Plan::new(&c, &Latencies::default()).donors[0].fits);
    }

    #[test]
    fn a_donor_serving_file_pages_needs_them_whole_and_registers_nothing() {
        let mut c = config(100.0, 128.0, "\"donor-a\"");
        c.donors[0].rdma = Some(crate::RdmaDevice::default());
        c.donors[0].map_files = true;
        let a = &Plan::new(&c, &Latencies::default()).donors[0];
        // 384,006,168 rows, 15 to a 4 KiB page: 25,600,412 pages.
        assert_eq!(a.table_bytes, 25_600_412 * 4096);
        assert_eq!((a.rdma_check_bytes, a.registered_bytes), (0, 0));
        assert_eq!(a.need_bytes, 25_600_412 * 4096 + (2 << 30));
        // 97.66 GiB of pages and 2 GiB of headroom do not fit 99 GiB.
        c.donors[0].ram_gib = 99.0;
        assert!(!Plan::new(&c, &Latencies::default()).donors[0].fits);
    }

    #[test]
    fn latency_specs() {
        let mut l = Latencies::default();
        l.apply("donor-a=80, ssd=350,local=2.5,donor=120")
            .expect("ok");
        assert_eq!(
            l.of(&SourceRef::Donor("donor-a".into())),
            Duration::from_micros(80)
        );
        assert_eq!(
            l.of(&SourceRef::Donor("other".into())),
            Duration::from_micros(120)
        );
        assert_eq!(l.of(&SourceRef::Ssd), Duration::from_micros(350));
        assert_eq!(l.of(&SourceRef::Local), Duration::from_nanos(2500));
        for bad in ["ssd", "ssd=x", "=5", "ssd=-1", "ssd=inf"] {
            assert!(l.apply(bad).is_err(), "{bad}");
        }
    }
}
