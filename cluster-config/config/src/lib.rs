//! `cluster-config`: the one file that describes an engram-rack rack.
//!
//! What it is: the TOML schema (tables, donors, nodes, model), parsing with
//! `deny_unknown_fields`, and a `validate` step whose every rule reports the
//! file, line, column and key it is about, all problems at once. The result
//! is a plain [`Config`] the daemons read and never poke at as TOML.
//!
//! What it is not: the config itself opens no table files and no sockets
//! (`engram-cluster check` runs anywhere, before anything is deployed).
//! Beside it live the small pieces both daemons share (`daemon`: logging,
//! systemd's readiness and watchdog protocol, the Prometheus `/metrics`
//! endpoint, the bounded accept loop of their gRPC servers); `plan`, the capacity and timing plan
//! `engram-cluster plan` prints; and `pki`, the rack CA and the hosts'
//! certificates (`engram-cluster pki`, and the check of their files);
//! and `manuals`, the man pages and shell completions of every command.
//!
//! Layers: `raw` (serde structs with spans) -> `validate` (rules, defaults,
//! path resolution) -> [`Config`].

#![warn(missing_docs)]

pub mod manuals;
pub mod model;
pub mod pki;
pub mod plan;
mod raw;
pub mod records;
pub mod tls;
mod validate;
pub use validate::node::{
    DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_LOOKUP_TIMEOUT_MS, DEFAULT_PREFILL_BUDGET,
};
pub use validate::pages_by_default;

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use engram_protocol::TableDigest;
use thiserror::Error;

/// Schema version this build reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A validated rack description.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it came from.
    pub path: PathBuf,
    /// The rack's name.
    pub rack: String,
    /// Shared secret every node sends in Hello and every donor requires, if set.
    pub credential_file: Option<PathBuf>,
    /// Engram tables.
    pub tables: Vec<Table>,
    /// Memory donors.
    pub donors: Vec<Donor>,
    /// Inference nodes.
    pub nodes: Vec<Node>,
    /// The model's Engram parameters (`[model]`), if given.
    pub model: Option<model::Model>,
    /// The rack's PKI (`[rack.tls]`), if it has one: TLS and QUIC on every plane.
    pub tls: Option<TlsSettings>,
    /// Whether plaintext (`tcp`, an unencrypted control plane) may bind
    /// anything but loopback.
    pub plaintext: Plaintext,
}

/// The rack's PKI: where its CA and the hosts' certificates are.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsSettings {
    /// Where `engram-cluster pki` writes and the daemons read by default
    /// (`pki` beside the config unless `dir` says otherwise).
    pub dir: PathBuf,
    /// The rack CA's certificate (PEM); default `DIR/ca.pem`.
    pub ca: PathBuf,
    /// Identities that may operate donors (Drain, SwapTable).
    pub operators: Vec<String>,
}

/// One host's certificate files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The rack CA (PEM).
    pub ca: PathBuf,
    /// The host's certificate (PEM).
    pub cert: PathBuf,
    /// The host's private key (PEM, PKCS#8).
    pub key: PathBuf,
}

/// `rack.plaintext`: may plaintext bind a non-loopback address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Plaintext {
    /// Plaintext only on loopback (the default).
    #[default]
    LoopbackOnly,
    /// Plaintext anywhere (`plaintext = "allow"`): the operator accepts
    /// rows and credentials in the clear on this network.
    Allow,
}

/// How one data-plane address is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    /// Plain TCP (frames in the clear; the Hello credential authenticates).
    Tcp,
    /// TLS 1.3 over TCP with mutual certificate authentication.
    Tls,
    /// QUIC (TLS 1.3 inside), ALPN `engram/1`.
    Quic,
    /// One-sided RDMA READs of the donor's registered memory; the region
    /// and a queue-pair token are learned over the donor's TLS or QUIC
    /// address (`docs/rdma.md`). The address is the donor's RDMA
    /// connection-manager listener.
    Rdma,
}

