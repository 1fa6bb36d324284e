//! The io_uring engine: every read of a batch queued and handed to the
//! kernel with one system call, completions reaped together.
//!
//! The kernel writes into our page buffers until a read completes, so a
//! batch never returns while one of its reads may still be in flight: an
//! interrupted wait (EINTR) is retried, a full submission queue is handed to
//! the kernel and the push retried, and every queued read is waited for
//! before the batch's result is decided. Each read is tagged with its
//! batch's generation, so a completion left from an earlier batch is
//! counted as stale and never taken for a row of this one.
//!
//! Should the ring itself keep failing, its buffers are leaked (a read still
//! in flight then lands in memory nothing else uses), a fresh ring replaces
//! it, and after [`MAX_RESETS`] the reader falls back to the pread pool.

use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, squeue, types};

use super::pages::{PAGE, PageError, PageRead, Pages};

/// Reads in flight at once (a larger batch goes in chunks of this many).
pub const MAX_IN_FLIGHT: usize = 256;
/// Rings given up on before the reader falls back to the pread pool.
pub(crate) const MAX_RESETS: u32 = 4;
/// Failed waits in a row (other than EINTR) before a ring is given up on.
const MAX_WAIT_ERRORS: u32 = 3;

/// The io_uring calls the engine makes, so tests can inject faults.
pub(crate) trait Ring: Send {
    /// Queue `entry`; false when the submission queue is full.
    ///
    /// # Safety
    /// The buffer the entry points at must stay valid and untouched until
    /// its completion is reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> bool;
    /// Hand queued entries to the kernel and wait for `want` completions.
    fn submit_and_wait(&mut self, want: usize) -> std::io::Result<usize>;
    /// Take every completion waiting, as (user data, result).
    fn reap(&mut self, into: &mut Vec<(u64, i32)>);
}

impl Ring for IoUring {
    unsafe fn push(&mut self, entry: &squeue::Entry) -> bool {
        // SAFETY: forwarded from the caller.
        unsafe { self.submission().push(entry) }.is_ok()
    }

    fn submit_and_wait(&mut self, want: usize) -> std::io::Result<usize> {
        IoUring::submit_and_wait(self, want)
    }

    fn reap(&mut self, into: &mut Vec<(u64, i32)>) {
        into.extend(self.completion().map(|c| (c.user_data(), c.result())));
    }
}

/// Makes a ring (a real one, or one with faults in tests).
pub(crate) type RingFactory = Box<dyn FnMut() -> std::io::Result<Box<dyn Ring>> + Send>;

/// A real ring of `MAX_IN_FLIGHT` entries.
pub(crate) fn real_ring() -> std::io::Result<Box<dyn Ring>> {
    Ok(Box::new(IoUring::new(MAX_IN_FLIGHT as u32)?))
}

/// What the engine has seen go wrong (for logs, metrics and tests).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingStats {
    /// Completions of earlier batches, discarded.
    pub stale: u64,
    /// Waits interrupted by a signal, retried.
    pub interrupted: u64,
    /// Rings given up on (their buffers leaked).
    pub resets: u32,
}

/// Reads pages through io_uring.
pub(crate) struct UringEngine {
    ring: Box<dyn Ring>,
    /// Every read's I/O priority (the kernel's encoding).
    ioprio: u16,
    new_ring: RingFactory,
    pages: Pages,
    generation: u32,
    done: Vec<bool>,
    reaped: Vec<(u64, i32)>,
    stats: RingStats,
    broken: bool,
}

fn tag(generation: u32, index: usize) -> u64 {
    (u64::from(generation) << 32) | index as u64
}

fn untag(user_data: u64) -> (u32, usize) {
    ((user_data >> 32) as u32, (user_data & 0xFFFF_FFFF) as usize)
}

impl UringEngine {
    pub(crate) fn new(mut new_ring: RingFactory, ioprio: u16) -> std::io::Result<Self> {
        let ring = new_ring()?;
        Ok(Self {
            ring,
            ioprio,
            new_ring,
            pages: Pages::new(24),
            generation: 0,
            done: Vec::with_capacity(MAX_IN_FLIGHT),
            reaped: Vec::with_capacity(MAX_IN_FLIGHT),
            stats: RingStats::default(),
            broken: false,
        })
    }

    /// What went wrong so far.
    pub(crate) fn stats(&self) -> RingStats {
        self.stats
    }

