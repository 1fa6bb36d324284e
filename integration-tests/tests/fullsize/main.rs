//! V4.1's two tables at their real size (384,006,168 and 384,016,682 rows,
//! `hash_base` 16,000,000; 94.4 GiB of rows, 97.8 GiB of file each) end to
//! end on a machine with neither the RAM nor the disk for them: the table
//! files are sparse (`memory-donor gen --sparse-rows`), holding their
//! synthetic rows only in the pages of the rows this test reads, which are
//! the rows whose bytes start, end or straddle 4 GiB and 64 GiB in every
//! layout a table takes (the file's pages, rows back to back, planar
//! values), the last rows, and rows spread over the table; every other row
//! is zero, and is read too. The digests and page checksums are those of
//! the whole tables. Each file takes about 200 MB of disk (its checksums);
//! the donors' copies take a few pages of memory.
//!
//! Checked, with each source's offsets (`offsets_covered`): `inspect`,
//! `verify` of every page and the whole digest, `engram-cluster plan`
//! against the memory each donor then reports, lookups from a donor serving
//! its files' pages (`map_files`), one serving a packed memfd copy, one
//! serving a planar copy on a host socket, the node's SSD copy (O_DIRECT
//! page reads, each page's checksum checked), the node's host view and
//! Python's view of the planar copy, and RDMA reads on the fake provider.

mod python;
mod rdma;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cluster_config::Config;
use engram_protocol::hashing::HashParams;
use engram_protocol::synthetic::synthetic_rows;
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::resident::ExpectedTable;
use inference_node::client::{ClientOptions, DonorClient, Request};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use inference_node::source::ssd::{SsdOptions, SsdReader};
use rack_harness::rack_toml::{
    DonorEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry,
};
use rack_harness::{DonorProcess, bin, free_port, runtime, sample, scrape};

/// The synthetic generator's seed.
pub const SEED: u64 = 41;
/// The layers, in table order.
pub const LAYERS: [u32; 2] = [1, 14];
const GIB: u64 = 1 << 30;

/// The two full-size tables.
#[derive(Debug)]
pub struct Tables {
    _dir: tempfile::TempDir,
    /// Their files.
    pub paths: [PathBuf; 2],
    /// Their digests.
    pub digests: [TableDigest; 2],
    /// Their rows.
    pub rows: [u64; 2],
    /// The rows whose pages hold data.
    pub touched: [Vec<u64>; 2],
}

impl Tables {
    /// Row `r` of table `t` as it must read: its synthetic bytes where its
    /// page holds data, zeros elsewhere.
    pub fn expected(&self, t: usize, r: u64) -> Vec<u8> {
        let mut row = vec![0u8; ROW_BYTES];
        if self.touched[t].iter().any(|x| x / 15 == r / 15) {
            synthetic_rows(SEED, LAYERS[t], r, &mut row);
        }
        row
    }

    /// The rows a check reads of table `t`: every touched row and two rows
    /// in holes.
    pub fn lookups(&self, t: usize) -> Vec<u64> {
        let mut v = self.touched[t].clone();
        v.extend([self.rows[t] / 3, self.rows[t] / 2 + 1]);
        v
    }

    /// Panic unless `out` holds table `t`'s rows `rows`, naming `source`.
    pub fn check(&self, t: usize, rows: &[u64], out: &[u8], source: &str) {
        for (i, &r) in rows.iter().enumerate() {
            let got = &out[i * ROW_BYTES..][..ROW_BYTES];
            assert!(
                got == self.expected(t, r).as_slice(),
                "{source}: table {} row {r} is wrong",
                LAYERS[t]
            );
        }
    }
}

/// Rows whose bytes start at, end at or straddle 4 GiB and 64 GiB in
/// each layout (file pages from offset 4096, rows back to back, planar
/// values), the first and last rows, and 31 rows spread over the table.
pub fn boundary_rows(rows: u64) -> Vec<u64> {
    let mut v = vec![0, rows - 2, rows - 1];
    for b in [4 * GIB, 64 * GIB] {
        let page = b / 4096 - 1;
        v.extend([page * 15 - 1, page * 15, page * 15 + 14]);
        let packed = b / ROW_BYTES as u64;
        v.extend([packed - 1, packed, packed + 1]);
        let planar = b / 256;
        v.extend([planar - 1, planar]);
    }
    v.extend((1..32).map(|k| rows / 32 * k + k));
    v.retain(|&r| r < rows);
    v.sort_unstable();
    v.dedup();
    v
}

