//! A node's reads over one queue pair: buffer slots, posting, polling and
//! copy-out, on top of the plan (`plan`) and any [`QueuePair`]. Nothing here
//! blocks: the caller polls between its own waits (the node yields to its
//! runtime), and the [`Session`] state machine says what a lookup needs
//! first (learn a region, connect, or wait out a backoff).

use std::time::{Duration, Instant};

use engram_protocol::messages::Region;
use engram_protocol::{ROW_BYTES, TableDigest};

use crate::plan::{
    Fault, Layout, Outcome, PlanError, SLOT_ROW_BYTES, Tracker, WRS_PER_ROW, build_reads,
    verify_into,
};
use crate::verbs::{Completion, Fabric, QpOptions, QueuePair, ReadWr, VerbsError};

/// Rows one buffer slot holds (one doorbell of 256 work requests).
pub const DEFAULT_SLOT_ROWS: usize = 128;
/// Slots per queue pair: lookups in flight at once.
pub const DEFAULT_SLOTS: usize = 4;

/// The queue pair a node asks for: room for every slot's work requests,
/// on the fabric settings of the donor it reads.
pub fn qp_options(connect_timeout: Duration, fabric: Fabric) -> QpOptions {
    QpOptions {
        send_depth: DEFAULT_SLOTS * DEFAULT_SLOT_ROWS * WRS_PER_ROW,
        buffer_bytes: DEFAULT_SLOTS * DEFAULT_SLOT_ROWS * SLOT_ROW_BYTES,
        connect_timeout,
        fabric,
    }
}

/// A read in flight.
#[derive(Debug)]
pub struct Read {
    tag: u32,
    slot: usize,
    rows: usize,
}

/// Why a read could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    /// Every slot is in use: try again after polling.
    Busy,
    /// The queue pair is dead.
    Dead(Fault),
    /// The plan refused it.
    Plan(PlanError),
    /// Posting failed (the queue pair is now dead).
    Post(VerbsError),
}

/// Work requests posted, doorbells rung and signalled requests, since the
/// reader was made (what the tests and the benchmark count).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Work requests posted.
    pub wrs: u64,
    /// Doorbells (post calls).
    pub doorbells: u64,
    /// Signalled work requests.
    pub signaled: u64,
}

/// Reads over one queue pair.
#[derive(Debug)]
pub struct Reader {
    qp: Box<dyn QueuePair>,
    slot_rows: usize,
    per_doorbell: usize,
    free: Vec<usize>,
    tracker: Tracker,
    next_tag: u32,
    dead: Option<Fault>,
    wrs: Vec<ReadWr>,
    wcs: Vec<Completion>,
    counts: Counts,
    /// Reads whose reader went away before their completion (a lookup
    /// cancelled when another source answered first): their slots are
    /// freed when the completion comes.
    orphans: Vec<(Read, Instant)>,
}

/// An orphaned read not completed after this means the queue pair is
/// stuck (completions come in order on a reliable connection, so every
/// later read waits behind it): the queue pair is given up.
pub const ORPHAN_LIMIT: Duration = Duration::from_millis(100);

impl Reader {
    /// Reads over `qp`, its buffer cut into slots of `slot_rows` rows.
    pub fn new(qp: Box<dyn QueuePair>, slot_rows: usize) -> Self {
        let slot_rows = slot_rows.max(1);
        let slots = (qp.buffer_len() / (slot_rows * SLOT_ROW_BYTES)).max(1);
        let per_doorbell = (qp.send_depth() / slots).max(WRS_PER_ROW);
        Self {
            qp,
            slot_rows,
            per_doorbell,
            free: (0..slots).rev().collect(),
            tracker: Tracker::default(),
            next_tag: 1,
            dead: None,
            wrs: Vec::with_capacity(slot_rows * WRS_PER_ROW),
            wcs: Vec::with_capacity(64),
            counts: Counts::default(),
            orphans: Vec::new(),
        }
    }

    /// Rows one read may carry.
    pub fn slot_rows(&self) -> usize {
        self.slot_rows
    }

    /// Why the queue pair is dead, if it is.
    pub fn dead(&self) -> Option<Fault> {
        self.dead
    }

    /// What was posted so far.
    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Start reading `rows` of `layout`.
    pub fn start(&mut self, rows: &[u64], layout: &Layout) -> Result<Read, StartError> {
        if let Some(f) = self.dead {
            return Err(StartError::Dead(f));
        }
        if self
            .orphans
            .first()
            .is_some_and(|(_, since)| since.elapsed() > ORPHAN_LIMIT)
        {
            self.die(Fault::Timeout);
            return Err(StartError::Dead(Fault::Timeout));
        }
        let Some(&slot) = self.free.last() else {
            return Err(StartError::Busy);
        };
        let tag = self.next_tag;
        self.next_tag = self.next_tag.wrapping_add(1).max(1);
        self.wrs.clear();
        let base = slot * self.slot_rows * SLOT_ROW_BYTES;
        let doorbells = build_reads(
            rows,
            layout,
            base,
            self.slot_rows,
            tag,
            self.per_doorbell,
            &mut self.wrs,
        )
        .map_err(StartError::Plan)?;
        self.free.pop();
        self.tracker.expect(tag, doorbells);
        let mut at = 0;
        while at < self.wrs.len() {
            let end = self.wrs[at..]
                .iter()
                .position(|w| w.signaled)
                .map_or(self.wrs.len(), |p| at + p + 1);
            if let Err(e) = self.qp.post_reads(&self.wrs[at..end]) {
                self.die(Fault::PeerGone);
                return Err(StartError::Post(e));
            }
            self.counts.doorbells += 1;
            self.counts.wrs += (end - at) as u64;
            self.counts.signaled += 1;
            at = end;
        }
        Ok(Read {
            tag,
            slot,
            rows: rows.len(),
        })
    }

