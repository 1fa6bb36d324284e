//! The sans-IO core of a node's reads: the work requests of one lookup
//! (a row and its check word per row), cut into doorbells that fit the
//! send queue with only each doorbell's last request signalled; the
//! matching of completions to lookups; the mapping of completion statuses
//! onto faults; and the verification and copy-out of the rows. No verbs
//! are called here.

use engram_protocol::messages::Region;
use engram_protocol::{ROW_BYTES, TableDigest};

use crate::check::{CHECK_BYTES, check_word, seed};
use crate::verbs::{Completion, ReadWr, WcStatus};

/// Bytes one row takes in a queue pair's buffer: the row, then its check word.
pub const SLOT_ROW_BYTES: usize = ROW_BYTES + CHECK_BYTES;

/// Work requests one row needs.
pub const WRS_PER_ROW: usize = 2;

/// Where a table version lives on a donor, as a node reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The table.
    pub table: u32,
    /// Its rows.
    pub rows: u64,
    /// Its version.
    pub digest: TableDigest,
    /// The registration's generation.
    pub generation: u64,
    /// Remote address of row 0.
    pub rows_addr: u64,
    /// Key of the rows.
    pub rows_rkey: u32,
    /// Remote address of row 0's check word.
    pub checks_addr: u64,
    /// Key of the check words.
    pub checks_rkey: u32,
    /// The seed of its check words.
    pub seed: u64,
}

impl Layout {
    /// The layout a donor's Region answer describes.
    pub fn from_region(r: &Region) -> Self {
        Self {
            table: r.table_id,
            rows: r.rows,
            digest: r.digest,
            generation: r.generation,
            rows_addr: r.rows_addr,
            rows_rkey: r.rows_rkey,
            checks_addr: r.checks_addr,
            checks_rkey: r.checks_rkey,
            seed: seed(&r.digest),
        }
    }
}

/// What went wrong with a read, and what the node does about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The region is no longer registered (a swap or a restart): learn it
    /// again; the queue pair is in the error state too.
    Revoked,
    /// The donor or the path is gone (retries exceeded, flushed, a dead
    /// queue pair): connect again.
    PeerGone,
    /// The donor refused the request (remote invalid request or operation).
    Rejected,
    /// An error on this side (protection, length): a bug; connect again.
    Local,
    /// No completion by the deadline: the queue pair may still write into
    /// its buffer, so it is not used again.
    Timeout,
    /// Rows arrived but a check word did not match (another version or a
    /// corrupted row): discarded; learn the region again.
    Corrupt {
        /// The position in the lookup.
        index: usize,
    },
}

impl Fault {
    /// The fault a completion status means.
    pub fn from_status(s: WcStatus) -> Self {
        match s {
            WcStatus::Success => Self::Local,
            WcStatus::RemoteAccess => Self::Revoked,
            WcStatus::RemoteInvalidRequest | WcStatus::RemoteOperation => Self::Rejected,
            WcStatus::RetryExceeded | WcStatus::Flushed | WcStatus::Other(_) => Self::PeerGone,
            WcStatus::LocalError => Self::Local,
        }
    }

    /// True when the queue pair cannot be used after it (every fault but a
    /// check mismatch: a failed work request moves a queue pair to the
    /// error state, and a timed-out one may still land).
    pub fn kills_queue_pair(self) -> bool {
        !matches!(self, Self::Corrupt { .. })
    }

    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::Revoked => "revoked",
            Self::PeerGone => "peer_gone",
            Self::Rejected => "rejected",
            Self::Local => "local",
            Self::Timeout => "timeout",
            Self::Corrupt { .. } => "corrupt",
        }
    }

    /// True when the region must be learned again before the next read.
    pub fn relearn(self) -> bool {
        matches!(self, Self::Revoked | Self::Corrupt { .. })
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Revoked => f.write_str("remote access error: the region was revoked"),
            Self::PeerGone => f.write_str("the queue pair failed: the donor or path is gone"),
            Self::Rejected => f.write_str("the donor rejected the read"),
            Self::Local => f.write_str("local work request error"),
            Self::Timeout => f.write_str("no completion by the deadline"),
            Self::Corrupt { index } => {
                write!(f, "row at position {index} failed its check word")
            }
        }
    }
}

