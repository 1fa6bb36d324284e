//! The verbs this crate needs, as traits: a [`Provider`] registers donor
//! memory for remote reads, listens for queue pairs, and connects a node's
//! queue pair; a [`QueuePair`] posts RDMA READs into its own registered
//! buffer and reports their completions. Two providers implement them: the
//! fake one (`fake`, in-process memory with fault injection) and the real
//! one (`ibv`, libibverbs and librdmacm, behind the `verbs` feature).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

/// Why a verbs call failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VerbsError {
    /// No RDMA device on this host (or none with the name asked for).
    #[error("no RDMA device found{0}")]
    NoDevice(String),
    /// This build or provider cannot do it.
    #[error("{0}")]
    Unsupported(String),
    /// The peer refused the queue pair (a bad or expired token, no listener).
    #[error("connection refused: {0}")]
    Refused(String),
    /// The peer did not answer in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The queue pair is in the error state: every later post fails.
    #[error("queue pair dead: {0}")]
    Dead(String),
    /// A request that can never work (a work request outside the buffer).
    #[error("invalid: {0}")]
    Invalid(String),
    /// Any other failure of the verbs library.
    #[error("{0}")]
    Io(String),
}

/// Memory a donor makes remotely readable. It stays alive (and at the same
/// address) for as long as the registration holds it.
pub trait Memory: Send + Sync + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

impl<T: AsRef<[u8]> + Send + Sync + 'static> Memory for T {
    fn bytes(&self) -> &[u8] {
        self.as_ref()
    }
}

/// Where registered memory is, as a remote peer addresses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    /// The virtual address of its first byte.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The key a peer presents to read it.
    pub rkey: u32,
}

/// A live registration: dropping it deregisters the memory, after which a
/// READ with its key fails with a remote access error.
pub trait Registration: Send + Sync + fmt::Debug {
    /// Where it is.
    fn remote(&self) -> Remote;
}

/// One RDMA READ: `len` bytes at `remote_addr` (under `rkey`) into the
/// queue pair's buffer at `local_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadWr {
    /// Echoed in its completion.
    pub wr_id: u64,
    /// Offset in the queue pair's registered buffer.
    pub local_offset: usize,
    /// Bytes to read.
    pub len: u32,
    /// Remote virtual address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Whether its success produces a completion (failures always do).
    pub signaled: bool,
}

/// How a work request ended (the verbs work completion status, reduced to
/// what the core tells apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// The remote key or range is not (or no longer) valid: a revoked region.
    RemoteAccess,
    /// The remote side rejected the request as invalid.
    RemoteInvalidRequest,
    /// The remote side failed to carry it out.
    RemoteOperation,
    /// The transport gave up retrying (the peer is gone).
    RetryExceeded,
    /// Flushed: the queue pair went to the error state before it ran.
    Flushed,
    /// A local protection or length error (a bug on this side).
    LocalError,
    /// Any other status code.
    Other(u32),
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
}

/// A connected queue pair with its registered receive buffer. One user at
/// a time (`&mut self`); the node keeps it behind a lock.
pub trait QueuePair: Send + fmt::Debug {
    /// The registered buffer READs land in.
    fn buffer(&self) -> &[u8];

    /// Send queue depth: the most work requests outstanding at once.
    fn send_depth(&self) -> usize;

    /// Post `wrs` as one chain with one doorbell.
    fn post_reads(&mut self, wrs: &[ReadWr]) -> Result<(), VerbsError>;

    /// Append up to `max` completions to `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError>;
}

/// Decides whether a connecting queue pair may in, from the private data it
/// sent (the token it was given over the authenticated channel):
/// `Some(key)` admits it under `key` (the name [`Listener::disconnect`]
/// cuts it by), `None` refuses it.
pub type Admit = Arc<dyn Fn(&[u8]) -> Option<u64> + Send + Sync>;

/// A donor's listener for queue pairs; dropping it stops accepting (queue
/// pairs already connected stay).
pub trait Listener: Send + fmt::Debug {
    /// The address it listens on.
    fn local_addr(&self) -> SocketAddr;

    /// Disconnect the accepted queue pairs admitted under `keys` (keys of
    /// queue pairs already gone are skipped). The peer's next READ fails.
    fn disconnect(&self, keys: &[u64]);
}

/// Which device and port a donor serves from (the config's `[donor.rdma]`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceSpec {
    /// The device's name (`mlx5_0`); any device when `None`.
    pub device: Option<String>,
    /// The device's port, from 1.
    pub port: u8,
    /// The GID index (RoCE); the connection manager's choice when `None`.
    pub gid_index: Option<u8>,
}

/// How a node's queue pair is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpOptions {
    /// Send queue depth (work requests outstanding).
    pub send_depth: usize,
    /// Bytes of registered buffer READs land in.
    pub buffer_bytes: usize,
    /// Time allowed to resolve, connect and be accepted.
    pub connect_timeout: Duration,
}

/// A verbs implementation.
pub trait Provider: Send + Sync + fmt::Debug {
    /// Its name in logs (`fake`, `ibverbs`).
    fn name(&self) -> &'static str;

    /// The RDMA devices this host has (names); empty when it has none.
    fn devices(&self) -> Result<Vec<String>, VerbsError>;

    /// Register `memory` for remote READs on the device `spec` names.
    fn register(
        &self,
        spec: &DeviceSpec,
        memory: Arc<dyn Memory>,
    ) -> Result<Box<dyn Registration>, VerbsError>;

    /// Accept queue pairs at `addr` that `admit` lets in.
    fn listen(
        &self,
        addr: SocketAddr,
        spec: &DeviceSpec,
        admit: Admit,
    ) -> Result<Box<dyn Listener>, VerbsError>;

    /// A queue pair to the listener at `addr`, presenting `private` (the
    /// token). Blocks up to `opts.connect_timeout`.
    fn connect(
        &self,
        addr: SocketAddr,
        private: &[u8],
        opts: &QpOptions,
    ) -> Result<Box<dyn QueuePair>, VerbsError>;
}
