//! The real verbs provider: libibverbs and librdmacm through `rdma-sys`.
//!
//! Devices come from `rdma_get_devices`, so the `ibv_context` a donor
//! registers memory on is the very one the connection manager reports for
//! queue pairs accepted on that device, and both use one protection domain
//! per device (allocated on first use). The donor's listener runs the
//! connection manager's event loop on a thread of its own; a node's queue
//! pair owns its event channel, protection domain, completion queue and
//! registered buffer.
//!
//! The connection manager picks the device, port and GID from the address
//! bound or resolved: [`Provider::device_of`] binds a connection manager id
//! to the donor's `rdma://` address and names the device it lands on, and
//! the donor registers and listens there. A listener refuses queue pairs
//! that arrive on another device (memory registered there would not be
//! readable with the keys it hands out).
//!
//! The private data of a connection request travels as one length byte and
//! the token: InfiniBand and RoCE pad it to a fixed size on the wire, so the
//! listener could not otherwise tell the token's end.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::ffi::CStr;
use std::fmt;
use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::raw::{c_int, c_void};
use std::panic::{self, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use engram_sync::Mutex;
use rdma_sys as sys;
use sys::rdma_cm_event_type as ev;

use crate::verbs::{
    Admit, Completion, DeviceSpec, Fabric, Listener, Memory, Provider, QpOptions, QueuePair,
    ReadWr, Registration, Remote, VerbsError, WcStatus,
};

/// The most private data an RC connection request carries (InfiniBand CM).
const MAX_PRIVATE_DATA: usize = 56;
/// The most token bytes: the private data less its length byte.
pub const MAX_TOKEN: usize = MAX_PRIVATE_DATA - 1;
/// Cap on outstanding RDMA READs per queue pair (initiator / responder).
const MAX_RD_ATOM: c_int = 16;
/// How often the listener's thread looks at its stop flag.
const LISTEN_TICK: Duration = Duration::from_millis(100);
/// How long dropping a listener waits for its port to be released.
const RELEASE_WAIT: Duration = Duration::from_secs(2);
/// Completions taken per `ibv_poll_cq` call.
const WC_BATCH: usize = 32;
/// RNR retries (7: "forever"; READs post no receives, so never used).
const RNR_RETRIES: u8 = 7;
/// `rdma_set_option` levels and names (`rdma/rdma_cma.h`; anonymous
/// enums there, so not in the generated bindings).
const RDMA_OPTION_ID: c_int = 0;
const RDMA_OPTION_ID_TOS: c_int = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: c_int = 3;

/// Set a one-byte connection manager option on `id`.
fn set_u8_option(
    id: *mut sys::rdma_cm_id,
    name: c_int,
    value: u8,
    what: &str,
) -> Result<(), VerbsError> {
    let mut v = value;
    // SAFETY: a live id; the option value is one byte the call only reads.
    let rc =
        unsafe { sys::rdma_set_option(id, RDMA_OPTION_ID, name, ptr::addr_of_mut!(v).cast(), 1) };
    check(rc, format_args!("rdma_set_option({what} = {value})"))
}

/// The traffic class `fabric` asks for, on `id` (before its route is
/// resolved, or before an accepted id is accepted).
fn set_traffic_class(id: *mut sys::rdma_cm_id, fabric: &Fabric) -> Result<(), VerbsError> {
    match fabric.traffic_class {
        Some(tos) => set_u8_option(id, RDMA_OPTION_ID_TOS, tos, "type of service"),
        None => Ok(()),
    }
}

/// The error of a failed C call, from `errno` (read before anything else).
fn os_err(what: fmt::Arguments<'_>) -> VerbsError {
    let e = io::Error::last_os_error();
    VerbsError::Io(format!("{what}: {e}"))
}

/// `Ok` when a C call returned 0, else the error in `errno`.
fn check(rc: c_int, what: fmt::Arguments<'_>) -> Result<(), VerbsError> {
    if rc == 0 { Ok(()) } else { Err(os_err(what)) }
}

/// `p` unless it is NULL, else the error in `errno`.
fn non_null<T>(p: *mut T, what: fmt::Arguments<'_>) -> Result<*mut T, VerbsError> {
    if p.is_null() {
        Err(os_err(what))
    } else {
        Ok(p)
    }
}

/// The connection manager's name for an event type.
fn event_name(kind: ev::Type) -> String {
    // SAFETY: rdma_event_str takes any value and returns a pointer to a
    // static NUL-terminated string (or NULL, checked).
    let s = unsafe { sys::rdma_event_str(kind) };
    if s.is_null() {
        return format!("event {kind}");
    }
    // SAFETY: non-null and NUL-terminated, with static lifetime.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// An all-zero value of a C struct of integers, raw pointers and unions of
/// those.
///
/// # Safety
/// All-zero bytes must be a valid `T`.
unsafe fn zeroed<T>() -> T {
    // SAFETY: the caller promises all-zero is a valid T.
    unsafe { MaybeUninit::<T>::zeroed().assume_init() }
}

/// Frames a token as private data: its length, then its bytes.
fn frame_private(token: &[u8]) -> Result<Vec<u8>, VerbsError> {
    let len = u8::try_from(token.len())
        .ok()
        .filter(|&n| usize::from(n) <= MAX_TOKEN)
        .ok_or_else(|| {
            VerbsError::Invalid(format!(
                "private data of {} bytes (at most {MAX_TOKEN})",
                token.len()
            ))
        })?;
    let mut out = Vec::with_capacity(token.len() + 1);
    out.push(len);
    out.extend_from_slice(token);
    Ok(out)
}

/// The token in received private data, if it is well framed.
fn unframe_private(data: &[u8]) -> Option<&[u8]> {
    let (&len, rest) = data.split_first()?;
    rest.get(..usize::from(len))
}

/// The work completion status, as the core tells them apart.
fn map_status(code: sys::ibv_wc_status::Type) -> WcStatus {
    use sys::ibv_wc_status as s;
    match code {
        s::IBV_WC_SUCCESS => WcStatus::Success,
        s::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        s::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        s::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
        s::IBV_WC_RETRY_EXC_ERR | s::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        s::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        s::IBV_WC_LOC_PROT_ERR | s::IBV_WC_LOC_LEN_ERR | s::IBV_WC_LOC_QP_OP_ERR => {
            WcStatus::LocalError
        }
        other => WcStatus::Other(other),
    }
}

/// Outstanding READs to allow: what the peer asked for (all we can give
/// when it asked for none), within the device's limit and [`MAX_RD_ATOM`].
fn rd_atom(requested: u8, device_max: c_int) -> u8 {
    let wanted = if requested == 0 {
        MAX_RD_ATOM
    } else {
        c_int::from(requested)
    };
    let n = wanted.min(device_max).clamp(0, MAX_RD_ATOM);
    u8::try_from(n).unwrap_or(0)
}

/// Milliseconds left before `deadline` (at least 1), or `None` once past.
fn millis_left(deadline: Instant) -> Option<c_int> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return None;
    }
    let ms = left.as_millis().saturating_add(1);
    Some(c_int::try_from(ms).unwrap_or(c_int::MAX))
}

