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

use std::cell::Cell;
use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use tokio::time::Instant;

thread_local! {
    /// Set by [`busy_yield`] during a poll; read and cleared by [`within`]
    /// right after the poll of its future, on the same thread.
    static YIELDED: Cell<bool> = const { Cell::new(false) };
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
    let mut sleep = pin!(None::<tokio::time::Sleep>);
    std::future::poll_fn(|cx| {
        YIELDED.set(false);
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Ok(v));
        }
        let yielded = YIELDED.replace(false);
        if sleep.is_none() {
            if Instant::now() >= deadline {
                return Poll::Ready(Err(()));
            }
            if yielded {
                // Polled again at once: the clock is read then.
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

    /// `fut` never finishes: `within` ends it at its deadline, 20 ms on.
    async fn times_out(fut: impl Future<Output = ()>) {
        let t = Instant::now();
        assert_eq!(within(t + Duration::from_millis(20), fut).await, Err(()));
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(20), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn a_busy_polling_future_times_out_on_the_clock() {
        rt().block_on(times_out(async {
            loop {
                busy_yield().await;
            }
        }));
    }

    #[test]
    fn a_future_that_sleeps_times_out_on_the_timer() {
        // Yields first (no timer), then waits for nothing at all: only the
        // runtime's timer can end it.
        rt().block_on(times_out(async {
            busy_yield().await;
            std::future::pending::<()>().await;
        }));
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
