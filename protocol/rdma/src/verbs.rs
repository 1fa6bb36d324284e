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
    /// Bytes of the registered buffer READs land in.
    fn buffer_len(&self) -> usize;

    /// The buffer's bytes `offset .. offset + len`, once every READ into
    /// them has completed; `None` out of bounds. Only that range is
    /// borrowed: the NIC may still be writing other parts of the buffer
    /// (other reads in flight), which no reference may span.
    fn landed(&self, offset: usize, len: usize) -> Option<&[u8]>;

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

/// Which device a donor serves from, and its queue pairs' fabric
/// settings (the config's `[donor.rdma]`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceSpec {
    /// The device's name (`mlx5_0`); the one the `rdma://` address is on
    /// when `None` ([`Provider::device_of`]).
    pub device: Option<String>,
    /// The accepted queue pairs' settings (their traffic class: the READ
    /// responses travel in it).
    pub fabric: Fabric,
}

/// A queue pair's timing and class on the fabric. The defaults let a lost
/// packet be resent well inside a route's hard timeout (100 ms by
/// default): the connection manager's own default on RoCE waits about a
/// second before the first resend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fabric {
    /// How long the requester waits for an acknowledgement (a READ's
    /// response) before it resends; the verbs round it up to 4.096 us
    /// times a power of two ([`Fabric::ack_timeout_exponent`]).
    pub ack_timeout: Duration,
    /// Resends before the queue pair gives up (0 to 7).
    pub retry_count: u8,
    /// The packets' traffic class (the IP ToS byte on RoCE; the fabric's
    /// default when `None`).
    pub traffic_class: Option<u8>,
}

/// [`Fabric::ack_timeout`] unless the config says otherwise.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_millis(16);
/// [`Fabric::retry_count`] unless the config says otherwise (the most the
/// wire format allows).
pub const DEFAULT_RETRY_COUNT: u8 = 7;

impl Default for Fabric {
    fn default() -> Self {
        Self {
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            retry_count: DEFAULT_RETRY_COUNT,
            traffic_class: None,
        }
    }
}

impl Fabric {
    /// The verbs' encoding of [`Fabric::ack_timeout`]: the smallest `n`
    /// with 4.096 us x 2^n at least the timeout, from 1 to 31 (0 would
    /// mean "wait forever").
    pub fn ack_timeout_exponent(&self) -> u8 {
        let unit_ns = 4096u128;
        let want = self.ack_timeout.as_nanos();
        let mut n = 1u8;
        while n < 31 && (unit_ns << n) < want {
            n += 1;
        }
        n
    }

    /// The timeout the exponent stands for.
    pub fn effective_ack_timeout(&self) -> Duration {
        Duration::from_nanos(4096u64 << self.ack_timeout_exponent())
    }
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
    /// Its timing and class on the fabric (the donor's `[donor.rdma]`).
    pub fabric: Fabric,
}

/// A verbs implementation.
pub trait Provider: Send + Sync + fmt::Debug {
    /// Its name in logs (`fake`, `ibverbs`).
    fn name(&self) -> &'static str;

    /// The RDMA devices this host has (names); empty when it has none.
    fn devices(&self) -> Result<Vec<String>, VerbsError>;

    /// The device a donor listening at `addr` must register its memory
    /// on and listen with: the one the address is on (the connection
    /// manager accepts queue pairs there, and keys from another device's
    /// registration would not read). A spec naming another device is an
    /// error that says both; an address on no device (a wildcard) takes
    /// the named device, or the first.
    fn device_of(&self, addr: SocketAddr, spec: &DeviceSpec) -> Result<DeviceSpec, VerbsError>;

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

/// [`Provider::device_of`]'s rule, given the device `addr` is on (`None`:
/// a wildcard address, on no device) and the host's first device.
pub fn choose_device(
    addr: SocketAddr,
    on: Option<&str>,
    spec: &DeviceSpec,
    first: Option<&str>,
) -> Result<DeviceSpec, VerbsError> {
    let device = match (on, spec.device.as_deref()) {
        (Some(on), Some(named)) if on != named => {
            return Err(VerbsError::Invalid(format!(
                "rdma://{addr} is on device {on}, not on {named} (the config's [donor.rdma] \
                 device): name {on}, or remove the setting to use the address's device"
            )));
        }
        (Some(on), _) => on,
        (None, Some(named)) => named,
        (None, None) => first.ok_or_else(|| VerbsError::NoDevice(String::new()))?,
    };
    Ok(DeviceSpec {
        device: Some(device.to_string()),
        fabric: spec.fabric,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_is_the_addresss_and_a_named_other_one_is_refused() {
        let addr: SocketAddr = "10.0.0.7:7480".parse().expect("addr");
        let named = |d: &str| DeviceSpec {
            device: Some(d.into()),
            ..DeviceSpec::default()
        };
        let any = DeviceSpec::default();
        assert_eq!(
            choose_device(addr, Some("mlx5_1"), &any, Some("mlx5_0")),
            Ok(named("mlx5_1"))
        );
        assert_eq!(
            choose_device(addr, Some("mlx5_1"), &named("mlx5_1"), Some("mlx5_0")),
            Ok(named("mlx5_1"))
        );
        let e = choose_device(addr, Some("mlx5_1"), &named("mlx5_0"), Some("mlx5_0"))
            .expect_err("another device named");
        assert!(
            e.to_string()
                .contains("rdma://10.0.0.7:7480 is on device mlx5_1, not on mlx5_0"),
            "{e}"
        );
        // A wildcard address: the named device, else the first.
        assert_eq!(
            choose_device(addr, None, &named("mlx5_3"), Some("mlx5_0")),
            Ok(named("mlx5_3"))
        );
        assert_eq!(
            choose_device(addr, None, &any, Some("mlx5_0")),
            Ok(named("mlx5_0"))
        );
        assert!(matches!(
            choose_device(addr, None, &any, None),
            Err(VerbsError::NoDevice(_))
        ));
    }

    #[test]
    fn ack_timeouts_round_up_to_the_verbs_encoding() {
        let f = |ms: f64| Fabric {
            ack_timeout: Duration::from_secs_f64(ms / 1e3),
            ..Fabric::default()
        };
        // 4.096 us x 2^12 = 16.8 ms: the default.
        assert_eq!(Fabric::default().ack_timeout_exponent(), 12);
        assert_eq!(
            Fabric::default().effective_ack_timeout(),
            Duration::from_nanos(16_777_216)
        );
        assert_eq!(f(0.0).ack_timeout_exponent(), 1);
        assert_eq!(f(0.008).ack_timeout_exponent(), 1);
        assert_eq!(f(0.0083).ack_timeout_exponent(), 2);
        assert_eq!(f(100.0).ack_timeout_exponent(), 15);
        assert_eq!(f(1e9).ack_timeout_exponent(), 31);
    }
}
