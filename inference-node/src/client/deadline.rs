//! A lookup's deadline without the runtime's timer while it busy-polls.
//!
//! `tokio::time::timeout_at` puts an entry in the runtime's timer wheel the
//! first time the lookup is pending and takes the timer driver's lock again
//! to drop it, on every lookup. A polling lookup is pending only because
//! its reader yields every few microseconds ([`busy_yield`]), and is polled
//! again right after each yield, so its deadline can be checked on the
//! clock instead. [`within`] arms the runtime's timer only once the lookup
//! waits for something else (the socket, a lock, another reader), which is
//! when nothing else would poll it before the deadline. Measured in
//! `engram-bench floor` (docs/benchmarks.md, "The client's timer").
//!
//! A lookup that reads its own answer and sleeps on the socket needs no
//! timer of its own either: the reader keeps one clock for its connection
//! ([`watch`]), armed no later than the deadline of the lookup it reads
//! for. Deadlines of back-to-back lookups come later and later, so that
//! clock is moved about once per lookup timeout, not registered and
//! dropped in the runtime's timer on every lookup (docs/benchmarks.md,
//! "The reader's clock").

use std::cell::Cell;
use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

thread_local! {
    /// Set by [`busy_yield`] during a poll; read and cleared by [`within`]
    /// right after the poll of its future, on the same thread.
    static YIELDED: Cell<bool> = const { Cell::new(false) };
    /// The deadline of the lookup [`within`] is polling, for [`watch`].
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
    /// Set by [`watch`]: a clock wakes the lookup by its deadline.
    static WATCHED: Cell<bool> = const { Cell::new(false) };
}

/// A reader about to sleep on its socket (`cx` registered there): keep
/// `clock` armed no later than the deadline of the lookup being polled,
/// and wake its task then, so that [`within`] arms no timer of its own.
/// The clock is moved only when it would ring too late or has rung; it
/// stays armed after the lookup (ringing once, for nobody, when the
/// connection has been idle that long). Outside [`within`], nothing.
pub(super) fn watch(clock: &mut Option<Pin<Box<Sleep>>>, cx: &mut Context<'_>) {
    let Some(deadline) = DEADLINE.get() else {
        return;
    };
    let clock = clock.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
    loop {
        if clock.deadline() > deadline || clock.is_elapsed() {
            clock.as_mut().reset(deadline);
        }
        match clock.as_mut().poll(cx) {
            Poll::Pending => break,
            // Rang for an earlier lookup: set it again for this one.
            Poll::Ready(()) if Instant::now() < deadline => {}
            // Past this lookup's deadline: `within` sees it on the clock.
            Poll::Ready(()) => break,
        }
    }
    WATCHED.set(true);
}

/// Yield to the runtime from a busy-polling loop: the task is woken again
/// at once (after the runtime's drivers had their turn), so [`within`]
/// needs no timer for this wait.
pub(super) async fn busy_yield() {
    YIELDED.set(true);
    tokio::task::yield_now().await;
}

/// `fut` if it finishes by `deadline`, else `Err(())` (as soon as the
/// clock or the runtime's timer sees the deadline pass).
pub(super) async fn within<F: Future>(deadline: Instant, fut: F) -> Result<F::Output, ()> {
    let mut fut = pin!(fut);
    // Made only when needed: a sleep takes the timer driver's lock when it
    // is dropped, armed or not.
    let mut sleep = pin!(None::<Sleep>);
    std::future::poll_fn(|cx| {
        YIELDED.set(false);
        WATCHED.set(false);
        let outer = DEADLINE.replace(Some(deadline));
        let polled = fut.as_mut().poll(cx);
        DEADLINE.set(outer);
        if let Poll::Ready(v) = polled {
            return Poll::Ready(Ok(v));
        }
        let yielded = YIELDED.replace(false);
        let watched = WATCHED.replace(false);
        if sleep.is_none() {
            if Instant::now() >= deadline {
                return Poll::Ready(Err(()));
            }
            if yielded || watched {
                // Polled again at once, or woken by the reader's clock by
                // the deadline: the clock is read then.
                return Poll::Pending;
            }
            sleep.set(Some(tokio::time::sleep_until(deadline)));
        }
        match sleep.as_mut().as_pin_mut().map(|s| s.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(Err(())),
            _ => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    }

    #[test]
    fn a_future_done_in_time_is_its_output() {
        rt().block_on(async {
            let deadline = Instant::now() + Duration::from_secs(5);
            assert_eq!(within(deadline, async { 7 }).await, Ok(7));
            // Done after some busy-poll yields and a real wait.
            let work = async {
                for _ in 0..10 {
                    busy_yield().await;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                8
            };
            assert_eq!(within(deadline, work).await, Ok(8));
        });
    }

    /// `fut` never finishes: `within` ends it at its deadline, `after` from
    /// now, not before, and not only when the harness gives up 1.5 s on
    /// (nothing woke it).
    async fn times_out(fut: impl Future<Output = ()>, after: Duration) {
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_millis(1500), within(t + after, fut)).await;
        assert_eq!(r, Ok(Err(())), "not ended by its deadline");
        let took = t.elapsed();
        assert!(took >= after, "{took:?}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
    }

    #[test]
    fn a_busy_polling_future_times_out_on_the_clock() {
        let spins = async {
            loop {
                busy_yield().await;
            }
        };
        rt().block_on(times_out(spins, Duration::from_millis(20)));
    }

    #[test]
    fn a_future_that_sleeps_times_out_on_the_timer() {
        // Yields first (no timer), then waits for nothing at all: only the
        // runtime's timer can end it.
        let sleeps = async {
            busy_yield().await;
            std::future::pending::<()>().await;
        };
        rt().block_on(times_out(sleeps, Duration::from_millis(20)));
    }

    /// A reader asleep on a socket that never answers, with `clock`.
    async fn asleep(clock: &mut Option<Pin<Box<Sleep>>>) {
        std::future::poll_fn(|cx| {
            watch(clock, cx);
            Poll::<()>::Pending
        })
        .await
    }

    #[test]
    fn the_readers_clock_ends_a_lookup_at_its_deadline() {
        rt().block_on(async {
            times_out(asleep(&mut None), Duration::from_millis(20)).await;
        });
    }

    #[test]
    fn the_readers_clock_is_moved_for_each_deadline() {
        rt().block_on(async {
            let mut clock = None;
            // A lookup answered at once leaves the clock set 10 s on.
            let answered = std::future::poll_fn(|cx| {
                if clock.is_some() {
                    return Poll::Ready(());
                }
                watch(&mut clock, cx);
                cx.waker().wake_by_ref();
                Poll::Pending
            });
            let far = Instant::now() + Duration::from_secs(10);
            assert_eq!(within(far, answered).await, Ok(()));
            assert!(clock.as_ref().is_some_and(|c| c.deadline() == far));
            // A nearer deadline moves it earlier...
            times_out(asleep(&mut clock), Duration::from_millis(20)).await;
            // ...and once it rang, a later one sets it again.
            times_out(asleep(&mut clock), Duration::from_millis(40)).await;
        });
    }

    #[test]
    fn a_deadline_already_past_ends_a_pending_future_at_once() {
        rt().block_on(async {
            let deadline = Instant::now();
            let stuck = std::future::pending::<()>();
            assert_eq!(within(deadline, stuck).await, Err(()));
            // Ready work still wins over a past deadline.
            assert_eq!(within(deadline, async { 1 }).await, Ok(1));
        });
    }
}
