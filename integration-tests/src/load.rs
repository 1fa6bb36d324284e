//! Background I/O on a drive, the neighbours an SSD copy competes with: a
//! sequential reader (an expert-streaming stand-in: 1 MiB O_DIRECT reads,
//! 32 in flight, looping over a file) and a writer (1 MiB buffered writes
//! with an fsync every 8 MiB, as page writeback does, looping over a
//! bounded file). Each runs on its own thread at the default I/O priority
//! until stopped or dropped, counting the bytes it moved and the longest
//! the drive kept it waiting.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

/// One read or write.
pub const CHUNK: usize = 1 << 20;
/// Reads in flight.
pub const READS_IN_FLIGHT: usize = 32;
/// Bytes written between fsyncs.
pub const FSYNC_EVERY: u64 = 8 << 20;

/// A background load on its own thread.
#[derive(Debug)]
pub struct Streamer {
    what: &'static str,
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
    longest_wait_us: Arc<AtomicU64>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl Streamer {
    /// Read `path` sequentially with O_DIRECT, [`READS_IN_FLIGHT`] reads of
    /// [`CHUNK`] at a time, from the start again at its end.
    pub fn reader(path: &Path) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        let len = file.metadata()?.len() / CHUNK as u64 * CHUNK as u64;
        if len == 0 {
            return Err(io::Error::other(format!(
                "{} is smaller than one {CHUNK}-byte read",
                path.display()
            )));
        }
        Self::start("sequential reader", move |stop, bytes, wait| {
            read_loop(&file, len, &stop, (&bytes, &wait))
        })
    }

    /// Write [`CHUNK`]s to `path` (created, at most `file_bytes` long, then
    /// from its start again), with an fsync every [`FSYNC_EVERY`] bytes.
    pub fn writer(path: &Path, file_bytes: u64) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(path)?;
        let len = (file_bytes / CHUNK as u64).max(1) * CHUNK as u64;
        Self::start("writer with fsync", move |stop, bytes, wait| {
            write_loop(&file, len, &stop, (&bytes, &wait))
        })
    }

    fn start(
        what: &'static str,
        body: impl FnOnce(Arc<AtomicBool>, Arc<AtomicU64>, Arc<AtomicU64>) -> io::Result<()>
        + Send
        + 'static,
    ) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let bytes = Arc::new(AtomicU64::new(0));
        let longest_wait_us = Arc::new(AtomicU64::new(0));
        let (s, b, w) = (
            Arc::clone(&stop),
            Arc::clone(&bytes),
            Arc::clone(&longest_wait_us),
        );
        let thread = std::thread::Builder::new()
            .name("io-load".into())
            .spawn(move || body(s, b, w))?;
        Ok(Self {
            what,
            stop,
            bytes,
            longest_wait_us,
            thread: Some(thread),
        })
    }

    /// The longest the drive kept this load waiting since the last call,
    /// in microseconds: for the reader, the longest wait for any of its
    /// reads in flight to complete; for the writer, its longest write or
    /// fsync. A floor for what one read of another process's can take on
    /// the same drive meanwhile.
    pub fn take_longest_wait_us(&self) -> u64 {
        self.longest_wait_us.swap(0, Ordering::Relaxed)
    }

    /// What it does, for reports.
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// Bytes moved so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Stop and wait for the thread; an error it met is returned.
    pub fn stop(mut self) -> io::Result<()> {
        self.join()
    }

    fn join(&mut self) -> io::Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(io::Error::other("the load thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// Make `path` a file of `bytes` bytes of data on its drive (written and
/// synced, not sparse: a sparse file reads without touching the drive),
/// unless it already is one.
pub fn data_file(path: &Path, bytes: u64) -> io::Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == bytes) {
        return Ok(());
    }
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let file = File::create(&partial)?;
    let chunk = vec![0xa5u8; 4 * CHUNK];
    let mut at = 0;
    while at < bytes {
        let n = (bytes - at).min(chunk.len() as u64) as usize;
        file.write_all_at(&chunk[..n], at)?;
        at += n as u64;
    }
    file.sync_all()?;
    std::fs::rename(&partial, path)
}

/// A rate over an interval: bytes moved between two readings.
#[derive(Debug, Clone, Copy)]
pub struct Meter {
    at: Instant,
    bytes: u64,
}

impl Meter {
    /// Start measuring `s`.
    pub fn start(s: &Streamer) -> Self {
        Self {
            at: Instant::now(),
            bytes: s.bytes(),
        }
    }

    /// MiB/s of `s` since the start.
    pub fn mib_per_second(&self, s: &Streamer) -> f64 {
        let secs = self.at.elapsed().as_secs_f64().max(1e-9);
        (s.bytes() - self.bytes) as f64 / (1 << 20) as f64 / secs
    }
}

