//! `engram-bench prefill`: a prompt's rows of both tables fetched in one
//! sweep, the way the node's prefill step fetches them, against the raw
//! bandwidth of the same link measured in the same run.
//!
//! Each donor runs in a network namespace of its own, joined to the bench
//! by a veth pair shaped to `--link-mbit` on both ends (a token bucket):
//! on a rack each donor has its own cable, and here the shaping makes the
//! link, not the two processes sharing this machine's cores, the bound.
//! `--link-mbit 0` leaves the links unshaped: the per-byte work of every
//! side (copies, checksums, TLS) is then the bound.
//! Series, per prompt length (positions; 24 distinct rows per position and
//! table, as a full-size table's hashing gives):
//!
//! - **floor**: the same bytes (both tables' rows) sent as one raw TCP
//!   stream over one such link, from a plain server in the namespace;
//! - **one donor**: both tables' routers over donor A alone;
//! - **two replicas**: routers over donors A and B (same tables, same
//!   versions, separate links): the sweep striped across them;
//! - **local RAM**: the tables in the bench's own memory (no network).
//!
//! The donors' series run over each of `--transports` (TLS, the rack's
//! default, then TCP and QUIC), every donor listening on all of them with
//! the run's own rack PKI; the floor and local RAM are measured once.
//!
//! The time of a sweep is the Engram share of the time to first token: the
//! prompt's rows must all be in before its first layer's fusion ends.
//! Targets (the issue's): one donor at least 70% of the floor's bandwidth,
//! two replicas at least 1.7x one donor.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use cluster_config::{Hedge, Policy, Transport};
use engram_protocol::hashing::{HashParams, Preset, hash_sequence};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::resident::ExpectedTable;
use inference_node::ClientOptions;
use inference_node::client::TlsClient;
use inference_node::metrics::{NodeMetrics, SourceOnly};
use inference_node::model::fetch::fetch_rows;
use inference_node::router::{RouteSettings, Router, SourceHealth};
use inference_node::source::{DonorSource, LocalRam, RowSource};
use inference_node::tls::NodeTls;
use rack_harness::netns::NetNs;
use rack_harness::rack_toml::{
    DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, bin, gen_table};
use serde::Serialize;

use crate::plot::{Bar, Bars};
use crate::stats::{median, print_table};

/// Arguments of `engram-bench prefill`.
#[derive(Debug, Args)]
pub struct PrefillArgs {
    /// Prompt lengths, in positions.
    #[arg(long, value_delimiter = ',', default_values_t = [512, 2048, 8192, 32768])]
    lengths: Vec<usize>,
    /// Rows of each of the two generated tables (at least twice the
    /// longest prompt's 24 rows per position).
    #[arg(long, default_value_t = 1_600_000)]
    rows: u64,
    /// Each donor link's rate, Mbit/s each way; 0: unshaped (the veth
    /// pair as fast as the two cores move bytes).
    #[arg(long, default_value_t = 2000)]
    link_mbit: u32,
    /// Rounds (figures are medians over them).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The donors' transports, each measured in turn (TLS and QUIC with
    /// the run's rack PKI).
    #[arg(long, value_delimiter = ',', default_value = "tls,tcp,quic", value_parser = crate::rack::stream_transport)]
    transports: Vec<Transport>,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Where the tables and the chart go (`prefill.svg`, `prefill.png`).
    #[arg(long, default_value = "target/bench-prefill")]
    out: PathBuf,
    /// Prompts from a real text instead of random distinct rows: its
    /// first positions through the V4 tokenizer, V4.1's token map and
    /// hashing (primes above a base sized to the tables), each table's
    /// distinct rows.
    #[command(flatten)]
    real: crate::realtext::RealTextArgs,
}

/// Arguments of the floor's server (`prefill-floor-server`).
#[derive(Debug, Args)]
pub struct PrefillFloorArgs {
    /// Where to listen.
    #[arg(long)]
    listen: SocketAddr,
}

/// The most one floor request may ask for.
const FLOOR_MAX: u64 = 1 << 30;

