//! The local rack that `demo` and `paced` run on: a table pair sized by a
//! hashing base, generated once and reused while its digest matches; a rack
//! config on loopback addresses; and the child processes (generator,
//! donors, nodes), each killed on every exit path: when its [`Child`]
//! guard drops (an error, a panic) and on SIGINT or SIGTERM, which kill
//! every registered child at once.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cluster_config::{Endpoint, Transport};
use engram_protocol::hashing::V41_COMPRESSED_VOCAB;
use rack_harness::rack_toml::{
    DonorEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, Process, bin};
use serde::{Deserialize, Serialize};

/// Seed of the synthetic rows.
pub const SEED: u64 = 7;
/// Fusion of the rack's `[model]`: small, so CPU fusion stays far below a
/// token's budget even at 1000 tokens/s.
pub const HIDDEN: u32 = 16;
pub const STREAMS: u32 = 4;
/// Channels per stream of a Qwen4Exp rack's PLE layer: its `kv_proj`
/// (`(4 x 16 + 16) x 16 x 160` values) keeps the CPU fusion far below a
/// token's budget.
pub const QWEN_HIDDEN: u32 = 16;

/// One generated table file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TableFile {
    /// Engram layer (1 or 14).
    pub layer: u32,
    /// Where it is.
    pub path: PathBuf,
    /// Rows in it.
    pub rows: u64,
    /// Its digest (the version a config pins).
    pub digest: String,
}

/// Which model's tables a rack serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ModelKind {
    /// DeepSeek V4.1: two tables (layers 1 and 14) of 264-byte rows.
    #[default]
    #[value(name = "deepseek_v41")]
    DeepseekV41,
    /// Qwen3.8-Flash-Next (Qwen4Exp): one PLE table (layer 1) of FP8 rows
    /// with a table scale, 160 bytes each.
    #[value(name = "qwen4exp")]
    Qwen4Exp,
}

/// The Qwen4Exp table's encoding and scale in a generated rack.
pub const QWEN_ENCODING: engram_protocol::encoding::RowEncoding =
    engram_protocol::encoding::RowEncoding::Fp8PerTensor { values: 160 };
/// Its table scale.
pub const QWEN_SCALE: f32 = 0.0123;

/// A model's tables, sized by one hashing base: V4.1's layers 1 and 14, or
/// Qwen4Exp's one PLE table.
#[derive(Debug, Clone)]
pub struct TablePair {
    /// The hashing base they are sized by.
    pub base: u64,
    /// The model they are for.
    pub model: ModelKind,
    /// Layer 1's, then layer 14's (V4.1); the PLE table (Qwen4Exp).
    pub tables: Vec<TableFile>,
    /// Whether they were already there (digest recorded at generation
    /// equal to the file's).
    pub reused: bool,
}

/// What `memory-donor inspect --json` says of a file (the fields used here).
#[derive(Debug, Deserialize)]
struct Inspected {
    layer: u32,
    rows: u64,
    digest: String,
    hash_base: Option<u64>,
}

