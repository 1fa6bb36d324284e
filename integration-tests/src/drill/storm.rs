//! A storm of malformed traffic at a donor's data-plane address: random
//! bytes, frame headers announcing oversized payloads, and half-open
//! connections that never send a byte (kept at `idle` open, reopened as the
//! donor closes them). Bounded: a fixed number of threads, every socket
//! with timeouts, all stopped and joined by [`Storm::stop`]. And the
//! drill that aims it at a donor while the node is being served.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Result, ensure};

use super::report::ensure_timing;
use super::scaffold::{Opts, begin, finish, max_open_during_fault};
use super::{Env, Plan, Report};
use crate::sample;

/// What the storm drill does.
pub(super) const ABOUT: &str =
    "random bytes, oversized lengths and silent connections at the primary";

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

/// The storm drill: the donor stays within its connection bound and the
/// node's connection to it is unhurt.
pub(super) fn storm(env: &Env, o: &Opts) -> Result<Report> {
    let mut plan = Plan::new("storm");
    plan.max_connections = 16;
    plan.hello_timeout_ms = 300;
    // A donor slowed by the storm would show as a hedge won elsewhere.
    plan.hedge = "2ms";
    let (rack, mut run) = begin(env, &plan, o)?;
    let storm = Storm::start(rack.listen("donor-a")?, 2 * plan.max_connections);
    let from =
        run.event("storm at donor-a: random bytes, oversized lengths, 32 silent connections");
    let open_max = max_open_during_fault(&rack, &mut run, o, "donor-a")?;
    let stats = storm.stop();
    let to = run.event("storm over");
    let m = rack.donor_metrics("donor-a")?;
    let refused = sample(&m, "engram_donor_connections_refused_total").unwrap_or(0.0);
    // Connections that never authenticate stay in the pre-auth budget,
    // whose newest evict its oldest.
    let evicted = sample(
        &m,
        "engram_donor_refusals_total{plane=\"data\",reason=\"preauth_evicted\"}",
    )
    .unwrap_or(0.0);
    let out = finish(run, o, true)?;
    let mut r = Report::check("storm", ABOUT, env, &plan, &out)?;
    let during: Vec<_> = r.between(from, to).collect();
    let elsewhere = during
        .iter()
        .filter(|s| {
            s.tables
                .iter()
                .any(|t| t.source.as_deref() != Some("donor-a"))
        })
        .count();
    let failovers: u64 = during
        .iter()
        .flat_map(|s| &s.tables)
        .map(|t| u64::from(t.failovers))
        .sum();
    let steps = during.len();
    let worst_in = r.between(from, to).map(|s| s.stall_us).fold(0.0, f64::max);
    let worst_before = r.between(0.0, from).map(|s| s.stall_us).fold(0.0, f64::max);
    r.figure(
        "storm",
        format!(
            "{} connections, {} KiB of random bytes, {} oversized headers; donor-a had at most {open_max} of {} connections open, refused {refused} at the bound and evicted {evicted} unauthenticated ones",
            stats.connections,
            stats.garbage_bytes / 1024,
            stats.oversized,
            plan.max_connections
        ),
    );
    r.figure(
        "node during the storm",
        format!(
            "worst stall {:.2} ms (before it {:.2} ms); {} of {steps} steps served by donor-a alone (the others by a hedge past 2 ms); {failovers} failovers",
            worst_in / 1e3,
            worst_before / 1e3,
            steps - elsewhere
        ),
    );
    ensure!(
        open_max <= plan.max_connections as f64,
        "donor-a held {open_max} connections, over its bound {}",
        plan.max_connections
    );
    ensure!(
        refused + evicted > 0.0,
        "the storm never reached donor-a's bounds (connections or pre-auth)"
    );
    // The node's connection to donor-a never broke: no lookup failed there.
    ensure!(
        failovers == 0,
        "{failovers} failovers during the storm: the node's connection to donor-a was hurt"
    );
    ensure_timing!(
        elsewhere * 10 <= steps,
        "{elsewhere} of {steps} steps during the storm were not served by donor-a"
    );
    Ok(r)
}