    fn die(&mut self, fault: Fault) {
        self.dead.get_or_insert(fault);
        self.tracker.fail_all(fault);
    }

    /// Take in the completions that arrived.
    pub fn poll(&mut self) {
        if self.dead.is_some() {
            return;
        }
        self.wcs.clear();
        match self.qp.poll(&mut self.wcs, 64) {
            Ok(_) => {
                for c in self.wcs.drain(..) {
                    if c.status != crate::verbs::WcStatus::Success {
                        // The queue pair is in the error state from here on.
                        self.dead.get_or_insert(Fault::from_status(c.status));
                    }
                    self.tracker.complete(c);
                }
                if let Some(f) = self.dead {
                    self.tracker.fail_all(f);
                }
            }
            Err(_) => self.die(Fault::PeerGone),
        }
        let mut i = 0;
        while i < self.orphans.len() {
            match self.tracker.outcome(self.orphans[i].0.tag) {
                Outcome::Pending => i += 1,
                _ => {
                    let (read, _) = self.orphans.swap_remove(i);
                    self.free.push(read.slot);
                }
            }
        }
    }

    /// The caller of `read` went away before its completion: free its slot
    /// when the completion comes (the NIC may still write into it).
    pub fn orphan(&mut self, read: Read) {
        self.orphans.push((read, Instant::now()));
    }

    /// Reads orphaned and not completed yet.
    pub fn orphans(&self) -> usize {
        self.orphans.len()
    }

    /// How `read` stands.
    pub fn outcome(&mut self, read: &Read) -> Outcome {
        self.tracker.outcome(read.tag)
    }

    /// Check and copy a read whose outcome was `Done` into `out` (264 bytes
    /// a row), and free its slot.
    pub fn finish(
        &mut self,
        read: Read,
        rows: &[u64],
        layout: &Layout,
        out: &mut [u8],
    ) -> Result<(), Fault> {
        let base = read.slot * self.slot_rows * SLOT_ROW_BYTES;
        let n = read.rows.min(rows.len());
        // Only this slot, whose reads all completed: others may be in flight.
        let slot = self
            .qp
            .landed(base, n * SLOT_ROW_BYTES)
            .ok_or(Fault::Local)?;
        let r = verify_into(&rows[..n], layout, slot, &mut out[..n * ROW_BYTES]);
        self.free.push(read.slot);
        r
    }

    /// The bytes of a completed read's slot (a row and its check word a row).
    pub fn slot_bytes(&self, read: &Read) -> &[u8] {
        let base = read.slot * self.slot_rows * SLOT_ROW_BYTES;
        self.qp
            .landed(base, read.rows * SLOT_ROW_BYTES)
            .unwrap_or(&[])
    }

    /// Give up on a read that failed: its slot is free only while the
    /// queue pair lives (a dead one is replaced whole).
    pub fn release(&mut self, read: Read) {
        self.tracker.forget(read.tag);
        self.free.push(read.slot);
    }

    /// Give up on a read at its deadline: its requests may still land, so
    /// the queue pair is not used again.
    pub fn abandon(&mut self, read: Read) {
        self.tracker.forget(read.tag);
        self.die(Fault::Timeout);
    }
}

/// What a lookup needs before it can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Ask the donor for the table's region (over the authenticated channel).
    Learn,
    /// Connect a queue pair presenting this token.
    Connect([u8; 16]),
    /// Read with this layout.
    Read(Layout),
    /// Connecting failed recently: do not try before then (use another source).
    Backoff(Instant),
}

/// A region that does not match what the node pins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrongVersion {
    /// The pinned digest.
    pub pinned: TableDigest,
    /// The digest the donor's region holds.
    pub region: TableDigest,
}

/// The node's state for one donor's RDMA path: the regions it learned, the
/// unused queue-pair tokens, whether a queue pair is up, and the backoff
/// after failed connects.
#[derive(Debug, Default)]
pub struct Session {
    layouts: Vec<Layout>,
    tokens: Vec<[u8; 16]>,
    connected: bool,
    failures: u32,
    retry_at: Option<Instant>,
}

/// First wait after a failed connect; it doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// Longest wait between connects.
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

