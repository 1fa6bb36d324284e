//! `memory-donor`: keeps whole Engram tables resident in RAM and serves
//! batched row lookups to inference nodes.
//!
//! What it is: the daemon over the table store (`engram-store`, which
//! holds the table files, resident tables and the table tools' logic): the
//! TCP data plane (`server`: connection and handler
//! layers over the `engram-protocol` codec), and the operations side: the
//! shared state (`status`, with the counters in `stats`), the gRPC control
//! plane (`control`) and the Prometheus metrics (`metrics`), all wired
//! together by `serve`; its loop (`supervise`) carries out reloads
//! (`reload`) and table hot swaps (`swap`) and proves the serving path
//! works before each systemd watchdog ping (`watchdog`). With an `rdma://`
//! address, `rdma` registers the tables for one-sided reads.
//!
//! What it is not: the client. Inference nodes use `inference-node`; the
//! two daemons share only `engram-protocol`, `engram-store` and
//! `cluster-config`, and never depend on each other.

pub mod control;
pub mod fdstore;
pub mod metrics;
pub mod rdma;
pub mod reload;
pub mod serve;
pub mod server;
pub mod stats;
pub mod status;
pub mod supervise;
pub mod swap;
pub mod tls;
pub mod watchdog;
