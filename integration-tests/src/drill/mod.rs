//! Failover drills: a rack of real `memory-donor` processes and a real
//! `inference-node run`, faults injected at chosen tokens (kill -9,
//! SIGSTOP, a donor at another table version, a partitioned link, a slow,
//! corrupting or cutting link through [`crate::proxy`], SIGTERM, a storm of
//! malformed traffic, a storm of TLS and QUIC handshakes that never become
//! sessions), and the node's trace checked against invariants:
//! every fused output equal to a local-RAM reference, no failed token while
//! the SSD copy exists, every stall within the hard timeout plus one SSD
//! read, and a healthy donor re-admitted within two probe intervals.
//!
//! Layers: [`Env`] (tables, the reference outputs, the SSD read time),
//! [`Plan`] and [`Rack`] (a config and its donors, proxies and network
//! namespaces), [`node::NodeRun`] (the paced node, its progress and the
//! drill's events on the node's clock), [`report::Report`] (timeline,
//! figures, checks), `scaffold` (what every drill does: its moments,
//! starting the rack, checking the end) and [`drills`] (the list of drills
//! and most of them; `storm` and `handshakes` hold the storms,
//! `generation` the drills of a donor back with a new generation, and
//! [`random`] the seeded random-schedule drill). The tests in
//! `tests/drills.rs` and `engram-bench drill` run the same drills.

pub mod drills;
mod generation;
mod handshakes;
pub mod node;
pub mod random;
pub mod report;
mod scaffold;
mod storm;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use engram_protocol::ROW_BYTES;
use engram_protocol::hashing::{HashParams, Preset};

use crate::netns::NetNs;
use crate::proxy::FaultProxy;
use crate::rack_toml::{
    DonorEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use crate::{DonorProcess, Process, bin, gen_hashed_table};

pub use node::{Event, NodeRun, Outcome};
pub use report::Report;

/// Hashing base of the drill tables (about 24k rows each: they load in a
/// blink, so a restart is quick and the drill measures the node).
pub const BASE: u64 = 1000;
/// Seed of the pinned tables' rows.
pub const SEED: u64 = 21;
/// Seed of the other version (same layers and sizes, other rows).
pub const OTHER_SEED: u64 = 22;
/// Slack allowed beyond a bound for the scheduler of a loaded machine (a
/// woken task, a reader thread), in microseconds.
pub const SCHED_ALLOWANCE_US: f64 = 5_000.0;
/// Progress lines every this many steps (the resolution of "at token N").
pub const PROGRESS_EVERY: u64 = 5;

/// Which model's rack the drills run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Model {
    /// DeepSeek V4.1: tables 1 and 14, 264-byte rows.
    #[default]
    DeepseekV41,
    /// Qwen4Exp (Qwen3.8-Flash-Next): one PLE table (id and layer 1) of
    /// FP8 rows with table scale [`QWEN_SCALE`], its end-of-sequence id
    /// [`QWEN_EOS`].
    Qwen4Exp,
}

/// The encoding of a Qwen4Exp drill table.
pub const QWEN_ENCODING: engram_protocol::encoding::RowEncoding =
    engram_protocol::encoding::RowEncoding::Fp8PerTensor { values: 160 };
/// Its table scale.
pub const QWEN_SCALE: f32 = 0.0123;
/// The end-of-sequence id of a Qwen4Exp drill rack: one the built-in
/// text's word-level ids hold, so that its segments restart.
pub const QWEN_EOS: u32 = 7;

