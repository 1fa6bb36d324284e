//! The fake verbs provider: READs executed against memory registered in
//! this process, with fault injection. A donor and a node in one process
//! (the tests, the benchmark) share one [`FakeFabric`]; everything above
//! the verbs (the plan, the session, the donor's region book and token
//! checks, the node's router and failover) runs as it would on hardware.
//!
//! A READ is carried out when it is posted (the "NIC" copies at once); its
//! completion is queued for `poll`. Faults are queued per listener address
//! and each one applies to the next doorbell to that donor.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use engram_sync::{Mutex, MutexGuard};

use crate::verbs::{
    Admit, Completion, DeviceSpec, Fabric, Listener, Memory, Provider, QpOptions, QueuePair,
    ReadWr, Registration, Remote, VerbsError, WcStatus,
};

/// A fault to inject into the next doorbell to a donor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeFault {
    /// The doorbell's first request completes with this status; the rest
    /// are flushed and the queue pair is dead.
    CompletionError(WcStatus),
    /// The data lands but the signalled completion never comes.
    LoseCompletion,
    /// The completion comes this late.
    Late(Duration),
    /// The regions the doorbell reads are deregistered first (as a swap
    /// does), so it fails with a remote access error.
    Revoke,
    /// The queue pair dies before the doorbell: the post fails.
    DeadQueuePair,
    /// The path goes silent for this doorbell (a partition, a dead host):
    /// nothing lands and nothing completes until the transport's retries
    /// run out, then it completes with retries exceeded and the queue
    /// pair is dead. Late detection, unlike an instant error.
    Silence,
}

#[derive(Clone)]
struct FakeRegion {
    memory: Arc<dyn Memory>,
    addr: u64,
    len: u64,
}

#[derive(Default)]
struct State {
    regions: HashMap<u32, FakeRegion>,
    next_rkey: u32,
    listeners: HashMap<SocketAddr, Admit>,
    faults: HashMap<SocketAddr, VecDeque<FakeFault>>,
    /// Generation of each address's listener: a queue pair made under an
    /// older one (a donor that went away) is dead.
    epochs: HashMap<SocketAddr, u64>,
    next_epoch: u64,
    /// READs carried out, by the listener address of their queue pair.
    reads_at: HashMap<SocketAddr, u64>,
    /// Queue pairs their listener disconnected (listener address, key).
    cut: HashSet<(SocketAddr, u64)>,
    /// The thread each queue pair was dropped on (torn down), by its
    /// listener's address.
    drops: Vec<(SocketAddr, std::thread::ThreadId)>,
    /// The devices and the addresses on each (none: every address);
    /// `fake0` on every address until set.
    devices: Vec<(String, Vec<IpAddr>)>,
    /// The device of each registration and listener made, in order.
    used: Vec<String>,
    /// The fabric settings each listener and each queue pair was made
    /// with, by the listener's address.
    listen_fabric: HashMap<SocketAddr, Fabric>,
    connect_fabric: Vec<(SocketAddr, Fabric)>,
    /// Refuse, as kernels before 6.2 do, to register shared memory that is
    /// not mapped writable.
    writable_shared_only: bool,
    /// Listener addresses whose paths are silent ([`FakeFabric::silence`]).
    silent: HashSet<SocketAddr>,
    /// The protection and flags (`/proc/self/maps`, like `r--s`) of the
    /// mapping each registration covered, in order.
    registered_perms: Vec<String>,
}

impl State {
    fn devices(&self) -> Vec<(String, Vec<IpAddr>)> {
        if self.devices.is_empty() {
            vec![(FAKE_DEVICE.to_string(), Vec::new())]
        } else {
            self.devices.clone()
        }
    }

    /// The device `spec` names (it must exist), or the first.
    fn pick(&self, spec: &DeviceSpec) -> Result<String, VerbsError> {
        let devices = self.devices();
        match &spec.device {
            Some(name) if devices.iter().any(|(d, _)| d == name) => Ok(name.clone()),
            Some(name) => Err(VerbsError::NoDevice(format!(" named {name}"))),
            None => Ok(devices[0].0.clone()),
        }
    }
}