/// What a load counts: bytes moved, and its longest wait in microseconds.
type Counts<'a> = (&'a AtomicU64, &'a AtomicU64);

fn waited(longest_us: &AtomicU64, since: Instant) {
    let us = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
    longest_us.fetch_max(us, Ordering::Relaxed);
}

fn read_loop(file: &File, len: u64, stop: &AtomicBool, counts: Counts) -> io::Result<()> {
    let layout = std::alloc::Layout::from_size_align(CHUNK * READS_IN_FLIGHT, 4096)
        .map_err(io::Error::other)?;
    // SAFETY: a non-zero size; freed below with the same layout, after every
    // read into it has completed (the ring is drained first).
    let buf = unsafe { std::alloc::alloc(layout) };
    if buf.is_null() {
        return Err(io::Error::other("out of memory"));
    }
    let result = read_ring(file, len, buf, stop, counts);
    // SAFETY: allocated above with this layout; no read is in flight.
    unsafe { std::alloc::dealloc(buf, layout) };
    result
}

fn read_ring(
    file: &File,
    len: u64,
    buf: *mut u8,
    stop: &AtomicBool,
    (bytes, longest_us): Counts,
) -> io::Result<()> {
    let mut ring = io_uring::IoUring::new(READS_IN_FLIGHT as u32)?;
    let fd = io_uring::types::Fd(file.as_raw_fd());
    let mut next = 0u64;
    let mut in_flight = 0usize;
    let push = |ring: &mut io_uring::IoUring, slot: usize, next: &mut u64| {
        // SAFETY: slot < READS_IN_FLIGHT, inside the buffer.
        let ptr = unsafe { buf.add(slot * CHUNK) };
        let sqe = io_uring::opcode::Read::new(fd, ptr, CHUNK as u32)
            .offset(*next)
            .build()
            .user_data(slot as u64);
        *next = (*next + CHUNK as u64) % len;
        // SAFETY: the slot's buffer stays allocated until the ring is
        // drained (below), and is not touched meanwhile.
        unsafe { ring.submission().push(&sqe) }.is_ok()
    };
    for slot in 0..READS_IN_FLIGHT {
        if push(&mut ring, slot, &mut next) {
            in_flight += 1;
        }
    }
    let mut first_err = None;
    while in_flight > 0 {
        let since = Instant::now();
        match ring.submit_and_wait(1) {
            Ok(_) => waited(longest_us, since),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in done {
            in_flight -= 1;
            if res < 0 {
                first_err = first_err.or(Some(io::Error::from_raw_os_error(-res)));
            } else {
                bytes.fetch_add(res as u64, Ordering::Relaxed);
            }
            if first_err.is_none()
                && !stop.load(Ordering::Relaxed)
                && push(&mut ring, slot as usize, &mut next)
            {
                in_flight += 1;
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

fn write_loop(file: &File, len: u64, stop: &AtomicBool, counts: Counts) -> io::Result<()> {
    let (bytes, longest_us) = counts;
    let chunk = vec![0x5au8; CHUNK];
    let (mut at, mut since_sync) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let since = Instant::now();
        file.write_all_at(&chunk, at)?;
        at = (at + CHUNK as u64) % len;
        since_sync += CHUNK as u64;
        if since_sync >= FSYNC_EVERY {
            file.sync_data()?;
            since_sync = 0;
        }
        waited(longest_us, since);
        bytes.fetch_add(CHUNK as u64, Ordering::Relaxed);
    }
    file.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reader_and_the_writer_move_bytes_until_stopped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("data");
        std::fs::write(&path, vec![1u8; 4 * CHUNK]).expect("write");
        let r = Streamer::reader(&path).expect("reader");
        let w = Streamer::writer(&dir.path().join("out"), 2 * CHUNK as u64).expect("writer");
        let started = Instant::now();
        while (r.bytes() < 8 * CHUNK as u64 || w.bytes() < 8 * CHUNK as u64)
            && started.elapsed().as_secs() < 20
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(r.bytes() >= 8 * CHUNK as u64, "{}", r.bytes());
        assert!(w.bytes() >= 8 * CHUNK as u64, "{}", w.bytes());
        // Each waited for its drive at least once, and a wait is taken once.
        assert!(r.take_longest_wait_us() > 0 && w.take_longest_wait_us() > 0);
        r.stop().expect("reader ends cleanly");
        w.stop().expect("writer ends cleanly");
        // The writer's file never grows past its bound.
        let len = std::fs::metadata(dir.path().join("out"))
            .expect("stat")
            .len();
        assert!(len <= 2 * CHUNK as u64, "{len}");
        assert!(Streamer::reader(&dir.path().join("missing")).is_err());
    }
}