/// Waits up to `timeout_ms` for `fd` to be readable; `Ok(false)` on timeout
/// or interruption.
fn wait_readable(fd: c_int, timeout_ms: c_int) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, the length passed is 1.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    if rc > 0 && pfd.revents & libc::POLLIN == 0 {
        return Err(io::Error::other(format!(
            "event channel poll: revents {:#x}",
            pfd.revents
        )));
    }
    Ok(rc > 0)
}

fn to_sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain integers; all-zero is valid.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let base = ptr::addr_of_mut!(storage);
    match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any
            // socket address; `base` is valid for writes and unaliased.
            let sin = unsafe { &mut *base.cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *base.cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
        }
    }
    storage
}

fn from_sockaddr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    let base = ptr::from_ref(storage);
    match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says it holds a sockaddr_in, which fits.
            let sin = unsafe { &*base.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it holds a sockaddr_in6, which fits.
            let s = unsafe { &*base.cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(s.sin6_addr.s6_addr);
            let port = u16::from_be(s.sin6_port);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                port,
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// One RDMA device, as librdmacm opened it.
struct Device {
    name: String,
    ctx: *mut sys::ibv_context,
    /// The device's protection domain, allocated on first use.
    pd: Mutex<*mut sys::ibv_pd>,
    /// The completion queue every queue pair a listener accepts on this
    /// device shares, made on first use.
    cq: Mutex<*mut sys::ibv_cq>,
    max_rd_atom: c_int,
}

impl Device {
    fn pd(&self) -> Result<*mut sys::ibv_pd, VerbsError> {
        let mut pd = self.pd.lock();
        if pd.is_null() {
            // SAFETY: ctx is a live context from rdma_get_devices.
            let new = unsafe { sys::ibv_alloc_pd(self.ctx) };
            *pd = non_null(new, format_args!("ibv_alloc_pd on {}", self.name))?;
        }
        Ok(*pd)
    }

    fn cq(&self) -> Result<*mut sys::ibv_cq, VerbsError> {
        let mut cq = self.cq.lock();
        if cq.is_null() {
            // SAFETY: ctx is a live context; no completion channel.
            let new = unsafe {
                sys::ibv_create_cq(self.ctx, SHARED_CQE, ptr::null_mut(), ptr::null_mut(), 0)
            };
            *cq = non_null(new, format_args!("ibv_create_cq on {}", self.name))?;
        }
        Ok(*cq)
    }
}

/// Entries of the CQ a device's accepted queue pairs share (they post no
/// work; a flushed receive is the most one could ever produce).
const SHARED_CQE: c_int = 64;

/// The device list and the protection domains, shared by the provider and
/// everything it made (registrations and accepted queue pairs keep the
/// protection domain alive).
struct Shared {
    list: *mut *mut sys::ibv_context,
    devices: Vec<Device>,
}

// SAFETY: the contexts belong to librdmacm for the life of the process and
// the verbs called on them (alloc_pd, reg_mr, dealloc_pd) are thread safe;
// the protection domain pointers are only written under their mutex.
unsafe impl Send for Shared {}
// SAFETY: as for Send; nothing is mutated through `&Shared` but the
// mutex-guarded protection domains.
unsafe impl Sync for Shared {}

impl Shared {
    /// The device `spec` names (the first when it names none).
    fn pick(&self, spec: &DeviceSpec) -> Result<(usize, &Device), VerbsError> {
        match &spec.device {
            Some(name) => self
                .devices
                .iter()
                .enumerate()
                .find(|(_, d)| d.name == *name)
                .ok_or_else(|| VerbsError::NoDevice(format!(" named {name}"))),
            None => self
                .devices
                .first()
                .map(|d| (0, d))
                .ok_or_else(|| VerbsError::NoDevice(String::new())),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for d in &mut self.devices {
            let cq = *d.cq.get_mut();
            // SAFETY: every accepted queue pair on this CQ holds an
            // Arc<Shared> (through its listener), so none is left.
            if !cq.is_null() && unsafe { sys::ibv_destroy_cq(cq) } != 0 {
                tracing::warn!(device = %d.name, "ibv_destroy_cq failed");
            }
            let pd = *d.pd.get_mut();
            if !pd.is_null() {
                // SAFETY: every registration and queue pair on this PD holds
                // an Arc<Shared>, so none is left.
                if unsafe { sys::ibv_dealloc_pd(pd) } != 0 {
                    tracing::warn!(device = %d.name, "ibv_dealloc_pd failed");
                }
            }
        }
        // SAFETY: the list came from rdma_get_devices and is freed once.
        unsafe { sys::rdma_free_devices(self.list) };
    }
}

/// The provider on libibverbs and librdmacm.
pub struct IbvProvider {
    shared: Arc<Shared>,
}

impl fmt::Debug for IbvProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self
            .shared
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        f.debug_struct("IbvProvider")
            .field("devices", &names)
            .finish()
    }
}

impl IbvProvider {
    /// Opens the host's RDMA devices; [`VerbsError::NoDevice`] when it has
    /// none (or no RDMA support in the kernel).
    pub fn open() -> Result<Self, VerbsError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer; the call returns NULL or a
        // NULL-terminated array that rdma_free_devices releases.
        let list = unsafe { sys::rdma_get_devices(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            return Err(VerbsError::NoDevice(format!(" ({e})")));
        }
        let mut devices = Vec::new();
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the array holds `n` entries before its NULL end.
            let ctx = unsafe { *list.add(i) };
            if ctx.is_null() {
                break;
            }
            // SAFETY: ctx is a live context; its device pointer is valid
            // and ibv_get_device_name returns its NUL-terminated name.
            let name = unsafe {
                let s = sys::ibv_get_device_name((*ctx).device);
                if s.is_null() {
                    format!("rdma{i}")
                } else {
                    CStr::from_ptr(s).to_string_lossy().into_owned()
                }
            };
            // SAFETY: all-zero is a valid ibv_device_attr (integers).
            let mut attr: sys::ibv_device_attr = unsafe { zeroed() };
            // SAFETY: ctx is live and attr a valid out struct.
            let max_rd_atom = if unsafe { sys::ibv_query_device(ctx, &mut attr) } == 0 {
                attr.max_qp_rd_atom
            } else {
                tracing::warn!(device = %name, "ibv_query_device failed; serving 1 READ at a time");
                1
            };
            devices.push(Device {
                name,
                ctx,
                pd: Mutex::new(ptr::null_mut()),
                cq: Mutex::new(ptr::null_mut()),
                max_rd_atom,
            });
        }
        let shared = Shared { list, devices };
        if shared.devices.is_empty() {
            return Err(VerbsError::NoDevice(String::new()));
        }
        Ok(Self {
            shared: Arc::new(shared),
        })
    }
}

/// Memory registered for remote READs; dropping it deregisters it.
struct IbvRegistration {
    mr: *mut sys::ibv_mr,
    remote: Remote,
    device: String,
    _memory: Arc<dyn Memory>,
    _shared: Arc<Shared>,
}

// SAFETY: the MR is only read (its keys, copied at registration) and
// deregistered once in Drop; ibv_dereg_mr is thread safe.
unsafe impl Send for IbvRegistration {}
// SAFETY: nothing is mutated through `&IbvRegistration`.
unsafe impl Sync for IbvRegistration {}