impl Model {
    /// Its tables' ids (= their layers).
    pub fn tables(self) -> &'static [u32] {
        match self {
            Self::DeepseekV41 => &[1, 14],
            Self::Qwen4Exp => &[1],
        }
    }

    /// Positions after one served without rows (zeros, or failed) whose
    /// outputs it changes too: Qwen4Exp's convolution reads each
    /// sequence's last `(kernel - 1) x dilation` = 9 inputs; V4.1 fuses
    /// each position alone.
    pub fn carry(self) -> u32 {
        match self {
            Self::DeepseekV41 => 0,
            Self::Qwen4Exp => 9,
        }
    }

    /// Bytes per row of its tables.
    pub fn row_bytes(self) -> usize {
        match self {
            Self::DeepseekV41 => ROW_BYTES,
            Self::Qwen4Exp => QWEN_ENCODING.row_bytes(),
        }
    }

    /// Rows of table `layer` with hashing base `base`, and the file
    /// `memory-donor gen` writes for it with `seed`.
    fn table(
        self,
        dir: &Path,
        name: &str,
        layer: u32,
        base: u64,
        seed: u64,
    ) -> Result<(PathBuf, u64, engram_protocol::TableDigest)> {
        match self {
            Self::DeepseekV41 => {
                let params = HashParams::new(Preset::from_base(base)?)?;
                let rows = params
                    .layers
                    .iter()
                    .find(|l| l.layer == layer)
                    .map(|l| l.rows)
                    .context("a V4.1 layer")?;
                let (path, digest) = gen_hashed_table(dir, name, layer, base, seed)?;
                Ok((path, rows, digest))
            }
            Self::Qwen4Exp => {
                let rows = qwen_hashing(base)?.padded_rows;
                let (path, digest) =
                    crate::gen_encoded_table(dir, name, layer, QWEN_ENCODING, rows, seed)?;
                Ok((path, rows, digest))
            }
        }
    }
}

/// Qwen4Exp's hashing with `ngram_vocab_size_base` `base`.
fn qwen_hashing(base: u64) -> Result<engram_protocol::qwen4exp::Qwen4ExpHashing> {
    use engram_protocol::qwen4exp::{Qwen4ExpConfig, Qwen4ExpHashing};
    Ok(Qwen4ExpHashing::new(Qwen4ExpConfig {
        base,
        ..Qwen4ExpConfig::qwen38_flash_next(u64::from(QWEN_EOS))
    })?)
}

/// One table file.
#[derive(Debug, Clone)]
pub struct TableFile {
    /// Table id (1 or 14, the Engram layer).
    pub id: u32,
    /// Its path.
    pub path: PathBuf,
    /// Rows.
    pub rows: u64,
    /// Digest (its version).
    pub digest: String,
}

/// What every drill shares: the tables (the pinned version and another),
/// the outputs of a local-RAM reference run, and how long one SSD read of
/// a step's rows takes on this machine.
#[derive(Debug)]
pub struct Env {
    /// Work directory.
    pub dir: PathBuf,
    /// The pinned tables, layer 1 then layer 14 (Qwen4Exp: its one).
    pub tables: Vec<TableFile>,
    /// Another version of each.
    pub other: Vec<TableFile>,
    /// Position `(seq, index)` -> checksum of its fused output, from local RAM.
    pub reference: BTreeMap<(u32, u32), inference_node::model::Checksum>,
    /// Longest fetch of a step's rows from the SSD copy in a paced
    /// calibration run (microseconds): "one SSD fetch" in the stall bound.
    pub ssd_fetch_us: f64,
    /// Positions the reference covers.
    pub max_tokens: u64,
    /// The tables' hashing base ([`BASE`] unless asked otherwise).
    pub base: u64,
    /// The model the rack serves.
    pub model: Model,
}

impl Env {
    /// Generate the tables in `dir`, run the reference (`max_tokens`
    /// positions) and the SSD calibration.
    pub fn prepare(dir: &Path, max_tokens: u64) -> Result<Self> {
        Self::prepare_with(dir, max_tokens, BASE)
    }

    /// [`Self::prepare`] with tables of hashing base `base` (larger
    /// tables: a load, and the mapping of a new generation, take longer).
    pub fn prepare_with(dir: &Path, max_tokens: u64, base: u64) -> Result<Self> {
        Self::prepare_model(dir, max_tokens, base, Model::DeepseekV41)
    }

