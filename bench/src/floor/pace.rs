//! The same pause before every timed lookup, in every series.
//!
//! Back to back, a series' next request leaves as soon as its own untimed
//! work (drawing row ids, checking every 16th answer, the harness's loop)
//! is done, and that work is not the same in every series. On a virtual
//! machine whose idle CPUs halt at once (no guest halt-polling), a server
//! that waited a few microseconds less is still awake and answers sooner:
//! 4 us more of such work in one series made its lookups 4 to 5 us slower
//! (docs/benchmarks.md, "The same pause before every lookup"). So every
//! series waits the same `pause` from the end of its last lookup to the
//! start of the next, spinning (the client's CPU stays awake, as a node's
//! does while its model computes), and a comparison of two series compares
//! their lookups, not their harnesses.

use std::time::{Duration, Instant};

/// Spaces one series' lookups.
#[derive(Debug)]
pub(super) struct Pacer {
    pause: Duration,
    /// When the last timed lookup ended.
    last: Option<Instant>,
    /// Gaps that the series' own work between lookups made longer than
    /// the pause, and gaps measured.
    overran: u64,
    gaps: u64,
}

impl Pacer {
    pub(super) fn new(pause: Duration) -> Self {
        Self {
            pause,
            last: None,
            overran: 0,
            gaps: 0,
        }
    }

    /// Wait out the rest of the pause since the last lookup ended; the
    /// instant the timed lookup starts.
    pub(super) fn start(&mut self) -> Instant {
        let Some(last) = self.last else {
            return Instant::now();
        };
        let due = last + self.pause;
        let mut now = Instant::now();
        self.gaps += 1;
        if now > due && !self.pause.is_zero() {
            self.overran += 1;
        }
        while now < due {
            std::hint::spin_loop();
            now = Instant::now();
        }
        now
    }

    /// The lookup that started at `t` ended now: its time.
    pub(super) fn took(&mut self, t: Instant) -> Duration {
        let now = Instant::now();
        self.last = Some(now);
        now - t
    }

    /// The series takes its turn: the pause runs from now (another
    /// series' lookups came before; they count as the series' gap only
    /// for its first lookup's wait, not as an overrun).
    pub(super) fn begin(&mut self) {
        self.last = Some(Instant::now());
    }

    /// The share of lookups whose series' own work between lookups took
    /// longer than the pause (those started late, not early).
    pub(super) fn overran(&self) -> f64 {
        if self.gaps == 0 {
            0.0
        } else {
            self.overran as f64 / self.gaps as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_starts_no_sooner_than_the_pause_after_the_last() {
        let pause = Duration::from_millis(2);
        let mut p = Pacer::new(pause);
        // The first lookup owes nothing.
        let t = p.start();
        assert!(t.elapsed() < pause);
        p.took(t);
        let ended = Instant::now();
        let t = p.start();
        assert!(t >= ended, "started before the last lookup ended");
        assert!(
            t - ended + Duration::from_micros(50) >= pause,
            "{:?}",
            t - ended
        );
        assert_eq!(p.overran(), 0.0);
        // Work between lookups longer than the pause is counted, not waited on again.
        p.took(t);
        std::thread::sleep(pause * 2);
        let before = Instant::now();
        let t = p.start();
        assert!(t - before < pause);
        assert_eq!(p.overran(), 0.5);
        // A turn begins with a whole pause, whatever came before.
        std::thread::sleep(pause * 2);
        p.begin();
        let before = Instant::now();
        assert!(p.start() - before + Duration::from_micros(50) >= pause);
        assert_eq!(p.overran(), 1.0 / 3.0);
    }

    #[test]
    fn no_pause_is_back_to_back() {
        let mut p = Pacer::new(Duration::ZERO);
        let t = p.start();
        p.took(t);
        std::thread::sleep(Duration::from_millis(1));
        p.start();
        assert_eq!(p.overran(), 0.0);
    }
}