fn inspect(path: &Path) -> Result<Inspected> {
    let out = Command::new(bin("memory-donor"))
        .arg("inspect")
        .arg(path)
        .arg("--json")
        .output()
        .context("running memory-donor inspect")?;
    if !out.status.success() {
        bail!(
            "memory-donor inspect {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_slice(&out.stdout).context("reading memory-donor inspect --json")
}

/// Create `dir` and return its absolute path (the config's paths must not
/// depend on where a process starts).
pub fn work_dir(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::canonicalize(dir).with_context(|| format!("resolving {}", dir.display()))
}

/// The table pair for `base` in `dir`: the files there when `tables.json`
/// (written after each generation) records the digest each file has,
/// otherwise freshly generated with `memory-donor gen --hash-base`.
pub fn table_pair(dir: &Path, base: u64) -> Result<TablePair> {
    model_tables(dir, base, ModelKind::DeepseekV41)
}

/// [`table_pair`] for `model`: V4.1's pair, or Qwen4Exp's one FP8 table
/// (generated with `memory-donor gen --rows --encoding`).
pub fn model_tables(dir: &Path, base: u64, model: ModelKind) -> Result<TablePair> {
    let manifest_path = dir.join("tables.json");
    let mut manifest: BTreeMap<String, String> = std::fs::read(&manifest_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let mut reused = true;
    let mut tables = Vec::new();
    let layers: &[u32] = match model {
        ModelKind::DeepseekV41 => &[1, 14],
        ModelKind::Qwen4Exp => &[1],
    };
    for &layer in layers {
        let name = match model {
            ModelKind::DeepseekV41 => format!("layer{layer}-base{base}-seed{SEED}.etab"),
            ModelKind::Qwen4Exp => format!("qwen4exp-layer{layer}-base{base}-seed{SEED}.etab"),
        };
        let path = dir.join(&name);
        let known = manifest.get(&name).cloned();
        let found = match (&known, path.is_file()) {
            (Some(d), true) => inspect(&path).ok().filter(|i| {
                &i.digest == d
                    && i.layer == layer
                    && match model {
                        ModelKind::DeepseekV41 => i.hash_base == Some(base),
                        ModelKind::Qwen4Exp => Some(i.rows) == qwen_rows(base).ok(),
                    }
            }),
            _ => None,
        };
        let info = match found {
            Some(i) => i,
            None => {
                reused = false;
                generate(&path, layer, base, model)?;
                let i = inspect(&path)?;
                manifest.insert(name, i.digest.clone());
                std::fs::write(&manifest_path, serde_json::to_vec_pretty(&manifest)?)
                    .with_context(|| format!("writing {}", manifest_path.display()))?;
                i
            }
        };
        tables.push(TableFile {
            layer,
            path,
            rows: info.rows,
            digest: info.digest,
        });
    }
    Ok(TablePair {
        base,
        model,
        tables,
        reused,
    })
}

/// Rows of the Qwen4Exp table the hashing addresses with
/// `ngram_vocab_size_base` `base` (padded as the checkpoint pads them).
pub fn qwen_rows(base: u64) -> Result<u64> {
    Ok(qwen_hashing(base, 0)?.padded_rows)
}

fn qwen_hashing(base: u64, eos: u32) -> Result<engram_protocol::qwen4exp::Qwen4ExpHashing> {
    use engram_protocol::qwen4exp::{Qwen4ExpConfig, Qwen4ExpHashing};
    Ok(Qwen4ExpHashing::new(Qwen4ExpConfig {
        base,
        ..Qwen4ExpConfig::qwen38_flash_next(u64::from(eos))
    })?)
}

/// The end-of-sequence id of a generated Qwen4Exp rack: the built-in
/// word tokenizer's id of `.`, so that each sentence of the built-in text
/// is an n-gram segment of its own.
pub fn qwen_eos() -> Result<u32> {
    let tok =
        inference_node::model::input::word_tokenizer(inference_node::model::input::BUILTIN_TEXT)?;
    tok.token_to_id(".")
        .context("the built-in text has no \".\" token")
}

/// `memory-donor gen` as a registered child (so an interrupt stops it too).
fn generate(path: &Path, layer: u32, base: u64, model: ModelKind) -> Result<()> {
    let mut cmd = Command::new(bin("memory-donor"));
    cmd.args(["gen", "--layer", &layer.to_string()]);
    match model {
        ModelKind::DeepseekV41 => {
            cmd.args(["--hash-base", &base.to_string()]);
        }
        ModelKind::Qwen4Exp => {
            cmd.args(["--rows", &qwen_rows(base)?.to_string()])
                .args(["--encoding", &QWEN_ENCODING.name()])
                .args(["--tensor-scale", &QWEN_SCALE.to_string()]);
        }
    }
    cmd.args(["--seed", &SEED.to_string()])
        .arg("--out")
        .arg(path);
    let mut generator = Child::spawn("memory-donor gen", cmd, Stdio::null())?;
    let status = generator.wait_exit(Duration::from_secs(600))?;
    if !status.success() {
        bail!("memory-donor gen failed ({status}):\n{}", generator.log());
    }
    Ok(())
}

/// One node of the rack and the sources of both its routes.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: &'static str,
    pub sources: &'static [&'static str],
    /// The routes' `ssd_ioprio`, if not the default.
    pub ssd_ioprio: Option<&'static str>,
}

/// What to write into the rack config.
#[derive(Debug, Clone)]
pub struct RackSpec {
    /// Donors, each serving both tables on its own loopback address
    /// (127.0.0.2, 127.0.0.3, ...) with a control plane.
    pub donors: &'static [&'static str],
    /// Nodes.
    pub nodes: Vec<NodeSpec>,
    /// How often a node probes an excluded source.
    pub probe_interval_ms: u64,
    /// Skip recomputing the digest of a node's SSD copy (or local RAM copy) at start.
    pub trust_copies: bool,
    /// The donors' data plane; TLS and QUIC give the rack a PKI (made in
    /// `pki/` beside the config with `engram-cluster pki`), and TLS on the
    /// control plane too.
    pub transport: Transport,
    /// Donors that also listen on a host socket (`DIR/NAME.sock`): a node
    /// on this host maps their tables instead of asking for rows.
    pub host_sockets: &'static [&'static str],
    /// The V4 tokenizer.json the nodes tokenize a real text with (`[model]
    /// tokenizer`; the map it gives must have V4.1's 99,092 ids); `None`:
    /// the node's built-in text, as word-level tokens.
    pub tokenizer: Option<PathBuf>,
}