    /// [`Self::prepare_with`] for a rack of `model`'s tables.
    pub fn prepare_model(dir: &Path, max_tokens: u64, base: u64, model: Model) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let dir = std::fs::canonicalize(dir)?;
        NetNs::remove_stale();
        let make = |seed: u64, tag: &str| -> Result<Vec<TableFile>> {
            let mut out = Vec::new();
            for &layer in model.tables() {
                let name = format!("{tag}-layer{layer}.etab");
                let (path, rows, digest) = model.table(&dir, &name, layer, base, seed)?;
                // On disk before the node reads it with O_DIRECT: a read of
                // pages still dirty in the page cache waits for their
                // writeback (tens of milliseconds on a fresh VM), which is
                // not what a deployed copy, written long ago, sees.
                std::fs::File::open(&path)
                    .and_then(|f| f.sync_all())
                    .with_context(|| format!("syncing {}", path.display()))?;
                out.push(TableFile {
                    id: layer,
                    path,
                    rows,
                    digest: digest.to_string(),
                });
            }
            Ok(out)
        };
        let tables = make(SEED, "pinned")?;
        let other = make(OTHER_SEED, "other")?;
        let mut env = Self {
            dir: dir.clone(),
            tables,
            other,
            reference: BTreeMap::new(),
            ssd_fetch_us: 0.0,
            max_tokens,
            base,
            model,
        };
        // The reference and the calibration run side by side.
        let plan = Plan::new("prepare");
        let config = dir.join("prepare.toml");
        let nodes = [
            ("ref", vec!["local".to_string()]),
            ("cal", vec!["ssd".to_string()]),
        ];
        rack_config(&env, &plan, &[], &nodes, false).write(&config)?;
        let reference = NodeRun::start(&config, "ref", max_tokens, 5_000.0, &dir.join("ref"))?;
        let calibration = NodeRun::start(&config, "cal", 300, 100.0, &dir.join("cal"))?;
        let r = reference.finish(Duration::from_secs(120))?;
        let c = calibration.finish(Duration::from_secs(120))?;
        for (name, o) in [("reference", &r), ("calibration", &c)] {
            if !o.success {
                bail!("the {name} run failed:\n{}", o.log);
            }
        }
        env.reference = report::checksums(&r.steps);
        if env.reference.len() as u64 != max_tokens {
            bail!(
                "the reference fused {} positions, not {max_tokens}",
                env.reference.len()
            );
        }
        env.ssd_fetch_us = c
            .steps
            .iter()
            .flat_map(|s| &s.tables)
            .map(|t| t.ready_us)
            .fold(0.0, f64::max);
        Ok(env)
    }
}

/// Where a donor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On a loopback address of its own (127.0.0.x).
    Loopback,
    /// In a network namespace of its own, over a veth pair (root only):
    /// its link can be cut.
    Netns,
}

/// One donor of a drill's rack.
#[derive(Debug, Clone)]
pub struct DonorPlan {
    /// Its name.
    pub name: &'static str,
    /// Where it runs.
    pub placement: Placement,
    /// Whether the node reaches it through a fault-injecting proxy.
    pub proxied: bool,
}

/// The rack and the node's knobs for one drill.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Name (the work subdirectory).
    pub name: String,
    /// Donors, each serving both tables.
    pub donors: Vec<DonorPlan>,
    /// The node's route for both tables, first preferred.
    pub sources: Vec<&'static str>,
    /// `hedge` of both routes.
    pub hedge: &'static str,
    /// `hard_timeout_ms` of both routes.
    pub hard_timeout_ms: u64,
    /// The node's `probe_interval_ms`.
    pub probe_interval_ms: u64,
    /// The node's `breaker_failures`.
    pub breaker_failures: u32,
    /// `policy` of both routes.
    pub policy: &'static str,
    /// Each donor's connection bound.
    pub max_connections: usize,
    /// Each donor's `hello_timeout_ms`.
    pub hello_timeout_ms: u64,
    /// "One SSD fetch" of the stall bound, when not the environment's idle
    /// calibration (a drill on a busy drive calibrates under its load).
    pub ssd_fetch_us: Option<f64>,
    /// The donors' data-plane transport (TLS and QUIC: the rack gets a PKI).
    pub transport: cluster_config::Transport,
    /// Each donor also listens on QUIC (UDP, the same port number), which
    /// the node does not use when `transport` is TLS: TLS first.
    pub also_quic: bool,
    /// Sequences the node decodes together (`inference-node run --batch`):
    /// each step fetches this many positions' rows in one message per table.
    pub batch: usize,
    /// Positions of each sequence prefilled in one sweep before decoding
    /// (`--prefill`): the run's first step.
    pub prefill: usize,
    /// Each donor also listens on a host socket (`unix://`) in the drill's
    /// directory: the node, on the same host, maps its tables.
    pub host_socket: bool,
    /// Each donor serves its control plane (over TLS on a secure rack,
    /// where `ops-1` is the rack's operator).
    pub control: bool,
}

