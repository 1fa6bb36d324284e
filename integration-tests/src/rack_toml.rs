//! The rack config as typed values that serialize to the TOML the daemons
//! read: tests and benchmarks build a rack with these and write it, instead
//! of formatting TOML text by hand. Field names are the schema's keys
//! (`cluster-config/config/src/raw.rs`, `docs/config.md`); an optional key
//! left `None` (or an empty list where the schema defaults one) is not
//! written, so the daemons apply their defaults.
//!
//! This is not a second parser or validator: `cluster_config::Config`
//! stays the one reader of the text, and the tests beside this file
//! (`rack_toml/tests.rs`) check that what is written here reads back.

#[cfg(test)]
mod tests;

use std::fmt::Display;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

/// A whole rack config: `version`, `[rack]`, `[[table]]`, `[[donor]]`,
/// `[[node]]` and `[model]`.
#[derive(Debug, Clone, Serialize)]
pub struct RackToml {
    /// The config format's version (1).
    pub version: u32,
    /// `[rack]`.
    pub rack: RackSection,
    /// `[[table]]`, one per Engram table.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub table: Vec<TableEntry>,
    /// `[[donor]]`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub donor: Vec<DonorEntry>,
    /// `[[node]]`, with its routes and links.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub node: Vec<NodeEntry>,
    /// `[model]`, the node's Engram parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSection>,
}

impl RackToml {
    /// Rack `name`, version 1, with nothing in it yet.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            version: 1,
            rack: RackSection {
                name: name.into(),
                ..RackSection::default()
            },
            table: Vec::new(),
            donor: Vec::new(),
            node: Vec::new(),
            model: None,
        }
    }

    /// The config as TOML text.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).context("serializing the rack config")
    }

    /// Write the config to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_toml()?).with_context(|| format!("writing {}", path.display()))
    }

    /// The donor named `name`, to change it.
    pub fn donor_mut(&mut self, name: &str) -> Result<&mut DonorEntry> {
        self.donor
            .iter_mut()
            .find(|d| d.name == name)
            .with_context(|| format!("no donor {name} in the rack config"))
    }

    /// The node named `name`, to change it.
    pub fn node_mut(&mut self, name: &str) -> Result<&mut NodeEntry> {
        self.node
            .iter_mut()
            .find(|n| n.name == name)
            .with_context(|| format!("no node {name} in the rack config"))
    }
}

/// `[rack]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RackSection {
    /// The rack's name.
    pub name: String,
    /// A file with the shared credential nodes present (plaintext racks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_file: Option<String>,
    /// `"loopback"` (the default) or `"allow"`: where plaintext may go.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plaintext: Option<String>,
    /// `[rack.tls]`: the rack PKI (present, even empty, turns TLS on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSection>,
}

/// `[rack.tls]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TlsSection {
    /// Where the PKI's files are (default `pki` beside the config).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    /// The CA certificate (default `DIR/ca.pem`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// Identities that may Drain and SwapTable donors.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub operators: Vec<String>,
}

impl TlsSection {
    /// `[rack.tls]` with these operators and the default PKI files.
    pub fn with_operators<S: Into<String>>(operators: impl IntoIterator<Item = S>) -> Self {
        Self {
            operators: strings(operators),
            ..Self::default()
        }
    }
}

/// One `[[table]]`.
#[derive(Debug, Clone, Serialize)]
pub struct TableEntry {
    /// The table's id.
    pub id: u32,
    /// The model layer it serves.
    pub layer: u32,
    /// Its file.
    pub path: PathBuf,
    /// Its row count.
    pub rows: u64,
    /// The pinned version, 64 hex digits.
    pub digest: String,
    /// Its rows' encoding, when not V4.1's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    /// Its rows' table scale, for an encoding with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor_scale: Option<f64>,
}

impl TableEntry {
    /// Table `id` for layer `id` (the racks here number tables by layer),
    /// pinned to `digest` (an [`engram_protocol::TableDigest`] or its hex).
    pub fn new(id: u32, path: impl Into<PathBuf>, rows: u64, digest: impl Display) -> Self {
        Self {
            id,
            layer: id,
            path: path.into(),
            rows,
            digest: digest.to_string(),
            encoding: None,
            tensor_scale: None,
        }
    }
}