fn list(rows: &[u64]) -> String {
    rows.iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Generate both tables at once (two processes, one core each).
fn generate() -> Tables {
    let dir = tempfile::tempdir().expect("tempdir");
    let params = HashParams::v41();
    let rows = [params.layers[0].rows, params.layers[1].rows];
    let touched = rows.map(boundary_rows);
    let paths = LAYERS.map(|l| dir.path().join(format!("layer{l}.etab")));
    let gens: Vec<Child> = (0..2)
        .map(|t| {
            Command::new(bin("memory-donor"))
                .args([
                    "gen",
                    "--layer",
                    &LAYERS[t].to_string(),
                    "--hash-preset",
                    "v41",
                ])
                .args(["--seed", &SEED.to_string(), "--threads", "1"])
                .arg("--out")
                .arg(&paths[t])
                .args(["--sparse-rows", &list(&touched[t])])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("gen starts")
        })
        .collect();
    let digests: Vec<TableDigest> = gens
        .into_iter()
        .map(|g| {
            let out = g.wait_with_output().expect("gen");
            assert!(out.status.success(), "gen failed");
            let text = String::from_utf8_lossy(&out.stdout);
            let hex = text.rsplit("digest ").next().expect("digest").trim();
            hex.parse().expect("a digest")
        })
        .collect();
    Tables {
        _dir: dir,
        paths,
        digests: [digests[0], digests[1]],
        rows,
        touched,
    }
}

/// `inspect --json` reports the real sizes, and `verify` checks every
/// page and the digest of each whole table.
fn tools(t: &Tables) {
    for i in 0..2 {
        let out = Command::new(bin("memory-donor"))
            .arg("inspect")
            .arg(&t.paths[i])
            .arg("--json")
            .output()
            .expect("inspect");
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let meta = std::fs::metadata(&t.paths[i]).expect("stat");
        assert_eq!(v["rows"].as_u64(), Some(t.rows[i]));
        assert_eq!(v["pages"].as_u64(), Some(t.rows[i].div_ceil(15)));
        assert_eq!(
            v["data_start"].as_u64(),
            Some(4096),
            "boundary_rows assumes it"
        );
        assert_eq!(v["file_len"].as_u64(), Some(meta.len()));
        assert!(meta.len() > 97 * GIB, "{} bytes", meta.len());
        assert_eq!(v["hash_base"].as_u64(), Some(16_000_000));
        assert_eq!(v["digest"].as_str(), Some(t.digests[i].to_hex().as_str()));
        // Sparse: the page checksums (1/512 of the file) and a few pages.
        let on_disk = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
        assert!(on_disk < 400 << 20, "{on_disk} bytes on disk");
    }
    let out = Command::new(bin("memory-donor"))
        .arg("verify")
        .args(&t.paths)
        .output()
        .expect("verify");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches(": ok: ").count(), 2, "{text}");
}