impl Transport {
    /// Every transport, in the node's order of preference for a donor that
    /// offers several: TLS, then QUIC, then TCP.
    pub const PREFERENCE: [Self; 3] = [Self::Tls, Self::Quic, Self::Tcp];

    /// The name in configs and URLs (`tcp`, `tls`, `quic`, `rdma`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Tls => "tls",
            Self::Quic => "quic",
            Self::Rdma => "rdma",
        }
    }

    /// Parse `tcp`, `tls`, `quic` or `rdma`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "tcp" => Some(Self::Tcp),
            "tls" => Some(Self::Tls),
            "quic" => Some(Self::Quic),
            "rdma" => Some(Self::Rdma),
            _ => None,
        }
    }

    /// True for TLS and QUIC (encrypted and mutually authenticated).
    pub fn is_secure(self) -> bool {
        matches!(self, Self::Tls | Self::Quic)
    }

    /// True for the transports that carry frames (all but RDMA).
    pub fn is_stream(self) -> bool {
        self != Self::Rdma
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A data-plane address and how it is spoken: `tls://10.0.0.11:7410`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The transport.
    pub transport: Transport,
    /// The address.
    pub addr: SocketAddr,
}

impl Endpoint {
    /// An endpoint.
    pub fn new(transport: Transport, addr: SocketAddr) -> Self {
        Self { transport, addr }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.transport, self.addr)
    }
}

/// How a node reaches one donor: over which of its transports, and over
/// which link (a Thunderbolt IP link, say).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Link {
    /// The transport to use, when not the donor's most secure one.
    pub transport: Option<Transport>,
    /// Source address of the node's connections to the donor.
    pub bind: Option<IpAddr>,
    /// Network interface the connections must use (`SO_BINDTODEVICE`).
    pub interface: Option<String>,
}

/// Longest interface name Linux accepts (IFNAMSIZ - 1).
pub const MAX_INTERFACE_NAME: usize = 15;

/// One Engram table and its pinned version.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Id used on the wire.
    pub id: u32,
    /// Model layer.
    pub layer: u32,
    /// Where donors load it from (resolved against the config's directory).
    pub path: PathBuf,
    /// Row count.
    pub rows: u64,
    /// The pinned version: a donor announcing another digest is never used.
    pub digest: TableDigest,
    /// How its rows are encoded (`encoding`; default V4.1's
    /// `e4m3_ue8m0_32x256`): a donor refuses a file of another encoding,
    /// and a node routes only its `[model] family`'s (docs/models.md).
    pub encoding: engram_protocol::encoding::RowEncoding,
    /// The table scale its rows are read with (`tensor_scale`; only for an
    /// encoding with one, such as FP8's): a donor refuses a file with
    /// another, and a Qwen4Exp node dequantizes with it. The digest covers
    /// the rows, not this.
    pub tensor_scale: Option<f32>,
}

/// How a donor's shared tables lie in memory (`host_layout`).
pub use engram_store::kept::KeptLayout;
/// Whether a donor locks table memory (`mlock`): the store's own mode.
pub use engram_store::resident::MlockMode;

/// The highest NUMA node a donor may name (`numa_node`; Linux's
/// `MAX_NUMNODES` is at most 1024).
pub const MAX_NUMA_NODE: u32 = 1023;