impl RackSpec {
    /// One donor (`donor-a`, plain TCP) and one node (`donor`) reading both
    /// tables from it alone, its copies trusted (benches that start many
    /// nodes).
    pub fn one_donor() -> Self {
        Self {
            donors: &["donor-a"],
            nodes: vec![NodeSpec {
                name: "donor",
                sources: &["donor-a"],
                ssd_ioprio: None,
            }],
            probe_interval_ms: 1000,
            trust_copies: true,
            transport: Transport::Tcp,
            host_sockets: &[],
            tokenizer: None,
        }
    }
}

/// A stream transport named on the command line: `tcp`, `tls` or `quic`.
pub fn stream_transport(s: &str) -> Result<Transport, String> {
    match Transport::parse(s) {
        Some(Transport::Rdma) | None => Err(format!("{s:?} is not one of tcp, tls, quic")),
        Some(t) => Ok(t),
    }
}

/// A donor as written into the config.
#[derive(Debug, Clone)]
pub struct DonorAddrs {
    pub name: String,
    pub listen: Endpoint,
    pub control: SocketAddr,
}

/// The written config.
#[derive(Debug, Clone)]
pub struct Rack {
    /// The config file.
    pub config: PathBuf,
    /// Its donors.
    pub donors: Vec<DonorAddrs>,
}

/// Where donor `name` of a rack written in `dir` has its host socket.
pub fn host_socket(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.sock"))
}

