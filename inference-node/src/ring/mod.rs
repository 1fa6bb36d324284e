//! The engine ring's host side: a ring's memory (made by an engine, or
//! here for tests and CPU engines) and the client that serves it from the
//! node's Engram memory ([`serve`]). The layout is
//! `engram_protocol::ring`'s (PROTOCOL.md section 6).
//!
//! Every value the engine writes is checked before use: the header's shape
//! once at open (bounds, stated sizes, the memory's length), each request's
//! position count and layer mask, every id against its table. A request the
//! engine rewrites while it is read is dropped, never half served.

mod serve;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use engram_protocol::ring::{
    FAULT_LOG_ENTRIES, WAIT_BUCKETS, client_state, fault_entry, fault_entry_at, header, slot,
};
pub use engram_protocol::ring::{RingError, Shape, Status};
pub use serve::{RingCounters, RingHandle, RingHub, RingOptions, RingServer, serve};

/// A fault the client logged (PROTOCOL.md section 6.1): section `section`
/// of request `seq`, of the engine's step `step` (0: unknown), had no rows
/// under a `fail` policy, for `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The request.
    pub seq: u64,
    /// The engine step it belongs to (its step tag; 0: unknown).
    pub step: u64,
    /// The layer section.
    pub section: u32,
    /// Why: [`Status::Failed`], [`Status::Late`] or the GPU's timeout.
    pub status: u32,
}

/// A ring's memory, mapped read-write and shared with the engine.
#[derive(Debug)]
pub struct RingMemory {
    map: memmap2::MmapRaw,
    file: File,
    shape: Shape,
}

// SAFETY: the mapping is shared memory that the engine and this process
// write concurrently by design; every access goes through atomics (the
// words) or through copies into and out of regions the protocol gives to
// one writer at a time. The raw pointer is valid for the map's life.
unsafe impl Send for RingMemory {}
// SAFETY: as above.
unsafe impl Sync for RingMemory {}

fn io(op: &str) -> impl FnOnce(std::io::Error) -> RingError + '_ {
    move |e| RingError(format!("{op}: {e}"))
}