/// A memory donor.
#[derive(Debug, Clone, PartialEq)]
pub struct Donor {
    /// Unique name.
    pub name: String,
    /// Data-plane addresses to bind, each with its transport.
    pub listen: Vec<Endpoint>,
    /// Data-plane addresses nodes dial, each with its transport.
    pub advertise: Vec<Endpoint>,
    /// Node identities allowed on its TLS and QUIC data plane (default: every node).
    pub clients: Vec<String>,
    /// Its host socket (`unix://PATH` in `listen`): processes on its own
    /// host map its tables' memory instead of asking for rows.
    pub host_socket: Option<PathBuf>,
    /// User ids allowed on the host socket (besides `host_gids`); with
    /// both empty, the donor's own user and group are.
    pub host_uids: Vec<u32>,
    /// Group ids allowed on the host socket.
    pub host_gids: Vec<u32>,
    /// `SwapTable` loads only files under these directories (`table_dir`,
    /// or the directories of its configured tables).
    pub table_dirs: Vec<PathBuf>,
    /// Its certificate, when not `DIR/NAME.pem`.
    pub tls_cert: Option<PathBuf>,
    /// Its key, when not `DIR/NAME.key`.
    pub tls_key: Option<PathBuf>,
    /// Ids of the tables it holds.
    pub tables: Vec<u32>,
    /// RAM it has for tables and headroom, in GiB.
    pub ram_gib: f64,
    /// RAM kept free beside the tables (OS, the service, buffers), in GiB.
    pub headroom_gib: f64,
    /// Log filter (`info`, `memory_donor=debug,info`); `RUST_LOG` wins at start.
    pub log_level: Option<String>,
    /// Connection bound.
    pub max_connections: usize,
    /// Rows-per-lookup cap.
    pub max_rows: u32,
    /// Memory locking.
    pub mlock: MlockMode,
    /// Skip recomputing digests at load (fast restarts of trusted files).
    pub trust_digest: bool,
    /// Under systemd, keep tables in its fd store so a restart serves them
    /// at once (`fd_store`, default true).
    pub fd_store: bool,
    /// Serve rows from the table files' own pages in the page cache, not
    /// a copy (`map_files`): loads cost about a hash of the file; no RDMA
    /// for those tables, and the fd store keeps only the file's mark.
    /// Default: true unless the donor has an `rdma://` address, a host
    /// socket or a `numa_node`, which need a copy
    /// ([`pages_by_default`]).
    pub map_files: bool,
    /// The NUMA node its tables' memory is bound to (`mbind`), so that a
    /// host with two sockets runs one donor per socket, each serving from
    /// its own node's memory; `None`: the kernel's default placement.
    pub numa_node: Option<u32>,
    /// How its tables lie in the memory it shares on its host socket
    /// (`host_layout`): packed rows (the default), or planar for engines
    /// whose own host-table kernels read it in place (docs/engines.md).
    pub host_layout: KeptLayout,
    /// Threads that read, place and hash a table at load (0: every core).
    pub load_threads: usize,
    /// Connection threads check their socket without sleeping for up to
    /// this long before a blocking read (`busy_poll_us`; zero: off).
    pub busy_poll: Duration,
    /// Time a new connection has to say Hello.
    pub hello_timeout: Duration,
    /// Silent ready connections are closed after this (zero: never).
    pub idle_timeout: Duration,
    /// A blocked write closes the connection after this.
    pub write_timeout: Duration,
    /// How long a drain (SIGTERM) waits for clients.
    pub drain_timeout: Duration,
    /// The control plane's gRPC address to bind (health, tables, stats, drain).
    pub control: Option<SocketAddr>,
    /// The Prometheus `/metrics` HTTP address to bind.
    pub metrics: Option<SocketAddr>,
    /// The RDMA device it serves from (`[donor.rdma]`), when it listens on
    /// an `rdma://` address.
    pub rdma: Option<RdmaDevice>,
}

/// A donor's RDMA device (`[donor.rdma]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    /// The device's name (`mlx5_0`); the one the listen address is on when `None`.
    pub device: Option<String>,
    /// How long a node's queue pair to this donor waits for a READ's
    /// response before it resends (`ack_timeout_ms`; the verbs round it
    /// up to 4.096 us times a power of two).
    pub ack_timeout: Duration,
    /// Resends before such a queue pair gives up (`retry_count`, 0 to 7).
    pub retry_count: u8,
    /// The traffic class (IP ToS byte on RoCE) of both ends' packets
    /// (`traffic_class`); the fabric's default when `None`.
    pub traffic_class: Option<u8>,
}

/// `[donor.rdma] ack_timeout_ms` unless set.
pub const DEFAULT_RDMA_ACK_TIMEOUT_MS: u64 = 16;
/// `[donor.rdma] retry_count` unless set.
pub const DEFAULT_RDMA_RETRY_COUNT: u8 = 7;

