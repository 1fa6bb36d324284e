//! A storm of malformed traffic at a donor's data-plane address: random
//! bytes, frame headers announcing oversized payloads, and half-open
//! connections that never send a byte (kept at `idle` open, reopened as the
//! donor closes them). Bounded: a fixed number of threads, every socket
//! with timeouts, all stopped and joined by [`Storm::stop`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the storm did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StormStats {
    /// Connections opened.
    pub connections: u64,
    /// Bytes of garbage sent.
    pub garbage_bytes: u64,
    /// Oversized headers sent.
    pub oversized: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    garbage_bytes: AtomicU64,
    oversized: AtomicU64,
}

/// A storm in progress.
#[derive(Debug)]
pub struct Storm {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
}

const TIMEOUT: Duration = Duration::from_millis(200);
/// Between two malformed connections of one thread (hundreds a second).
const PAUSE: Duration = Duration::from_millis(2);

fn connect(addr: SocketAddr, c: &Counters) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, TIMEOUT).ok()?;
    s.set_read_timeout(Some(TIMEOUT)).ok()?;
    s.set_write_timeout(Some(TIMEOUT)).ok()?;
    c.connections.fetch_add(1, Ordering::Relaxed);
    Some(s)
}

/// Read until the peer closes or the timeout passes (so the donor's answer,
/// an error frame or a close, is taken).
fn drain(s: &mut TcpStream) {
    let mut buf = [0u8; 512];
    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
}

impl Storm {
    /// Start it against `addr`, holding `idle` silent connections.
    pub fn start(addr: SocketAddr, idle: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let mut threads = Vec::new();
        // Random bytes.
        let (st, c) = (stop.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            let mut buf = [0u8; 4096];
            while !st.load(Ordering::Relaxed) {
                for b in buf.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8;
                }
                if let Some(mut s) = connect(addr, &c) {
                    if s.write_all(&buf).is_ok() {
                        c.garbage_bytes
                            .fetch_add(buf.len() as u64, Ordering::Relaxed);
                    }
                    drain(&mut s);
                }
                std::thread::sleep(PAUSE);
            }
        }));
        // Oversized lengths: a Hello header announcing ~4 GiB, and a Lookup
        // header doing the same after a valid-looking start.
        let (st, c) = (stop.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            let mut kind = 1u8;
            while !st.load(Ordering::Relaxed) {
                let mut h = Vec::with_capacity(16);
                h.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
                h.extend_from_slice(&[kind, 0, 0, 0]);
                h.extend_from_slice(&7u64.to_le_bytes());
                kind = if kind == 1 { 3 } else { 1 };
                if let Some(mut s) = connect(addr, &c) {
                    if s.write_all(&h).is_ok() {
                        c.oversized.fetch_add(1, Ordering::Relaxed);
                    }
                    drain(&mut s);
                }
                std::thread::sleep(PAUSE);
            }
        }));
        // Half-open: connections that never send.
        let (st, c) = (stop.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !st.load(Ordering::Relaxed) {
                // Drop those the donor closed (a read sees EOF at once).
                held.retain(|s| {
                    let _ = s.set_nonblocking(true);
                    let mut b = [0u8; 1];
                    let alive = matches!((&*s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
                    let _ = s.set_nonblocking(false);
                    alive
                });
                while held.len() < idle && !st.load(Ordering::Relaxed) {
                    match connect(addr, &c) {
                        Some(s) => held.push(s),
                        None => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
        Self {
            stop,
            threads,
            counters,
        }
    }

    /// Stop it, close everything and say what it did.
    pub fn stop(self) -> StormStats {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        StormStats {
            connections: self.counters.connections.load(Ordering::Relaxed),
            garbage_bytes: self.counters.garbage_bytes.load(Ordering::Relaxed),
            oversized: self.counters.oversized.load(Ordering::Relaxed),
        }
    }
}