/// The floor's server: per connection, read a little-endian u64 length
/// (at most 1 GiB) and send that many bytes, until the peer closes.
pub fn floor_server(args: &PrefillFloorArgs) -> Result<()> {
    let listener = TcpListener::bind(args.listen)?;
    eprintln!("ready listen={}", listener.local_addr()?);
    for stream in listener.incoming() {
        let Ok(mut s) = stream else { continue };
        std::thread::spawn(move || {
            let buf = vec![0x5au8; 1 << 20];
            let mut len = [0u8; 8];
            while s.read_exact(&mut len).is_ok() {
                let mut left = u64::from_le_bytes(len);
                if left > FLOOR_MAX {
                    return;
                }
                while left > 0 {
                    let n = left.min(buf.len() as u64) as usize;
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            }
        });
    }
    Ok(())
}

/// Table ids and their layers, as V4.1 numbers them.
const TABLES: [u32; 2] = [1, 14];

/// One prompt length's medians.
#[derive(Debug, Serialize)]
struct LengthRow {
    positions: usize,
    rows_per_table: usize,
    bytes: usize,
    floor_ms: f64,
    local_ms: f64,
    /// The donors' series, per transport.
    transports: Vec<TransportRow>,
}

/// One prompt length's donor series over one transport.
#[derive(Debug, Serialize)]
struct TransportRow {
    transport: String,
    one_donor_ms: f64,
    two_replicas_ms: f64,
    /// One donor's bandwidth over the floor's.
    one_vs_floor: f64,
    /// Two replicas' bandwidth over one donor's.
    two_vs_one: f64,
}

/// Whether a transport met the targets at every length.
#[derive(Debug, Serialize)]
struct TargetsMet {
    transport: String,
    /// Every length: one donor >= 0.70 of the floor.
    one_donor: bool,
    /// Every length: two replicas >= 1.7x one donor.
    two_replicas: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    link_mbit: u32,
    rounds: usize,
    /// Where the prompts' rows came from.
    prompts: String,
    lengths: Vec<LengthRow>,
    targets: Vec<TargetsMet>,
}

/// The bench's side of the rack: the routers of each setup, the donors'
/// per transport.
struct Setups {
    donors: Vec<(Transport, DonorSetups)>,
    local: [Arc<Router>; 2],
}

/// One donor, and both replicas, over one transport.
struct DonorSetups {
    one: [Arc<Router>; 2],
    two: [Arc<Router>; 2],
}

/// The bench's name as a node of the run's rack.
const NODE: &str = "engram-bench";

/// The run's rack config: donors `donor-a` and `donor-b`, each in its
/// namespace at `ips`, listening on every transport of `transports`
/// (ports the kernel picks), serving both tables; the bench as node
/// [`NODE`]. With a TLS or QUIC transport the rack gets a PKI.
fn write_rack(
    dir: &std::path::Path,
    tables: &[(u32, TableDigest, PathBuf)],
    rows: u64,
    ips: [std::net::Ipv4Addr; 2],
    transports: &[Transport],
) -> Result<cluster_config::Config> {
    let secure = transports.iter().any(|t| t.is_secure());
    let mut rack = RackToml::new("prefill");
    if transports.contains(&Transport::Tcp) {
        // The namespaces' addresses are not loopback: plaintext is this
        // run's choice, on links only it uses.
        rack.rack.plaintext = Some("allow".into());
    }
    if secure {
        rack.rack.tls = Some(TlsSection::default());
    }
    rack.table = tables
        .iter()
        .map(|(id, digest, path)| TableEntry::new(*id, path, rows, digest))
        .collect();
    rack.donor = ["donor-a", "donor-b"]
        .into_iter()
        .zip(ips)
        .map(|(name, ip)| DonorEntry {
            ram_gib: 64.0,
            ..DonorEntry::new(
                name,
                transports.iter().map(|t| format!("{t}://{ip}:0")),
                [1, 14],
            )
        })
        .collect();
    let routes = tables
        .iter()
        .map(|(id, _, _)| RouteEntry::new(*id, ["donor-a", "donor-b"]));
    rack.node = vec![NodeEntry::new(NODE, routes.collect())];
    let path = dir.join("prefill-rack.toml");
    rack.write(&path)?;
    if secure {
        let _ = std::fs::remove_dir_all(dir.join("pki"));
        rack_harness::rack_pki(&path).context("making the run's rack PKI")?;
    }
    cluster_config::Config::load(&path).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The bench's client options over `transport` in `rack`.
fn client_options(
    rack: &cluster_config::Config,
    pinned: &[(u32, TableDigest)],
    transport: Transport,
    donor: &str,
) -> Result<ClientOptions> {
    let mut opts = ClientOptions::new(NODE, pinned.to_vec());
    opts.transport = transport;
    opts.lookup_timeout = crate::LOOKUP_TIMEOUT;
    if transport.is_secure() {
        let files = rack.tls_files(NODE).context("the bench's certificate")?;
        opts.tls = Some(TlsClient {
            tls: NodeTls::load(&files)?,
            server_name: cluster_config::tls::server_name(donor)?,
        });
    }
    Ok(opts)
}

fn settings(table: u32) -> RouteSettings {
    // The node's defaults: 100 tokens/s, grace 100 us, hard timeout 100 ms,
    // p99 hedging (a sweep's chunks are not hedged), policy fail.
    let layers = cluster_config::V41_ENGRAM_LAYERS;
    let layer = if table == TABLES[0] {
        layers[0]
    } else {
        layers[1]
    };
    let w = Duration::from_millis(10);
    RouteSettings {
        table,
        encoding: engram_protocol::encoding::RowEncoding::V41,
        window: cluster_config::window(w, cluster_config::window_blocks(layer, layers)),
        grace: Duration::from_micros(100),
        hard_timeout: Duration::from_millis(100),
        hedge: Hedge::Percentile(99.0),
        policy: Policy::Fail,
        precise_timers: true,
    }
}

fn health(
    m: &NodeMetrics,
    source: Arc<dyn RowSource>,
    pinned: &[(u32, TableDigest)],
) -> Arc<SourceHealth> {
    let gauge = m
        .breaker_state
        .get_or_create(&SourceOnly {
            source: source.name().to_string(),
        })
        .clone();
    Arc::new(SourceHealth::new(source, pinned.to_vec(), 3, gauge))
}

fn routers(m: &NodeMetrics, sources: &[Arc<SourceHealth>]) -> [Arc<Router>; 2] {
    TABLES.map(|t| Arc::new(Router::new(settings(t), sources.to_vec(), m)))
}

/// Where a prompt's rows come from.
enum Prompts {
    /// `24 x positions` random distinct rows of each table.
    Random(SplitMix64),
    /// A real text's first positions, hashed with `params`: each table's
    /// distinct rows.
    Text {
        ids: Vec<u32>,
        pad: i64,
        params: Box<HashParams>,
    },
}

impl Prompts {
    /// Random prompts, or (with `--real-text`) the text's, hashed with the
    /// largest base whose tables fit in `rows` rows.
    fn new(args: &PrefillArgs) -> Result<Self> {
        if !args.real.real_text {
            return Ok(Self::Random(SplitMix64::new(0x009e_f111)));
        }
        let w = args.real.text.load()?;
        let mut base = args.rows / 24;
        let params = loop {
            let p = HashParams::new(Preset::from_base(base)?)?;
            if p.layers.iter().all(|l| l.rows <= args.rows) {
                break p;
            }
            base -= base / 64 + 1;
        };
        Ok(Self::Text {
            ids: w.compressed,
            pad: w.pad,
            params: Box::new(params),
        })
    }

    /// What the report says of the prompts.
    fn describe(&self) -> String {
        match self {
            Self::Random(_) => "24 random distinct rows per position and table".into(),
            Self::Text { ids, params, .. } => format!(
                "a real text's first positions ({} V4 tokens), V4.1's token map and hashing with primes above {}: each table's distinct rows",
                ids.len(),
                params.preset.base() - 1
            ),
        }
    }

    /// The rows of both tables for a prompt of `positions`, sorted.
    fn rows(&mut self, positions: usize, rows: u64) -> Result<[Vec<u64>; 2]> {
        let (ids, pad, params) = match self {
            Self::Random(rng) => {
                let n = positions * 24;
                return Ok([prompt_rows(rng, n, rows), prompt_rows(rng, n, rows)]);
            }
            Self::Text { ids, pad, params } => (ids, *pad, params),
        };
        if ids.is_empty() {
            bail!("the text has no tokens");
        }
        let seq: Vec<i64> = ids
            .iter()
            .cycle()
            .take(positions)
            .map(|&i| i64::from(i))
            .collect();
        let mut out = [Vec::new(), Vec::new()];
        for p in hash_sequence(params, pad, &seq)?.into_iter().flatten() {
            for (o, layer) in out.iter_mut().zip(p) {
                o.extend(layer);
            }
        }
        for o in &mut out {
            o.sort_unstable();
            o.dedup();
        }
        Ok(out)
    }
}

/// `n` distinct rows of a table of `rows`, sorted (a prompt's addresses).
fn prompt_rows(rng: &mut SplitMix64, n: usize, rows: u64) -> Vec<u64> {
    let mut v: Vec<u64> = Vec::with_capacity(n);
    while v.len() < n {
        v.extend((v.len()..n).map(|_| rng.next_u64() % rows));
        v.sort_unstable();
        v.dedup();
    }
    v
}

/// Run `engram-bench prefill`.
pub fn run(args: &PrefillArgs) -> Result<()> {
    crate::rack::kill_children_on_interrupt()?;
    check_args(args)?;
    let bench = Bench::start(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _guard = rt.enter();
    let setups = bench.setups(args)?;
    let mut floor = TcpStream::connect(
        bench.floors[0]
            .endpoint(Transport::Tcp)
            .context("the floor's server address")?,
    )?;
    floor.set_nodelay(true)?;

    let mut prompts = Prompts::new(args)?;
    let mut sink = vec![0u8; 1 << 20];
    let mut rows_out = Vec::new();
    for &positions in &args.lengths {
        rows_out.push(measure_length(
            args,
            &rt,
            &setups,
            &mut floor,
            &mut prompts,
            &mut sink,
            positions,
        )?);
    }
    drop(floor);
    drop(bench);

    let targets = args
        .transports
        .iter()
        .enumerate()
        .map(|(i, t)| TargetsMet {
            transport: t.to_string(),
            one_donor: rows_out
                .iter()
                .all(|r| r.transports[i].one_vs_floor >= 0.70),
            two_replicas: rows_out.iter().all(|r| r.transports[i].two_vs_one >= 1.7),
        })
        .collect();
    let report = Report {
        link_mbit: args.link_mbit,
        rounds: args.rounds,
        prompts: prompts.describe(),
        lengths: rows_out,
        targets,
    };
    let chart = chart(&report);
    let (svg, png) = chart.write_both(&args.out.join("prefill"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
        println!("chart: {} {}", svg.display(), png.display());
    }
    Ok(())
}

fn check_args(args: &PrefillArgs) -> Result<()> {
    if args.lengths.is_empty() || args.rounds == 0 || args.transports.is_empty() {
        bail!("--lengths, --transports and --rounds must not be empty or zero");
    }
    let max_rows = args.lengths.iter().max().copied().unwrap_or(0) * 24;
    if (args.rows as usize) < max_rows * 2 {
        bail!(
            "--rows {} is too few for {} distinct rows per table: give at least {}",
            args.rows,
            max_rows,
            max_rows * 2
        );
    }
    Ok(())
}

/// The bench's rack: the tables, two network namespaces (links shaped),
/// each with a donor and a floor server.
struct Bench {
    pinned: Vec<(u32, TableDigest)>,
    files: Vec<PathBuf>,
    rack: cluster_config::Config,
    donors: Vec<DonorProcess>,
    floors: Vec<DonorProcess>,
    /// Dropped last: the processes run inside them.
    _spaces: Vec<NetNs>,
}

impl Bench {
    fn start(args: &PrefillArgs) -> Result<Self> {
        NetNs::check()
            .map_err(|e| anyhow::anyhow!("the prefill bench needs network namespaces: {e}"))?;
        std::fs::create_dir_all(&args.out)?;
        // Absolute: the rack config names the table files, and a config's
        // relative paths are taken from the config's own directory.
        let out =
            std::fs::canonicalize(&args.out).with_context(|| format!("{}", args.out.display()))?;
        let mut pinned = Vec::new();
        let mut files = Vec::new();
        for (i, &t) in TABLES.iter().enumerate() {
            let (path, digest) =
                gen_table(&out, &format!("prefill-{t}"), t, args.rows, 11 + i as u64)?;
            pinned.push((t, digest));
            files.push(path);
        }
        // Two namespaces, each with a donor and a floor server, links shaped.
        let mut spaces = Vec::new();
        for name in ["a", "b"] {
            let ns = NetNs::create(&format!("prefill{name}"))?;
            if args.link_mbit > 0 {
                ns.shape(args.link_mbit)?;
            }
            spaces.push(ns);
        }
        let tables: Vec<(u32, TableDigest, PathBuf)> = pinned
            .iter()
            .zip(&files)
            .map(|(&(t, d), p)| (t, d, p.clone()))
            .collect();
        let ips = [spaces[0].addr(), spaces[1].addr()];
        let rack = write_rack(&out, &tables, args.rows, ips, &args.transports)?;
        let mut donors = Vec::new();
        let mut floors = Vec::new();
        for (name, ns) in ["a", "b"].into_iter().zip(&spaces) {
            let mut cmd = ns.command(bin("memory-donor"));
            cmd.arg("serve")
                .arg("--config")
                .arg(&rack.path)
                .arg("--name")
                .arg(format!("donor-{name}"))
                .arg("--trust-digest")
                .env("RUST_LOG", "info");
            let donor =
                DonorProcess::spawn(cmd).with_context(|| format!("starting donor-{name}"))?;
            let mut fcmd = ns.command(std::env::current_exe()?);
            fcmd.args([
                "prefill-floor-server",
                "--listen",
                &format!("{}:0", ns.addr()),
            ]);
            let floor = DonorProcess::spawn(fcmd).context("starting the floor's server")?;
            donors.push(donor);
            floors.push(floor);
        }

        Ok(Self {
            pinned,
            files,
            rack,
            donors,
            floors,
            _spaces: spaces,
        })
    }

    /// The routers of every series: one donor and both replicas over each
    /// transport, and each table's own copy in local RAM.
    fn setups(&self, args: &PrefillArgs) -> Result<Setups> {
        let (pinned, files, rack, donors) = (&self.pinned, &self.files, &self.rack, &self.donors);
        let m = NodeMetrics::new();
        let mut donor_setups = Vec::new();
        for &t in &args.transports {
            let sources: Vec<Arc<SourceHealth>> = donors
                .iter()
                .zip(["donor-a", "donor-b"])
                .map(|(d, name)| {
                    let addr = d
                        .endpoint(t)
                        .with_context(|| format!("{name} does not listen on {t}"))?;
                    let opts = client_options(rack, pinned, t, name)?;
                    let src = DonorSource::new(name, vec![addr], opts);
                    Ok(health(&m, Arc::new(src), pinned))
                })
                .collect::<Result<_>>()?;
            donor_setups.push((
                t,
                DonorSetups {
                    one: routers(&m, &sources[..1]),
                    two: routers(&m, &sources),
                },
            ));
        }
        let mut locals = Vec::new();
        for ((t, p), (_, digest)) in TABLES.iter().zip(files).zip(pinned) {
            let expected = ExpectedTable {
                digest: *digest,
                layer: *t,
                rows: args.rows,
            };
            let local = LocalRam::load(*t, p, expected, true).context("loading the local copy")?;
            locals.push(health(&m, Arc::new(local), pinned));
        }
        Ok(Setups {
            donors: donor_setups,
            // Each table's own copy.
            local: [0, 1].map(|i| {
                Arc::new(Router::new(
                    settings(TABLES[i]),
                    vec![locals[i].clone()],
                    &m,
                ))
            }),
        })
    }
}

/// Every series at one prompt length: a checked warm-up sweep each, then
/// `--rounds` rounds interleaving the series (so the machine's drift
/// touches each alike); medians.
#[allow(clippy::too_many_arguments)]
fn measure_length(
    args: &PrefillArgs,
    rt: &tokio::runtime::Runtime,
    setups: &Setups,
    floor: &mut TcpStream,
    prompts: &mut Prompts,
    sink: &mut [u8],
    positions: usize,
) -> Result<LengthRow> {
    let prompt = prompts.rows(positions, args.rows)?;
    let n = prompt[0].len().max(prompt[1].len());
    let bytes = (prompt[0].len() + prompt[1].len()) * ROW_BYTES;
    // A warm-up sweep each (connections made, pages touched), checked.
    sweep(rt, &setups.local, &prompt, true)
        .with_context(|| format!("local RAM, {positions} positions"))?;
    for (t, d) in &setups.donors {
        for (label, r) in [("one donor", &d.one), ("two replicas", &d.two)] {
            sweep(rt, r, &prompt, true)
                .with_context(|| format!("{label} over {t}, {positions} positions"))?;
        }
    }
    // Rounds interleave every series, so the machine's drift touches
    // each alike.
    let mut floor_s = Vec::new();
    let mut local_s = Vec::new();
    let mut donor_s = vec![(Vec::new(), Vec::new()); setups.donors.len()];
    for _ in 0..args.rounds {
        crate::rack::check_interrupted()?;
        floor_s.push(floor_once(floor, bytes, sink)?);
        for ((_, d), (one, two)) in setups.donors.iter().zip(&mut donor_s) {
            one.push(sweep(rt, &d.one, &prompt, false)?);
            two.push(sweep(rt, &d.two, &prompt, false)?);
        }
        local_s.push(sweep(rt, &setups.local, &prompt, false)?);
    }
    let f = median(floor_s) * 1e3;
    let transports = setups
        .donors
        .iter()
        .zip(donor_s)
        .map(|((t, _), (one, two))| {
            let (one, two) = (median(one) * 1e3, median(two) * 1e3);
            TransportRow {
                transport: t.to_string(),
                one_donor_ms: one,
                two_replicas_ms: two,
                one_vs_floor: f / one,
                two_vs_one: one / two,
            }
        })
        .collect();
    Ok(LengthRow {
        positions,
        rows_per_table: n,
        bytes,
        floor_ms: f,
        local_ms: median(local_s) * 1e3,
        transports,
    })
}

/// One sweep of both tables' prompt rows through `routers`, concurrently,
/// as the node's prefill step fetches them: its seconds. `check`: compare
/// every row with the generator's.
fn sweep(
    rt: &tokio::runtime::Runtime,
    routers: &[Arc<Router>; 2],
    prompt: &[Vec<u64>; 2],
    check: bool,
) -> Result<f64> {
    let cap = engram_protocol::frame::DEFAULT_MAX_ROWS as usize;
    let t0 = Instant::now();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            fetch_rows(&routers[0], &prompt[0], cap),
            fetch_rows(&routers[1], &prompt[1], cap)
        )
    });
    let secs = t0.elapsed().as_secs_f64();
    for (i, f) in [a, b].iter().enumerate() {
        if let Some(e) = &f.error {
            bail!("table {}: {e}", TABLES[i]);
        }
        if check {
            let seed = 11 + i as u64;
            if let Some(at) = first_mismatch(seed, TABLES[i], &prompt[i], &f.bytes) {
                bail!("table {}: row {at} is not the generator's", TABLES[i]);
            }
        }
    }
    Ok(secs)
}

/// One floor request of `bytes`: its seconds.
fn floor_once(s: &mut TcpStream, bytes: usize, sink: &mut [u8]) -> Result<f64> {
    let t0 = Instant::now();
    s.write_all(&(bytes as u64).to_le_bytes())?;
    let mut left = bytes;
    while left > 0 {
        let take = left.min(sink.len());
        let n = s.read(&mut sink[..take])?;
        if n == 0 {
            bail!("the floor's server closed the connection");
        }
        left -= n;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// How the links were shaped, for titles.
fn links(mbit: u32) -> String {
    if mbit == 0 {
        "unshaped".into()
    } else {
        format!("shaped to {mbit} Mbit/s")
    }
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms / 1e3) / 1e9
}

fn print_report(r: &Report) {
    println!(
        "prefill: both tables' rows of a prompt in one sweep; each donor on its own link {}; medians of {} rounds",
        links(r.link_mbit),
        r.rounds
    );
    println!("prompts: {}", r.prompts);
    let ms_gbps = |bytes: usize, ms: f64| format!("{ms:.2} ({:.3})", gbps(bytes, ms));
    let mut rows: Vec<Vec<String>> = Vec::new();
    for l in &r.lengths {
        for (i, t) in l.transports.iter().enumerate() {
            // The floor and local RAM are the length's, shown once.
            let once = |v: String| if i == 0 { v } else { String::new() };
            rows.push(vec![
                once(l.positions.to_string()),
                once(format!("{:.1}", l.bytes as f64 / 1e6)),
                once(ms_gbps(l.bytes, l.floor_ms)),
                once(ms_gbps(l.bytes, l.local_ms)),
                t.transport.clone(),
                ms_gbps(l.bytes, t.one_donor_ms),
                ms_gbps(l.bytes, t.two_replicas_ms),
                format!("{:.2}", t.one_vs_floor),
                format!("{:.2}", t.two_vs_one),
            ]);
        }
    }
    print_table(
        &[
            "positions",
            "MB",
            "floor ms (GB/s)",
            "local RAM ms (GB/s)",
            "transport",
            "one donor ms (GB/s)",
            "two replicas ms (GB/s)",
            "one/floor",
            "two/one",
        ],
        &rows,
    );
    println!(
        "Engram share of time to first token = the sweep's time above (every row in before layer 1's fusion ends)"
    );
    let yes = |b: bool| if b { "met" } else { "NOT met" };
    for t in &r.targets {
        println!(
            "targets over {}: one donor >= 0.70 of the floor's bandwidth: {}; two replicas >= 1.7x one donor: {}",
            t.transport,
            yes(t.one_donor),
            yes(t.two_replicas)
        );
    }
}

fn chart(r: &Report) -> Bars {
    let mut bars = Vec::new();
    for l in &r.lengths {
        bars.push(Bar {
            label: format!("{} positions, floor", l.positions),
            value: gbps(l.bytes, l.floor_ms),
            floor: true,
        });
        for t in &l.transports {
            for (name, ms) in [
                ("one donor", t.one_donor_ms),
                ("two replicas", t.two_replicas_ms),
            ] {
                bars.push(Bar {
                    label: format!("{} positions, {name}, {}", l.positions, t.transport),
                    value: gbps(l.bytes, ms),
                    floor: false,
                });
            }
        }
    }
    Bars {
        title: format!(
            "prefill sweep bandwidth, links {} (median of {})",
            links(r.link_mbit),
            r.rounds
        ),
        unit: "GB/s".into(),
        bars,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_rows_are_distinct_sorted_and_in_range() {
        let mut rng = SplitMix64::new(1);
        let v = prompt_rows(&mut rng, 5000, 6000);
        assert_eq!(v.len(), 5000);
        assert!(v.windows(2).all(|w| w[0] < w[1]));
        assert!(v.iter().all(|&r| r < 6000));
    }
}