impl Default for RdmaDevice {
    fn default() -> Self {
        Self {
            device: None,
            ack_timeout: Duration::from_millis(DEFAULT_RDMA_ACK_TIMEOUT_MS),
            retry_count: DEFAULT_RDMA_RETRY_COUNT,
            traffic_class: None,
        }
    }
}

/// Bytes of check words an RDMA donor registers beside each row (one
/// XXH3-64 a row, `docs/rdma.md`).
pub const RDMA_CHECK_BYTES: u64 = 8;

/// GiB a donor keeps free beside its tables unless `headroom_gib` says otherwise.
pub const DEFAULT_HEADROOM_GIB: f64 = 2.0;

/// A donor's data plane unless its config says: the most open connections
/// (`max_connections`)...
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// ...the time a new connection has to say Hello (`hello_timeout_ms`)...
pub const DEFAULT_HELLO_TIMEOUT_MS: u64 = 5_000;
/// ...how long a ready connection may stay silent (`idle_timeout_ms`)...
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 600_000;
/// ...how long a write may block on a client not reading
/// (`write_timeout_ms`)...
pub const DEFAULT_WRITE_TIMEOUT_MS: u64 = 10_000;
/// ...and how long a drain waits for clients (`drain_timeout_ms`). The
/// donor's own defaults (`ServerConfig::new`) are these.
pub const DEFAULT_DRAIN_TIMEOUT_MS: u64 = 5_000;

/// Bytes in a GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

impl Donor {
    /// Bytes of RAM the donor may fill with tables: `ram_gib - headroom_gib`.
    pub fn table_budget_bytes(&self) -> u64 {
        ((self.ram_gib - self.headroom_gib).max(0.0) * GIB) as u64
    }

    /// The control-plane address a node dials: `control` itself, or, when it
    /// binds a wildcard IP, the first advertised data-plane IP on its port.
    pub fn control_endpoint(&self) -> Option<SocketAddr> {
        let c = self.control?;
        if !c.ip().is_unspecified() {
            return Some(c);
        }
        self.advertise
            .first()
            .map(|a| SocketAddr::new(a.addr.ip(), c.port()))
    }

    /// Its advertised RDMA address, if it has one.
    pub fn rdma_endpoint(&self) -> Option<Endpoint> {
        self.advertise
            .iter()
            .find(|e| e.transport == Transport::Rdma)
            .copied()
    }

    /// The address to dial for `transport`, or for the most secure
    /// stream transport advertised when `None` (TLS, then QUIC, then TCP).
    pub fn endpoints(&self, transport: Option<Transport>) -> Vec<Endpoint> {
        let pick = transport.or_else(|| {
            Transport::PREFERENCE
                .into_iter()
                .find(|t| self.advertise.iter().any(|e| e.transport == *t))
        });
        self.advertise
            .iter()
            .filter(|e| Some(e.transport) == pick)
            .copied()
            .collect()
    }
}

/// Where a node may get a table's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceRef {
    /// A donor, by name.
    Donor(String),
    /// The node's SSD copy of the table.
    Ssd,
    /// The table loaded into the node's own RAM.
    Local,
}

impl fmt::Display for SourceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Donor(d) => f.write_str(d),
            Self::Ssd => f.write_str("ssd"),
            Self::Local => f.write_str("local"),
        }
    }
}

/// When a lookup also goes to the next source.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Hedge {
    /// Never hedge: the next source is asked only after a failure or at the deadline.
    Off,
    /// After a fixed delay.
    Fixed(Duration),
    /// After this percentile (0 < p < 100) of the source's recent latencies.
    Percentile(f64),
}

impl fmt::Display for Hedge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Fixed(d) => write!(f, "{}us", d.as_micros()),
            Self::Percentile(p) => write!(f, "p{p}"),
        }
    }
}

/// What a lookup returns when every source failed by the hard timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// A typed error (the default).
    #[default]
    Fail,
    /// Zero rows: Engram suppressed for the token, counted and logged.
    Zeros,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fail => "fail",
            Self::Zeros => "zeros",
        })
    }
}