/// The permissions column of `/proc/self/maps` for the mapping holding
/// `addr` (`r--s`, `rw-p`, ...); `None` when no mapping holds it.
fn mapping_perms(addr: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (lo, hi) = f.next()?.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        (lo <= addr && addr < hi).then(|| f.next().map(str::to_string))?
    })
}

/// The fake's one device until [`FakeFabric::set_devices`] says otherwise.
pub const FAKE_DEVICE: &str = "fake0";

/// The in-process fabric: registered regions, listeners, faults, counters.
#[derive(Default)]
pub struct FakeFabric {
    state: Mutex<State>,
    copy_nanos: AtomicU64,
    reads: AtomicU64,
}

impl std::fmt::Debug for FakeFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("FakeFabric")
            .field("regions", &s.regions.len())
            .field("listeners", &s.listeners.len())
            .finish_non_exhaustive()
    }
}

impl FakeFabric {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Queue `fault` for the next doorbell to the donor listening at `addr`.
    pub fn inject(&self, addr: SocketAddr, fault: FakeFault) {
        self.lock().faults.entry(addr).or_default().push_back(fault);
    }

    /// The donor's process at `addr` ended (its host still up): its end of
    /// every queue pair disconnects, which a node sees as the connection
    /// manager's DISCONNECTED on its next poll; posts are flushed; new
    /// connects are refused until a listener binds the address again.
    pub fn kill(&self, addr: SocketAddr) {
        let mut s = self.lock();
        s.listeners.remove(&addr);
        s.next_epoch += 1;
        let e = s.next_epoch;
        s.epochs.insert(addr, e);
    }

    /// The path to `addr` goes silent (the host died, or a partition): no
    /// event comes, nothing posted lands or completes until each queue
    /// pair's retries run out (`ack_timeout x (retry_count + 1)`), and
    /// then with retries exceeded. [`FakeFabric::heal`] ends it for
    /// queue pairs made afterwards.
    pub fn silence(&self, addr: SocketAddr) {
        self.lock().silent.insert(addr);
    }

    /// The path to `addr` carries traffic again.
    pub fn heal(&self, addr: SocketAddr) {
        self.lock().silent.remove(&addr);
    }

    /// Deregister the region with key `rkey` (what a swap does).
    pub fn revoke(&self, rkey: u32) -> bool {
        self.lock().regions.remove(&rkey).is_some()
    }

    /// READs carried out on queue pairs to the listener at `addr`.
    pub fn reads_at(&self, addr: SocketAddr) -> u64 {
        self.lock().reads_at.get(&addr).copied().unwrap_or(0)
    }

    /// The threads queue pairs to the listener at `addr` were dropped on,
    /// in order (a real teardown blocks in the driver: the node must not
    /// do it on an async worker).
    pub fn queue_pair_drops(&self, addr: SocketAddr) -> Vec<std::thread::ThreadId> {
        self.lock()
            .drops
            .iter()
            .filter(|(a, _)| *a == addr)
            .map(|(_, t)| *t)
            .collect()
    }

    /// The host's devices and the IP addresses on each (an empty list:
    /// every address is on it).
    pub fn set_devices(&self, devices: &[(&str, &[IpAddr])]) {
        self.lock().devices = devices
            .iter()
            .map(|(d, ips)| (d.to_string(), ips.to_vec()))
            .collect();
    }

    /// Register as a kernel before 6.2 does: memory in a `MAP_SHARED`
    /// mapping that is not writable is refused (`ib_umem_get` pins with
    /// `FOLL_WRITE`, which fails with `EFAULT` there).
    pub fn refuse_read_only_shared(&self, on: bool) {
        self.lock().writable_shared_only = on;
    }

