//! One lookup through a router, step by step: [`Lookup::begin`] asks the
//! first admissible source; then each [`Event`] is handled by its own
//! step: an answer ([`Lookup::answered`]: the winner, or a failover), the
//! hedge delay ([`Lookup::hedge`]: the next source too), the hard timeout
//! ([`Lookup::past_hard_timeout`]: only the node's own copy is still waited
//! for); when nothing is left in flight, [`Lookup::give_up`] applies the
//! table's policy.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use engram_protocol::encoding::RowEncoding;
use smallvec::SmallVec;
use tokio::time::Instant;

use super::{
    COPY_READ_LIMIT, Fetched, Hedge, Policy, RouteState, Router, RouterError, error_kind,
    sleep_until,
};
use super::{Miss, MissReason};
use crate::source::{FetchJob, FetchSlot, SourceError, SourceKind};

/// Check an answer's rows by their encoding's rule (V4.1's: no NaN
/// scale or value code; the others': no NaN code), naming the first bad
/// row.
fn check_answer(encoding: RowEncoding, rows: &[u8]) -> Result<(), SourceError> {
    if encoding == RowEncoding::V41 {
        return engram_protocol::row::check_rows(rows)
            .map_err(|(at, e)| SourceError::Corrupt(format!("row {at}: {e}")));
    }
    encoding
        .check_rows(rows)
        .map_err(|(at, e)| SourceError::Corrupt(format!("row {at}: {e}")))
}

/// Rotate the donors among `order` left by `k` (modulo their count), the
/// other sources (the node's own copies) staying where they are: `[a, b,
/// ssd]` rotated by 1 is `[b, a, ssd]`.
pub(super) fn rotate_donors(order: &mut [usize], k: usize, is_donor: impl Fn(usize) -> bool) {
    let slots: Vec<usize> = (0..order.len()).filter(|&p| is_donor(order[p])).collect();
    if slots.len() < 2 {
        return;
    }
    let donors: Vec<usize> = slots.iter().map(|&p| order[p]).collect();
    let k = k % donors.len();
    for (j, &p) in slots.iter().enumerate() {
        order[p] = donors[(j + k) % donors.len()];
    }
}

/// An attempt in flight: its fetch (in a slot of the router's, given back
/// when the attempt ends), which source, whether it was a hedge, when sent.
pub(super) struct InFlight {
    slot: FetchSlot,
    source: usize,
    hedge: bool,
    sent: Instant,
}

/// An attempt that finished.
pub(super) struct Answered {
    source: usize,
    hedge: bool,
    sent: Instant,
    result: Result<(), SourceError>,
    job: FetchJob,
    slot: FetchSlot,
}

/// Where a lookup's rows go: the caller's slice (copied in), or the
/// caller's buffer, which the winner's buffer replaces (no copy; the
/// caller's old buffer joins the router's pool).
pub(super) enum Out<'o> {
    Slice(&'o mut [u8]),
    Vec(&'o mut Vec<u8>),
}

impl Out<'_> {
    /// Bytes the caller's slice holds (`None`: a buffer, sized to fit).
    pub(super) fn fixed_len(&self) -> Option<usize> {
        match self {
            Out::Slice(s) => Some(s.len()),
            Out::Vec(_) => None,
        }
    }

    /// Place the winner's rows (`buf`, checked); `buf` is left holding
    /// what should go back to the pool.
    fn place(&mut self, buf: &mut Vec<u8>) {
        match self {
            Out::Slice(s) => s.copy_from_slice(buf),
            Out::Vec(v) => std::mem::swap(*v, buf),
        }
    }

    /// Zeros for `len` bytes.
    fn zeros(&mut self, len: usize) {
        match self {
            Out::Slice(s) => s.fill(0),
            Out::Vec(v) => {
                v.clear();
                v.resize(len, 0);
            }
        }
    }
}

/// Which attempt an answer came from.
struct Attempt {
    source: usize,
    hedge: bool,
    sent: Instant,
}

/// The attempts in flight: a handful at most (the first source, hedges,
/// failovers), kept inline so that a lookup allocates nothing for them,
/// and polled in turn when the lookup's task wakes.
type Attempts = SmallVec<[InFlight; 4]>;

/// The next attempt to finish; `None` when none is in flight.
async fn next_answer(set: &mut Attempts) -> Option<Answered> {
    std::future::poll_fn(|cx: &mut Context<'_>| {
        if set.is_empty() {
            return Poll::Ready(None);
        }
        for i in 0..set.len() {
            if let Poll::Ready((result, job)) = set[i].slot.poll(cx) {
                let a = set.swap_remove(i);
                return Poll::Ready(Some(Answered {
                    source: a.source,
                    hedge: a.hedge,
                    sent: a.sent,
                    result,
                    job,
                    slot: a.slot,
                }));
            }
        }
        Poll::Pending
    })
    .await
}