/// Write `dir/rack.toml` for `tables` as `spec` says.
pub fn write_config(dir: &Path, tables: &TablePair, spec: &RackSpec) -> Result<Rack> {
    let mut rack = RackToml::new("local");
    if spec.transport.is_secure() {
        rack.rack.tls = Some(TlsSection::default());
    }
    let qwen = tables.model == ModelKind::Qwen4Exp;
    // Each table's id is its layer (1 and 14; Qwen4Exp's 1).
    let ids: Vec<u32> = tables.tables.iter().map(|t| t.layer).collect();
    rack.table = tables
        .tables
        .iter()
        .map(|t| TableEntry {
            layer: t.layer,
            encoding: qwen.then(|| QWEN_ENCODING.name()),
            tensor_scale: qwen.then_some(f64::from(QWEN_SCALE)),
            ..TableEntry::new(t.layer, &t.path, t.rows, &t.digest)
        })
        .collect();
    let mut donors = Vec::new();
    for (i, name) in spec.donors.iter().enumerate() {
        let ip = Ipv4Addr::new(127, 0, 0, 2 + i as u8);
        let listen = Endpoint::new(
            spec.transport,
            SocketAddr::from((ip, rack_harness::free_port_on(ip)?)),
        );
        let mut control = SocketAddr::from((ip, rack_harness::free_port_on(ip)?));
        while control == listen.addr {
            control = SocketAddr::from((ip, rack_harness::free_port_on(ip)?));
        }
        let host = spec
            .host_sockets
            .contains(name)
            .then(|| format!("unix://{}", host_socket(dir, name).display()));
        rack.donor.push(DonorEntry {
            ram_gib: 2.0,
            control: Some(control.to_string()),
            ..DonorEntry::new(
                *name,
                std::iter::once(listen.to_string()).chain(host),
                ids.iter().copied(),
            )
        });
        donors.push(DonorAddrs {
            name: (*name).to_string(),
            listen,
            control,
        });
    }
    rack.node = spec
        .nodes
        .iter()
        .map(|n| node_entry(n, &tables.tables, spec))
        .collect();
    rack.model = Some(match tables.model {
        ModelKind::DeepseekV41 => ModelSection {
            fusion: Some("cpu".into()),
            tokenizer: spec.tokenizer.as_ref().map(|t| t.display().to_string()),
            compressed_vocab: spec.tokenizer.as_ref().map(|_| V41_COMPRESSED_VOCAB),
            ..ModelSection::synthetic(tables.base, 1, HIDDEN, STREAMS)
        },
        ModelKind::Qwen4Exp => {
            if spec.tokenizer.is_some() {
                bail!("a Qwen4Exp rack decodes token ids: its tokenizer is not read yet");
            }
            ModelSection {
                family: Some("qwen4exp".into()),
                eos_token: Some(qwen_eos()?),
                ..ModelSection::synthetic(tables.base, 1, QWEN_HIDDEN, STREAMS)
            }
        }
    });
    let config = dir.join("rack.toml");
    rack.write(&config)?;
    if spec.transport.is_secure() {
        // A fresh PKI each time the config is written (new ports, same names).
        let _ = std::fs::remove_dir_all(dir.join("pki"));
        rack_harness::rack_pki(&config).context("making the rack's PKI")?;
    }
    Ok(Rack { config, donors })
}

