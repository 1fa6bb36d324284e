//! Microsecond timers for async code. Tokio's timers count whole
//! milliseconds, longer than table 1's window at 100 tokens/s; spinning
//! until a deadline would hold a core that donors on a small machine need.
//! Instead one thread keeps the pending deadlines, sleeps until the
//! earliest (with 1 us timer slack) and wakes its task: precise to tens of
//! microseconds, and idle between deadlines.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use engram_sync::{Condvar, Mutex};

struct Shared {
    pending: Mutex<HashMap<u64, (Instant, Waker)>>,
    changed: Condvar,
}

static TIMER: OnceLock<Option<&'static Shared>> = OnceLock::new();
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn shared() -> Option<&'static Shared> {
    *TIMER.get_or_init(|| {
        let s: &'static Shared = Box::leak(Box::new(Shared {
            pending: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("precise-timer".into())
            .spawn(move || run(s))
            .ok()
            .map(|_| s)
    })
}

fn run(s: &'static Shared) {
    // SAFETY: PR_SET_TIMERSLACK takes an integer and touches no memory.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
    let mut pending = s.pending.lock();
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        pending.retain(|_, (t, w)| {
            if *t <= now {
                due.push(w.clone());
                false
            } else {
                true
            }
        });
        for w in due {
            w.wake();
        }
        let next = pending.values().map(|(t, _)| *t).min();
        pending = match next {
            None => s.changed.wait(pending),
            Some(t) => {
                s.changed
                    .wait_timeout(pending, t.saturating_duration_since(Instant::now()))
                    .0
            }
        };
    }
}

/// A future that is ready at `deadline`.
#[derive(Debug)]
pub struct Sleep {
    deadline: Instant,
    id: u64,
    fallback: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// Sleep until `deadline` to within tens of microseconds.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        fallback: None,
    }
}

/// Sleep for `d`.
pub fn sleep(d: Duration) -> Sleep {
    sleep_until(Instant::now() + d)
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            return Poll::Ready(());
        }
        let Some(s) = shared() else {
            // No timer thread could start: tokio's coarser timer.
            let d = self.deadline;
            let f = self
                .fallback
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(d.into())));
            return f.as_mut().poll(cx);
        };
        let mut p = s.pending.lock();
        p.insert(self.id, (self.deadline, cx.waker().clone()));
        drop(p);
        s.changed.notify_one();
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(Some(s)) = TIMER.get() {
            s.pending.lock().remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sleeps_end_on_time_and_cancelled_ones_leave_nothing() {
        for us in [200u64, 700, 1_300] {
            let t = Instant::now() + Duration::from_micros(us);
            sleep_until(t).await;
            let late = Instant::now() - t;
            assert!(
                late < Duration::from_millis(20),
                "{late:?} late for {us} us"
            );
        }
        // Many concurrent sleeps each end after their own deadline.
        let start = Instant::now();
        let mut v = Vec::new();
        for i in 0..50u64 {
            v.push(tokio::spawn(async move {
                let t = start + Duration::from_micros(100 * (50 - i));
                sleep_until(t).await;
                Instant::now() >= t
            }));
        }
        for h in v {
            assert!(h.await.expect("task"));
        }
        // A dropped sleep is forgotten.
        {
            let mut s = Box::pin(sleep(Duration::from_secs(60)));
            let waker = Waker::noop();
            assert!(
                s.as_mut()
                    .poll(&mut Context::from_waker(waker))
                    .is_pending()
            );
        }
        let left = TIMER.get().and_then(|s| s.map(|s| s.pending.lock().len()));
        assert_eq!(left, Some(0));
    }
}