    /// True once the engine has given up on io_uring (too many resets).
    pub(crate) fn is_broken(&self) -> bool {
        self.broken
    }

    /// Read every page of `plan` (at most [`MAX_IN_FLIGHT`]) from `fd`, each
    /// row into its place in `out`. Returns only when no read of this batch
    /// can still write into the engine's buffers.
    pub(crate) fn read(
        &mut self,
        fd: RawFd,
        plan: &[PageRead],
        out: &mut [u8],
    ) -> Result<(), PageError> {
        let n = plan.len();
        assert!(n <= MAX_IN_FLIGHT, "the reader chunks batches");
        if self.broken {
            return Err(PageError::Io(std::io::Error::other(
                "io_uring was given up on",
            )));
        }
        if self.pages.len() < n {
            self.pages = Pages::new(n.next_power_of_two().min(MAX_IN_FLIGHT));
        }
        self.generation = self.generation.wrapping_add(1);
        self.done.clear();
        self.done.resize(n, false);
        let mut state = Batch {
            completed: 0,
            first_err: None,
            wait_errors: 0,
        };
        for (i, read) in plan.iter().enumerate() {
            let entry = opcode::Read::new(types::Fd(fd), self.pages.page_ptr(i), PAGE as u32)
                .offset(read.offset)
                .ioprio(self.ioprio)
                .build()
                .user_data(tag(self.generation, i));
            // SAFETY: the page stays allocated and untouched until its
            // completion is reaped: this function waits for every read it
            // queued, and a ring given up on leaks its buffers instead.
            let mut full = 0;
            while !unsafe { self.ring.push(&entry) } {
                // Full: hand what is queued to the kernel, then push again.
                full += 1;
                let waited = if full > MAX_WAIT_ERRORS {
                    Err(std::io::Error::other("the submission queue stays full"))
                } else {
                    self.wait(0, plan, out, &mut state)
                };
                if let Err(e) = waited {
                    return Err(self.give_up(e));
                }
            }
        }
        while state.completed < n {
            if let Err(e) = self.wait(1, plan, out, &mut state) {
                return Err(self.give_up(e));
            }
        }
        state.first_err.map_or(Ok(()), Err)
    }

    /// One wait for `want` completions, then take in what completed.
    fn wait(
        &mut self,
        want: usize,
        plan: &[PageRead],
        out: &mut [u8],
        state: &mut Batch,
    ) -> Result<(), std::io::Error> {
        match self.ring.submit_and_wait(want) {
            Ok(_) => state.wait_errors = 0,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                self.stats.interrupted += 1;
            }
            // The kernel has completions to hand over first; reap below.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {}
            Err(e) => {
                state.wait_errors += 1;
                if state.wait_errors >= MAX_WAIT_ERRORS {
                    return Err(e);
                }
            }
        }
        self.reaped.clear();
        self.ring.reap(&mut self.reaped);
        for &(user_data, res) in &self.reaped {
            let (generation, i) = untag(user_data);
            if generation != self.generation || i >= plan.len() || self.done[i] {
                self.stats.stale += 1;
                continue;
            }
            self.done[i] = true;
            state.completed += 1;
            let taken = if res < 0 {
                Err(PageError::Io(std::io::Error::from_raw_os_error(-res)))
            } else {
                let len = plan[i].len;
                let row = &mut out[i * len..(i + 1) * len];
                plan[i].take_row(self.pages.page_mut(i), res as usize, row)
            };
            if let Err(e) = taken {
                state.first_err = state.first_err.take().or(Some(e));
            }
        }
        Ok(())
    }

    /// The ring keeps failing with reads possibly in flight: leak their
    /// buffers, start a fresh ring (or give up on io_uring).
    fn give_up(&mut self, e: std::io::Error) -> PageError {
        let pages = std::mem::replace(&mut self.pages, Pages::new(24));
        // A read of the old ring may still land in these pages: they are
        // never freed or reused (at most MAX_RESETS x 1 MiB).
        std::mem::forget(pages);
        self.stats.resets += 1;
        tracing::error!(error = %e, resets = self.stats.resets, "io_uring keeps failing; starting a fresh ring");
        if self.stats.resets >= MAX_RESETS {
            self.broken = true;
        } else {
            match (self.new_ring)() {
                Ok(ring) => self.ring = ring,
                Err(_) => self.broken = true,
            }
        }
        PageError::Io(e)
    }
}

struct Batch {
    completed: usize,
    first_err: Option<PageError>,
    wait_errors: u32,
}