impl Plan {
    /// Two donors on loopback, route donor-a, donor-b, ssd; hedge p99, hard
    /// timeout 20 ms, probes every 200 ms, breaker after 3 failures, policy
    /// fail.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            donors: vec![
                DonorPlan {
                    name: "donor-a",
                    placement: Placement::Loopback,
                    proxied: false,
                },
                DonorPlan {
                    name: "donor-b",
                    placement: Placement::Loopback,
                    proxied: false,
                },
            ],
            sources: vec!["donor-a", "donor-b", "ssd"],
            hedge: "p99",
            hard_timeout_ms: 20,
            probe_interval_ms: 200,
            breaker_failures: 3,
            policy: "fail",
            max_connections: 64,
            hello_timeout_ms: 1_000,
            ssd_fetch_us: None,
            transport: cluster_config::Transport::Tcp,
            also_quic: false,
            batch: 1,
            prefill: 0,
            host_socket: false,
            control: false,
        }
    }

    /// The node's arguments for the plan's batch and prefill.
    pub fn node_args(&self) -> Vec<String> {
        vec![
            "--batch".into(),
            self.batch.to_string(),
            "--prefill".into(),
            self.prefill.to_string(),
        ]
    }

    /// Whether the route has the node's own copy.
    pub fn has_copy(&self) -> bool {
        self.sources.iter().any(|s| *s == "ssd" || *s == "local")
    }
}

/// A donor's addresses as the config writes them.
#[derive(Debug, Clone)]
struct DonorAddrs {
    name: &'static str,
    listen: SocketAddr,
    advertise: SocketAddr,
    metrics: SocketAddr,
    /// Its QUIC address, when it has one beside `listen`.
    quic: Option<SocketAddr>,
    /// Its control plane's address ([`Plan::control`]).
    control: Option<SocketAddr>,
}

/// The config: tables (`other`: the other version), donors, and nodes with
/// their routes.
fn rack_config(
    env: &Env,
    plan: &Plan,
    donors: &[DonorAddrs],
    nodes: &[(&str, Vec<String>)],
    other: bool,
) -> RackToml {
    let tables = if other { &env.other } else { &env.tables };
    let mut rack = RackToml::new("drill");
    let netns = plan.donors.iter().any(|d| d.placement == Placement::Netns);
    if netns && plan.transport == cluster_config::Transport::Tcp {
        // Plain TCP over the namespaces' veth links: said explicitly.
        rack.rack.plaintext = Some("allow".into());
    }
    if plan.transport.is_secure() {
        let operators = if plan.control { &["ops-1"][..] } else { &[] };
        rack.rack.tls = Some(TlsSection::with_operators(operators.iter().copied()));
    }
    let qwen = env.model == Model::Qwen4Exp;
    rack.table = tables
        .iter()
        .map(|f| TableEntry {
            encoding: qwen.then(|| QWEN_ENCODING.name()),
            tensor_scale: qwen.then_some(f64::from(QWEN_SCALE)),
            ..TableEntry::new(f.id, &f.path, f.rows, &f.digest)
        })
        .collect();
    rack.donor = donors.iter().map(|d| donor_entry(env, plan, d)).collect();
    rack.node = nodes
        .iter()
        .map(|(name, sources)| NodeEntry {
            tokens_per_second: Some(100.0),
            probe_interval_ms: Some(plan.probe_interval_ms),
            breaker_failures: Some(plan.breaker_failures),
            connect_timeout_ms: Some(200),
            ..NodeEntry::new(
                *name,
                env.tables.iter().map(|f| route(plan, f, sources)).collect(),
            )
        })
        .collect();
    rack.model = Some(match env.model {
        Model::DeepseekV41 => ModelSection {
            fusion: Some("cpu".into()),
            ..ModelSection::synthetic(env.base, 5, 16, 4)
        },
        Model::Qwen4Exp => ModelSection {
            family: Some("qwen4exp".into()),
            eos_token: Some(QWEN_EOS),
            ..ModelSection::synthetic(env.base, 5, 16, 4)
        },
    });
    rack
}

/// A drill node's route to table `f` from `sources`, its SSD copy the
/// pinned file.
fn route(plan: &Plan, f: &TableFile, sources: &[String]) -> RouteEntry {
    RouteEntry {
        hedge: Some(plan.hedge.into()),
        hard_timeout_ms: Some(plan.hard_timeout_ms),
        policy: Some(plan.policy.into()),
        ..RouteEntry::new(f.id, sources.iter().cloned()).ssd_path(&f.path)
    }
}

