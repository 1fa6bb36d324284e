//! How lookups reach the SSD copy's reader threads and how their answers
//! come back, with no allocation in the steady state: one queue whose
//! storage is kept from job to job, and a completion per job in flight
//! that is reused once its job is answered.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use engram_sync::{Condvar, Mutex};

use crate::source::SourceError;

/// A lookup for a reader: the rows, the caller's buffer to read them
/// into, and where both go back.
pub(super) struct Job {
    pub rows: Vec<u64>,
    pub buf: Vec<u8>,
    /// `None` once the reader took it to answer.
    pub reply: Option<Arc<Completion>>,
}

/// A job's outcome, with its buffers.
pub(super) type Done = (Result<(), SourceError>, Vec<u8>, Vec<u64>);

/// The jobs waiting for a reader, in order.
#[derive(Debug, Default)]
pub(super) struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

#[derive(Debug, Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    stopped: bool,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("rows", &self.rows.len())
            .finish()
    }
}

impl Queue {
    /// Queue `job` for the next free reader; handed back when the readers
    /// have stopped.
    pub fn push(&self, job: Job) -> Result<(), Job> {
        let mut st = self.state.lock();
        if st.stopped {
            return Err(job);
        }
        st.jobs.push_back(job);
        drop(st);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job, waiting for one; `None` once stopped.
    pub fn pop(&self) -> Option<Job> {
        let mut st = self.state.lock();
        loop {
            if st.stopped {
                return None;
            }
            if let Some(job) = st.jobs.pop_front() {
                return Some(job);
            }
            st = self.ready.wait(st);
        }
    }

    /// Stop the readers: each returns from [`Self::pop`]; jobs still
    /// queued are dropped (their callers see the reader stopped).
    pub fn stop(&self) {
        let mut st = self.state.lock();
        st.stopped = true;
        st.jobs.clear();
        drop(st);
        self.ready.notify_all();
    }
}

/// Where a reader leaves a job's outcome, and whom it wakes. Reused for
/// the next job once its caller took the outcome and the reader let go of
/// the job (the caller holds the only reference again).
#[derive(Debug, Default)]
pub(super) struct Completion {
    state: Mutex<CompletionState>,
}

#[derive(Debug, Default)]
struct CompletionState {
    done: Option<Done>,
    waker: Option<Waker>,
    /// The caller stopped waiting (a hedge that lost, a deadline): the job
    /// is skipped if not started, its outcome dropped if it was.
    cancelled: bool,
    /// The job was answered, or dropped unanswered.
    ended: bool,
}

impl Completion {
    /// Ready for another job.
    pub fn reset(&self) {
        *self.state.lock() = CompletionState::default();
    }

    /// True when the caller no longer waits.
    pub fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }

    /// The reader's answer: kept for the caller, or dropped when the
    /// caller left. The reader's reference goes before the caller is woken,
    /// so the caller finds the completion free to reuse.
    pub fn complete(self: Arc<Self>, done: Done) {
        let waker = {
            let mut st = self.state.lock();
            st.ended = true;
            if st.cancelled {
                return;
            }
            st.done = Some(done);
            st.waker.take()
        };
        drop(self);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The job is gone: if it was not answered, its caller stops waiting.
    fn end(&self) {
        let mut st = self.state.lock();
        if st.ended {
            return;
        }
        st.ended = true;
        let waker = st.waker.take();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The outcome once there; `Ready(None)` when the job was dropped
    /// unanswered (the readers stopped).
    pub fn poll_done(&self, cx: &mut Context<'_>) -> Poll<Option<Done>> {
        let mut st = self.state.lock();
        if let Some(done) = st.done.take() {
            return Poll::Ready(Some(done));
        }
        if st.ended {
            return Poll::Ready(None);
        }
        match &mut st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// The caller stops waiting: the job is skipped, or its outcome
    /// dropped.
    pub fn cancel(&self) {
        let mut st = self.state.lock();
        st.cancelled = true;
        st.waker = None;
        st.done = None;
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // A job dropped without its answer (the readers stopped) still
        // ends its caller's wait; after an answer this does nothing.
        if let Some(reply) = self.reply.take() {
            reply.end();
        }
    }
}
