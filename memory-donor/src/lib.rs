//! `memory-donor`: keeps whole Engram tables resident in RAM and serves
//! batched row lookups to inference nodes.
//!
//! What it is: the table tools (`generate`, `pack`, and `table_file` for
//! reading, verifying and writing `.etab` files), the resident table store
//! (`resident`), and the TCP data plane (`server`: connection and handler
//! layers over the `engram-protocol` codec), wired together by `serve`.
//!
//! What it is not: the client. Inference nodes use `inference-node`; the
//! two crates share only `engram-protocol` and `cluster-config`.

pub mod generate;
pub mod pack;
pub mod progress;
pub mod resident;
pub mod serve;
pub mod server;
pub mod table_file;