impl fmt::Debug for IbvRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvRegistration")
            .field("device", &self.device)
            .field("remote", &self.remote)
            .finish()
    }
}

impl Registration for IbvRegistration {
    fn remote(&self) -> Remote {
        self.remote
    }
}

impl Drop for IbvRegistration {
    fn drop(&mut self) {
        // SAFETY: the MR came from ibv_reg_mr and is deregistered once;
        // the memory and the PD it needs are dropped only afterwards.
        let rc = unsafe { sys::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            // ibv_dereg_mr returns the errno value itself.
            let e = io::Error::from_raw_os_error(rc);
            tracing::warn!(device = %self.device, "ibv_dereg_mr: {e}");
        }
    }
}

impl Provider for IbvProvider {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn devices(&self) -> Result<Vec<String>, VerbsError> {
        Ok(self.shared.devices.iter().map(|d| d.name.clone()).collect())
    }

    fn device_of(&self, addr: SocketAddr, spec: &DeviceSpec) -> Result<DeviceSpec, VerbsError> {
        let mut id = ptr::null_mut();
        let ps = sys::rdma_port_space::RDMA_PS_TCP;
        // SAFETY: a NULL channel makes a synchronous id; `id` is a valid
        // out pointer; the id is destroyed below.
        let rc = unsafe { sys::rdma_create_id(ptr::null_mut(), &mut id, ptr::null_mut(), ps) };
        check(rc, format_args!("rdma_create_id"))?;
        // Port 0: the lookup must not hold the port the listener binds.
        let mut sa = to_sockaddr(SocketAddr::new(addr.ip(), 0));
        // SAFETY: a live id and a socket address the call only reads.
        let rc = unsafe { sys::rdma_bind_addr(id, ptr::addr_of_mut!(sa).cast()) };
        let bound = check(rc, format_args!("rdma_bind_addr {}", addr.ip())).map(|()| {
            // SAFETY: a live, bound id: `verbs` is NULL (a wildcard) or the
            // device context the address is on, whose device pointer is
            // valid and whose name is NUL-terminated.
            unsafe {
                let verbs = (*id).verbs;
                if verbs.is_null() {
                    return None;
                }
                let name = sys::ibv_get_device_name((*verbs).device);
                (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
            }
        });
        // SAFETY: the id came from rdma_create_id, has no queue pair, and
        // is destroyed once.
        unsafe { sys::rdma_destroy_id(id) };
        let on = bound.map_err(|e| {
            VerbsError::NoDevice(format!(
                " for {}: the address is on no RDMA device ({e})",
                addr.ip()
            ))
        })?;
        let first = self.shared.devices.first().map(|d| d.name.as_str());
        crate::verbs::choose_device(addr, on.as_deref(), spec, first)
    }

    fn register(
        &self,
        spec: &DeviceSpec,
        memory: Arc<dyn Memory>,
    ) -> Result<Box<dyn Registration>, VerbsError> {
        let (_, dev) = self.shared.pick(spec)?;
        let bytes = memory.bytes();
        if bytes.is_empty() {
            return Err(VerbsError::Invalid("cannot register empty memory".into()));
        }
        let pd = dev.pd()?;
        let access = sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 as c_int;
        // SAFETY: the bytes stay alive and in place while `memory` is held
        // (the Memory contract), which the registration does until after
        // deregistering. With remote-read access only, nothing writes them.
        let mr =
            unsafe { sys::ibv_reg_mr(pd, bytes.as_ptr().cast_mut().cast(), bytes.len(), access) };
        let what = format_args!("ibv_reg_mr of {} bytes on {}", bytes.len(), dev.name);
        let mr = non_null(mr, what)?;
        // SAFETY: mr is a valid MR just returned.
        let rkey = unsafe { (*mr).rkey };
        let remote = Remote {
            addr: bytes.as_ptr() as u64,
            len: bytes.len() as u64,
            rkey,
        };
        Ok(Box::new(IbvRegistration {
            mr,
            remote,
            device: dev.name.clone(),
            _memory: memory,
            _shared: Arc::clone(&self.shared),
        }))
    }

    fn listen(
        &self,
        addr: SocketAddr,
        spec: &DeviceSpec,
        admit: Admit,
    ) -> Result<Box<dyn Listener>, VerbsError> {
        let (dev_index, dev) = self.shared.pick(spec)?;
        dev.pd()?;
        let (released_tx, released_rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(Mutex::new(Vec::new()));
        let mut lp = ListenLoop {
            shared: Arc::clone(&self.shared),
            dev_index,
            channel: ptr::null_mut(),
            listen_id: ptr::null_mut(),
            accepted: HashMap::new(),
            admit,
            cut: Arc::clone(&cut),
            stop: Arc::clone(&stop),
            released: Some(released_tx),
            fabric: spec.fabric,
        };
        // SAFETY: no arguments; NULL on failure.
        let channel = unsafe { sys::rdma_create_event_channel() };
        lp.channel = non_null(channel, format_args!("rdma_create_event_channel"))?;
        let mut id = ptr::null_mut();
        let ps = sys::rdma_port_space::RDMA_PS_TCP;
        // SAFETY: a live channel and a valid out pointer; `lp` destroys both.
        let rc = unsafe { sys::rdma_create_id(lp.channel, &mut id, ptr::null_mut(), ps) };
        check(rc, format_args!("rdma_create_id"))?;
        lp.listen_id = id;
        let mut sa = to_sockaddr(addr);
        // SAFETY: a live id and a socket address the call only reads.
        let rc = unsafe { sys::rdma_bind_addr(lp.listen_id, ptr::addr_of_mut!(sa).cast()) };
        check(rc, format_args!("rdma_bind_addr {addr}"))?;
        // SAFETY: a live id; `verbs` is set when the address is on a device.
        let bound = unsafe { (*lp.listen_id).verbs };
        if !bound.is_null() && bound != dev.ctx {
            return Err(VerbsError::Invalid(format!(
                "{addr} is not on device {}",
                dev.name
            )));
        }
        // SAFETY: a live, bound id.
        let rc = unsafe { sys::rdma_listen(lp.listen_id, 64) };
        check(rc, format_args!("rdma_listen {addr}"))?;
        // SAFETY: a live id; the source address is a sockaddr_storage-sized
        // union, read as its storage member.
        let src = unsafe { (*lp.listen_id).route.addr.src_addr_union.src_storage };
        let local = from_sockaddr(&src).unwrap_or(addr);
        let thread = thread::Builder::new()
            .name("engram-rdma-listen".into())
            .spawn(move || lp.run())
            .map_err(|e| VerbsError::Io(format!("spawning the listener thread: {e}")))?;
        drop(thread);
        tracing::debug!(%local, device = %dev.name, "rdma listener up");
        Ok(Box::new(IbvListener {
            local,
            stop,
            released: released_rx,
            cut,
        }))
    }

    fn connect(
        &self,
        addr: SocketAddr,
        private: &[u8],
        opts: &QpOptions,
    ) -> Result<Box<dyn QueuePair>, VerbsError> {
        Ok(Box::new(IbvQueuePair::connect(addr, private, opts)?))
    }
}

/// A donor's listener: dropping it stops accepting; accepted queue pairs
/// are served by its thread until their peers disconnect.
struct IbvListener {
    local: SocketAddr,
    stop: Arc<AtomicBool>,
    released: mpsc::Receiver<()>,
    /// Keys of accepted queue pairs to disconnect, for the loop's next tick.
    cut: Arc<Mutex<Vec<u64>>>,
}

impl fmt::Debug for IbvListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvListener")
            .field("local", &self.local)
            .finish()
    }
}

