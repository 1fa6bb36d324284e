//! `inference-node`: the GPU machine's side of engram-rack.
//!
//! What it is: the Engram memory client. `client` is the donor client (TCP,
//! handshake, pinned versions, pipelined lookups into caller buffers).
//!
//! What it is not: a donor. It shares only `engram-protocol` (the contract)
//! and `cluster-config` with `memory-donor`.

pub mod client;
pub mod rowlist;

pub use client::{ClientError, ClientOptions, DEFAULT_BUSY_POLL, DonorClient, Request};
