//! Log setup shared by the rack's binaries: to stderr (journald captures
//! it under systemd), ANSI colours only on a terminal, the level from
//! `RUST_LOG` or the binary's default, changeable at run time (a reload),
//! and [`RateLimit`] for warnings a peer could otherwise repeat without
//! bound (one per connection or per request).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use engram_sync::Mutex;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Changes the level of the installed log subscriber.
#[derive(Debug, Clone)]
pub struct LogLevel {
    handle: Option<tracing_subscriber::reload::Handle<EnvFilter, tracing_subscriber::Registry>>,
}

impl LogLevel {
    /// Replace the filter with `directives` (`info`, `memory_donor=debug,info`).
    pub fn set(&self, directives: &str) -> Result<(), String> {
        let filter = EnvFilter::try_new(directives).map_err(|e| e.to_string())?;
        match &self.handle {
            Some(h) => h.reload(filter).map_err(|e| e.to_string()),
            None => Err("logging was not initialised".into()),
        }
    }
}

/// Install the global log subscriber; `default_filter` applies when
/// `RUST_LOG` is unset. The handle changes the level later.
pub fn init_logging(default_filter: &str) -> LogLevel {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .try_init()
        .is_ok();
    LogLevel {
        handle: installed.then_some(handle),
    }
}

/// At most `per_second` events a second from one call site; the rest are
/// counted and the count is reported with the next event let through.
///
/// ```ignore
/// static LIMIT: RateLimit = RateLimit::new(5);
/// if let Some(suppressed) = LIMIT.allow() {
///     tracing::warn!(suppressed, %peer, "accept failed");
/// }
/// ```
#[derive(Debug)]
pub struct RateLimit {
    per_second: u32,
    state: Mutex<Option<Window>>,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    passed: u32,
    suppressed: u64,
}

impl RateLimit {
    /// A limiter letting `per_second` events through per second.
    pub const fn new(per_second: u32) -> Self {
        Self {
            per_second,
            state: Mutex::new(None),
        }
    }

    /// `Some(suppressed since the last one let through)` when this event
    /// may be logged, `None` when it is to be dropped (and counted).
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    /// [`RateLimit::allow`] at a given instant.
    pub fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut g = self.state.lock();
        let w = g.get_or_insert(Window {
            start: now,
            passed: 0,
            suppressed: 0,
        });
        if now.saturating_duration_since(w.start) >= Duration::from_secs(1) {
            w.start = now;
            w.passed = 0;
        }
        if w.passed < self.per_second {
            w.passed += 1;
            Some(std::mem::take(&mut w.suppressed))
        } else {
            w.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_limit_passes_n_a_second_and_counts_the_rest() {
        let l = RateLimit::new(3);
        let t0 = Instant::now();
        let passed: Vec<Option<u64>> = (0..10).map(|_| l.allow_at(t0)).collect();
        assert_eq!(&passed[..3], &[Some(0), Some(0), Some(0)]);
        assert!(passed[3..].iter().all(Option::is_none));
        // The next second: the first event carries the count of the dropped seven.
        let t1 = t0 + Duration::from_millis(1000);
        assert_eq!(l.allow_at(t1), Some(7));
        assert_eq!(l.allow_at(t1), Some(0));
    }
}
