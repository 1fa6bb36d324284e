//! `engram-rdma`: one-sided RDMA READs of donor rows.
//!
//! What it is: the verbs it needs as traits (`verbs`); the row check words
//! that stand in for the data plane's per-answer checksum (`check`); a
//! sans-IO core (`plan`: work requests, doorbells, completion matching,
//! fault mapping, verification; `reader`: buffer slots over a queue pair
//! and the node's session state machine: learn, connect, read, back off);
//! the donor's region book (`book`: registrations per table version, queue
//! pair tokens); a fake provider with fault injection (`fake`); and, with
//! the `verbs` feature, the real provider on libibverbs and librdmacm
//! (`ibv`). `provider` picks the provider a process uses.
//!
//! What it is not: it opens no TCP connection and knows nothing of TLS;
//! the daemons carry the Region exchange over their authenticated data
//! plane (PROTOCOL.md section 3.10).

#![warn(missing_docs)]

pub mod book;
pub mod check;
pub mod fake;
#[cfg(feature = "verbs")]
pub mod ibv;
pub mod plan;
pub mod reader;
pub mod verbs;

use std::sync::{Arc, OnceLock};

use verbs::{Provider, VerbsError};

static INSTALLED: OnceLock<Arc<dyn Provider>> = OnceLock::new();

/// Make `provider` the one this process uses (the tests and the benchmark
/// install the fake one). Fails when one was installed already.
pub fn install(provider: Arc<dyn Provider>) -> Result<(), Arc<dyn Provider>> {
    INSTALLED.set(provider)
}

/// The provider this process uses: the installed one, else the real one
/// (when built with the `verbs` feature and the host has a device).
pub fn provider() -> Result<Arc<dyn Provider>, VerbsError> {
    if let Some(p) = INSTALLED.get() {
        return Ok(Arc::clone(p));
    }
    system_provider()
}

#[cfg(feature = "verbs")]
fn system_provider() -> Result<Arc<dyn Provider>, VerbsError> {
    static SYSTEM: OnceLock<Result<Arc<dyn Provider>, VerbsError>> = OnceLock::new();
    SYSTEM
        .get_or_init(|| ibv::IbvProvider::open().map(|p| Arc::new(p) as Arc<dyn Provider>))
        .clone()
}

#[cfg(not(feature = "verbs"))]
fn system_provider() -> Result<Arc<dyn Provider>, VerbsError> {
    Err(VerbsError::Unsupported(
        "this build has no RDMA support (built without the `rdma` feature)".into(),
    ))
}

/// True when this build carries the real provider.
pub const HAS_VERBS: bool = cfg!(feature = "verbs");