impl Listener for IbvListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn disconnect(&self, keys: &[u64]) {
        let mut cut = self.cut.lock();
        cut.extend_from_slice(keys);
        // Bounded: keys the loop has not taken yet, at most the book's
        // queue pairs; duplicates are harmless.
        cut.sort_unstable();
        cut.dedup();
    }
}

impl Drop for IbvListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wait (bounded) until the listening id is gone, so the address can
        // be bound again at once; a disconnect means the thread ended.
        let _ = self.released.recv_timeout(RELEASE_WAIT);
    }
}

/// What the listener's thread keeps of one event (valid after the ack).
struct CmEvent {
    kind: ev::Type,
    status: c_int,
    id: *mut sys::rdma_cm_id,
    private: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

/// The listener's event loop and everything it owns.
struct ListenLoop {
    shared: Arc<Shared>,
    dev_index: usize,
    channel: *mut sys::rdma_event_channel,
    listen_id: *mut sys::rdma_cm_id,
    /// Accepted ids (with their QPs) and their keys, by address.
    accepted: HashMap<usize, (*mut sys::rdma_cm_id, u64)>,
    admit: Admit,
    /// Keys the book asked to disconnect ([`Listener::disconnect`]).
    cut: Arc<Mutex<Vec<u64>>>,
    stop: Arc<AtomicBool>,
    released: Option<mpsc::Sender<()>>,
    /// The accepted queue pairs' settings (their traffic class).
    fabric: Fabric,
}

// SAFETY: the cm ids and the channel are used by one thread at a time: the
// caller of `listen` until it hands the loop to its thread, then only that
// thread.
unsafe impl Send for ListenLoop {}

impl ListenLoop {
    fn run(mut self) {
        // SAFETY: the channel is live for the life of the loop.
        let fd = unsafe { (*self.channel).fd };
        let tick = c_int::try_from(LISTEN_TICK.as_millis()).unwrap_or(100);
        loop {
            self.disconnect_cut();
            if self.stop.load(Ordering::Acquire) {
                self.close_listener();
                if self.accepted.is_empty() {
                    break;
                }
            }
            match wait_readable(fd, tick) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!("rdma listener stops: {e}");
                    break;
                }
            }
            let mut raw: *mut sys::rdma_cm_event = ptr::null_mut();
            // SAFETY: a live channel with an event ready; valid out pointer.
            let rc = unsafe { sys::rdma_get_cm_event(self.channel, &mut raw) };
            if let Err(e) = check(rc, format_args!("rdma_get_cm_event")) {
                tracing::warn!("{e}");
                thread::sleep(LISTEN_TICK);
                continue;
            }
            if raw.is_null() {
                continue;
            }
            // SAFETY: `raw` is a valid event until acked. For a connection
            // request param.conn is the member in use and its private data
            // is private_data_len bytes (or NULL), copied out here.
            let event = unsafe {
                let e = &*raw;
                let mut event = CmEvent {
                    kind: e.event,
                    status: e.status,
                    id: e.id,
                    private: Vec::new(),
                    responder_resources: 0,
                    initiator_depth: 0,
                };
                if e.event == ev::RDMA_CM_EVENT_CONNECT_REQUEST {
                    let conn = e.param.conn;
                    if !conn.private_data.is_null() {
                        let p = conn.private_data.cast::<u8>();
                        let len = usize::from(conn.private_data_len);
                        event.private = std::slice::from_raw_parts(p, len).to_vec();
                    }
                    event.responder_resources = conn.responder_resources;
                    event.initiator_depth = conn.initiator_depth;
                }
                event
            };
            // SAFETY: acked once, before any id it names is destroyed.
            unsafe { sys::rdma_ack_cm_event(raw) };
            self.handle(event);
        }
    }

    fn handle(&mut self, e: CmEvent) {
        match e.kind {
            ev::RDMA_CM_EVENT_CONNECT_REQUEST => self.on_request(&e),
            ev::RDMA_CM_EVENT_ESTABLISHED => tracing::debug!("rdma queue pair established"),
            ev::RDMA_CM_EVENT_DEVICE_REMOVAL if e.id == self.listen_id => {
                tracing::warn!("rdma device removed: the listener stops accepting");
                self.close_listener();
            }
            ev::RDMA_CM_EVENT_DISCONNECTED
            | ev::RDMA_CM_EVENT_CONNECT_ERROR
            | ev::RDMA_CM_EVENT_UNREACHABLE
            | ev::RDMA_CM_EVENT_REJECTED
            | ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                if e.kind != ev::RDMA_CM_EVENT_DISCONNECTED {
                    tracing::warn!(
                        status = e.status,
                        "rdma queue pair lost: {}",
                        event_name(e.kind)
                    );
                }
                self.drop_conn(e.id);
            }
            _ => {}
        }
    }

    /// A connection request proves nothing about its source (its
    /// addresses can be forged on the fabric), so nothing is kept by
    /// source: only a token the book granted over an authenticated
    /// session admits, and a request without one is rejected and its id
    /// destroyed at once.
    fn on_request(&mut self, e: &CmEvent) {
        let id = e.id;
        // `dev_index` came from `pick` and the device list never changes.
        let dev = &self.shared.devices[self.dev_index];
        // SAFETY: the request's new id is live until we destroy it.
        let verbs = unsafe { (*id).verbs };
        let admitted = if self.listen_id.is_null() {
            None
        } else if verbs != dev.ctx {
            tracing::warn!(device = %dev.name, "rdma request arrived on another device: refused");
            None
        } else if let Some(token) = unframe_private(&e.private) {
            let admit = &self.admit;
            panic::catch_unwind(AssertUnwindSafe(|| admit(token))).unwrap_or_else(|_| {
                tracing::warn!("rdma admit check panicked: refused");
                None
            })
        } else {
            tracing::warn!("rdma request with malformed private data: refused");
            None
        };
        let Some(key) = admitted else {
            // SAFETY: a live, unaccepted id; destroyed once, after its
            // event was acked.
            unsafe {
                sys::rdma_reject(id, ptr::null(), 0);
                sys::rdma_destroy_id(id);
            }
            return;
        };
        if let Err(msg) = self.accept(id, e, dev) {
            tracing::warn!("rdma accept failed: {msg}");
            // SAFETY: as above; `accept` destroyed any QP it made.
            unsafe {
                sys::rdma_reject(id, ptr::null(), 0);
                sys::rdma_destroy_id(id);
            }
            return;
        }
        self.accepted.insert(id as usize, (id, key));
    }

    /// Disconnect and destroy the accepted queue pairs the book cut.
    fn disconnect_cut(&mut self) {
        let keys = std::mem::take(&mut *self.cut.lock());
        if keys.is_empty() {
            return;
        }
        let ids: Vec<*mut sys::rdma_cm_id> = self
            .accepted
            .values()
            .filter(|(_, k)| keys.contains(k))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            // SAFETY: an accepted, live id; the peer sees a disconnect and
            // its QP's work fails. Destroyed once, in `drop_conn`.
            unsafe { sys::rdma_disconnect(id) };
            tracing::info!("rdma queue pair disconnected: its identity's access was revoked");
            self.drop_conn(id);
        }
    }

    fn accept(&self, id: *mut sys::rdma_cm_id, e: &CmEvent, dev: &Device) -> Result<(), String> {
        let pd = dev.pd().map_err(|e| e.to_string())?;
        let cq = dev.cq().map_err(|e| e.to_string())?;
        set_traffic_class(id, &self.fabric).map_err(|e| e.to_string())?;
        // SAFETY: all-zero is valid for this struct of pointers and integers.
        let mut attr: sys::ibv_qp_init_attr = unsafe { zeroed() };
        // The device's one shared CQ: a responder posts nothing, so it
        // stays empty (without it librdmacm makes two CQs and two
        // completion channels for every accepted queue pair).
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.cap.max_send_wr = 1;
        attr.cap.max_recv_wr = 1;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: a live id on the device of the PD and the CQ.
        let rc = unsafe { sys::rdma_create_qp(id, pd, &mut attr) };
        check(rc, format_args!("rdma_create_qp")).map_err(|e| e.to_string())?;
        // SAFETY: all-zero is valid (no private data).
        let mut param: sys::rdma_conn_param = unsafe { zeroed() };
        param.responder_resources = rd_atom(e.responder_resources, dev.max_rd_atom);
        param.initiator_depth = e
            .initiator_depth
            .min(u8::try_from(MAX_RD_ATOM).unwrap_or(0));
        param.retry_count = self.fabric.retry_count.min(7);
        param.rnr_retry_count = RNR_RETRIES;
        // SAFETY: a live id with a QP; param is read during the call.
        let rc = unsafe { sys::rdma_accept(id, &mut param) };
        check(rc, format_args!("rdma_accept")).map_err(|e| {
            // SAFETY: the QP made above, destroyed once.
            unsafe { sys::rdma_destroy_qp(id) };
            e.to_string()
        })
    }

    fn drop_conn(&mut self, id: *mut sys::rdma_cm_id) {
        if self.accepted.remove(&(id as usize)).is_some() {
            // SAFETY: an accepted id, removed from the map so destroyed once.
            unsafe { destroy_accepted(id) };
        }
    }

    fn close_listener(&mut self) {
        if !self.listen_id.is_null() {
            // SAFETY: the listening id, destroyed once (then NULL).
            unsafe { sys::rdma_destroy_id(self.listen_id) };
            self.listen_id = ptr::null_mut();
        }
        if let Some(tx) = self.released.take() {
            let _ = tx.send(());
        }
    }
}

