//! The config file as written: serde structs that keep every value's span,
//! so validation can point at the line. Numbers are read as i64 and range-
//! checked by `validate`, which gives better messages than a type error.

use serde::Deserialize;
use toml::Spanned;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    pub version: Spanned<i64>,
    pub rack: Spanned<RawRack>,
    #[serde(default, rename = "table")]
    pub tables: Vec<Spanned<RawTable>>,
    #[serde(default, rename = "donor")]
    pub donors: Vec<Spanned<RawDonor>>,
    #[serde(default, rename = "node")]
    pub nodes: Vec<Spanned<RawNode>>,
    pub model: Option<Spanned<RawModel>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRack {
    pub name: Spanned<String>,
    pub credential_file: Option<Spanned<String>>,
    pub plaintext: Option<Spanned<String>>,
    pub tls: Option<Spanned<RawTls>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTls {
    pub dir: Option<Spanned<String>>,
    pub ca: Option<Spanned<String>>,
    #[serde(default)]
    pub operators: Vec<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTable {
    pub id: Spanned<i64>,
    pub layer: Spanned<i64>,
    pub path: Spanned<String>,
    pub rows: Spanned<i64>,
    pub digest: Spanned<String>,
    pub encoding: Option<Spanned<String>>,
    pub tensor_scale: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDonor {
    pub name: Spanned<String>,
    pub listen: Spanned<Vec<Spanned<String>>>,
    pub advertise: Option<Spanned<Vec<Spanned<String>>>>,
    pub tables: Spanned<Vec<Spanned<i64>>>,
    pub ram_gib: Spanned<f64>,
    pub headroom_gib: Option<Spanned<f64>>,
    pub log_level: Option<Spanned<String>>,
    pub max_connections: Option<Spanned<i64>>,
    pub max_rows: Option<Spanned<i64>>,
    pub mlock: Option<Spanned<String>>,
    pub trust_digest: Option<bool>,
    pub fd_store: Option<bool>,
    pub map_files: Option<bool>,
    pub load_threads: Option<Spanned<i64>>,
    pub busy_poll_us: Option<Spanned<i64>>,
    pub hello_timeout_ms: Option<Spanned<i64>>,
    pub idle_timeout_ms: Option<Spanned<i64>>,
    pub write_timeout_ms: Option<Spanned<i64>>,
    pub drain_timeout_ms: Option<Spanned<i64>>,
    pub control: Option<Spanned<String>>,
    pub metrics: Option<Spanned<String>>,
    pub clients: Option<Spanned<Vec<Spanned<String>>>>,
    pub host_uids: Option<Spanned<Vec<Spanned<i64>>>>,
    pub host_gids: Option<Spanned<Vec<Spanned<i64>>>>,
    pub numa_node: Option<Spanned<i64>>,
    pub host_layout: Option<Spanned<String>>,
    pub table_dir: Option<Spanned<String>>,
    pub tls_cert: Option<Spanned<String>>,
    pub tls_key: Option<Spanned<String>>,
    pub rdma: Option<Spanned<RawRdma>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRdma {
    pub device: Option<Spanned<String>>,
    pub port: Option<Spanned<i64>>,
    pub gid_index: Option<Spanned<i64>>,
    pub ack_timeout_ms: Option<Spanned<i64>>,
    pub retry_count: Option<Spanned<i64>>,
    pub traffic_class: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLink {
    pub donor: Spanned<String>,
    pub transport: Option<Spanned<String>>,
    pub bind: Option<Spanned<String>>,
    pub interface: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNode {
    pub name: Spanned<String>,
    pub connect_timeout_ms: Option<Spanned<i64>>,
    pub lookup_timeout_ms: Option<Spanned<i64>>,
    pub tokens_per_second: Option<Spanned<f64>>,
    pub probe_interval_ms: Option<Spanned<i64>>,
    pub breaker_failures: Option<Spanned<i64>>,
    pub max_batch: Option<Spanned<i64>>,
    pub prefill_budget: Option<Spanned<i64>>,
    pub metrics: Option<Spanned<String>>,
    pub api: Option<Spanned<String>>,
    pub log_level: Option<Spanned<String>>,
    pub ssd_io: Option<Spanned<String>>,
    pub ssd_direct: Option<bool>,
    #[serde(default, rename = "route")]
    pub routes: Vec<Spanned<RawRoute>>,
    #[serde(default, rename = "link")]
    pub links: Vec<Spanned<RawLink>>,
    pub tls_cert: Option<Spanned<String>>,
    pub tls_key: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRoute {
    pub table: Spanned<i64>,
    pub sources: Spanned<Vec<Spanned<String>>>,
    pub ssd_path: Option<Spanned<String>>,
    pub trust_digest: Option<bool>,
    pub grace_us: Option<Spanned<i64>>,
    pub hard_timeout_ms: Option<Spanned<i64>>,
    pub hedge: Option<Spanned<String>>,
    pub policy: Option<Spanned<String>>,
    pub ssd_ioprio: Option<Spanned<String>>,
}

/// `[model]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawModel {
    pub family: Option<Spanned<String>>,
    pub eos_token: Option<Spanned<i64>>,
    pub hash_preset: Option<Spanned<String>>,
    pub hash_base: Option<Spanned<i64>>,
    pub tokenizer: Option<Spanned<String>>,
    pub token_map: Option<Spanned<String>>,
    pub compressed_vocab: Option<Spanned<i64>>,
    pub pad_token: Option<Spanned<i64>>,
    pub hidden: Option<Spanned<i64>>,
    pub streams: Option<Spanned<i64>>,
    pub weights: Option<Spanned<String>>,
    pub weights_seed: Option<Spanned<i64>>,
    pub fusion: Option<Spanned<String>>,
    pub config: Option<Spanned<String>>,
}