/// Node `n`'s entry: a route to each of `tables` (its id is its layer)
/// with the table's file as its SSD copy.
fn node_entry(n: &NodeSpec, tables: &[TableFile], spec: &RackSpec) -> NodeEntry {
    let route = |t: &TableFile| RouteEntry {
        trust_digest: Some(spec.trust_copies),
        ssd_ioprio: n.ssd_ioprio.map(Into::into),
        ..RouteEntry::new(t.layer, n.sources.iter().copied()).ssd_path(&t.path)
    };
    NodeEntry {
        tokens_per_second: Some(100.0),
        probe_interval_ms: Some(spec.probe_interval_ms),
        ..NodeEntry::new(n.name, tables.iter().map(route).collect())
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// From now on, SIGINT and SIGTERM kill every process this command
/// started through the harness and refuse new ones (the waits on them,
/// and lookups to them, then fail, the command unwinds, removing its
/// scratch directories, and exits non-zero).
pub fn kill_children_on_interrupt() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let (mut int, mut term) = rt.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("interrupt".into())
        .spawn(move || {
            rt.block_on(async {
                loop {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                    INTERRUPTED.store(true, Ordering::SeqCst);
                    eprintln!("interrupted: stopping every process this run started");
                    rack_harness::stop_all_processes();
                }
            });
        })?;
    Ok(())
}

/// Fail if an interrupt came.
pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// A named child process (killed by the interrupt handler while it
/// lives); dropping it kills it (SIGKILL) and reaps it.
#[derive(Debug)]
pub struct Child {
    name: String,
    pid: u32,
    process: Process,
}

impl Child {
    /// Start `cmd` (stdout to `stdout`, stderr collected).
    pub fn spawn(name: &str, cmd: Command, stdout: Stdio) -> Result<Self> {
        Ok(Self::register(
            name,
            Process::spawn_with_stdout(cmd, stdout)?,
        ))
    }

    /// Name an already started process (the harness registered it for
    /// the interrupt handler when it started it).
    pub fn register(name: &str, process: Process) -> Self {
        let pid = process.id();
        Self {
            name: name.to_string(),
            pid,
            process,
        }
    }

    /// Start `memory-donor serve --config CONFIG --name NAME [EXTRA]`
    /// (see [`Child::wait_ready`]).
    pub fn launch_donor(config: &Path, name: &str, extra: &[&str]) -> Result<Self> {
        let config = config.to_str().context("the config's path is not UTF-8")?;
        let mut args = vec!["--config", config, "--name", name];
        args.extend_from_slice(extra);
        Ok(Self::register(name, DonorProcess::launch(&args)?))
    }

    /// Wait (at most `timeout`) for its `ready listen=` line.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.wait_line(timeout, |l| l.contains("ready listen=").then_some(()))
            .with_context(|| format!("{} did not become ready", self.name))
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Wait (at most `timeout`) for a stderr line `f` accepts.
    pub fn wait_line<T>(&self, timeout: Duration, f: impl FnMut(&str) -> Option<T>) -> Result<T> {
        let r = self.process.wait_line(timeout, f);
        check_interrupted()?;
        r
    }

    /// Wait (at most `timeout`) for it to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let name = self.name.clone();
        let st = self.process.wait(timeout);
        check_interrupted()?;
        st.with_context(|| format!("{name} still runs after {timeout:?}"))
    }

    /// Send `sig`.
    pub fn signal(&self, sig: i32) {
        self.process.signal(sig);
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// Whether process `pid` is gone (no `/proc` entry, or a different program now).
pub fn gone(pid: u32, program: &str) -> bool {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Err(_) => true,
        Ok(c) => !String::from_utf8_lossy(&c).contains(program),
    }
}

/// `inference-node run --config CONFIG --name NAME ARGS`, stdout to `stdout`.
pub fn start_node(config: &Path, name: &str, args: &[String], stdout: &Path) -> Result<Child> {
    let mut cmd = Command::new(bin("inference-node"));
    cmd.arg("run")
        .arg("--config")
        .arg(config)
        .args(["--name", name])
        .args(args);
    let out =
        std::fs::File::create(stdout).with_context(|| format!("creating {}", stdout.display()))?;
    Child::spawn(&format!("node {name}"), cmd, out.into())
}

/// The arguments of a paced `inference-node run` at `rate` tokens/s for
/// `seconds` (at least one token), printing its summary as JSON.
pub fn paced_args(rate: f64, seconds: f64) -> Vec<String> {
    let tokens = (rate * seconds).round().max(1.0) as u64;
    vec![
        "--tokens-per-second".to_string(),
        rate.to_string(),
        "--tokens".into(),
        tokens.to_string(),
        "--json".into(),
        "--quiet".into(),
    ]
}

/// Run a node to its end (at most `timeout`); its stdout is in `stdout`.
pub fn run_node(
    config: &Path,
    name: &str,
    args: &[String],
    stdout: &Path,
    timeout: Duration,
) -> Result<()> {
    let mut node = start_node(config, name, args, stdout)?;
    let st = node.wait_exit(timeout)?;
    if !st.success() {
        bail!("node {name} failed ({st}):\n{}", node.log());
    }
    Ok(())
}

/// CPU seconds process `pid` has taken so far (user and system), from
/// `/proc/PID/stat`.
pub fn cpu_s(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name (which may hold spaces).
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("an unreadable /proc stat line")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here.
    let ticks: f64 = [12, 13]
        .iter()
        .map(|&i| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks / hz)
}

/// Seconds since `t`, for messages.
pub fn since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}