    /// The protection and flags of the mapping under each registration
    /// made so far (`rw-s`, `r--s`, `rw-p`, ...), as the kernel saw them.
    pub fn registered_perms(&self) -> Vec<String> {
        self.lock().registered_perms.clone()
    }

    /// The device of each registration and listener made so far, in order.
    pub fn devices_used(&self) -> Vec<String> {
        self.lock().used.clone()
    }

    /// The fabric settings of the listener at `addr` (the latest made
    /// there) and of every queue pair made to it, in order.
    pub fn fabric_at(&self, addr: SocketAddr) -> (Option<Fabric>, Vec<Fabric>) {
        let s = self.lock();
        let qps = s
            .connect_fabric
            .iter()
            .filter(|(a, _)| *a == addr)
            .map(|(_, f)| *f)
            .collect();
        (s.listen_fabric.get(&addr).copied(), qps)
    }

    /// Regions registered now.
    pub fn regions(&self) -> usize {
        self.lock().regions.len()
    }

    /// Time the fake "NIC" spent copying rows, and READs carried out: the
    /// benchmark subtracts the copying from the node's CPU time, since a
    /// real NIC does it.
    pub fn nic_work(&self) -> (Duration, u64) {
        (
            Duration::from_nanos(self.copy_nanos.load(Ordering::Relaxed)),
            self.reads.load(Ordering::Relaxed),
        )
    }
}

/// The fake provider over a fabric.
#[derive(Debug, Clone, Default)]
pub struct FakeProvider {
    fabric: Arc<FakeFabric>,
}

impl FakeProvider {
    /// A provider on a new fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Its fabric (to inject faults and kill donors).
    pub fn fabric(&self) -> &Arc<FakeFabric> {
        &self.fabric
    }
}

#[derive(Debug)]
struct FakeRegistration {
    fabric: Weak<FakeFabric>,
    remote: Remote,
}

impl Registration for FakeRegistration {
    fn remote(&self) -> Remote {
        self.remote
    }
}

impl Drop for FakeRegistration {
    fn drop(&mut self) {
        if let Some(f) = self.fabric.upgrade() {
            f.lock().regions.remove(&self.remote.rkey);
        }
    }
}

#[derive(Debug)]
struct FakeListener {
    fabric: Weak<FakeFabric>,
    addr: SocketAddr,
    epoch: u64,
}

impl Listener for FakeListener {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn disconnect(&self, keys: &[u64]) {
        if let Some(f) = self.fabric.upgrade() {
            let mut s = f.lock();
            s.cut.extend(keys.iter().map(|k| (self.addr, *k)));
        }
    }
}

impl Drop for FakeListener {
    fn drop(&mut self) {
        if let Some(f) = self.fabric.upgrade() {
            let mut s = f.lock();
            // Only this listener's own address binding: a newer listener
            // on the address (a restarted donor) stays.
            if s.epochs.get(&self.addr) == Some(&self.epoch) {
                s.listeners.remove(&self.addr);
            }
        }
    }
}

impl Provider for FakeProvider {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn devices(&self) -> Result<Vec<String>, VerbsError> {
        Ok(self
            .fabric
            .lock()
            .devices()
            .into_iter()
            .map(|d| d.0)
            .collect())
    }

    fn device_of(&self, addr: SocketAddr, spec: &DeviceSpec) -> Result<DeviceSpec, VerbsError> {
        let devices = self.fabric.lock().devices();
        let on = if addr.ip().is_unspecified() {
            None
        } else {
            let d = devices
                .iter()
                .find(|(_, ips)| ips.contains(&addr.ip()))
                .or_else(|| devices.iter().find(|(_, ips)| ips.is_empty()))
                .ok_or_else(|| {
                    VerbsError::NoDevice(format!(
                        " for {}: the address is on no RDMA device",
                        addr.ip()
                    ))
                })?;
            Some(d.0.as_str())
        };
        crate::verbs::choose_device(addr, on, spec, devices.first().map(|d| d.0.as_str()))
    }

