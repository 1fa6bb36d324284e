//! The donor's control plane (`engram.control.v1`, compiled from
//! `proto/engram/control/v1/control.proto`): message types, the
//! `DonorControl` client (`donor_control_client::DonorControlClient`) and
//! server (`donor_control_server::{DonorControl, DonorControlServer}`).
//! Only with the `control` feature; the codec above never needs it.
//!
//! The health service beside it is the standard `grpc.health.v1` one
//! (crate `tonic-health`); [`SERVICE_NAME`] is the name it reports
//! `DonorControl` under.

#![allow(missing_docs, missing_debug_implementations, unused_qualifications)]
#![allow(clippy::all, clippy::pedantic)]

tonic::include_proto!("engram.control.v1");

/// The fully qualified service name, as health checks name it.
pub const SERVICE_NAME: &str = "engram.control.v1.DonorControl";

impl LoadState {
    /// The lowercase name used in metrics and logs (`loading`, `ready`, ...).
    pub fn label(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::Loading => "loading",
            Self::Verifying => "verifying",
            Self::Ready => "ready",
            Self::Failed => "failed",
        }
    }
}