/// A request the plan cannot make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanError {
    /// Row id `row` is not below the table's row count.
    RowOutOfRange {
        /// The row id.
        row: u64,
    },
    /// More rows than the buffer slot holds.
    TooManyRows {
        /// Rows asked.
        rows: usize,
        /// Rows that fit.
        fit: usize,
    },
}

/// The wr_id of position `index` of the lookup tagged `tag` (rows use even
/// indexes: 2i for the row, 2i + 1 for its check word).
pub fn wr_id(tag: u32, index: usize) -> u64 {
    (u64::from(tag) << 32) | index as u64
}

/// The lookup tag of a wr_id.
pub fn tag_of(wr_id: u64) -> u32 {
    (wr_id >> 32) as u32
}

/// Append to `out` the work requests that read `rows` of `layout` into the
/// buffer slot at `base` (row i and its check word at `base + 272 * i`),
/// each doorbell at most `per_doorbell` requests with only its last one
/// signalled. Returns the number of doorbells. `per_doorbell` is rounded
/// down to whole rows (at least one row).
pub fn build_reads(
    rows: &[u64],
    layout: &Layout,
    base: usize,
    slot_rows: usize,
    tag: u32,
    per_doorbell: usize,
    out: &mut Vec<ReadWr>,
) -> Result<usize, PlanError> {
    if rows.len() > slot_rows {
        return Err(PlanError::TooManyRows {
            rows: rows.len(),
            fit: slot_rows,
        });
    }
    if let Some(&row) = rows.iter().find(|&&r| r >= layout.rows) {
        return Err(PlanError::RowOutOfRange { row });
    }
    let first = out.len();
    for (i, &r) in rows.iter().enumerate() {
        let local = base + i * SLOT_ROW_BYTES;
        out.push(ReadWr {
            wr_id: wr_id(tag, WRS_PER_ROW * i),
            local_offset: local,
            len: ROW_BYTES as u32,
            remote_addr: layout.rows_addr + r * ROW_BYTES as u64,
            rkey: layout.rows_rkey,
            signaled: false,
        });
        out.push(ReadWr {
            wr_id: wr_id(tag, WRS_PER_ROW * i + 1),
            local_offset: local + ROW_BYTES,
            len: CHECK_BYTES as u32,
            remote_addr: layout.checks_addr + r * CHECK_BYTES as u64,
            rkey: layout.checks_rkey,
            signaled: false,
        });
    }
    let per = (per_doorbell / WRS_PER_ROW).max(1) * WRS_PER_ROW;
    let mut doorbells = 0;
    for chunk in out[first..].chunks_mut(per) {
        if let Some(last) = chunk.last_mut() {
            last.signaled = true;
            doorbells += 1;
        }
    }
    Ok(doorbells)
}

/// Check the rows read into `slot` (272 bytes a row) against their check
/// words and copy them, 264 bytes each, into `out`.
pub fn verify_into(
    rows: &[u64],
    layout: &Layout,
    slot: &[u8],
    out: &mut [u8],
) -> Result<(), Fault> {
    for (i, (&r, dst)) in rows.iter().zip(out.chunks_exact_mut(ROW_BYTES)).enumerate() {
        let Some(s) = slot.get(i * SLOT_ROW_BYTES..(i + 1) * SLOT_ROW_BYTES) else {
            return Err(Fault::Local);
        };
        let (row, word) = s.split_at(ROW_BYTES);
        let mut w = [0u8; CHECK_BYTES];
        w.copy_from_slice(word);
        if check_word(layout.seed, r, row) != u64::from_le_bytes(w) {
            return Err(Fault::Corrupt { index: i });
        }
        dst.copy_from_slice(row);
    }
    Ok(())
}