/// Destroys an accepted id and its QP.
///
/// # Safety
/// `id` must be a live id this listener accepted, not used afterwards.
unsafe fn destroy_accepted(id: *mut sys::rdma_cm_id) {
    // SAFETY: per the contract; the QP (if any) is destroyed before the id.
    unsafe {
        if !(*id).qp.is_null() {
            sys::rdma_destroy_qp(id);
        }
        sys::rdma_destroy_id(id);
    }
}

impl Drop for ListenLoop {
    fn drop(&mut self) {
        for (_, (id, _)) in self.accepted.drain() {
            // SAFETY: accepted ids, each destroyed once.
            unsafe { destroy_accepted(id) };
        }
        self.close_listener();
        if !self.channel.is_null() {
            // SAFETY: every id on the channel is destroyed above.
            unsafe { sys::rdma_destroy_event_channel(self.channel) };
        }
    }
}

/// A page-aligned, zeroed buffer.
struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

impl PageBuf {
    fn new(len: usize) -> Result<Self, VerbsError> {
        if len == 0 {
            return Err(VerbsError::Invalid("a buffer of 0 bytes".into()));
        }
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        // Whole pages, so the registration shares no page with the heap.
        let layout = len
            .checked_next_multiple_of(page)
            .and_then(|size| Layout::from_size_align(size, page).ok())
            .ok_or_else(|| VerbsError::Invalid(format!("a buffer of {len} bytes")))?;
        // SAFETY: the layout's size is not zero.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| VerbsError::Io(format!("cannot allocate {len} bytes")))?;
        Ok(Self { ptr, len, layout })
    }

    /// `len` bytes at `offset`, bounds checked. Never the whole buffer:
    /// the NIC writes into it behind the compiler's back, so a reference
    /// may cover only bytes no READ is landing in.
    fn range(&self, offset: usize, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: in bounds of `len` initialized (zeroed) bytes, live while
        // self is; the caller names a range whose READs have completed.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Everything a node's queue pair owns; Drop releases what was made, in
/// order, so it is also the cleanup of a failed connect.
struct Conn {
    channel: *mut sys::rdma_event_channel,
    id: *mut sys::rdma_cm_id,
    pd: *mut sys::ibv_pd,
    cq: *mut sys::ibv_cq,
    qp: *mut sys::ibv_qp,
    mr: *mut sys::ibv_mr,
    connected: bool,
    /// Freed after the MR is deregistered (fields drop after `drop`).
    buffer: Option<PageBuf>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: each object was made by this Conn and is released once,
        // dependents first: the QP before its CQ and PD, the MR before its
        // PD, everything on the id before the id, the id before its channel.
        unsafe {
            if self.connected {
                sys::rdma_disconnect(self.id);
            }
            if !self.qp.is_null() {
                sys::rdma_destroy_qp(self.id);
            }
            if !self.mr.is_null() {
                sys::ibv_dereg_mr(self.mr);
            }
            if !self.cq.is_null() {
                sys::ibv_destroy_cq(self.cq);
            }
            if !self.pd.is_null() {
                sys::ibv_dealloc_pd(self.pd);
            }
            if !self.id.is_null() {
                sys::rdma_destroy_id(self.id);
            }
            if !self.channel.is_null() {
                sys::rdma_destroy_event_channel(self.channel);
            }
        }
    }
}

impl Conn {
    /// A non-blocking event channel and a connection id on it, with the
    /// fabric's traffic class and ACK timeout set: both before the route is
    /// resolved (the class picks the path's service level, and the timeout
    /// is applied when the queue pair is readied to send; librdmacm 18 and
    /// kernel 4.18 or later).
    fn open(opts: &QpOptions) -> Result<Self, VerbsError> {
        let mut c = Conn {
            channel: ptr::null_mut(),
            id: ptr::null_mut(),
            pd: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            mr: ptr::null_mut(),
            connected: false,
            buffer: None,
        };
        // SAFETY: no arguments; NULL on failure.
        let channel = unsafe { sys::rdma_create_event_channel() };
        c.channel = non_null(channel, format_args!("rdma_create_event_channel"))?;
        // Non-blocking: reading an event must never stall a lookup (the
        // connection waits with poll first; the queue pair checks for
        // events between completions).
        // SAFETY: the channel is live; fcntl on its descriptor.
        let rc = unsafe {
            let fd = (*c.channel).fd;
            libc::fcntl(
                fd,
                libc::F_SETFL,
                libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
            )
        };
        check(
            rc.min(0),
            format_args!("making the event channel non-blocking"),
        )?;
        let mut id = ptr::null_mut();
        let ps = sys::rdma_port_space::RDMA_PS_TCP;
        // SAFETY: a live channel and a valid out pointer.
        let rc = unsafe { sys::rdma_create_id(c.channel, &mut id, ptr::null_mut(), ps) };
        check(rc, format_args!("rdma_create_id"))?;
        c.id = id;
        set_traffic_class(c.id, &opts.fabric)?;
        let exponent = opts.fabric.ack_timeout_exponent();
        set_u8_option(
            c.id,
            RDMA_OPTION_ID_ACK_TIMEOUT,
            exponent,
            "ACK timeout exponent",
        )?;
        Ok(c)
    }