    fn register(
        &self,
        spec: &DeviceSpec,
        memory: Arc<dyn Memory>,
    ) -> Result<Box<dyn Registration>, VerbsError> {
        let bytes = memory.bytes();
        let addr = bytes.as_ptr() as u64;
        let len = bytes.len() as u64;
        let perms = mapping_perms(addr).unwrap_or_else(|| "????".into());
        let mut s = self.fabric.lock();
        let device = s.pick(spec)?;
        if s.writable_shared_only && perms.ends_with('s') && !perms.starts_with("rw") {
            return Err(VerbsError::Io(format!(
                "ibv_reg_mr of {len} bytes on {device}: Bad address (os error 14): a {perms} \
                 mapping (this kernel pins shared memory only through a writable mapping)"
            )));
        }
        s.registered_perms.push(perms);
        s.used.push(device);
        s.next_rkey = s.next_rkey.wrapping_add(0x9e37).max(1);
        while s.regions.contains_key(&s.next_rkey) {
            s.next_rkey = s.next_rkey.wrapping_add(1).max(1);
        }
        let rkey = s.next_rkey;
        s.regions.insert(rkey, FakeRegion { memory, addr, len });
        Ok(Box::new(FakeRegistration {
            fabric: Arc::downgrade(&self.fabric),
            remote: Remote { addr, len, rkey },
        }))
    }

    fn listen(
        &self,
        addr: SocketAddr,
        spec: &DeviceSpec,
        admit: Admit,
    ) -> Result<Box<dyn Listener>, VerbsError> {
        let mut s = self.fabric.lock();
        if s.listeners.contains_key(&addr) {
            return Err(VerbsError::Io(format!("{addr} is already listened on")));
        }
        // As the connection manager: an address on another device is refused.
        let device = s.pick(spec)?;
        let on = s
            .devices()
            .into_iter()
            .find(|(_, ips)| ips.contains(&addr.ip()))
            .map(|d| d.0);
        if let Some(on) = on.filter(|on| *on != device) {
            return Err(VerbsError::Invalid(format!(
                "{addr} is not on device {device} (it is on {on})"
            )));
        }
        s.used.push(device);
        s.listen_fabric.insert(addr, spec.fabric);
        s.listeners.insert(addr, admit);
        s.next_epoch += 1;
        let epoch = s.next_epoch;
        s.epochs.insert(addr, epoch);
        Ok(Box::new(FakeListener {
            fabric: Arc::downgrade(&self.fabric),
            addr,
            epoch,
        }))
    }

    fn connect(
        &self,
        addr: SocketAddr,
        private: &[u8],
        opts: &QpOptions,
    ) -> Result<Box<dyn QueuePair>, VerbsError> {
        if private.len() > 56 {
            return Err(VerbsError::Invalid(format!(
                "{} bytes of private data (at most 56)",
                private.len()
            )));
        }
        let (admit, epoch) = {
            let mut s = self.fabric.lock();
            s.connect_fabric.push((addr, opts.fabric));
            let Some(admit) = s.listeners.get(&addr) else {
                return Err(VerbsError::Refused(format!("no RDMA listener at {addr}")));
            };
            (Arc::clone(admit), s.epochs.get(&addr).copied().unwrap_or(0))
        };
        // Outside the fabric's lock: the donor's admission takes its own.
        let Some(key) = admit(private) else {
            return Err(VerbsError::Refused(
                "the donor did not admit the queue pair (bad or expired token)".into(),
            ));
        };
        Ok(Box::new(FakeQp {
            fabric: Arc::clone(&self.fabric),
            peer: addr,
            key,
            epoch,
            buffer: vec![0; opts.buffer_bytes],
            depth: opts.send_depth,
            fabric_opts: opts.fabric,
            cq: VecDeque::new(),
            dead: false,
            posted: 0,
            retired: 0,
        }))
    }
}