/// Donor `d`'s `[[donor]]` entry of the drill's config.
fn donor_entry(env: &Env, plan: &Plan, d: &DonorAddrs) -> DonorEntry {
    let scheme = plan.transport.as_str();
    let quic = d.quic.map(|q| format!("quic://{q}"));
    let host = plan
        .host_socket
        .then(|| format!("unix://{}", host_socket(env, plan, d.name).display()));
    let listen = std::iter::once(format!("{scheme}://{}", d.listen)).chain(quic.clone());
    let advertise = std::iter::once(format!("{scheme}://{}", d.advertise)).chain(quic);
    // Room for both tables and a swap's new version beside them, however
    // large `Env::base` makes them.
    let tables = env.tables.iter().map(|t| t.rows).sum::<u64>() * env.model.row_bytes() as u64;
    let ram_gib = (tables as f64 * 2.0 / f64::from(1u32 << 30)).max(1.0);
    DonorEntry {
        advertise: Some(advertise.collect()),
        metrics: Some(d.metrics.to_string()),
        ram_gib,
        headroom_gib: Some(0.0),
        max_connections: Some(plan.max_connections as u64),
        hello_timeout_ms: Some(plan.hello_timeout_ms),
        drain_timeout_ms: Some(2000),
        control: d.control.map(|c| c.to_string()),
        ..DonorEntry::new(
            d.name,
            listen.chain(host),
            env.model.tables().iter().copied(),
        )
    }
}

/// Where donor `donor` of `plan` has its host socket ([`Plan::host_socket`]).
fn host_socket(env: &Env, plan: &Plan, donor: &str) -> PathBuf {
    env.dir.join(format!("{}-{donor}.sock", plan.name))
}

/// Kill the child with SIGKILL when the thread that started it ends (an
/// interrupted drill leaves nothing behind).
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Which version of the tables a donor is started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// The pinned one.
    Pinned,
    /// Another one (the node must never use it).
    Other,
}

/// One donor of a running rack.
#[derive(Debug)]
struct Donor {
    plan: DonorPlan,
    addrs: DonorAddrs,
    proxy: Option<FaultProxy>,
    netns: Option<NetNs>,
    /// Its systemd: notifications and the fd store that carries its tables
    /// across a kill -9.
    notify: crate::NotifySocket,
    process: Option<DonorProcess>,
}

impl Donor {
    /// Donor `d`, the `i`th of `plan`: its addresses (on loopback, or in a
    /// network namespace of its own), its fault proxy, its home under
    /// `dir` and notify socket; not started.
    fn place(plan: &Plan, dir: &Path, i: usize, d: &DonorPlan) -> Result<Self> {
        let (netns, ip) = match d.placement {
            Placement::Loopback => (None, Ipv4Addr::new(127, 0, 0, 2 + i as u8)),
            Placement::Netns => {
                let ns = NetNs::create(d.name)
                    .with_context(|| format!("a network namespace for {}", d.name))?;
                let ip = ns.addr();
                (Some(ns), ip)
            }
        };
        // In a namespace of its own any port is free.
        let port = |k: u16| -> Result<u16> {
            match d.placement {
                Placement::Loopback => crate::free_port_on(ip),
                Placement::Netns => Ok(7400 + k),
            }
        };
        let listen = SocketAddr::from((ip, port(0)?));
        let mut metrics = SocketAddr::from((ip, port(1)?));
        while metrics == listen {
            metrics = SocketAddr::from((ip, port(1)?));
        }
        let mut control = None;
        if plan.control {
            let mut c = SocketAddr::from((ip, port(2)?));
            while c == listen || c == metrics {
                c = SocketAddr::from((ip, port(2)?));
            }
            control = Some(c);
        }
        let proxy = if d.proxied {
            Some(FaultProxy::start("127.0.0.1:0".parse()?, listen)?)
        } else {
            None
        };
        let advertise = proxy.as_ref().map_or(listen, FaultProxy::addr);
        let home = dir.join(d.name);
        std::fs::create_dir_all(&home)?;
        let notify = crate::NotifySocket::bind(&home)?;
        Ok(Donor {
            notify,
            plan: d.clone(),
            addrs: DonorAddrs {
                name: d.name,
                listen,
                advertise,
                metrics,
                quic: plan.also_quic.then_some(listen),
                control,
            },
            proxy,
            netns,
            process: None,
        })
    }
}