    /// Resolve `addr`'s address and route by `deadline`: the device that
    /// reaches it.
    fn resolve(
        &mut self,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<*mut sys::ibv_context, VerbsError> {
        let ms = |d| millis_left(d).ok_or_else(|| VerbsError::Timeout("connecting".into()));
        let mut dst = to_sockaddr(addr);
        let dst_ptr = ptr::addr_of_mut!(dst).cast::<libc::sockaddr>();
        let timeout = ms(deadline)?;
        // SAFETY: a live id; the address is only read.
        let rc = unsafe { sys::rdma_resolve_addr(self.id, ptr::null_mut(), dst_ptr, timeout) };
        check(rc, format_args!("rdma_resolve_addr {addr}"))?;
        self.wait(ev::RDMA_CM_EVENT_ADDR_RESOLVED, deadline)?;
        let timeout = ms(deadline)?;
        // SAFETY: a live id with its address resolved.
        let rc = unsafe { sys::rdma_resolve_route(self.id, timeout) };
        check(rc, format_args!("rdma_resolve_route {addr}"))?;
        self.wait(ev::RDMA_CM_EVENT_ROUTE_RESOLVED, deadline)?;
        // SAFETY: a live id; `verbs` is set once the address is resolved.
        let ctx = unsafe { (*self.id).verbs };
        if ctx.is_null() {
            return Err(VerbsError::Io(format!("no RDMA device reaches {addr}")));
        }
        Ok(ctx)
    }

    /// The protection domain, the completion queue and the reliable queue
    /// pair for `depth` reads in flight, on device `ctx`, within what the
    /// device allows; the device's initiator depth.
    fn make_queue_pair(
        &mut self,
        ctx: *mut sys::ibv_context,
        depth: u32,
    ) -> Result<c_int, VerbsError> {
        // SAFETY: all-zero is a valid ibv_device_attr (integers).
        let mut dattr: sys::ibv_device_attr = unsafe { zeroed() };
        // SAFETY: a live context and a valid out struct.
        let (max_wr, max_cqe, max_init) = if unsafe { sys::ibv_query_device(ctx, &mut dattr) } == 0
        {
            (dattr.max_qp_wr, dattr.max_cqe, dattr.max_qp_init_rd_atom)
        } else {
            (c_int::MAX, c_int::MAX, 1)
        };
        let cqe = c_int::try_from(depth + 1).unwrap_or(c_int::MAX);
        if c_int::try_from(depth).unwrap_or(c_int::MAX) > max_wr || cqe > max_cqe {
            return Err(VerbsError::Invalid(format!(
                "send depth {depth} (the device allows {max_wr} work requests, {max_cqe} cqes)"
            )));
        }
        // SAFETY: a live context.
        self.pd = non_null(
            unsafe { sys::ibv_alloc_pd(ctx) },
            format_args!("ibv_alloc_pd"),
        )?;
        // One CQ for both queues; one spare entry for a flushed receive.
        // SAFETY: a live context; no completion channel.
        let cq = unsafe { sys::ibv_create_cq(ctx, cqe, ptr::null_mut(), ptr::null_mut(), 0) };
        self.cq = non_null(cq, format_args!("ibv_create_cq"))?;
        // SAFETY: all-zero is valid for this struct of pointers and integers.
        let mut qattr: sys::ibv_qp_init_attr = unsafe { zeroed() };
        qattr.send_cq = self.cq;
        qattr.recv_cq = self.cq;
        qattr.cap.max_send_wr = depth;
        qattr.cap.max_recv_wr = 1;
        qattr.cap.max_send_sge = 1;
        qattr.cap.max_recv_sge = 1;
        qattr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: a live id whose route is resolved; PD and CQ on its device.
        let rc = unsafe { sys::rdma_create_qp(self.id, self.pd, &mut qattr) };
        check(rc, format_args!("rdma_create_qp"))?;
        // SAFETY: the id now holds the QP just made.
        self.qp = unsafe { (*self.id).qp };
        Ok(max_init)
    }

    /// The landing buffer of `bytes`, registered for local writes: its
    /// address and local key.
    fn register_buffer(&mut self, bytes: usize) -> Result<(*mut u8, u32), VerbsError> {
        let buffer = PageBuf::new(bytes)?;
        let (base, len) = (buffer.ptr.as_ptr(), buffer.len);
        self.buffer = Some(buffer);
        let access = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as c_int;
        // SAFETY: the buffer lives in `self` and is freed after this MR.
        let mr = unsafe { sys::ibv_reg_mr(self.pd, base.cast::<c_void>(), len, access) };
        self.mr = non_null(mr, format_args!("ibv_reg_mr of {len} bytes"))?;
        // SAFETY: a valid MR.
        let lkey = unsafe { (*self.mr).lkey };
        Ok((base, lkey))
    }

    /// Connect to `addr` with `frame` as the private data, by `deadline`.
    fn establish(
        &mut self,
        addr: SocketAddr,
        frame: &[u8],
        max_init: c_int,
        opts: &QpOptions,
        deadline: Instant,
    ) -> Result<(), VerbsError> {
        // SAFETY: all-zero is valid; the private data outlives the call.
        let mut param: sys::rdma_conn_param = unsafe { zeroed() };
        param.private_data = frame.as_ptr().cast();
        param.private_data_len = u8::try_from(frame.len()).unwrap_or(0);
        param.initiator_depth = u8::try_from(max_init.clamp(0, MAX_RD_ATOM)).unwrap_or(0);
        param.responder_resources = 0;
        param.retry_count = opts.fabric.retry_count.min(7);
        param.rnr_retry_count = RNR_RETRIES;
        // SAFETY: a live id with a QP; param and its data are read in the call.
        let rc = unsafe { sys::rdma_connect(self.id, &mut param) };
        check(rc, format_args!("rdma_connect {addr}"))?;
        self.wait(ev::RDMA_CM_EVENT_ESTABLISHED, deadline)?;
        self.connected = true;
        Ok(())
    }

    /// The next connection manager event and its status, acked; `None`
    /// when none is waiting (the channel is non-blocking).
    fn next_event(&self) -> Result<Option<(ev::Type, c_int)>, VerbsError> {
        let mut raw: *mut sys::rdma_cm_event = ptr::null_mut();
        // SAFETY: a live channel; valid out pointer.
        let rc = unsafe { sys::rdma_get_cm_event(self.channel, &mut raw) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(VerbsError::Io(format!("rdma_get_cm_event: {e}"))),
            };
        }
        if raw.is_null() {
            return Ok(None);
        }
        // SAFETY: a valid event until acked; acked once.
        let e = unsafe {
            let e = ((*raw).event, (*raw).status);
            sys::rdma_ack_cm_event(raw);
            e
        };
        Ok(Some(e))
    }