/// What a lookup's doorbells came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Still waiting for signalled completions.
    Pending,
    /// Every doorbell's signalled completion arrived (and, on a reliable
    /// connection, every request before it completed).
    Done,
    /// A work request failed.
    Failed(Fault),
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    tag: u32,
    waiting: usize,
    failed: Option<Fault>,
}

/// Completion matching for the lookups outstanding on one queue pair:
/// whoever polls the completion queue feeds every completion here, and
/// each lookup asks for its own outcome by tag.
#[derive(Debug, Default)]
pub struct Tracker {
    live: Vec<Tracked>,
}

impl Tracker {
    /// A lookup tagged `tag` waits for `doorbells` signalled completions.
    pub fn expect(&mut self, tag: u32, doorbells: usize) {
        self.live.push(Tracked {
            tag,
            waiting: doorbells,
            failed: None,
        });
    }

    /// Take in one completion. One that matches no live lookup (a lookup
    /// abandoned at its deadline) is ignored.
    pub fn complete(&mut self, c: Completion) {
        let tag = tag_of(c.wr_id);
        let Some(t) = self.live.iter_mut().find(|t| t.tag == tag) else {
            return;
        };
        if c.status == WcStatus::Success {
            t.waiting = t.waiting.saturating_sub(1);
        } else if t.failed.is_none() {
            t.failed = Some(Fault::from_status(c.status));
        }
    }

    /// Fail every live lookup with `fault` (the queue pair died).
    pub fn fail_all(&mut self, fault: Fault) {
        for t in &mut self.live {
            t.failed.get_or_insert(fault);
        }
    }

    /// The lookup's outcome; a finished one is forgotten.
    pub fn outcome(&mut self, tag: u32) -> Outcome {
        let Some(i) = self.live.iter().position(|t| t.tag == tag) else {
            return Outcome::Failed(Fault::Local);
        };
        let t = self.live[i];
        let o = match (t.failed, t.waiting) {
            (Some(f), _) => Outcome::Failed(f),
            (None, 0) => Outcome::Done,
            (None, _) => return Outcome::Pending,
        };
        self.live.swap_remove(i);
        o
    }

    /// Forget a lookup that gave up.
    pub fn forget(&mut self, tag: u32) {
        self.live.retain(|t| t.tag != tag);
    }

    /// Lookups outstanding.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// True when none is outstanding.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::table_checks;

    fn layout() -> Layout {
        Layout {
            table: 1,
            rows: 100,
            digest: TableDigest([3; 32]),
            generation: 1,
            rows_addr: 0x1000_0000,
            rows_rkey: 7,
            checks_addr: 0x2000_0000,
            checks_rkey: 8,
            seed: seed(&TableDigest([3; 32])),
        }
    }

    #[test]
    fn a_token_is_one_doorbell_with_one_signalled_request() {
        let rows: Vec<u64> = (0..24).map(|i| i * 3).collect();
        let mut wrs = Vec::new();
        let n = build_reads(&rows, &layout(), 4096, 128, 9, 1024, &mut wrs).unwrap_or(0);
        assert_eq!(n, 1);
        assert_eq!(wrs.len(), 48);
        assert_eq!(wrs.iter().filter(|w| w.signaled).count(), 1);
        assert!(wrs[47].signaled);
        assert_eq!(wrs[2].remote_addr, 0x1000_0000 + 3 * 264);
        assert_eq!(wrs[2].local_offset, 4096 + 272);
        assert_eq!(wrs[3].remote_addr, 0x2000_0000 + 3 * 8);
        assert_eq!((wrs[3].rkey, wrs[3].len), (8, 8));
        assert!(wrs.iter().all(|w| tag_of(w.wr_id) == 9));
    }

    #[test]
    fn doorbells_cut_at_whole_rows() {
        let rows: Vec<u64> = (0..50).collect();
        let mut wrs = Vec::new();
        // 33 requests a doorbell rounds down to 16 rows: 4 doorbells.
        let n = build_reads(&rows, &layout(), 0, 64, 1, 33, &mut wrs).unwrap_or(0);
        assert_eq!(n, 4);
        let signalled: Vec<usize> = (0..wrs.len()).filter(|&i| wrs[i].signaled).collect();
        assert_eq!(signalled, vec![31, 63, 95, 99]);
    }

