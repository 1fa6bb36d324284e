//! `inference-node`: the GPU machine's side of engram-rack.
//!
//! What it is: the Engram memory client and the Engram math. `client` is the
//! donor client (TCP, TLS or QUIC; handshake, pinned versions, pipelined
//! lookups into caller buffers); `source` puts every place rows can come from (local RAM,
//! donors, the SSD copy) behind one trait; `router` picks among a table's
//! sources per lookup, with deadlines, hedging, circuit breakers, probes and
//! the table's policy when everything fails; `engram` computes what the
//! model computes (token map, row addresses, dequantization, fusion on CPU
//! or GPU).
//!
//! What it is not: a donor. It shares the table library (`engram-store`)
//! with the donor, for the table loader and file reader (so the node loads
//! and verifies a local copy exactly as a donor does); neither daemon
//! depends on the other.

#![warn(missing_docs)]

pub mod canary;
pub mod client;
pub mod daemon;
pub mod embed;
pub mod engines;
pub mod engram;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod ring;
pub mod router;
pub mod rowlist;
pub mod source;
pub mod timer;
pub mod tls;

pub use client::{ClientError, ClientOptions, DEFAULT_BUSY_POLL, DonorClient, Request};