/// A drill's rack: the config, and its donors running.
#[derive(Debug)]
pub struct Rack {
    /// The drill's plan.
    pub plan: Plan,
    /// Work directory of this drill.
    pub dir: PathBuf,
    /// The config (the pinned tables): the node and donors read it.
    pub config: PathBuf,
    /// The same config with the other version's tables.
    pub other_config: PathBuf,
    donors: Vec<Donor>,
}

impl Rack {
    /// Write the configs, build namespaces and proxies, start every donor
    /// and wait for each to be ready.
    pub fn start(env: &Env, plan: Plan) -> Result<Self> {
        let dir = env.dir.join(&plan.name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut donors = Vec::new();
        for (i, d) in plan.donors.iter().enumerate() {
            donors.push(Donor::place(&plan, &dir, i, d)?);
        }
        let addrs: Vec<DonorAddrs> = donors.iter().map(|d| d.addrs.clone()).collect();
        let sources: Vec<String> = plan.sources.iter().map(|s| s.to_string()).collect();
        let nodes = [("n", sources)];
        let config = dir.join("rack.toml");
        rack_config(env, &plan, &addrs, &nodes, false).write(&config)?;
        let other_config = dir.join("other.toml");
        rack_config(env, &plan, &addrs, &nodes, true).write(&other_config)?;
        if plan.transport.is_secure() {
            crate::rack_pki(&config)?;
        }
        let mut rack = Self {
            plan,
            dir,
            config,
            other_config,
            donors,
        };
        let names: Vec<&'static str> = rack.donors.iter().map(|d| d.plan.name).collect();
        for name in &names {
            rack.launch(name, Version::Pinned)?;
        }
        for name in &names {
            rack.wait_ready(name)?;
        }
        Ok(rack)
    }

    fn donor(&self, name: &str) -> Result<&Donor> {
        self.donors
            .iter()
            .find(|d| d.plan.name == name)
            .with_context(|| format!("no donor {name} in this rack"))
    }

    fn donor_mut(&mut self, name: &str) -> Result<&mut Donor> {
        self.donors
            .iter_mut()
            .find(|d| d.plan.name == name)
            .with_context(|| format!("no donor {name} in this rack"))
    }

    /// Start donor `name` serving `version` (without waiting).
    fn launch(&mut self, name: &str, version: Version) -> Result<()> {
        let config = match version {
            Version::Pinned => self.config.clone(),
            Version::Other => self.other_config.clone(),
        };
        let transport = self.plan.transport;
        let d = self.donor_mut(name)?;
        if d.process.is_some() {
            bail!("{name} is already running");
        }
        // Under its systemd: a shell that sets LISTEN_PID and execs the
        // donor, with the fd store's descriptors.
        let mut cmd = match &d.netns {
            Some(ns) => ns.command("/bin/sh"),
            None => {
                let mut c = Command::new("/bin/sh");
                die_with_parent(&mut c);
                c
            }
        };
        cmd.args(["-c", crate::EXEC_WITH_LISTEN_PID])
            .arg(bin("memory-donor"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .args(["--name", name])
            .env("RUST_LOG", "info");
        let held = d.notify.attach(&mut cmd)?;
        let p = Process::spawn(cmd)?;
        drop(held);
        // Parsed once the ready line is there.
        let mut endpoints = vec![cluster_config::Endpoint::new(transport, d.addrs.listen)];
        let quic = cluster_config::Transport::Quic;
        endpoints.extend(d.addrs.quic.map(|q| cluster_config::Endpoint::new(quic, q)));
        d.process = Some(DonorProcess {
            addr: d.addrs.listen,
            addrs: endpoints.iter().map(|e| e.addr).collect(),
            endpoints,
            host_socket: None,
            process: p,
        });
        Ok(())
    }

    /// Wait (at most 60 s) for donor `name`'s ready line.
    fn wait_ready(&self, name: &str) -> Result<()> {
        let d = self.donor(name)?;
        let p = d.process.as_ref().context("not running")?;
        p.wait_line(Duration::from_secs(60), |l| {
            l.contains("ready listen=").then_some(())
        })
        .with_context(|| format!("{name} did not become ready"))
    }

    /// Start donor `name` again with `version` and wait until it is
    /// ready; returns how long that took.
    pub fn restart(&mut self, name: &str, version: Version) -> Result<Duration> {
        let began = std::time::Instant::now();
        self.launch(name, version)?;
        self.wait_ready(name)?;
        Ok(began.elapsed())
    }

    /// Send `sig` to donor `name`.
    pub fn signal(&self, name: &str, sig: i32) -> Result<()> {
        let d = self.donor(name)?;
        d.process.as_ref().context("not running")?.signal(sig);
        Ok(())
    }

    /// SIGSTOP donor `name` and wait until the kernel shows it stopped.
    pub fn stop(&self, name: &str) -> Result<()> {
        self.donor(name)?
            .process
            .as_ref()
            .context("not running")?
            .stop();
        Ok(())
    }

    /// Send `sig` (SIGKILL, SIGTERM) and wait (at most 10 s) for the exit;
    /// the exit status.
    pub fn end(&mut self, name: &str, sig: i32) -> Result<std::process::ExitStatus> {
        let d = self.donor_mut(name)?;
        let mut p = d.process.take().context("not running")?;
        p.signal(sig);
        let st = p
            .wait(Duration::from_secs(10))
            .with_context(|| format!("{name} still runs 10 s after signal {sig}"))?;
        Ok(st)
    }

    /// The log of donor `name` (its running process).
    pub fn log(&self, name: &str) -> Result<String> {
        Ok(self
            .donor(name)?
            .process
            .as_ref()
            .context("not running")?
            .log())
    }

    /// Cut donor `name`'s link (it must run in a namespace).
    pub fn partition(&self, name: &str) -> Result<()> {
        self.netns(name)?.link_down()
    }

    /// Bring donor `name`'s link back.
    pub fn heal(&self, name: &str) -> Result<()> {
        self.netns(name)?.link_up()
    }

    fn netns(&self, name: &str) -> Result<&NetNs> {
        self.donor(name)?
            .netns
            .as_ref()
            .with_context(|| format!("{name} does not run in a network namespace"))
    }

    /// Wait (at most `timeout`) until a TCP connect from here to donor
    /// `name` succeeds; how long that took.
    pub fn wait_reachable(&self, name: &str, timeout: Duration) -> Result<Duration> {
        let addr = self.listen(name)?;
        let start = std::time::Instant::now();
        while start.elapsed() < timeout {
            // The donor closes it unanswered after its hello timeout.
            if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(50)).is_ok() {
                return Ok(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        bail!("{name} at {addr} is still unreachable after {timeout:?}")
    }

    /// The proxy in front of donor `name`.
    pub fn proxy(&self, name: &str) -> Result<&FaultProxy> {
        self.donor(name)?
            .proxy
            .as_ref()
            .with_context(|| format!("{name} is not behind a proxy"))
    }

    /// Where donor `name` listens (behind any proxy).
    pub fn listen(&self, name: &str) -> Result<SocketAddr> {
        Ok(self.donor(name)?.addrs.listen)
    }

    /// Where donor `name` listens on QUIC beside its transport ([`Plan::also_quic`]).
    pub fn quic(&self, name: &str) -> Result<SocketAddr> {
        self.donor(name)?
            .addrs
            .quic
            .with_context(|| format!("{name} does not listen on QUIC beside its transport"))
    }

    /// Donor `name`'s control plane address ([`Plan::control`]).
    pub fn control(&self, name: &str) -> Result<SocketAddr> {
        self.donor(name)?
            .addrs
            .control
            .with_context(|| format!("{name} serves no control plane in this plan"))
    }

    /// Donor `name`'s Prometheus text.
    pub fn donor_metrics(&self, name: &str) -> Result<String> {
        crate::scrape(self.donor(name)?.addrs.metrics)
    }

    /// Start the node `n` for `steps` decode steps at `rate` steps/s (each
    /// step one position of each of the plan's sequences, after its
    /// prefill step when it has one).
    pub fn run_node(&self, steps: u64, rate: f64) -> Result<NodeRun> {
        NodeRun::start_with(
            &self.config,
            "n",
            steps * self.plan.batch as u64,
            rate,
            &self.dir.join("node"),
            &self.plan.node_args(),
        )
    }
}