/// One `[[donor]]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DonorEntry {
    /// Its name.
    pub name: String,
    /// Addresses it listens on (`tcp://`, `tls://`, `quic://`, `rdma://`,
    /// `unix://`, or a bare `IP:PORT`).
    pub listen: Vec<String>,
    /// What nodes dial, when not `listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<Vec<String>>,
    /// Ids of the tables it serves.
    pub tables: Vec<u32>,
    /// Its RAM, in GiB.
    pub ram_gib: f64,
    /// RAM kept free beside the tables, in GiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom_gib: Option<f64>,
    /// Its log filter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    /// Connections it serves at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u64>,
    /// Rows one frame may ask for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u64>,
    /// `"off"`, `"on"` or `"try"`: locking the tables in RAM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlock: Option<String>,
    /// Skip recomputing the tables' digests at load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trust_digest: Option<bool>,
    /// Keep the tables in systemd's fd store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd_store: Option<bool>,
    /// Serve from the table files' pages, not a copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map_files: Option<bool>,
    /// Threads a table load uses (0: every core).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_threads: Option<u64>,
    /// Busy polling of connection sockets, in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busy_poll_us: Option<u64>,
    /// How long a connection may take to say Hello.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hello_timeout_ms: Option<u64>,
    /// How long a connection may stay silent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout_ms: Option<u64>,
    /// How long an answer's write may take.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_timeout_ms: Option<u64>,
    /// How long a drain waits for connections to leave.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain_timeout_ms: Option<u64>,
    /// The control plane's address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control: Option<String>,
    /// The Prometheus `/metrics` address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    /// Nodes admitted on TLS and QUIC (default: every node).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clients: Option<Vec<String>>,
    /// Users that may use its host socket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_uids: Option<Vec<u32>>,
    /// Groups that may use its host socket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_gids: Option<Vec<u32>>,
    /// The NUMA node its tables are bound to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// How its shared tables lie: `"packed"` or `"planar"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_layout: Option<String>,
    /// The directory SwapTable loads from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table_dir: Option<String>,
    /// Its certificate (default `DIR/NAME.pem`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<String>,
    /// Its key (default `DIR/NAME.key`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<String>,
    /// `[donor.rdma]`: the fabric settings of its `rdma://` address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaSection>,
}

impl DonorEntry {
    /// Donor `name` on `listen`, serving `tables` with 1 GiB of RAM and
    /// every other key at its default.
    pub fn new<S: ToString>(
        name: impl Into<String>,
        listen: impl IntoIterator<Item = S>,
        tables: impl IntoIterator<Item = u32>,
    ) -> Self {
        Self {
            name: name.into(),
            listen: listen.into_iter().map(|s| s.to_string()).collect(),
            tables: tables.into_iter().collect(),
            ram_gib: 1.0,
            ..Self::default()
        }
    }
}

/// `[donor.rdma]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RdmaSection {
    /// The RDMA device (default: the one the address is on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The device's port (refused by `check`: the address's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u32>,
    /// The GID index (refused by `check`: the address's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gid_index: Option<u32>,
    /// The queue pairs' ACK timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ack_timeout_ms: Option<u32>,
    /// The queue pairs' retries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_count: Option<u32>,
    /// The traffic class of what both ends send.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_class: Option<u32>,
}

/// One `[[node]]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeEntry {
    /// Its name.
    pub name: String,
    /// Connect and handshake timeout with a donor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_timeout_ms: Option<u64>,
    /// Default hard timeout of its routes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lookup_timeout_ms: Option<u64>,
    /// The model's rate, which sets each table's window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// How often excluded or failed sources are probed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_interval_ms: Option<u64>,
    /// Consecutive failures that open a donor's breaker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker_failures: Option<u32>,
    /// Sequences `serve` batches together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch: Option<u32>,
    /// Prefill positions a serve step takes beside decoders.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_budget: Option<u32>,
    /// The Prometheus `/metrics` address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    /// The address `serve` answers on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api: Option<String>,
    /// Its log filter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    /// `"auto"`, `"uring"` or `"pread"`: how SSD copies are read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd_io: Option<String>,
    /// O_DIRECT for SSD copies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd_direct: Option<bool>,
    /// Its certificate (default `DIR/NAME.pem`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<String>,
    /// Its key (default `DIR/NAME.key`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<String>,
    /// `[[node.route]]`, one per table it reads.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub route: Vec<RouteEntry>,
    /// `[[node.link]]`, at most one per donor.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub link: Vec<LinkEntry>,
}