/// What happened next.
pub(super) enum Event {
    /// An attempt finished.
    Answer(Answered),
    /// The hedge delay passed with no answer: ask the next source too.
    HedgeDue,
    /// The hard timeout passed.
    HardTimeout,
}

/// The part of the hard timeout a stripe of a wide sweep waits for its
/// donor before asking the next replica too.
pub const STRIPE_SHARE: f64 = 0.5;

/// One lookup's state.
pub(super) struct Lookup<'r> {
    router: &'r Router,
    st: &'r RouteState,
    rows: &'r [u64],
    start: Instant,
    deadline: Instant,
    hard: Instant,
    /// Admissible sources, in the configured order; `next` is the first
    /// not asked yet.
    order: SmallVec<[usize; 8]>,
    next: usize,
    inflight: Attempts,
    /// When the next source is asked too, if the ones out stay silent.
    hedge_at: Option<Instant>,
    /// Past the hard timeout only the node's own copy is waited for.
    past_hard: bool,
    /// Whether a silent source is hedged by the route's hedge setting (not
    /// for a stripe of a wide sweep: every replica already carries its
    /// share of it).
    hedging: bool,
    /// For a stripe: how long a source has before the next is asked too
    /// ([`STRIPE_SHARE`] of the hard timeout), so a hung replica costs a
    /// delay, not the sweep.
    stripe_share: Option<Duration>,
    hedges: u32,
    failovers: u32,
    /// Sources that failed or were not admissible, and why.
    failed: Vec<Miss>,
}

impl<'r> Lookup<'r> {
    /// Check the request, find the admissible sources and ask the first.
    /// `stripe`: this lookup is one chunk of a wide sweep, to start at the
    /// admissible donor `stripe` (modulo their count; the node's own copies
    /// keep their places), unhedged, its deadline the hard timeout.
    pub(super) fn begin(
        router: &'r Router,
        st: &'r RouteState,
        rows: &'r [u64],
        out_len: Option<usize>,
        stripe: Option<usize>,
    ) -> Result<Self, RouterError> {
        let s = &st.settings;
        let row_bytes = s.encoding.row_bytes();
        if let Some(out_len) = out_len
            && out_len != rows.len() * row_bytes
        {
            return Err(RouterError::BadRequest {
                table: s.table,
                message: format!(
                    "output buffer is {out_len} bytes, {} rows need {}",
                    rows.len(),
                    rows.len() * row_bytes
                ),
            });
        }
        let start = Instant::now();
        let mut failed = Vec::new();
        let mut order: SmallVec<[usize; 8]> = (0..st.sources.len())
            .filter(|&i| {
                let ok = st.sources[i].admissible(s.table);
                if !ok {
                    failed.push(Miss {
                        source: st.sources[i].source.name().to_string(),
                        why: MissReason::Skipped(st.sources[i].why_not(s.table)),
                    });
                }
                ok
            })
            .collect();
        if let Some(k) = stripe {
            rotate_donors(&mut order, k, |i| {
                st.sources[i].source.kind() == SourceKind::Donor
            });
        }
        let deadline = match stripe {
            Some(_) => start + s.hard_timeout,
            None => start + s.window + s.grace,
        };
        let mut l = Self {
            router,
            st,
            rows,
            start,
            deadline,
            hard: start + s.hard_timeout,
            order,
            next: 0,
            inflight: Attempts::new(),
            hedge_at: None,
            past_hard: false,
            hedging: stripe.is_none(),
            stripe_share: stripe.map(|_| s.hard_timeout.mul_f64(STRIPE_SHARE)),
            hedges: 0,
            failovers: 0,
            failed,
        };
        if let Some(first) = l.take_next() {
            l.launch(first, false, start);
        }
        Ok(l)
    }

    /// True when nothing is in flight any more.
    pub(super) fn is_over(&self) -> bool {
        self.inflight.is_empty()
    }

    /// Wait for the next answer, the hedge delay or the hard timeout.
    pub(super) async fn next_event(&mut self) -> Event {
        let precise = self.st.settings.precise_timers;
        let can_hedge = self.next < self.order.len() && !self.past_hard;
        let hedge_at = self.hedge_at.filter(|_| can_hedge);
        let (hard, past_hard) = (self.hard, self.past_hard);
        tokio::select! {
            biased;
            Some(a) = next_answer(&mut self.inflight) => Event::Answer(a),
            () = sleep_until(precise, hedge_at.unwrap_or(hard)), if hedge_at.is_some() => Event::HedgeDue,
            () = sleep_until(precise, hard), if !past_hard => Event::HardTimeout,
        }
    }

