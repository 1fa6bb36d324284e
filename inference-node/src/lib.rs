//! `inference-node`: the GPU machine's side of engram-rack.
//!
//! What it is: the Engram memory client and the Engram math. `client` is the
//! donor client (TCP, handshake, pinned versions, pipelined lookups into
//! caller buffers); `engram` computes what the model computes (token map,
//! row addresses, dequantization, fusion on CPU or GPU).
//!
//! What it is not: a donor. It shares only `engram-protocol` (the contract)
//! and `cluster-config` with `memory-donor`.

pub mod client;
pub mod engram;
pub mod rowlist;

pub use client::{ClientError, ClientOptions, DEFAULT_BUSY_POLL, DonorClient, Request};
