//! `memory-donor`: keeps whole Engram tables resident in RAM and serves
//! batched row lookups to inference nodes.
//!
//! What it is: the table tools (`generate`, `pack`, and `table_file` for
//! reading, verifying and writing `.etab` files), the resident table store
//! (`resident`), the TCP data plane (`server`: connection and handler
//! layers over the `engram-protocol` codec), and the operations side: the
//! shared state (`status`, with the counters in `stats`), the gRPC control
//! plane (`control`) and the Prometheus metrics (`metrics`), all wired
//! together by `serve`; its loop (`supervise`) carries out reloads
//! (`reload`) and table hot swaps (`swap`) and proves the serving path
//! works before each systemd watchdog ping (`watchdog`).
//!
//! What it is not: the client. Inference nodes use `inference-node`; the
//! two crates share only `engram-protocol` and `cluster-config`.

pub mod checkpoint;
pub mod control;
pub mod generate;
pub mod metrics;
pub mod pack;
pub mod progress;
pub mod reload;
pub mod resident;
pub mod serve;
pub mod server;
pub mod stats;
pub mod status;
pub mod supervise;
pub mod swap;
pub mod table_file;
pub mod watchdog;