    /// The hedge delay passed: ask the next source too.
    pub(super) fn hedge(&mut self) {
        if let Some(i) = self.take_next() {
            self.hedges += 1;
            self.router.table.hedges.inc();
            self.launch(i, true, Instant::now());
        }
    }

    /// The donors are out of time. The node's own copy, in flight or not
    /// yet asked, gets its read: a lookup never fails while the copy can be
    /// read, and takes at most the hard timeout plus one read of it.
    pub(super) fn past_hard_timeout(&mut self) {
        self.past_hard = true;
        let (copies, donors): (Attempts, Attempts) = std::mem::take(&mut self.inflight)
            .into_iter()
            .partition(|a| self.is_copy(a.source));
        self.slow(donors, None);
        self.inflight.extend(copies);
        if self.inflight.is_empty() {
            self.failover();
        }
    }

    /// An attempt finished: the winner's rows go to `out` (`Some`), or the
    /// next source is asked (`None`). A request no source can answer is an
    /// error at once.
    pub(super) fn answered(
        &mut self,
        a: Answered,
        out: &mut Out<'_>,
    ) -> Result<Option<Fetched>, RouterError> {
        let encoding = self.st.settings.encoding;
        let len = self.rows.len() * encoding.row_bytes();
        let Answered {
            source,
            hedge,
            sent,
            result,
            mut job,
            slot,
        } = a;
        let checked = result.and_then(|()| {
            if job.buf.len() != len {
                return Err(SourceError::Failed(format!(
                    "the source gave back {} bytes for {} rows",
                    job.buf.len(),
                    self.rows.len()
                )));
            }
            check_answer(encoding, &job.buf)
        });
        let a = Attempt {
            source,
            hedge,
            sent,
        };
        let st = self.st;
        match checked {
            Ok(()) => {
                let now = Instant::now();
                out.place(&mut job.buf);
                self.router.recycle(st, job, slot);
                let latency = now - a.sent;
                st.sources[a.source].on_success(latency);
                let ser = &st.series[a.source];
                ser.fetch.observe(latency.as_secs_f64());
                ser.rows.inc_by(self.rows.len() as u64);
                if a.hedge {
                    ser.hedges_won.inc();
                }
                let late = now > self.deadline;
                if late {
                    self.router.table.misses.inc();
                }
                let others = std::mem::take(&mut self.inflight);
                self.slow(others, Some(a.sent));
                Ok(Some(Fetched {
                    source: Some(st.series[a.source].name.clone()),
                    hedges: self.hedges,
                    failovers: self.failovers,
                    late,
                    elapsed: now - self.start,
                }))
            }
            Err(e) => {
                self.router.recycle(st, job, slot);
                self.failure(a.source, &e);
                self.failed.push(Miss {
                    source: st.sources[a.source].source.name().to_string(),
                    why: MissReason::Failed(e.clone()),
                });
                if !e.retry_elsewhere() {
                    return Err(RouterError::BadRequest {
                        table: st.settings.table,
                        message: e.to_string(),
                    });
                }
                self.failover();
                Ok(None)
            }
        }
    }

    /// Nothing is in flight and no answer won (every source failed, or the
    /// hard timeout passed): the table's policy decides.
    pub(super) fn give_up(mut self, out: &mut Out<'_>) -> Result<Fetched, RouterError> {
        let others = std::mem::take(&mut self.inflight);
        self.slow(others, None);
        let st = self.st;
        let elapsed = self.start.elapsed();
        if elapsed >= st.settings.hard_timeout {
            self.failed.push(Miss {
                source: "(all)".into(),
                why: MissReason::HardTimeout(st.settings.hard_timeout),
            });
        }
        let router = self.router;
        match st.settings.policy {
            Policy::Fail => {
                router.table.failed.inc();
                Err(RouterError::AllFailed {
                    table: router.table_id,
                    elapsed,
                    attempts: self.failed,
                })
            }
            Policy::Zeros => {
                out.zeros(self.rows.len() * st.settings.encoding.row_bytes());
                router.table.zeros.inc();
                router.warn_zeros(self.rows.len(), &self.failed);
                Ok(Fetched {
                    source: None,
                    hedges: 0,
                    failovers: 0,
                    late: true,
                    elapsed,
                })
            }
        }
    }