/// How a node reads its SSD copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SsdIo {
    /// io_uring where the kernel allows it, else the pread pool.
    #[default]
    Auto,
    /// io_uring or refuse to start.
    Uring,
    /// A pool of threads issuing pread.
    Pread,
}

/// The Linux I/O scheduling class of the node's SSD reads (`ioprio_set(2)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoClass {
    /// Served before every best-effort request: the read window is
    /// protected from other I/O on the drive. Needs CAP_SYS_NICE.
    RealTime,
    /// The kernel's default class.
    BestEffort,
    /// Served only when the drive has nothing else to do.
    Idle,
}

/// An I/O priority: a class and, for real-time and best-effort, a level
/// (0 highest .. 7 lowest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdIoprio {
    /// The class.
    pub class: IoClass,
    /// The level within it (0 for idle, which has none).
    pub level: u8,
}

impl SsdIoprio {
    /// The default of a route: real-time, level 4.
    pub const DEFAULT: Self = Self {
        class: IoClass::RealTime,
        level: 4,
    };

    /// Parse `realtime`, `realtime:N`, `best-effort`, `best-effort:N` or
    /// `idle` (N 0..=7, 4 when left out).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{s:?} is not an I/O priority: \"realtime\", \"best-effort\" or \"idle\", \
                 optionally with a level 0 (highest) to 7, as in \"realtime:2\""
            )
        };
        let (class, level) = match s.split_once(':') {
            Some((c, l)) => (
                c,
                Some(l.parse::<u8>().ok().filter(|&l| l <= 7).ok_or_else(bad)?),
            ),
            None => (s, None),
        };
        let class = match class {
            "realtime" => IoClass::RealTime,
            "best-effort" => IoClass::BestEffort,
            "idle" if level.is_none() => IoClass::Idle,
            _ => return Err(bad()),
        };
        let level = match class {
            IoClass::Idle => 0,
            _ => level.unwrap_or(4),
        };
        Ok(Self { class, level })
    }
}

impl fmt::Display for SsdIoprio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.class {
            IoClass::RealTime => write!(f, "realtime:{}", self.level),
            IoClass::BestEffort => write!(f, "best-effort:{}", self.level),
            IoClass::Idle => f.write_str("idle"),
        }
    }
}

/// A node's sources for one table, in order of preference, and the knobs
/// that bound a lookup.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Table id.
    pub table: u32,
    /// Sources, first preferred.
    pub sources: Vec<SourceRef>,
    /// The node's local copy (for `ssd` and `local`), resolved.
    pub ssd_path: PathBuf,
    /// Skip recomputing the local copy's digest at startup.
    pub trust_digest: bool,
    /// Added to the table's window to make a lookup's deadline.
    pub grace: Duration,
    /// A lookup never takes longer; then the policy decides.
    pub hard_timeout: Duration,
    /// When the next source is asked too.
    pub hedge: Hedge,
    /// What happens when every source failed.
    pub policy: Policy,
    /// The I/O priority of the SSD copy's reads.
    pub ssd_ioprio: SsdIoprio,
}

/// An inference node.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Unique name.
    pub name: String,
    /// Per-table routes.
    pub routes: Vec<Route>,
    /// Time allowed to connect and handshake with a donor.
    pub connect_timeout: Duration,
    /// Default hard timeout of a route's lookups.
    pub lookup_timeout: Duration,
    /// The token rate the model runs at; it sets each table's window.
    pub tokens_per_second: f64,
    /// How often an excluded donor is probed for re-admission.
    pub probe_interval: Duration,
    /// Consecutive failures that open a donor's circuit breaker.
    pub breaker_failures: u32,
    /// Most sequences `inference-node serve` runs together in one batch
    /// (continuous batching: requests join and leave at step boundaries).
    pub max_batch: u32,
    /// Prefill positions a step of `inference-node serve` takes, in all,
    /// while other sequences decode: a joining sequence prefills in chunks
    /// of this many, so the decoders keep their step time (0: no limit).
    pub prefill_budget: usize,
    /// Where the node serves Prometheus `/metrics`, if anywhere.
    pub metrics: Option<SocketAddr>,
    /// Where `inference-node serve` serves its gRPC API and health.
    pub api: SocketAddr,
    /// Log filter (reloadable), if set.
    pub log_level: Option<String>,
    /// How SSD copies are read.
    pub ssd_io: SsdIo,
    /// Open SSD copies with O_DIRECT (bypass the page cache).
    pub ssd_direct: bool,
    /// Per donor: which transport and link to use (`[[node.link]]`).
    pub links: Vec<(String, Link)>,
    /// Its certificate, when not `DIR/NAME.pem`.
    pub tls_cert: Option<PathBuf>,
    /// Its key, when not `DIR/NAME.key`.
    pub tls_key: Option<PathBuf>,
}