/// A fake queue pair: its buffer, its send queue, and completions waiting
/// to be polled.
///
/// As on hardware: work requests hold their send-queue entries until a
/// completion at or after them is polled (a post past the depth fails);
/// posting to a queue pair in the error state succeeds and every request
/// completes flushed; a donor whose process ended is seen as the
/// connection manager's DISCONNECTED on the next poll; a path that went
/// silent completes nothing until the transport's retries run out
/// (`ack_timeout x (retry_count + 1)` of the queue pair's fabric settings).
struct FakeQp {
    fabric: Arc<FakeFabric>,
    peer: SocketAddr,
    /// Its key at the listener.
    key: u64,
    epoch: u64,
    buffer: Vec<u8>,
    depth: usize,
    fabric_opts: Fabric,
    /// Completions: when each becomes visible, the completion, and the
    /// count of requests posted up to its own (polling it retires them).
    cq: VecDeque<(Option<Instant>, Completion, u64)>,
    dead: bool,
    /// Work requests posted, and retired by a polled completion.
    posted: u64,
    retired: u64,
}

impl std::fmt::Debug for FakeQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeQp")
            .field("peer", &self.peer)
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        let mut s = self.fabric.lock();
        s.cut.remove(&(self.peer, self.key));
        s.drops.push((self.peer, std::thread::current().id()));
    }
}

impl FakeQp {
    /// Queue one completion per request of `wrs` (all of them: a failed or
    /// flushed request completes whether signalled or not), the first with
    /// `status` and the rest flushed, visible at `at`; the queue pair is in
    /// the error state from here on.
    fn fail_at(&mut self, wrs: &[ReadWr], status: WcStatus, at: Option<Instant>) {
        self.dead = true;
        for (i, w) in wrs.iter().enumerate() {
            self.posted += 1;
            let s = if i == 0 { status } else { WcStatus::Flushed };
            let c = Completion {
                wr_id: w.wr_id,
                status: s,
            };
            self.cq.push_back((at, c, self.posted));
        }
    }

    fn fail(&mut self, wrs: &[ReadWr], status: WcStatus) {
        self.fail_at(wrs, status, None);
    }

    /// When a path gone silent now gives up: the transport's retries.
    fn retries_run_out(&self) -> Instant {
        let f = self.fabric_opts;
        Instant::now() + f.effective_ack_timeout() * (u32::from(f.retry_count) + 1)
    }
}

impl FakeQp {
    /// A post the real provider would refuse outright: more work requests
    /// than the send queue has room for, or one landing outside the buffer.
    fn admit_post(&self, wrs: &[ReadWr]) -> Result<(), VerbsError> {
        let outstanding = (self.posted - self.retired) as usize;
        if outstanding + wrs.len() > self.depth {
            return Err(VerbsError::Io(format!(
                "ibv_post_send: Cannot allocate memory (os error 12): {} work requests with \
                 {outstanding} of {} send queue entries in use",
                wrs.len(),
                self.depth
            )));
        }
        if let Some(w) = wrs
            .iter()
            .find(|w| w.local_offset.saturating_add(w.len as usize) > self.buffer.len())
        {
            return Err(VerbsError::Invalid(format!(
                "work request {} lands outside the buffer",
                w.wr_id
            )));
        }
        Ok(())
    }

    /// The reads of `wrs` landed: their completions, as `fault` shapes them
    /// (lost, or visible only later).
    fn complete(&mut self, wrs: &[ReadWr], fault: Option<FakeFault>) {
        let visible = match fault {
            Some(FakeFault::LoseCompletion) => {
                self.posted += wrs.len() as u64;
                return;
            }
            Some(FakeFault::Late(d)) => Some(Instant::now() + d),
            _ => None,
        };
        for w in wrs {
            self.posted += 1;
            if w.signaled {
                let c = Completion {
                    wr_id: w.wr_id,
                    status: WcStatus::Success,
                };
                self.cq.push_back((visible, c, self.posted));
            }
        }
    }
}

