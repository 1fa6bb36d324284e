//! `memory-donor`: keeps whole Engram tables resident in RAM and serves
//! batched row lookups to inference nodes.
//!
//! What it is: the daemon over the table store (`engram-store`, which
//! holds the table files, resident tables and the table tools' logic): the
//! data plane (`server`: TCP, TLS and QUIC connections, the host socket,
//! and the handler over the `engram-protocol` codec), and the operations
//! side. A start reads what to serve (`spec`), loads it (`load`, taking
//! copies kept in systemd's fd store, `fdstore`), and `daemon` wires the
//! rest: the shared state (`status`, with the counters in `stats`), the
//! gRPC control plane (`control`), the Prometheus metrics (`metrics`) and
//! the loop (`supervise`) that carries out the orders (`orders`: reloads,
//! `reload`, and table hot swaps, `swap`) and proves the serving path works
//! before each systemd watchdog ping (`watchdog`). With an `rdma://`
//! address, `rdma` registers the tables for one-sided reads.
//!
//! What it is not: the client. Inference nodes use `inference-node`; the
//! two daemons share only `engram-protocol`, `engram-store`, `engram-rdma`,
//! `engram-sync`, `cluster-config` and `daemon-runtime`, and never depend
//! on each other.

#![warn(missing_docs)]

pub mod control;
pub mod daemon;
pub mod fdstore;
pub mod load;
pub mod metrics;
pub mod orders;
pub mod rdma;
pub mod reload;
pub mod server;
pub mod spec;
pub mod stats;
pub mod status;
pub mod supervise;
pub mod swap;
pub mod tls;
pub mod watchdog;