    /// Waits for `want` on the channel until `deadline`; acks every event.
    fn wait(&self, want: ev::Type, deadline: Instant) -> Result<(), VerbsError> {
        let step = event_name(want);
        // SAFETY: the channel is live.
        let fd = unsafe { (*self.channel).fd };
        loop {
            let ms = millis_left(deadline)
                .ok_or_else(|| VerbsError::Timeout(format!("waiting for {step}")))?;
            if !wait_readable(fd, ms).map_err(|e| VerbsError::Io(e.to_string()))? {
                continue;
            }
            let Some((kind, status)) = self.next_event()? else {
                continue;
            };
            let name = event_name(kind);
            return match kind {
                k if k == want && status == 0 => Ok(()),
                ev::RDMA_CM_EVENT_REJECTED => {
                    Err(VerbsError::Refused(format!("{name} (status {status})")))
                }
                ev::RDMA_CM_EVENT_UNREACHABLE if status == -libc::ETIMEDOUT => {
                    Err(VerbsError::Timeout(format!("{name} (status {status})")))
                }
                ev::RDMA_CM_EVENT_UNREACHABLE => {
                    Err(VerbsError::Refused(format!("{name} (status {status})")))
                }
                _ => Err(VerbsError::Io(format!(
                    "waiting for {step}: {name} (status {status})"
                ))),
            };
        }
    }
}

/// A node's connected RC queue pair with its registered buffer.
struct IbvQueuePair {
    conn: Conn,
    depth: usize,
    base: u64,
    lkey: u32,
    sges: Vec<sys::ibv_sge>,
    chain: Vec<sys::ibv_send_wr>,
    wcs: Vec<sys::ibv_wc>,
    /// When `poll` next reads the connection manager's events.
    next_cm_check: Instant,
}

/// How often a queue pair's `poll` reads its connection manager events
/// (one `read` of a non-blocking descriptor).
const CM_CHECK_EVERY: Duration = Duration::from_millis(1);

/// Events after ESTABLISHED that end a node's queue pair: the donor's end
/// went away, the device did, or the address moved to another one.
fn ends_queue_pair(kind: ev::Type) -> bool {
    matches!(
        kind,
        ev::RDMA_CM_EVENT_DISCONNECTED
            | ev::RDMA_CM_EVENT_DEVICE_REMOVAL
            | ev::RDMA_CM_EVENT_ADDR_CHANGE
            | ev::RDMA_CM_EVENT_TIMEWAIT_EXIT
    )
}

// SAFETY: the verbs objects are used from one thread at a time, through
// `&mut self` (posting and polling) or `&self` (reading the buffer), and
// libibverbs objects may move between threads.
unsafe impl Send for IbvQueuePair {}

impl fmt::Debug for IbvQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvQueuePair")
            .field("send_depth", &self.depth)
            .field("buffer_bytes", &self.buffer_len())
            .finish()
    }
}

impl IbvQueuePair {
    /// Every read of `wrs` lands inside the registered buffer.
    fn check_landing(&self, wrs: &[ReadWr]) -> Result<(), VerbsError> {
        let cap = self.buffer_len();
        for w in wrs {
            let end = w.local_offset.checked_add(w.len as usize);
            if end.is_none_or(|end| end > cap) {
                let msg = format!(
                    "read of {} bytes at {} (buffer {cap})",
                    w.len, w.local_offset
                );
                return Err(VerbsError::Invalid(msg));
            }
        }
        Ok(())
    }

    fn connect(addr: SocketAddr, private: &[u8], opts: &QpOptions) -> Result<Self, VerbsError> {
        let frame = frame_private(private)?;
        let depth = u32::try_from(opts.send_depth)
            .ok()
            .filter(|&d| d > 0 && d < u32::MAX)
            .ok_or_else(|| VerbsError::Invalid(format!("send depth {}", opts.send_depth)))?;
        let now = Instant::now();
        let deadline = now
            .checked_add(opts.connect_timeout)
            .or_else(|| now.checked_add(Duration::from_secs(86_400)))
            .unwrap_or(now);
        let mut c = Conn::open(opts)?;
        let ctx = c.resolve(addr, deadline)?;
        let max_init = c.make_queue_pair(ctx, depth)?;
        let (base, lkey) = c.register_buffer(opts.buffer_bytes)?;
        c.establish(addr, &frame, max_init, opts, deadline)?;
        let n = opts.send_depth;
        Ok(Self {
            conn: c,
            depth: n,
            base: base as u64,
            lkey,
            sges: Vec::with_capacity(n),
            chain: Vec::with_capacity(n),
            // SAFETY: all-zero is a valid ibv_wc (integers and a union of them).
            wcs: (0..WC_BATCH).map(|_| unsafe { zeroed() }).collect(),
            next_cm_check: Instant::now(),
        })
    }

    /// Whether the QP is in the error state (for a failed post).
    fn is_dead(&self) -> bool {
        // SAFETY: all-zero is valid for these structs of integers and pointers.
        let (mut attr, mut init): (sys::ibv_qp_attr, sys::ibv_qp_init_attr) =
            unsafe { (zeroed(), zeroed()) };
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int;
        // SAFETY: a live QP and valid out structs.
        let rc = unsafe { sys::ibv_query_qp(self.conn.qp, &mut attr, mask, &mut init) };
        rc == 0 && attr.qp_state == sys::ibv_qp_state::IBV_QPS_ERR
    }
}

impl QueuePair for IbvQueuePair {
    fn buffer_len(&self) -> usize {
        self.conn.buffer.as_ref().map_or(0, |b| b.len)
    }

    fn landed(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.conn.buffer.as_ref()?.range(offset, len)
    }

    fn send_depth(&self) -> usize {
        self.depth
    }