    /// Whether source `i` is the node's own copy (`ssd` or `local`): the
    /// last resort, which gets one read past the hard timeout.
    fn is_copy(&self, i: usize) -> bool {
        self.st.sources[i].source.kind() != SourceKind::Donor
    }

    /// The next source in order not asked yet, if any is worth asking
    /// (past the hard timeout only a copy is).
    fn take_next(&mut self) -> Option<usize> {
        let k = self
            .order
            .get(self.next..)?
            .iter()
            .position(|&i| !self.past_hard || self.is_copy(i))?;
        let i = self.order[self.next + k];
        self.next += k + 1;
        Some(i)
    }

    /// A source failed (or the donors ran out of time): ask the next one.
    fn failover(&mut self) {
        if let Some(j) = self.take_next() {
            self.failovers += 1;
            self.router.table.failovers.inc();
            self.launch(j, false, Instant::now());
        }
    }

    /// Send the lookup to source `i` and set when the one after it is
    /// asked. A donor gets until the hard timeout; the node's own copy until
    /// one more hard timeout after it, at least [`COPY_READ_LIMIT`] (its
    /// read normally takes well under a millisecond; the bound is for a
    /// dead disk).
    fn launch(&mut self, i: usize, hedge: bool, now: Instant) {
        let st = self.st;
        let until = if self.is_copy(i) {
            self.hard + st.settings.hard_timeout.max(COPY_READ_LIMIT)
        } else {
            self.hard
        };
        let (job, mut slot) = self.router.job(&st.settings, self.rows, until);
        Arc::clone(&st.sources[i].source).fetch_job(job, &mut slot);
        self.inflight.push(InFlight {
            slot,
            source: i,
            hedge,
            sent: Instant::now(),
        });
        self.hedge_at = if self.hedging {
            self.hedge_delay_after(i, now, self.deadline.max(now))
        } else {
            self.stripe_share.map(|share| now + share)
        };
    }

    /// When to ask the source after `i` if `i` has not answered.
    fn hedge_delay_after(&self, i: usize, from: Instant, deadline: Instant) -> Option<Instant> {
        let hedge = self.st.settings.hedge;
        match self.st.sources[i].hedge_delay(hedge) {
            Some(d) => Some((from + d).min(deadline)),
            None if hedge == Hedge::Off => (from < deadline).then_some(deadline),
            // A percentile without enough history yet: wait for the deadline.
            None => Some(deadline),
        }
    }

    /// Attempts still out when the lookup ends: those sent before the
    /// winner (or out at the hard timeout) were too slow, and that counts
    /// against their breaker; a healthy source rarely loses to a hedge it
    /// started ahead of several times in a row, a hung one always does.
    fn slow(&self, left: impl IntoIterator<Item = InFlight>, winner_sent: Option<Instant>) {
        for a in left {
            self.router.forget(a.slot);
            match winner_sent {
                // Out of time: a plain failure.
                None => self.failure(a.source, &SourceError::Timeout),
                // Beaten by a source asked after it: slower, not wrong.
                Some(w) if a.sent < w => {
                    self.st.series[a.source].errors[error_kind(&SourceError::Timeout)].inc();
                    self.st.sources[a.source].on_lost_race();
                }
                Some(_) => {}
            }
        }
    }

    /// Count a failure of source `i` (and remember it for the error).
    fn failure(&self, i: usize, e: &SourceError) {
        let st = self.st;
        let ser = &st.series[i];
        ser.errors[error_kind(e)].inc();
        match e {
            SourceError::VersionMismatch { .. } => {
                ser.versions.inc();
            }
            SourceError::Corrupt(_) => {
                ser.checksums.inc();
            }
            _ => {}
        }
        st.sources[i].on_failure(st.settings.table, e);
    }
}

#[cfg(test)]
mod tests {
    use super::rotate_donors;

    #[test]
    fn donors_rotate_and_the_copies_keep_their_places() {
        // Sources 0 and 2 are donors, 1 and 3 copies.
        let donor = |i: usize| i.is_multiple_of(2);
        let mut order = vec![0, 1, 2, 3];
        rotate_donors(&mut order, 1, donor);
        assert_eq!(order, [2, 1, 0, 3]);
        let mut order = vec![0, 1, 2, 3];
        rotate_donors(&mut order, 2, donor);
        assert_eq!(order, [0, 1, 2, 3]);
        let mut three = vec![4, 0, 2, 3];
        rotate_donors(&mut three, 1, |i| i != 3);
        assert_eq!(three, [0, 2, 4, 3]);
        let mut one = vec![0, 3];
        rotate_donors(&mut one, 5, donor);
        assert_eq!(one, [0, 3]);
    }
}