impl QueuePair for FakeQp {
    fn buffer_len(&self) -> usize {
        self.buffer.len()
    }

    // The fake "NIC" writes while it holds `&mut self` (at the post), so
    // any range may be borrowed here.
    fn landed(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.buffer.get(offset..offset.checked_add(len)?)
    }

    fn send_depth(&self) -> usize {
        self.depth
    }

    fn post_reads(&mut self, wrs: &[ReadWr]) -> Result<(), VerbsError> {
        self.admit_post(wrs)?;
        let fabric = Arc::clone(&self.fabric);
        let mut s = fabric.lock();
        let fault = s.faults.get_mut(&self.peer).and_then(VecDeque::pop_front);
        if fault == Some(FakeFault::DeadQueuePair) {
            // Some providers check the state and fail the post itself.
            self.dead = true;
            return Err(VerbsError::Dead(
                "the queue pair is in the error state".into(),
            ));
        }
        // Gone: the donor's process ended (its end disconnected, the queue
        // pair went to the error state) or its listener cut this queue
        // pair; or it was in the error state already. The post is taken
        // and flushed.
        if self.dead
            || s.epochs.get(&self.peer).copied().unwrap_or(0) != self.epoch
            || s.cut.contains(&(self.peer, self.key))
        {
            drop(s);
            // After a silent path's give-up, not before it.
            let at = self.cq.back().and_then(|e| e.0);
            self.fail_at(wrs, WcStatus::Flushed, at);
            return Ok(());
        }
        // A silent path: nothing lands, nothing completes until the
        // transport gives up.
        if s.silent.contains(&self.peer) || fault == Some(FakeFault::Silence) {
            drop(s);
            let at = Some(self.retries_run_out());
            self.fail_at(wrs, WcStatus::RetryExceeded, at);
            return Ok(());
        }
        match fault {
            Some(FakeFault::CompletionError(status)) => {
                drop(s);
                self.fail(wrs, status);
                return Ok(());
            }
            Some(FakeFault::Revoke) => {
                for w in wrs {
                    s.regions.remove(&w.rkey);
                }
            }
            _ => {}
        }
        let began = Instant::now();
        for (i, w) in wrs.iter().enumerate() {
            let src = s.regions.get(&w.rkey).and_then(|r| {
                let off = w.remote_addr.checked_sub(r.addr)?;
                let end = off.checked_add(u64::from(w.len))?;
                (end <= r.len).then(|| {
                    // The fabric's lock holds the registration (and its
                    // memory) while the bytes are read.
                    &r.memory.bytes()[off as usize..end as usize]
                })
            });
            let Some(src) = src else {
                drop(s);
                self.posted += i as u64;
                self.fail(&wrs[i..], WcStatus::RemoteAccess);
                return Ok(());
            };
            let at = w.local_offset;
            self.buffer[at..at + src.len()].copy_from_slice(src);
        }
        *s.reads_at.entry(self.peer).or_default() += wrs.len() as u64;
        drop(s);
        self.fabric
            .copy_nanos
            .fetch_add(began.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.fabric
            .reads
            .fetch_add(wrs.len() as u64, Ordering::Relaxed);
        self.complete(wrs, fault);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        // The connection manager's events, as the real provider reads
        // them: the donor's end disconnected (its process ended, or its
        // listener cut this queue pair).
        {
            let s = self.fabric.lock();
            if s.epochs.get(&self.peer).copied().unwrap_or(0) != self.epoch
                || s.cut.contains(&(self.peer, self.key))
            {
                return Err(VerbsError::Dead(
                    "the connection manager reported RDMA_CM_EVENT_DISCONNECTED".into(),
                ));
            }
        }
        let now = Instant::now();
        let mut n = 0;
        while n < max {
            match self.cq.front() {
                Some((Some(t), ..)) if *t > now => break,
                Some(&(_, c, upto)) => {
                    out.push(c);
                    self.cq.pop_front();
                    self.retired = self.retired.max(upto);
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }
}