impl RingMemory {
    /// A new ring of `shape` in a memfd of its own, its header written,
    /// its size sealed: what an engine makes before capturing its graphs.
    pub fn create(shape: &Shape) -> Result<Self, RingError> {
        let h = shape.encode()?;
        let len = shape.bytes().ok_or_else(|| RingError("too large".into()))?;
        // SAFETY: a NUL-terminated literal; a new descriptor or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"engram-ring".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io("memfd_create")(std::io::Error::last_os_error()));
        }
        // SAFETY: a descriptor nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len).map_err(io("sizing the ring"))?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: fcntl on our descriptor with integer arguments.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io("sealing the ring")(std::io::Error::last_os_error()));
        }
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(&file)
            .map_err(io("mapping the ring"))?;
        // SAFETY: a fresh mapping at least 4 KiB long, ours alone so far.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), map.as_mut_ptr(), h.len()) };
        Ok(Self {
            map,
            file,
            shape: *shape,
        })
    }

    /// Map a ring an engine made (`file`, its memfd): refused unless its
    /// size is sealed and its header checks out against its length.
    pub fn open(file: File) -> Result<Self, RingError> {
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & need != need {
            return Err(RingError(
                "the ring's memory is not a memfd sealed against shrinking and growing".into(),
            ));
        }
        let len = file.metadata().map_err(io("stat"))?.len();
        if !(engram_protocol::ring::HEADER_BYTES..=engram_protocol::ring::MAX_RING_BYTES)
            .contains(&len)
        {
            return Err(RingError(format!("{len} bytes is not a ring")));
        }
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(&file)
            .map_err(io("mapping the ring"))?;
        let mut h = [0u8; engram_protocol::ring::ENGINE_HEADER_BYTES];
        // SAFETY: the mapping is at least 4 KiB; a copy of the header's
        // engine-written part.
        unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), h.as_mut_ptr(), h.len()) };
        let shape = Shape::decode(&h, len)?;
        Ok(Self { map, file, shape })
    }

    /// Its shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// Its memfd (to hand to another process).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The first byte of the mapping (for an engine's kernels, and for a
    /// buffer over the whole ring).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Never empty (a ring has at least its header).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The 8-byte word at `at` (8-aligned, inside the mapping).
    fn word(&self, at: u64) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && (at as usize) + 8 <= self.len());
        // SAFETY: `at` is 8-aligned inside the mapping (offsets come from
        // the checked shape), which lives as long as `self`.
        unsafe { &*(self.as_ptr().add(at as usize) as *const AtomicU64) }
    }

    /// The 4-byte word at `at` (4-aligned, inside the mapping).
    fn word32(&self, at: u64) -> &AtomicU32 {
        debug_assert!(at.is_multiple_of(4) && (at as usize) + 4 <= self.len());
        // SAFETY: as `word`, 4-aligned.
        unsafe { &*(self.as_ptr().add(at as usize) as *const AtomicU32) }
    }

    /// The engine's side: count a wait of `ns` in section `l`'s histogram
    /// (what the GPU's wait kernel does; one writer per section).
    pub fn waited(&self, l: u32, ns: u64) {
        if l >= self.shape.layers {
            return;
        }
        let b = engram_protocol::ring::wait_bucket(ns) as u64;
        let at = header::WAITS as u64 + 8 * (u64::from(l) * WAIT_BUCKETS as u64 + b);
        self.word(at).fetch_add(1, Ordering::Relaxed);
    }

    /// Section `l`'s wait histogram as the engine wrote it (PROTOCOL.md
    /// 6.1): counts per bucket.
    pub fn waits(&self, l: u32) -> [u64; WAIT_BUCKETS] {
        if l >= self.shape.layers {
            return [0; WAIT_BUCKETS];
        }
        let at = header::WAITS as u64 + 8 * (u64::from(l) * WAIT_BUCKETS as u64);
        std::array::from_fn(|b| self.word(at + 8 * b as u64).load(Ordering::Relaxed))
    }

    /// Slot `s`'s request word.
    pub fn request(&self, s: u32) -> u64 {
        self.word(self.shape.slot_at(s) + slot::REQUEST as u64)
            .load(Ordering::Acquire)
    }

    /// Slot `s`'s done word of layer section `l`.
    pub fn done(&self, s: u32, l: u32) -> u64 {
        self.word(self.shape.slot_at(s) + slot::DONE as u64 + 8 * u64::from(l))
            .load(Ordering::Acquire)
    }

    /// Slot `s`'s status of layer section `l` (a [`Status`] value).
    pub fn status(&self, s: u32, l: u32) -> u32 {
        self.word32(self.shape.slot_at(s) + slot::STATUS as u64 + 4 * u64::from(l))
            .load(Ordering::Acquire)
    }

    /// How slot `s`'s layer section `l` was served (`SERVED_*` bits).
    pub fn served(&self, s: u32, l: u32) -> u32 {
        self.word32(self.shape.slot_at(s) + slot::SERVED as u64 + 4 * u64::from(l))
            .load(Ordering::Acquire)
    }

    /// The header's client state ([`client_state`]).
    pub fn client_state(&self) -> u32 {
        self.word32(header::CLIENT_STATE as u64)
            .load(Ordering::Acquire)
    }

    /// The header's client heartbeat (CLOCK_MONOTONIC ns; 0: none yet).
    pub fn heartbeat(&self) -> u64 {
        self.word(header::HEARTBEAT_NS as u64)
            .load(Ordering::Acquire)
    }

    /// The faults the client has counted (sections without rows under a
    /// `fail` policy) and the last one's `(seq, section, status)`.
    pub fn faults(&self) -> (u64, u64, u32, u32) {
        let n = self.word(header::FAULTS as u64).load(Ordering::Acquire);
        (
            n,
            self.word(header::FAULT_SEQ as u64).load(Ordering::Relaxed),
            self.word32(header::FAULT_SECTION as u64)
                .load(Ordering::Relaxed),
            self.word32(header::FAULT_STATUS as u64)
                .load(Ordering::Relaxed),
        )
    }

    /// Fault `n`'s entry in the header's fault log (counting from 1; the
    /// log keeps the last [`FAULT_LOG_ENTRIES`]): `None` when the client
    /// has not counted `n` faults yet, or `n` has been overwritten.
    pub fn fault(&self, n: u64) -> Option<Fault> {
        let count = self.word(header::FAULTS as u64).load(Ordering::Acquire);
        if n == 0 || n > count || count - n >= FAULT_LOG_ENTRIES as u64 {
            return None;
        }
        let at = fault_entry_at(n) as u64;
        Some(Fault {
            seq: self
                .word(at + fault_entry::SEQ as u64)
                .load(Ordering::Relaxed),
            step: self
                .word(at + fault_entry::STEP as u64)
                .load(Ordering::Relaxed),
            section: self
                .word32(at + fault_entry::SECTION as u64)
                .load(Ordering::Relaxed),
            status: self
                .word32(at + fault_entry::STATUS as u64)
                .load(Ordering::Relaxed),
        })
    }

    /// Slot `s`'s step tag (what the engine wrote with its request).
    pub fn step_tag(&self, s: u32) -> u64 {
        self.word(header::STEP_TAGS as u64 + 8 * u64::from(s % self.shape.slots))
            .load(Ordering::Relaxed)
    }

    /// What an engine's publish does first when it tags its requests with
    /// its step: write `step` as request `seq`'s step tag (before
    /// [`publish`](Self::publish) of `seq`). For tests and CPU engines.
    pub fn tag(&self, seq: u64, step: u64) {
        let s = (seq % u64::from(self.shape.slots)) as u32;
        self.word(header::STEP_TAGS as u64 + 8 * u64::from(s))
            .store(step, Ordering::Relaxed);
    }

    /// What an engine's wait does when the GPU's deadline passes first:
    /// write `seq` in its slot's give-up word, for the client to turn into
    /// the table's policy. For tests and CPU engines.
    pub fn gave_up(&self, seq: u64) {
        let s = (seq % u64::from(self.shape.slots)) as u32;
        self.word(self.shape.slot_at(s) + slot::GPU_GAVE_UP as u64)
            .store(seq, Ordering::Release);
    }

    /// What an engine's publish does, on the CPU: write `ids` (`[layer
    /// sections in mask][positions][columns]`, the sections `mask` names
    /// in order) into slot `seq % slots`, then publish `seq` (release).
    /// For tests and CPU engines; a GPU engine's kernel does the same.
    pub fn publish(
        &self,
        seq: u64,
        mask: u32,
        positions: u32,
        ids: &[i64],
    ) -> Result<(), RingError> {
        let sh = &self.shape;
        let sections = (0..sh.layers).filter(|l| mask & (1 << l) != 0).count() as u32;
        if seq == 0 || positions > sh.positions || mask == 0 || mask >> sh.layers != 0 {
            return Err(RingError(format!(
                "seq {seq}, mask {mask:#b}, {positions} positions"
            )));
        }
        let per = positions as usize * sh.columns as usize;
        if ids.len() != per * sections as usize {
            return Err(RingError(format!(
                "{} ids for {sections} sections of {positions} positions",
                ids.len()
            )));
        }
        let s = (seq % u64::from(sh.slots)) as u32;
        let base = sh.slot_at(s);
        let mut chunks = ids.chunks_exact(per);
        for l in (0..sh.layers).filter(|l| mask & (1 << l) != 0) {
            let src = chunks.next().unwrap_or_default();
            let at = base + sh.id_at(l, 0, 0);
            // SAFETY: the section's first `per` ids lie inside the slot.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr().cast::<u8>(),
                    self.as_ptr().add(at as usize),
                    per * 8,
                )
            };
        }
        self.word32(base + slot::POSITIONS as u64)
            .store(positions, Ordering::Relaxed);
        self.word32(base + slot::MASK as u64)
            .store(mask, Ordering::Relaxed);
        self.word(base + slot::REQUEST as u64)
            .store(seq, Ordering::Release);
        Ok(())
    }

    /// Layer section `l`'s rows of slot `s` (the first `positions`), as the
    /// client wrote them: for tests and CPU engines, after the done word.
    pub fn rows(&self, s: u32, l: u32, positions: u32) -> Vec<u8> {
        let sh = &self.shape;
        let n = positions.min(sh.positions) as usize * sh.columns as usize * sh.row_bytes as usize;
        let at = sh.slot_at(s.min(sh.slots - 1)) + sh.layer_rows_at(l.min(sh.layers - 1));
        let mut v = vec![0u8; n];
        // SAFETY: the section's rows lie inside the slot.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(at as usize), v.as_mut_ptr(), n) };
        v
    }

    /// Log a fault (the client's side): its entry, then the count, with a
    /// release store, so an engine that reads the count sees the entry.
    fn log_fault(&self, f: Fault) {
        let n = self.word(header::FAULTS as u64).load(Ordering::Relaxed) + 1;
        let at = fault_entry_at(n) as u64;
        self.word(at + fault_entry::SEQ as u64)
            .store(f.seq, Ordering::Relaxed);
        self.word(at + fault_entry::STEP as u64)
            .store(f.step, Ordering::Relaxed);
        self.word32(at + fault_entry::SECTION as u64)
            .store(f.section, Ordering::Relaxed);
        self.word32(at + fault_entry::STATUS as u64)
            .store(f.status, Ordering::Relaxed);
        self.word(header::FAULT_SEQ as u64)
            .store(f.seq, Ordering::Relaxed);
        self.word32(header::FAULT_SECTION as u64)
            .store(f.section, Ordering::Relaxed);
        self.word32(header::FAULT_STATUS as u64)
            .store(f.status, Ordering::Relaxed);
        self.word(header::FAULTS as u64).store(n, Ordering::Release);
    }

    /// Mark the ring as no longer served (the client let go).
    fn set_client(&self, pid: u32, state: u32) {
        self.word32(header::CLIENT_PID as u64)
            .store(pid, Ordering::Relaxed);
        self.word32(header::CLIENT_STATE as u64)
            .store(state, Ordering::Release);
    }
}

#[cfg(test)]
mod tests;