/// The rack: donor `m` serves its files' pages, `c` a packed copy and `p`
/// a planar copy, both memfds on host sockets; node `n` routes both tables to `p`, then
/// its SSD copies. Every donor trusts the digests (`verify` checked them)
/// and locks nothing (a sparse table's pages would all be faulted in).
fn rack(t: &Tables, dir: &Path) -> Config {
    let mut toml = RackToml::new("full");
    toml.table = (0..2)
        .map(|i| TableEntry::new(LAYERS[i], &t.paths[i], t.rows[i], t.digests[i]))
        .collect();
    let donor = |name: &str, extra: Vec<String>| {
        let mut listen = vec![format!("127.0.0.1:{}", free_port().expect("port"))];
        listen.extend(extra);
        DonorEntry {
            ram_gib: 256.0,
            trust_digest: Some(true),
            mlock: Some("off".into()),
            map_files: Some(name == "m"),
            metrics: Some(format!("127.0.0.1:{}", free_port().expect("port"))),
            ..DonorEntry::new(name, listen, LAYERS)
        }
    };
    // A host socket makes a donor's copy a memfd, which a sparse table's
    // holes leave unallocated (an anonymous copy of 94 GiB is refused by
    // the kernel's overcommit check on a machine with less memory).
    let socket = |n: &str| {
        vec![format!(
            "unix://{}",
            dir.join(format!("{n}.sock")).display()
        )]
    };
    toml.donor = vec![
        donor("m", vec![]),
        donor("c", socket("c")),
        DonorEntry {
            host_layout: Some("planar".into()),
            ..donor("p", socket("p"))
        },
    ];
    let route = |i: usize| RouteEntry {
        trust_digest: Some(true),
        ..RouteEntry::new(LAYERS[i], ["p", "ssd"])
            .ssd_path(&t.paths[i])
            .hedge("off")
    };
    toml.node = vec![NodeEntry {
        tokens_per_second: Some(1.0),
        probe_interval_ms: Some(100),
        lookup_timeout_ms: Some(5_000),
        ..NodeEntry::new("n", vec![route(0), route(1)])
    }];
    // An embedded memory (Python's) needs the model's hashing and a token
    // map: V4.1's, with the identity map of its 99,092 compressed ids.
    let map = dir.join("identity.map");
    let ids: String = (0..99_092).map(|i| format!("{i}\n")).collect();
    std::fs::write(&map, ids).expect("map");
    toml.model = Some(ModelSection {
        hash_preset: Some("v41".into()),
        token_map: Some(map.display().to_string()),
        ..ModelSection::default()
    });
    let path = dir.join("rack.toml");
    toml.write(&path).expect("config");
    Config::load(&path).expect("valid config")
}

