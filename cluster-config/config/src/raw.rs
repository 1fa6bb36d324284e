//! The config file as written: serde structs that keep every value's span,
//! so validation can point at the line. Numbers are read as i64 and range-
//! checked by `validate`, which gives better messages than a type error.

use serde::Deserialize;
use toml::Spanned;

pub(crate) type S<T> = Spanned<T>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    pub version: S<i64>,
    pub rack: S<RawRack>,
    #[serde(default, rename = "table")]
    pub tables: Vec<S<RawTable>>,
    #[serde(default, rename = "donor")]
    pub donors: Vec<S<RawDonor>>,
    #[serde(default, rename = "node")]
    pub nodes: Vec<S<RawNode>>,
    pub model: Option<S<crate::model::RawModel>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRack {
    pub name: S<String>,
    pub credential_file: Option<S<String>>,
    pub plaintext: Option<S<String>>,
    pub tls: Option<S<RawTls>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTls {
    pub dir: Option<S<String>>,
    pub ca: Option<S<String>>,
    #[serde(default)]
    pub operators: Vec<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTable {
    pub id: S<i64>,
    pub layer: S<i64>,
    pub path: S<String>,
    pub rows: S<i64>,
    pub digest: S<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDonor {
    pub name: S<String>,
    pub listen: S<Vec<S<String>>>,
    pub advertise: Option<S<Vec<S<String>>>>,
    pub tables: S<Vec<S<i64>>>,
    pub ram_gib: S<f64>,
    pub headroom_gib: Option<S<f64>>,
    pub log_level: Option<S<String>>,
    pub max_connections: Option<S<i64>>,
    pub max_rows: Option<S<i64>>,
    pub mlock: Option<S<String>>,
    pub trust_digest: Option<bool>,
    pub fd_store: Option<bool>,
    pub map_files: Option<bool>,
    pub load_threads: Option<S<i64>>,
    pub busy_poll_us: Option<S<i64>>,
    pub hello_timeout_ms: Option<S<i64>>,
    pub idle_timeout_ms: Option<S<i64>>,
    pub write_timeout_ms: Option<S<i64>>,
    pub drain_timeout_ms: Option<S<i64>>,
    pub control: Option<S<String>>,
    pub metrics: Option<S<String>>,
    pub clients: Option<S<Vec<S<String>>>>,
    pub host_uids: Option<S<Vec<S<i64>>>>,
    pub host_gids: Option<S<Vec<S<i64>>>>,
    pub numa_node: Option<S<i64>>,
    pub table_dir: Option<S<String>>,
    pub tls_cert: Option<S<String>>,
    pub tls_key: Option<S<String>>,
    pub rdma: Option<S<RawRdma>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRdma {
    pub device: Option<S<String>>,
    pub port: Option<S<i64>>,
    pub gid_index: Option<S<i64>>,
    pub ack_timeout_ms: Option<S<i64>>,
    pub retry_count: Option<S<i64>>,
    pub traffic_class: Option<S<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLink {
    pub donor: S<String>,
    pub transport: Option<S<String>>,
    pub bind: Option<S<String>>,
    pub interface: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNode {
    pub name: S<String>,
    pub connect_timeout_ms: Option<S<i64>>,
    pub lookup_timeout_ms: Option<S<i64>>,
    pub tokens_per_second: Option<S<f64>>,
    pub probe_interval_ms: Option<S<i64>>,
    pub breaker_failures: Option<S<i64>>,
    pub max_batch: Option<S<i64>>,
    pub prefill_budget: Option<S<i64>>,
    pub metrics: Option<S<String>>,
    pub api: Option<S<String>>,
    pub log_level: Option<S<String>>,
    pub ssd_io: Option<S<String>>,
    pub ssd_direct: Option<bool>,
    #[serde(default, rename = "route")]
    pub routes: Vec<S<RawRoute>>,
    #[serde(default, rename = "link")]
    pub links: Vec<S<RawLink>>,
    pub tls_cert: Option<S<String>>,
    pub tls_key: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRoute {
    pub table: S<i64>,
    pub sources: S<Vec<S<String>>>,
    pub ssd_path: Option<S<String>>,
    pub trust_digest: Option<bool>,
    pub grace_us: Option<S<i64>>,
    pub hard_timeout_ms: Option<S<i64>>,
    pub hedge: Option<S<String>>,
    pub policy: Option<S<String>>,
    pub ssd_ioprio: Option<S<String>>,
}