impl NodeEntry {
    /// Node `name` with `route` and every other key at its default.
    pub fn new(name: impl Into<String>, route: Vec<RouteEntry>) -> Self {
        Self {
            name: name.into(),
            route,
            ..Self::default()
        }
    }
}

/// One `[[node.route]]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouteEntry {
    /// The table it routes.
    pub table: u32,
    /// Donors by name, `"ssd"` or `"local"`, in order of preference.
    pub sources: Vec<String>,
    /// The SSD copy (default: the table's path).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd_path: Option<PathBuf>,
    /// Skip recomputing the copy's digest at startup.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trust_digest: Option<bool>,
    /// Deadline beyond the window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grace_us: Option<u64>,
    /// The route's hard timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hard_timeout_ms: Option<u64>,
    /// `"pNN"`, a duration or `"off"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hedge: Option<String>,
    /// `"fail"` or `"zeros"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// The SSD copy's I/O priority.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd_ioprio: Option<String>,
}

impl RouteEntry {
    /// Table `table` from `sources`, every other key at its default.
    pub fn new<S: Into<String>>(table: u32, sources: impl IntoIterator<Item = S>) -> Self {
        Self {
            table,
            sources: strings(sources),
            ..Self::default()
        }
    }

    /// This route with its SSD copy at `path`.
    pub fn ssd_path(self, path: impl Into<PathBuf>) -> Self {
        Self {
            ssd_path: Some(path.into()),
            ..self
        }
    }

    /// This route with hedging `hedge` (`"off"`, `"p99"`, `"2ms"`).
    pub fn hedge(self, hedge: impl Into<String>) -> Self {
        Self {
            hedge: Some(hedge.into()),
            ..self
        }
    }
}

/// One `[[node.link]]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LinkEntry {
    /// The donor it reaches.
    pub donor: String,
    /// The transport, when not the most secure the donor advertises.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// The connections' source IP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind: Option<String>,
    /// The interface the connections leave through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
}

impl LinkEntry {
    /// A link to `donor` over `transport`.
    pub fn new(donor: impl Into<String>, transport: impl Display) -> Self {
        Self {
            donor: donor.into(),
            transport: Some(transport.to_string()),
            ..Self::default()
        }
    }
}

/// `[model]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelSection {
    /// The model family (`deepseek_v41` when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
    /// A Qwen4Exp model's end-of-sequence id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_token: Option<u32>,
    /// A named hashing preset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hash_preset: Option<String>,
    /// The hashing's base (instead of a preset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hash_base: Option<u64>,
    /// A tokenizer file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// A token map file (instead of a tokenizer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_map: Option<String>,
    /// The compressed vocabulary's size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compressed_vocab: Option<u32>,
    /// The padding token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pad_token: Option<u32>,
    /// The hidden size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hidden: Option<u32>,
    /// Residual streams.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streams: Option<u32>,
    /// A fusion weights file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
    /// The seed of synthetic fusion weights (instead of a file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights_seed: Option<u64>,
    /// The fusion backend (`"cpu"`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fusion: Option<String>,
    /// The checkpoint's `config.json`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
}

impl ModelSection {
    /// Hashing base `hash_base`, synthetic weights from `weights_seed`,
    /// `hidden` wide with `streams` streams.
    pub fn synthetic(hash_base: u64, weights_seed: u64, hidden: u32, streams: u32) -> Self {
        Self {
            hash_base: Some(hash_base),
            weights_seed: Some(weights_seed),
            hidden: Some(hidden),
            streams: Some(streams),
            ..Self::default()
        }
    }
}

fn strings<S: Into<String>>(items: impl IntoIterator<Item = S>) -> Vec<String> {
    items.into_iter().map(Into::into).collect()
}