    fn post_reads(&mut self, wrs: &[ReadWr]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        if wrs.len() > self.depth {
            let msg = format!("{} work requests (send depth {})", wrs.len(), self.depth);
            return Err(VerbsError::Invalid(msg));
        }
        self.check_landing(wrs)?;
        self.sges.clear();
        self.chain.clear();
        for w in wrs {
            let addr = self.base + w.local_offset as u64;
            self.sges.push(sys::ibv_sge {
                addr,
                length: w.len,
                lkey: self.lkey,
            });
            // SAFETY: all-zero is valid for ibv_send_wr (integers, pointers
            // and unions of those).
            let mut wr: sys::ibv_send_wr = unsafe { zeroed() };
            wr.wr_id = w.wr_id;
            // A zero-length READ carries no scatter entry (some devices read
            // a zero-length entry as 2 GiB).
            wr.num_sge = c_int::from(w.len > 0);
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
            wr.send_flags = if w.signaled {
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.wr.rdma = sys::rdma_t {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            self.chain.push(wr);
        }
        let n = self.chain.len();
        let sge_base = self.sges.as_mut_ptr();
        let wr_base = self.chain.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n, the length of both vectors, which are not
            // touched again until the post returns.
            unsafe {
                let wr = wr_base.add(i);
                (*wr).sg_list = sge_base.add(i);
                (*wr).next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    ptr::null_mut()
                };
            }
        }
        let qp = self.conn.qp;
        // SAFETY: a live QP and its context.
        let post = unsafe { (*(*qp).context).ops.post_send }
            .ok_or_else(|| VerbsError::Unsupported("the device has no post_send".into()))?;
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: a chain of n valid work requests on a live QP; the
        // scatter entries point into the registered buffer (bounds checked).
        let rc = unsafe { post(qp, wr_base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let at = (0..n).find(|&i| wr_base.wrapping_add(i) == bad);
        let err = io::Error::from_raw_os_error(rc);
        if self.is_dead() {
            return Err(VerbsError::Dead(format!("ibv_post_send: {err}")));
        }
        Err(VerbsError::Io(format!(
            "ibv_post_send (failed at work request {at:?}): {err}"
        )))
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        // A donor that disconnected, a device removed, an address moved:
        // the queue pair is over now, not when a lookup times out.
        let now = Instant::now();
        if now >= self.next_cm_check {
            self.next_cm_check = now + CM_CHECK_EVERY;
            while let Some((kind, _)) = self.conn.next_event()? {
                if ends_queue_pair(kind) {
                    return Err(VerbsError::Dead(format!(
                        "the connection manager reported {}",
                        event_name(kind)
                    )));
                }
            }
        }
        let cq = self.conn.cq;
        // SAFETY: a live CQ and its context.
        let poll_cq = unsafe { (*(*cq).context).ops.poll_cq }
            .ok_or_else(|| VerbsError::Unsupported("the device has no poll_cq".into()))?;
        let mut total = 0;
        while total < max {
            let want = (max - total).min(self.wcs.len());
            let want_c = c_int::try_from(want).unwrap_or(0);
            // SAFETY: a live CQ and room for `want` completions.
            let rc = unsafe { poll_cq(cq, want_c, self.wcs.as_mut_ptr()) };
            let got = usize::try_from(rc)
                .map_err(|_| VerbsError::Io(format!("ibv_poll_cq failed ({rc})")))?
                .min(want);
            out.extend(self.wcs[..got].iter().map(|wc| Completion {
                wr_id: wc.wr_id,
                status: map_status(wc.status),
            }));
            total += got;
            if got < want {
                break;
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_finds_devices_or_fails_cleanly() {
        match IbvProvider::open() {
            Ok(p) => assert!(!p.devices().unwrap().is_empty()),
            Err(VerbsError::NoDevice(_)) => {}
            Err(other) => panic!("unexpected error: {other}"),
        }
    }

    #[test]
    fn thread_safety_markers() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<IbvQueuePair>();
        send::<IbvListener>();
        send_sync::<IbvRegistration>();
        send_sync::<IbvProvider>();
    }

    /// rdma-sys writes these structs by hand (bindgen cannot do their
    /// unions); check them against the C headers (sizes and offsets from
    /// gcc on 64-bit Linux, rdma-core 44).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn hand_written_layouts_match_the_c_headers() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<sys::ibv_send_wr>(), 128);
        assert_eq!(offset_of!(sys::ibv_send_wr, sg_list), 16);
        assert_eq!(offset_of!(sys::ibv_send_wr, send_flags), 32);
        assert_eq!(offset_of!(sys::ibv_send_wr, wr), 40);
        assert_eq!(size_of::<sys::ibv_wc>(), 48);
        assert_eq!(offset_of!(sys::ibv_wc, status), 8);
        assert_eq!(size_of::<sys::rdma_cm_event>(), 80);
        assert_eq!(offset_of!(sys::rdma_cm_event, param), 24);
        assert_eq!(
            offset_of!(sys::rdma_cm_event, param.conn.private_data_len),
            32
        );
        assert_eq!(size_of::<sys::rdma_cm_id>(), 416);
        assert_eq!(offset_of!(sys::rdma_cm_id, qp), 24);
        assert_eq!(offset_of!(sys::rdma_cm_id, route.addr.src_addr_union), 32);
        assert_eq!(offset_of!(sys::rdma_cm_id, ps), 344);
        assert_eq!(size_of::<sys::rdma_conn_param>(), 24);
        assert_eq!(size_of::<sys::ibv_qp_init_attr>(), 64);
        assert_eq!(size_of::<sys::ibv_qp_attr>(), 144);
        assert_eq!(size_of::<sys::ibv_device_attr>(), 232);
    }

    #[test]
    fn private_data_is_framed_with_its_length() {
        let frame = frame_private(b"token").unwrap();
        assert_eq!(frame[0], 5);
        let mut padded = frame.clone();
        padded.resize(MAX_PRIVATE_DATA, 0);
        assert_eq!(unframe_private(&padded), Some(&b"token"[..]));
        assert!(frame_private(&[7; MAX_TOKEN]).is_ok());
        assert!(matches!(
            frame_private(&[7; MAX_TOKEN + 1]),
            Err(VerbsError::Invalid(_))
        ));
        assert_eq!(unframe_private(&[]), None);
        assert_eq!(unframe_private(&[9, 1, 2]), None);
        assert_eq!(unframe_private(&[0]), Some(&[][..]));
    }

    #[test]
    fn statuses_map() {
        use sys::ibv_wc_status as s;
        assert_eq!(map_status(s::IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(map_status(s::IBV_WC_REM_ACCESS_ERR), WcStatus::RemoteAccess);
        assert_eq!(
            map_status(s::IBV_WC_RNR_RETRY_EXC_ERR),
            WcStatus::RetryExceeded
        );
        assert_eq!(map_status(s::IBV_WC_WR_FLUSH_ERR), WcStatus::Flushed);
        assert_eq!(map_status(s::IBV_WC_LOC_LEN_ERR), WcStatus::LocalError);
        assert_eq!(
            map_status(s::IBV_WC_FATAL_ERR),
            WcStatus::Other(s::IBV_WC_FATAL_ERR)
        );
    }

    #[test]
    fn read_depth_is_clamped() {
        assert_eq!(rd_atom(4, 16), 4);
        assert_eq!(rd_atom(0, 8), 8);
        assert_eq!(rd_atom(200, 64), 16);
        assert_eq!(rd_atom(4, -1), 0);
    }

    #[test]
    fn socket_addresses_round_trip() {
        for a in ["10.1.2.3:4791", "[fe80::1%2]:18515", "0.0.0.0:0"] {
            let addr: SocketAddr = a.parse().unwrap();
            assert_eq!(from_sockaddr(&to_sockaddr(addr)), Some(addr));
        }
    }
}