/// `engram-cluster plan --json`: each donor's memory per table.
fn plan(config: &Config) -> serde_json::Value {
    let out = Command::new(bin("engram-cluster"))
        .arg("plan")
        .arg(&config.path)
        .arg("--json")
        .output()
        .expect("plan");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// The memory each donor reports per table equals the plan's.
fn plan_matches_the_donors(config: &Config, plan: &serde_json::Value) {
    let donors = plan["donors"].as_array().expect("donors");
    assert_eq!(donors.len(), 3);
    for d in donors {
        let name = d["name"].as_str().expect("name");
        let addr = config.donor(name).and_then(|d| d.metrics).expect("metrics");
        let m = scrape(addr).expect("scrape");
        for entry in d["tables"].as_array().expect("tables") {
            let (id, bytes) = (
                entry[0].as_u64().expect("id"),
                entry[1].as_u64().expect("bytes"),
            );
            let series =
                format!("engram_donor_table_memory_bytes{{table=\"{id}\",layer=\"{id}\"}}");
            assert_eq!(
                sample(&m, &series),
                Some(bytes as f64),
                "donor {name} table {id}: plan says {bytes} bytes"
            );
            assert!(bytes > 94 * GIB, "donor {name} table {id}: {bytes}");
        }
    }
}

/// Both tables' lookup rows in one message to the donor at `addr`.
fn donor_rows(t: &Tables, addr: std::net::SocketAddr, name: &str) {
    let pins = (0..2).map(|i| (LAYERS[i], t.digests[i])).collect();
    let rows = [t.lookups(0), t.lookups(1)];
    let n = rows[0].len() + rows[1].len();
    let mut out = vec![0u8; n * ROW_BYTES];
    runtime().block_on(async {
        let c = DonorClient::connect(addr, &ClientOptions::new("n", pins))
            .await
            .expect("connect");
        let req = [
            Request {
                table: LAYERS[0],
                rows: &rows[0],
            },
            Request {
                table: LAYERS[1],
                rows: &rows[1],
            },
        ];
        c.lookup(&req, &mut out).await.expect("lookup");
    });
    let split = rows[0].len() * ROW_BYTES;
    t.check(0, &rows[0], &out[..split], name);
    t.check(1, &rows[1], &out[split..], name);
}

/// The SSD copy's page reads (O_DIRECT where the file system allows).
fn ssd_rows(t: &Tables) {
    for (i, &layer) in LAYERS.iter().enumerate() {
        let pin = ExpectedTable {
            digest: t.digests[i],
            layer,
            rows: t.rows[i],
        };
        let mut r =
            SsdReader::open(&t.paths[i], Some(pin), true, SsdOptions::default()).expect("ssd copy");
        assert!(r.checks_pages(), "the copy checks every page it reads");
        let rows = t.lookups(i);
        let mut out = vec![0u8; rows.len() * ROW_BYTES];
        r.read(&rows, &mut out).expect("read");
        t.check(i, &rows, &out, "ssd");
        assert_eq!(r.checksum_failures(), 0);
    }
}

/// The node maps donor `p`'s planar copies: its routers read them, and
/// its view of each has the rows where their offsets say; the window it
/// reports for each table is the plan's.
fn host_rows(t: &Tables, config: &Config, planned: &serde_json::Value) {
    runtime().block_on(async {
        let metrics = NodeMetrics::new();
        let mem = Routers::from_config(config, "n", &metrics)
            .await
            .expect("memory");
        for i in 0..2 {
            let rows = t.lookups(i);
            let mut out = vec![0u8; rows.len() * ROW_BYTES];
            let router = mem.router(LAYERS[i]).expect("router");
            let t0 = Instant::now();
            loop {
                let f = router.fetch(&rows, &mut out).await.expect("fetch");
                if f.source.as_deref() == Some("p") {
                    break;
                }
                assert!(t0.elapsed() < Duration::from_secs(30), "never mapped");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            t.check(i, &rows, &out, "host socket");
            let view = mem.table_view(LAYERS[i]).expect("a view");
            let plan = &planned["nodes"][0]["tables"][i];
            let series = format!(
                "engram_node_table_window_seconds{{table=\"{}\"}}",
                LAYERS[i]
            );
            let window = sample(&metrics.render(), &series).expect("the node's window");
            let planned_us = plan["window_us"].as_f64().expect("window");
            assert!(
                (window * 1e6 - planned_us).abs() < 1e-6,
                "{window} s, planned {planned_us} us"
            );
            assert_eq!(plan["table"].as_u64(), Some(u64::from(LAYERS[i])));
            assert!(view.shared() && view.layout().name() == "planar");
            let bytes = view.bytes();
            for &r in &rows {
                let (v, s) = view.offsets(r).expect("in range");
                assert_eq!(v as u64, r * 256, "row {r}");
                let mut row = bytes[v..v + 256].to_vec();
                row.extend_from_slice(&bytes[s..s + 8]);
                assert!(
                    row == t.expected(i, r),
                    "host view: table {} row {r}",
                    LAYERS[i]
                );
            }
        }
    });
}

fn start(config: &Config, name: &str) -> DonorProcess {
    DonorProcess::start(&[
        "--config",
        &config.path.display().to_string(),
        "--name",
        name,
    ])
    .expect("donor starts")
}

/// Where each check read, per table: the byte offsets of its rows in each
/// layout, printed so a run shows what it covered.
fn offsets_covered(t: &Tables) {
    for (i, layer) in LAYERS.iter().enumerate() {
        let rows = t.lookups(i);
        let max = |f: &dyn Fn(u64) -> u64| rows.iter().map(|&r| f(r)).max().unwrap_or(0);
        let scales_at = t.rows[i] * 256;
        eprintln!(
            "table {}: {} rows read; highest offsets: file {} , packed {} , planar values {} , planar scales {}",
            layer,
            rows.len(),
            max(&|r| 4096 + r / 15 * 4096 + r % 15 * 264),
            max(&|r| r * 264),
            max(&|r| r * 256),
            max(&|r| scales_at + r * 8)
        );
    }
}

#[test]
fn full_size_tables_are_served_and_checked_end_to_end() {
    let t = generate();
    offsets_covered(&t);
    tools(&t);
    let config = rack(&t, t.paths[0].parent().expect("dir"));
    let planned = plan(&config);
    let donors: Vec<DonorProcess> = ["m", "c", "p"].map(|n| start(&config, n)).into();
    plan_matches_the_donors(&config, &planned);
    for (name, d) in ["m", "c", "p"].iter().zip(&donors) {
        let addr = d.endpoint(cluster_config::Transport::Tcp).expect("tcp");
        donor_rows(&t, addr, name);
    }
    ssd_rows(&t);
    host_rows(&t, &config, &planned);
    python::view_rows(&t, &config);
    rdma::rows(&t);
}