/// Where the node daemon serves its API unless the config says otherwise (this host only).
pub const DEFAULT_NODE_API: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7420);

/// Blocks in a V4.1 token; a table's window is measured in them.
pub const MODEL_BLOCKS: u32 = 40;

/// The Engram layers of V4.1 (0-based), in order.
pub const V41_ENGRAM_LAYERS: [u32; 2] = [1, 14];

/// The window of the table of Engram layer `layer`, in blocks (seed 000):
/// the blocks between the previous Engram layer among `layers` (block 0
/// for the first) and its own, at least one. V4.1's layers 1 and 14 get 1
/// and 13. The one place windows are counted.
pub fn window_blocks(layer: u32, layers: impl IntoIterator<Item = u32>) -> u32 {
    let previous = layers.into_iter().filter(|&l| l < layer).max().unwrap_or(0);
    (layer - previous).max(1)
}

/// `blocks` of a token's [`MODEL_BLOCKS`] blocks, for a token of `token`.
pub fn window(token: Duration, blocks: u32) -> Duration {
    token * blocks / MODEL_BLOCKS
}

impl Node {
    /// Time of one token at the node's rate.
    pub fn token_time(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.tokens_per_second)
    }

    /// The window a table's rows have (seed 000): the blocks between the
    /// previous Engram layer this node routes (block 0 for the first) and
    /// the table's own layer, at one `W/40` each; V4.1's layers 1 and 14
    /// get `W/40` and `13W/40`.
    pub fn window(&self, config: &Config, table: u32) -> Option<Duration> {
        let layer = config.table(table)?.layer;
        let layers = self
            .routes
            .iter()
            .filter_map(|r| config.table(r.table))
            .map(|t| t.layer);
        Some(window(self.token_time(), window_blocks(layer, layers)))
    }

    /// The route of a table.
    pub fn route(&self, table: u32) -> Option<&Route> {
        self.routes.iter().find(|r| r.table == table)
    }

    /// How this node reaches donor `donor` (defaults when no `[[node.link]]` names it).
    pub fn link(&self, donor: &str) -> Link {
        self.links
            .iter()
            .find(|(d, _)| d == donor)
            .map(|(_, l)| l.clone())
            .unwrap_or_default()
    }
}

/// Where a problem is and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The config file.
    pub file: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// The key, as a path (`donor[1].tables[0]`).
    pub key: String,
    /// What is wrong and, where it helps, what would be right.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}: {}",
            self.file.display(),
            self.line,
            self.column,
            self.key,
            self.message
        )
    }
}

/// Why a config was not accepted.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The config file.
        path: PathBuf,
        /// The OS error, or why the file is too large to read.
        source: std::io::Error,
    },
    /// The file is not a valid rack config; every problem found is listed.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Diagnostic>),
}

/// Largest config file read.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Why plaintext beyond loopback is refused, in every such error.
pub const PLAINTEXT_WHY: &str = "plaintext carries rows, credentials and control calls in the \
     clear to anyone on this network; use tls:// or quic:// with [rack.tls], bind a loopback \
     address, or set rack.plaintext = \"allow\" to accept it";

