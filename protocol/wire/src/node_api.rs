//! The inference node daemon's API (`engram.node.v1`, compiled from
//! `proto/engram/node/v1/node.proto`): message types, the `EngramNode`
//! client (`engram_node_client::EngramNodeClient`) and server
//! (`engram_node_server::{EngramNode, EngramNodeServer}`). Only with the
//! `control` feature.

#![allow(missing_docs, missing_debug_implementations, unused_qualifications)]
#![allow(clippy::all, clippy::pedantic)]

tonic::include_proto!("engram.node.v1");

/// The fully qualified service name, as health checks name it.
pub const SERVICE_NAME: &str = "engram.node.v1.EngramNode";
