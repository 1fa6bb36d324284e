//! Time as the token loop sees it: the real clock (sleeps most of a wait
//! and spins only for its last stretch, so the loop is precise to a few
//! microseconds without holding a core) and, for tests, a clock that jumps.

use std::time::{Duration, Instant};

use engram_sync::Mutex;

/// How the loop reads and spends time. Times are offsets from the run's start.
pub trait Clock {
    /// Now.
    fn now(&self) -> Duration;
    /// Return at `t` (at once when `t` has passed).
    fn sleep_until(&self, t: Duration);
}

/// Below this much remaining time a wait spins instead of sleeping.
const SPIN: Duration = Duration::from_micros(100);

/// The real clock, started at construction.
#[derive(Debug, Clone, Copy)]
pub struct RealClock {
    origin: Instant,
}

impl RealClock {
    /// A clock whose zero is now. Also asks the kernel for 1 us timer slack
    /// on the calling thread (the default 50 us would blur short sleeps).
    pub fn start() -> Self {
        // SAFETY: PR_SET_TIMERSLACK takes an integer and touches no memory.
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
        }
        Self {
            origin: Instant::now(),
        }
    }

    /// The instant of its zero.
    pub fn origin(&self) -> Instant {
        self.origin
    }
}

impl Clock for RealClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn sleep_until(&self, t: Duration) {
        loop {
            let now = self.now();
            if now >= t {
                return;
            }
            let left = t - now;
            if left > SPIN {
                std::thread::sleep(left - SPIN);
            } else {
                // Any other runnable thread on this core first: the I/O
                // thread the loop just handed a fetch to is often woken
                // here, and would otherwise wait for this spin to end.
                std::thread::yield_now();
            }
        }
    }
}

/// A clock that only moves when the loop waits (tests).
#[derive(Debug, Default)]
pub struct FakeClock {
    now: Mutex<Duration>,
}

impl FakeClock {
    /// Move forward by `d` (work that takes time, such as fusion).
    pub fn advance(&self, d: Duration) {
        *self.now.lock() += d;
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        *self.now.lock()
    }

    fn sleep_until(&self, t: Duration) {
        let mut now = self.now.lock();
        *now = (*now).max(t);
    }
}

/// CLOCK_MONOTONIC now, in microseconds (the same clock in every process).
pub fn monotonic_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_clock_wakes_on_time() {
        let c = RealClock::start();
        for us in [50u64, 300, 2_000] {
            let t = c.now() + Duration::from_micros(us);
            c.sleep_until(t);
            let late = c.now() - t;
            // Never early; late only by scheduling noise.
            assert!(
                late < Duration::from_millis(20),
                "{late:?} late for {us} us"
            );
        }
    }

    #[test]
    fn the_fake_clock_never_goes_back() {
        let c = FakeClock::default();
        c.sleep_until(Duration::from_millis(5));
        c.sleep_until(Duration::from_millis(2));
        assert_eq!(c.now(), Duration::from_millis(5));
        c.advance(Duration::from_micros(10));
        assert_eq!(c.now(), Duration::from_micros(5_010));
    }
}