    #[test]
    fn bad_plans_are_refused() {
        let mut wrs = Vec::new();
        assert_eq!(
            build_reads(&[5, 100], &layout(), 0, 8, 1, 64, &mut wrs),
            Err(PlanError::RowOutOfRange { row: 100 })
        );
        assert_eq!(
            build_reads(&[1; 9], &layout(), 0, 8, 1, 64, &mut wrs),
            Err(PlanError::TooManyRows { rows: 9, fit: 8 })
        );
        assert!(wrs.is_empty());
    }

    #[test]
    fn verification_finds_a_row_of_another_version() {
        let l = layout();
        let table: Vec<u8> = (0..100 * ROW_BYTES).map(|i| (i % 253) as u8).collect();
        let checks = table_checks(l.seed, &table, 2);
        let rows = [4u64, 99, 0];
        let mut slot = vec![0u8; rows.len() * SLOT_ROW_BYTES];
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            slot[i * 272..i * 272 + 264].copy_from_slice(&table[r * 264..(r + 1) * 264]);
            slot[i * 272 + 264..(i + 1) * 272].copy_from_slice(&checks[r * 8..r * 8 + 8]);
        }
        let mut out = vec![0u8; rows.len() * ROW_BYTES];
        assert_eq!(verify_into(&rows, &l, &slot, &mut out), Ok(()));
        assert_eq!(&out[264..528], &table[99 * 264..100 * 264]);
        let other = Layout {
            seed: l.seed ^ 1,
            ..l
        };
        assert_eq!(
            verify_into(&rows, &other, &slot, &mut out),
            Err(Fault::Corrupt { index: 0 })
        );
        slot[2 * 272 + 5] ^= 0x10;
        assert_eq!(
            verify_into(&rows, &l, &slot, &mut out),
            Err(Fault::Corrupt { index: 2 })
        );
    }

    #[test]
    fn the_tracker_matches_completions_by_tag() {
        let mut t = Tracker::default();
        t.expect(1, 2);
        t.expect(2, 1);
        let ok = |tag, i| Completion {
            wr_id: wr_id(tag, i),
            status: WcStatus::Success,
        };
        t.complete(ok(2, 47));
        t.complete(ok(1, 31));
        assert_eq!(t.outcome(1), Outcome::Pending);
        assert_eq!(t.outcome(2), Outcome::Done);
        t.complete(Completion {
            wr_id: wr_id(1, 40),
            status: WcStatus::RemoteAccess,
        });
        t.complete(Completion {
            wr_id: wr_id(1, 41),
            status: WcStatus::Flushed,
        });
        assert_eq!(t.outcome(1), Outcome::Failed(Fault::Revoked));
        assert!(t.is_empty());
        // A late completion of a forgotten lookup is ignored.
        t.expect(3, 1);
        t.forget(3);
        t.complete(ok(3, 1));
        assert!(t.is_empty());
    }

    #[test]
    fn statuses_map_onto_faults() {
        assert_eq!(Fault::from_status(WcStatus::RemoteAccess), Fault::Revoked);
        assert_eq!(Fault::from_status(WcStatus::RetryExceeded), Fault::PeerGone);
        assert_eq!(Fault::from_status(WcStatus::Flushed), Fault::PeerGone);
        assert_eq!(
            Fault::from_status(WcStatus::RemoteInvalidRequest),
            Fault::Rejected
        );
        assert!(Fault::Revoked.relearn() && Fault::Revoked.kills_queue_pair());
        assert!(Fault::Corrupt { index: 0 }.relearn());
        assert!(!Fault::Corrupt { index: 0 }.kills_queue_pair());
        assert!(Fault::Timeout.kills_queue_pair() && !Fault::Timeout.relearn());
    }
}