impl Config {
    /// The model family the rack serves (`[model] family`; DeepSeek V4.1's
    /// without a `[model]` table).
    pub fn family(&self) -> model::Family {
        self.model.as_ref().map(|m| m.family).unwrap_or_default()
    }

    /// Whether a plaintext service (plain TCP data, a control plane without
    /// TLS, /metrics, the node API) may bind `addr`: loopback always, any
    /// address only with `rack.plaintext = "allow"`. The daemons apply this
    /// to command-line overrides as `check` applies it to the config.
    pub fn plaintext_bind(&self, what: &str, addr: SocketAddr) -> Result<(), String> {
        if addr.ip().is_loopback() || self.plaintext == Plaintext::Allow {
            Ok(())
        } else {
            Err(format!(
                "{what} {addr} would be plaintext and unauthenticated on a non-loopback \
                 address: {PLAINTEXT_WHY}"
            ))
        }
    }

    /// Read and validate a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let io = |source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_CONFIG_BYTES {
            return Err(ConfigError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(format!(
                    "{len} bytes is more than the {MAX_CONFIG_BYTES} accepted"
                )),
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        Self::parse(&text, path)
    }

    /// Validate config text; `path` names it in errors and relative paths resolve against its directory.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        validate::parse(text, path)
    }

    /// The table with this id.
    pub fn table(&self, id: u32) -> Option<&Table> {
        self.tables.iter().find(|t| t.id == id)
    }

    /// The donor with this name.
    pub fn donor(&self, name: &str) -> Option<&Donor> {
        self.donors.iter().find(|d| d.name == name)
    }

    /// The node with this name.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The certificate files of `host` (a donor, node or operator), when
    /// the rack has a PKI: `DIR/HOST.pem` and `DIR/HOST.key` unless the
    /// host's `tls_cert` / `tls_key` say otherwise.
    pub fn tls_files(&self, host: &str) -> Option<TlsFiles> {
        let tls = self.tls.as_ref()?;
        let (cert, key) = if let Some(d) = self.donor(host) {
            (d.tls_cert.clone(), d.tls_key.clone())
        } else if let Some(n) = self.node(host) {
            (n.tls_cert.clone(), n.tls_key.clone())
        } else {
            (None, None)
        };
        Some(TlsFiles {
            ca: tls.ca.clone(),
            cert: cert.unwrap_or_else(|| tls.dir.join(format!("{host}.pem"))),
            key: key.unwrap_or_else(|| tls.dir.join(format!("{host}.key"))),
        })
    }

    /// True when `name` is one of `[rack.tls] operators`.
    pub fn is_operator(&self, name: &str) -> bool {
        self.tls
            .as_ref()
            .is_some_and(|t| t.operators.iter().any(|o| o == name))
    }

    /// The shared credential, read from its file (see [`read_credential`]).
    pub fn credential(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        self.credential_file
            .as_deref()
            .map(read_credential)
            .transpose()
    }
}

/// Read a credential file: 1 to 1024 bytes once trailing newlines are
/// removed; a larger file is refused before it is read whole.
pub fn read_credential(path: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let max = engram_protocol::messages::MAX_CREDENTIAL;
    let io = |source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(max as u64 + 3)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        bytes.pop();
    }
    if bytes.is_empty() || bytes.len() > max {
        return Err(io(std::io::Error::other(format!(
            "a credential is 1 to {max} bytes"
        ))));
    }
    Ok(bytes)
}

#[cfg(test)]
mod window_tests {
    use super::*;

    #[test]
    fn windows_count_the_blocks_since_the_previous_engram_layer() {
        assert_eq!(window_blocks(1, V41_ENGRAM_LAYERS), 1);
        assert_eq!(window_blocks(14, V41_ENGRAM_LAYERS), 13);
        // A node that routes only layer 14 has all 14 blocks before it.
        assert_eq!(window_blocks(14, [14]), 14);
        assert_eq!(window_blocks(0, [0]), 1, "at least one block");
        let w = Duration::from_millis(10);
        assert_eq!(window(w, 1), Duration::from_micros(250));
        assert_eq!(window(w, 13), Duration::from_micros(3250));
    }
}