impl Session {
    /// What reading `table` needs now.
    pub fn step(&self, table: u32, now: Instant) -> Step {
        if let Some(t) = self.retry_at
            && t > now
        {
            return Step::Backoff(t);
        }
        let Some(layout) = self.layouts.iter().find(|l| l.table == table) else {
            return Step::Learn;
        };
        if !self.connected {
            return match self.tokens.last() {
                Some(t) => Step::Connect(*t),
                None => Step::Learn,
            };
        }
        Step::Read(*layout)
    }

    /// The donor answered a RegionQuery: keep the region if it holds the
    /// pinned version (its token either way: it admits one queue pair).
    pub fn learned(&mut self, region: &Region, pinned: &TableDigest) -> Result<(), WrongVersion> {
        if region.digest != *pinned {
            return Err(WrongVersion {
                pinned: *pinned,
                region: region.digest,
            });
        }
        self.layouts.retain(|l| l.table != region.table_id);
        self.layouts.push(Layout::from_region(region));
        if !self.connected {
            self.tokens.clear();
            self.tokens.push(region.token);
        }
        Ok(())
    }

    /// A queue pair is up (its token is spent).
    pub fn connected(&mut self) {
        self.connected = true;
        self.tokens.clear();
        self.failures = 0;
        self.retry_at = None;
    }

    /// Connecting failed: back off, and learn again for a fresh token.
    pub fn connect_failed(&mut self, now: Instant) {
        self.tokens.clear();
        self.layouts.clear();
        let wait = FIRST_BACKOFF
            .saturating_mul(1u32 << self.failures.min(10))
            .min(MAX_BACKOFF);
        self.failures = self.failures.saturating_add(1);
        self.retry_at = Some(now + wait);
    }

    /// A read of `table` failed with `fault`. A dead queue pair forgets
    /// every region (a new queue pair usually means a restarted donor,
    /// whose regions are new); a check mismatch forgets that table's.
    pub fn fault(&mut self, table: u32, fault: Fault) {
        if fault.kills_queue_pair() {
            self.connected = false;
            self.layouts.clear();
            self.tokens.clear();
        } else if fault.relearn() {
            self.layouts.retain(|l| l.table != table);
        }
    }

    /// True while a queue pair is up.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// The region learned for `table`.
    pub fn layout(&self, table: u32) -> Option<&Layout> {
        self.layouts.iter().find(|l| l.table == table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(table: u32, generation: u64, digest: u8) -> Region {
        Region {
            table_id: table,
            rows: 10,
            digest: TableDigest([digest; 32]),
            generation,
            rows_addr: 4096,
            rows_rkey: 1,
            checks_rkey: 2,
            checks_addr: 8192,
            token: [generation as u8; 16],
        }
    }

    #[test]
    fn a_session_learns_connects_then_reads() {
        let now = Instant::now();
        let pin = TableDigest([1; 32]);
        let mut s = Session::default();
        assert_eq!(s.step(0, now), Step::Learn);
        assert!(s.learned(&region(0, 1, 1), &pin).is_ok());
        assert_eq!(s.step(0, now), Step::Connect([1; 16]));
        s.connected();
        assert!(matches!(s.step(0, now), Step::Read(l) if l.generation == 1));
        // Another table: learned over the same queue pair.
        assert_eq!(s.step(1, now), Step::Learn);
    }

    #[test]
    fn a_region_of_another_version_is_refused() {
        let mut s = Session::default();
        let e = s.learned(&region(0, 1, 2), &TableDigest([1; 32]));
        assert!(e.is_err());
        assert_eq!(s.step(0, Instant::now()), Step::Learn);
    }

    #[test]
    fn a_revoked_region_is_learned_again_on_a_new_queue_pair() {
        let now = Instant::now();
        let pin = TableDigest([1; 32]);
        let mut s = Session::default();
        assert!(s.learned(&region(0, 1, 1), &pin).is_ok());
        s.connected();
        s.fault(0, Fault::Revoked);
        assert!(!s.is_connected());
        assert_eq!(s.step(0, now), Step::Learn);
        assert!(s.learned(&region(0, 2, 1), &pin).is_ok());
        assert_eq!(s.step(0, now), Step::Connect([2; 16]));
        s.connected();
        assert!(matches!(s.step(0, now), Step::Read(l) if l.generation == 2));
        // A check mismatch keeps the queue pair, forgets the region.
        s.fault(0, Fault::Corrupt { index: 3 });
        assert!(s.is_connected());
        assert_eq!(s.step(0, now), Step::Learn);
    }

    #[test]
    fn failed_connects_back_off_exponentially_up_to_a_cap() {
        let now = Instant::now();
        let mut s = Session::default();
        let mut waits = Vec::new();
        for _ in 0..8 {
            s.connect_failed(now);
            match s.step(0, now) {
                Step::Backoff(t) => waits.push(t - now),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(waits[0], FIRST_BACKOFF);
        assert_eq!(waits[1], FIRST_BACKOFF * 2);
        assert_eq!(*waits.last().unwrap_or(&Duration::ZERO), MAX_BACKOFF);
        assert_eq!(s.step(0, now + MAX_BACKOFF), Step::Learn);
        s.connected();
        assert_eq!(s.step(0, now), Step::Learn);
    }
}
