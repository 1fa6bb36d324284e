//! A CPU stand-in for an engine's ring kernels (what a GPU engine's
//! publish and wait kernels do, with the host's clock for the GPU timer):
//! publish a step's ids, then spin on a layer section's done word until it
//! or the ring's GPU deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inference_node::ring::RingMemory;

/// The engine's side of one ring.
#[derive(Debug)]
pub struct CpuEngine {
    /// The ring.
    pub ring: Arc<RingMemory>,
    /// The last `seq` published.
    pub seq: u64,
    /// The step tag the next requests carry (0: none), as an engine's
    /// plugin sets it before each step.
    pub step: u64,
}

/// What one layer section's wait came to.
#[derive(Debug)]
pub struct Answer {
    /// The status the client wrote; `None` when the GPU's deadline ended
    /// the wait first (rows are then zeros).
    pub status: Option<u32>,
    /// How it was served (`SERVED_*` bits).
    pub served: u32,
    /// The rows.
    pub rows: Vec<u8>,
    /// How long the wait spun.
    pub waited: Duration,
}

impl CpuEngine {
    /// A stand-in for `ring`, nothing published yet.
    pub fn new(ring: Arc<RingMemory>) -> Self {
        Self {
            ring,
            seq: 0,
            step: 0,
        }
    }

    /// Publish the next request: `ids[p][k]` is position `p`'s ids of the
    /// `k`-th layer section in `mask`, `columns` each.
    pub fn publish(&mut self, mask: u32, ids: &[Vec<Vec<i64>>]) -> u64 {
        self.seq += 1;
        let sections = mask.count_ones() as usize;
        let mut flat = Vec::new();
        for k in 0..sections {
            for p in ids {
                flat.extend_from_slice(&p[k]);
            }
        }
        self.ring.tag(self.seq, self.step);
        self.ring
            .publish(self.seq, mask, ids.len() as u32, &flat)
            .expect("publish");
        self.seq
    }

    /// Spin on `seq`'s done word of section `l` (the wait kernel's loop);
    /// at the GPU's deadline, zeros and no status, and `seq` in the slot's
    /// give-up word.
    pub fn wait(&self, seq: u64, l: u32, positions: u32) -> Answer {
        let sh = *self.ring.shape();
        let s = (seq % u64::from(sh.slots)) as u32;
        let t0 = Instant::now();
        let limit = Duration::from_nanos(sh.gpu_deadline_ns);
        loop {
            if self.ring.done(s, l) == seq {
                self.ring.waited(l, t0.elapsed().as_nanos() as u64);
                return Answer {
                    status: Some(self.ring.status(s, l)),
                    served: self.ring.served(s, l),
                    rows: self.ring.rows(s, l, positions),
                    waited: t0.elapsed(),
                };
            }
            // A GPU spins on its own cores; this stand-in shares the
            // host's with the client it waits for.
            std::thread::yield_now();
            if t0.elapsed() > limit {
                self.ring.waited(l, t0.elapsed().as_nanos() as u64);
                self.ring.gave_up(seq);
                let n = positions as usize * sh.columns as usize * sh.row_bytes as usize;
                return Answer {
                    status: None,
                    served: 0,
                    rows: vec![0; n],
                    waited: t0.elapsed(),
                };
            }
            std::hint::spin_loop();
        }
    }
}
