//! The engine ring: shared memory through which an engine's GPU kernels
//! ask for rows and the host's rack client answers, with no host sync on
//! the engine's side (PROTOCOL.md section 6; docs/engines.md).
//!
//! The engine process makes the ring (a memfd), registers it with its GPU
//! and hands it to the host's rack client (its own process, or
//! `inference-node engines` through the engine socket). A kernel writes a
//! step's row ids into slot `seq % slots`, then publishes `seq` in the
//! slot's request word with a system-scope release store; the client polls
//! the request words, fetches the rows, writes them and a status into the
//! slot, and publishes `seq` in the slot's done word of each layer; a
//! kernel on the engine's side stream spins on that word (or its deadline)
//! and gathers the rows. This module is the layout and its checks only:
//! offsets, the header, and the bounds every client applies before it
//! trusts a byte of the ring.
//!
//! Header (the ring's first 4 KiB; integers little-endian):
//!
//! | offset | bytes | field | written by |
//! | --- | --- | --- | --- |
//! | 0 | 8 | magic `ENGRRING` | engine |
//! | 8 | 4 | version (1: rows of 264 bytes; 2: the row size at 132) | engine |
//! | 12 | 4 | slots (1 to 64) | engine |
//! | 16 | 4 | layers (1 or 2) | engine |
//! | 20 | 4 | columns per position per layer (1 to 24) | engine |
//! | 24 | 4 | positions a slot holds at most | engine |
//! | 28 | 4 | the first column (columns `first..first + columns`) | engine |
//! | 32 | 8 | the sections' model layers, `u32` each (unused: 0) | engine |
//! | 40 | 8 | slot stride in bytes | engine |
//! | 48 | 8 | ring bytes | engine |
//! | 56 | 8 | the GPU's deadline, ns from publish | engine |
//! | 64 | 4 | the client's pid (0: none attached) | client |
//! | 68 | 4 | client state: 0 never attached, 1 serving, 2 gone | client |
//! | 72 | 8 | client heartbeat, its monotonic clock in ns | client |
//! | 80 | 8 | the client's own give-up age, ns | client |
//! | 88 | 8 | requests served | client |
//! | 96 | 8 | requests failed or given up | client |
//! | 104 | 8 | faults: sections answered without rows whose table's policy is `fail` | client |
//! | 112 | 8 | the last fault's request `seq` | client |
//! | 120 | 4 | the last fault's layer section | client |
//! | 124 | 4 | the last fault's status ([`Status`], or [`GPU_TIMEOUT`]) | client |
//! | 128 | 4 | layer sections whose table's policy is `fail` (bit `i`: section `i`) | client |
//! | 132 | 4 | bytes per row (version 2 only: 1 to 16,384) | engine |
//! | 1024 | 8 x 80 x 2 | each section's wait histogram | engine |
//! | 2304 | 32 x 32 | the fault log: fault `n` (counting from 1) in entry `(n - 1) % 32` | client |
//! | 3328 | 8 x 64 | each slot's step tag: the engine step its request belongs to (0: none) | engine |
//!
//! Slot `s` starts at `4096 + s * stride`:
//!
//! | offset | bytes | field | written by |
//! | --- | --- | --- | --- |
//! | 0 | 8 | request word: the request's `seq` (0: none yet) | engine, last |
//! | 8 | 4 | positions in the request | engine |
//! | 12 | 4 | layer mask (bit `i`: layer section `i` asked) | engine |
//! | 16 | 8 x 2 | done word of each layer section: `seq` once answered | client, last |
//! | 32 | 4 x 2 | status of each layer section ([`Status`]) | client |
//! | 40 | 4 x 2 | how each was served ([`SERVED_SSD`] and friends) | client |
//! | 48 | 8 | the GPU timer at publish (diagnostic) | engine |
//! | 56 | 8 | the last `seq` whose wait passed the GPU's deadline | engine |
//! | 64 | | ids: `i64 [layers][positions][columns]` (-1: no row) | engine |
//! | | | rows: `[layers][positions][columns][row bytes]`, 64-aligned | client |
//!
//! A ring of DeepSeek V4.1's 264-byte rows is version 1, byte for byte as
//! it always was; a ring of another row size (a table of another encoding:
//! `engram_protocol::encoding`) is version 2 and states its row size.

use crate::row::ROW_BYTES;

/// The ring's magic.
pub const MAGIC: &[u8; 8] = b"ENGRRING";
/// The layout version of a ring of V4.1's 264-byte rows.
pub const VERSION: u32 = 1;
/// The layout version of a ring that states its row size (at
/// [`header::ROW_BYTES`]).
pub const VERSION_SIZED: u32 = 2;
/// Most bytes a ring's row may have (a BF16 row of 8,192 values).
pub const MAX_ROW_BYTES: u32 = 16_384;
/// Bytes of the header the engine writes: its first 64, then up to the
/// row size's word.
pub const ENGINE_HEADER_BYTES: usize = 136;
/// The header's size (the slots start here).
pub const HEADER_BYTES: u64 = 4096;
/// Most slots a ring may have.
pub const MAX_SLOTS: u32 = 64;
/// Most layer sections a slot has (V4.1's two Engram layers).
pub const MAX_LAYERS: u32 = 2;
/// Most columns per position per layer.
pub const MAX_COLUMNS: u32 = 24;
/// Most positions a slot may hold (a chunked prefill goes in several).
pub const MAX_POSITIONS: u32 = 65_536;
/// Largest ring a client maps.
pub const MAX_RING_BYTES: u64 = 4 << 30;
/// Where a slot's ids start.
pub const IDS_AT: u64 = 64;
/// An id that asks for no row (a DEAD position, or graph padding).
pub const NO_ROW: i64 = -1;

/// Header field offsets.
pub mod header {
    /// Slots.
    pub const SLOTS: usize = 12;
    /// Layer sections.
    pub const LAYERS: usize = 16;
    /// Columns.
    pub const COLUMNS: usize = 20;
    /// Positions per slot.
    pub const POSITIONS: usize = 24;
    /// First column.
    pub const FIRST_COLUMN: usize = 28;
    /// Layer ids.
    pub const LAYER_IDS: usize = 32;
    /// Slot stride.
    pub const STRIDE: usize = 40;
    /// Ring bytes.
    pub const BYTES: usize = 48;
    /// GPU deadline.
    pub const GPU_DEADLINE_NS: usize = 56;
    /// Client pid.
    pub const CLIENT_PID: usize = 64;
    /// Client state.
    pub const CLIENT_STATE: usize = 68;
    /// Client heartbeat.
    pub const HEARTBEAT_NS: usize = 72;
    /// The client's give-up age.
    pub const CLIENT_DEADLINE_NS: usize = 80;
    /// Requests served.
    pub const SERVED: usize = 88;
    /// Requests failed.
    pub const FAILED: usize = 96;
    /// Faults: sections answered without rows under a `fail` policy (the
    /// count; the engine raises an error when it grows).
    pub const FAULTS: usize = 104;
    /// The last fault's request `seq`.
    pub const FAULT_SEQ: usize = 112;
    /// The last fault's layer section.
    pub const FAULT_SECTION: usize = 120;
    /// The last fault's status.
    pub const FAULT_STATUS: usize = 124;
    /// Layer sections whose table's policy is `fail` (a bit each).
    pub const FAIL_SECTIONS: usize = 128;
    /// Bytes per row (version 2).
    pub const ROW_BYTES: usize = 132;
    /// The GPU's waits, a histogram per layer section: `u64
    /// [sections][WAIT_BUCKETS]`, bucket [`super::wait_bucket`] of each
    /// wait's spin time (the engine's wait kernel adds one per wait).
    pub const WAITS: usize = 1024;
    /// The fault log: [`FAULT_LOG_ENTRIES`](super::FAULT_LOG_ENTRIES)
    /// entries of [`FAULT_ENTRY_BYTES`](super::FAULT_ENTRY_BYTES), fault
    /// `n` (counting from 1) in entry `(n - 1) % FAULT_LOG_ENTRIES`, written
    /// before the count says `n`: `seq` (u64), step tag (u64), section
    /// (u32), status (u32), 8 bytes reserved.
    pub const FAULT_LOG: usize = 2304;
    /// Each slot's step tag (`u64 [MAX_SLOTS]`): the engine step the
    /// slot's request belongs to, written by the engine before the request
    /// word (0: no step, or an engine that does not tag its requests).
    pub const STEP_TAGS: usize = 3328;
}

/// Entries in the header's fault log.
pub const FAULT_LOG_ENTRIES: usize = 32;
/// Bytes of a fault log entry.
pub const FAULT_ENTRY_BYTES: usize = 32;

/// A fault log entry's fields, as offsets inside the entry.
pub mod fault_entry {
    /// The request's `seq`.
    pub const SEQ: usize = 0;
    /// The request's step tag (0: unknown).
    pub const STEP: usize = 8;
    /// The layer section.
    pub const SECTION: usize = 16;
    /// The status ([`super::Status`], or [`super::GPU_TIMEOUT`]).
    pub const STATUS: usize = 20;
}

/// Buckets of a section's wait histogram.
pub const WAIT_BUCKETS: usize = 80;

// The histograms, the fault log and the step tags fit the header, in
// that order, after its last other field.
const _: () = assert!(
    header::WAITS >= header::ROW_BYTES + 4
        && header::ROW_BYTES + 4 == ENGINE_HEADER_BYTES
        && header::WAITS + 8 * MAX_LAYERS as usize * WAIT_BUCKETS <= header::FAULT_LOG
        && header::FAULT_LOG + FAULT_LOG_ENTRIES * FAULT_ENTRY_BYTES <= header::STEP_TAGS
        && (header::STEP_TAGS + 8 * MAX_SLOTS as usize) as u64 <= HEADER_BYTES
);

/// Where fault `n` (counting from 1) is logged in the header.
pub fn fault_entry_at(n: u64) -> usize {
    header::FAULT_LOG + ((n.max(1) - 1) % FAULT_LOG_ENTRIES as u64) as usize * FAULT_ENTRY_BYTES
}

/// The bucket of a wait of `ns` nanoseconds: 0 under 1,024 ns; then four
/// to each power of two, by the two bits after the leading one; the last
/// takes every longer wait.
pub fn wait_bucket(ns: u64) -> usize {
    if ns < 1024 {
        return 0;
    }
    let e = 63 - ns.leading_zeros() as usize;
    let m = ((ns >> (e - 2)) & 3) as usize;
    (4 * (e - 10) + m + 1).min(WAIT_BUCKETS - 1)
}

/// Bucket `b`'s bounds in nanoseconds, `[low, high)` (the last bucket
/// also takes every longer wait).
pub fn wait_bucket_bounds(b: usize) -> (f64, f64) {
    if b == 0 {
        return (0.0, 1024.0);
    }
    let e = 10 + (b - 1) / 4;
    let m = ((b - 1) % 4) as f64;
    let p = (1u64 << e) as f64;
    (p * (1.0 + m / 4.0), p * (1.0 + (m + 1.0) / 4.0))
}

/// Slot field offsets.
pub mod slot {
    /// Request word.
    pub const REQUEST: usize = 0;
    /// Positions.
    pub const POSITIONS: usize = 8;
    /// Layer mask.
    pub const MASK: usize = 12;
    /// Done words (8 bytes per layer section).
    pub const DONE: usize = 16;
    /// Statuses (4 bytes per layer section).
    pub const STATUS: usize = 32;
    /// How each was served (4 bytes per layer section).
    pub const SERVED: usize = 40;
    /// The GPU timer at publish.
    pub const PUBLISHED_NS: usize = 48;
    /// The last `seq` whose wait passed the GPU's deadline (the engine's
    /// wait kernel writes it; the client turns it into the table's policy).
    pub const GPU_GAVE_UP: usize = 56;
}

/// Client states in the header.
pub mod client_state {
    /// No client has attached.
    pub const NEVER: u32 = 0;
    /// A client serves the ring.
    pub const SERVING: u32 = 1;
    /// The client has let go (closed, or told the engine to stop).
    pub const GONE: u32 = 2;
}

/// How a layer section's request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Rows served.
    Ok = 0,
    /// Zeros by the table's `zeros` policy (every source failed).
    Zeros = 1,
    /// Every source failed under the table's `fail` policy: the rows are
    /// zeros and the engine must fail the request.
    Failed = 2,
    /// Some positions' ids were invalid (past the table, or a no-row id
    /// beside live ids): those positions are zeros, the rest served.
    BadIds = 3,
    /// The client gave up at its own deadline: zeros.
    Late = 4,
}

/// The status the engine's wait records for itself when the GPU's
/// deadline passed before the client answered (zeros). Never written by a
/// client; a fault's status when the client sees it under a `fail` policy.
pub const GPU_TIMEOUT: u32 = 5;

/// Served by the SSD copy (after a failover).
pub const SERVED_SSD: u32 = 1;
/// A hedge was sent.
pub const SERVED_HEDGED: u32 = 2;
/// A source failed and another served.
pub const SERVED_FAILOVER: u32 = 4;
/// An answer came after the table's deadline.
pub const SERVED_LATE: u32 = 8;

/// A ring's shape: what its header says, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Slots.
    pub slots: u32,
    /// Layer sections per slot.
    pub layers: u32,
    /// Columns per position per layer.
    pub columns: u32,
    /// Positions a slot holds at most.
    pub positions: u32,
    /// The first column.
    pub first_column: u32,
    /// The model layer of each section's table (0: unused): V4.1's
    /// Engram layers 1 and 14, or the layer of a table of another family.
    pub layer_ids: [u32; 2],
    /// The GPU's deadline, ns from publish.
    pub gpu_deadline_ns: u64,
    /// Bytes per row: 264 (V4.1's, a version 1 ring), or another table's.
    pub row_bytes: u32,
}

/// Why a ring's header is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine ring: {0}")]
pub struct RingError(pub String);

fn round_up(x: u64, to: u64) -> Option<u64> {
    x.checked_next_multiple_of(to)
}

impl Shape {
    /// Check the shape's bounds (what a client applies to a header before
    /// it trusts any offset computed from it).
    pub fn check(&self) -> Result<(), RingError> {
        let bad = |m: String| Err(RingError(m));
        if !(1..=MAX_SLOTS).contains(&self.slots) {
            return bad(format!("{} slots (1 to {MAX_SLOTS})", self.slots));
        }
        if !(1..=MAX_LAYERS).contains(&self.layers) {
            return bad(format!("{} layers (1 to {MAX_LAYERS})", self.layers));
        }
        if !(1..=MAX_COLUMNS).contains(&self.columns)
            || self.first_column + self.columns > MAX_COLUMNS
        {
            return bad(format!(
                "columns {}..{} (within 0..{MAX_COLUMNS})",
                self.first_column,
                self.first_column + self.columns
            ));
        }
        if !(1..=MAX_ROW_BYTES).contains(&self.row_bytes) {
            return bad(format!(
                "rows of {} bytes (1 to {MAX_ROW_BYTES})",
                self.row_bytes
            ));
        }
        if !(1..=MAX_POSITIONS).contains(&self.positions) {
            return bad(format!(
                "{} positions a slot (1 to {MAX_POSITIONS})",
                self.positions
            ));
        }
        for (i, &l) in self.layer_ids.iter().enumerate() {
            let used = (i as u32) < self.layers;
            if used == (l == 0) {
                return bad(format!(
                    "layer section {i} has layer id {l} with {} layers",
                    self.layers
                ));
            }
        }
        match self.bytes() {
            Some(b) if b <= MAX_RING_BYTES => Ok(()),
            _ => bad(format!(
                "{} slots of {} positions need more than {} GiB",
                self.slots,
                self.positions,
                MAX_RING_BYTES >> 30
            )),
        }
    }

    /// Ids of one layer section of a slot, in bytes.
    fn ids_len(&self) -> Option<u64> {
        u64::from(self.positions)
            .checked_mul(u64::from(self.columns))?
            .checked_mul(8)
    }

    /// Rows of one layer section of a slot, in bytes.
    fn rows_len(&self) -> Option<u64> {
        u64::from(self.positions)
            .checked_mul(u64::from(self.columns))?
            .checked_mul(u64::from(self.row_bytes))
    }

    /// Where a slot's rows start, from the slot's start.
    pub fn rows_at(&self) -> Option<u64> {
        round_up(
            IDS_AT + self.ids_len()?.checked_mul(u64::from(self.layers))?,
            64,
        )
    }

    /// A slot's stride (4 KiB aligned).
    pub fn stride(&self) -> Option<u64> {
        let end = self
            .rows_at()?
            .checked_add(self.rows_len()?.checked_mul(u64::from(self.layers))?)?;
        round_up(end, 4096)
    }

    /// The ring's bytes.
    pub fn bytes(&self) -> Option<u64> {
        HEADER_BYTES.checked_add(self.stride()?.checked_mul(u64::from(self.slots))?)
    }

    /// Where slot `s` starts.
    pub fn slot_at(&self, s: u32) -> u64 {
        HEADER_BYTES + u64::from(s) * self.stride().unwrap_or(0)
    }

    /// Where layer section `l`'s id of position `p`, column `c` is, from
    /// the slot's start.
    pub fn id_at(&self, l: u32, p: u32, c: u32) -> u64 {
        IDS_AT
            + ((u64::from(l) * u64::from(self.positions) + u64::from(p)) * u64::from(self.columns)
                + u64::from(c))
                * 8
    }

    /// Where layer section `l`'s rows start, from the slot's start.
    pub fn layer_rows_at(&self, l: u32) -> u64 {
        self.rows_at().unwrap_or(0) + u64::from(l) * self.rows_len().unwrap_or(0)
    }

    /// The layout version of a ring of this shape: 1 for V4.1's rows, 2
    /// for any other size.
    pub fn version(&self) -> u32 {
        if self.row_bytes as usize == ROW_BYTES {
            VERSION
        } else {
            VERSION_SIZED
        }
    }

    /// The header's engine-written part (the bytes between 64 and 132 are
    /// the client's, zero in a new ring).
    pub fn encode(&self) -> Result<[u8; ENGINE_HEADER_BYTES], RingError> {
        self.check()?;
        let mut h = [0u8; ENGINE_HEADER_BYTES];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&self.version().to_le_bytes());
        let put32 = |h: &mut [u8; ENGINE_HEADER_BYTES], at: usize, v: u32| {
            h[at..at + 4].copy_from_slice(&v.to_le_bytes());
        };
        put32(&mut h, header::SLOTS, self.slots);
        put32(&mut h, header::LAYERS, self.layers);
        put32(&mut h, header::COLUMNS, self.columns);
        put32(&mut h, header::POSITIONS, self.positions);
        put32(&mut h, header::FIRST_COLUMN, self.first_column);
        put32(&mut h, header::LAYER_IDS, self.layer_ids[0]);
        put32(&mut h, header::LAYER_IDS + 4, self.layer_ids[1]);
        let stride = self.stride().unwrap_or(0);
        h[header::STRIDE..header::STRIDE + 8].copy_from_slice(&stride.to_le_bytes());
        let bytes = self.bytes().unwrap_or(0);
        h[header::BYTES..header::BYTES + 8].copy_from_slice(&bytes.to_le_bytes());
        h[header::GPU_DEADLINE_NS..header::GPU_DEADLINE_NS + 8]
            .copy_from_slice(&self.gpu_deadline_ns.to_le_bytes());
        if self.version() == VERSION_SIZED {
            put32(&mut h, header::ROW_BYTES, self.row_bytes);
        }
        Ok(h)
    }

    /// Read and check a header (at least its first
    /// [`ENGINE_HEADER_BYTES`]; 64 do for a version 1 ring) of a ring `len`
    /// bytes long: the magic, the version, the bounds, and the stride and
    /// size it states against the ones its shape gives.
    pub fn decode(h: &[u8], len: u64) -> Result<Self, RingError> {
        if h.len() < 64 || &h[0..8] != MAGIC {
            return Err(RingError("no ring header (magic ENGRRING)".into()));
        }
        let u32_at = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let row_bytes = match u32_at(8) {
            VERSION => ROW_BYTES as u32,
            VERSION_SIZED if h.len() >= ENGINE_HEADER_BYTES => u32_at(header::ROW_BYTES),
            VERSION_SIZED => {
                return Err(RingError(format!(
                    "a version {VERSION_SIZED} header of {} bytes (its row size is at {})",
                    h.len(),
                    header::ROW_BYTES
                )));
            }
            v => {
                return Err(RingError(format!(
                    "layout version {v} (this build reads {VERSION} and {VERSION_SIZED})"
                )));
            }
        };
        let shape = Self {
            slots: u32_at(header::SLOTS),
            layers: u32_at(header::LAYERS),
            columns: u32_at(header::COLUMNS),
            positions: u32_at(header::POSITIONS),
            first_column: u32_at(header::FIRST_COLUMN),
            layer_ids: [u32_at(header::LAYER_IDS), u32_at(header::LAYER_IDS + 4)],
            gpu_deadline_ns: u64_at(header::GPU_DEADLINE_NS),
            row_bytes,
        };
        shape.check()?;
        let (stride, bytes) = (u64_at(header::STRIDE), u64_at(header::BYTES));
        if Some(stride) != shape.stride() || Some(bytes) != shape.bytes() {
            return Err(RingError(format!(
                "the header states a stride of {stride} and {bytes} bytes; its shape gives {:?} and {:?}",
                shape.stride(),
                shape.bytes()
            )));
        }
        if len < bytes {
            return Err(RingError(format!(
                "{len} bytes of memory for a ring of {bytes}"
            )));
        }
        Ok(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wait_falls_in_the_bucket_whose_bounds_hold_it() {
        let mut last = 0;
        for ns in (0..40).flat_map(|e| {
            let p = 1u64 << e;
            [
                p - 1,
                p,
                p + p / 4 - 1,
                p + p / 4,
                p + p / 3,
                p + p / 2,
                p + 3 * p / 4,
            ]
        }) {
            let b = wait_bucket(ns);
            let (lo, hi) = wait_bucket_bounds(b);
            let x = ns as f64;
            assert!(b < WAIT_BUCKETS, "{ns}");
            assert!(
                lo <= x && (x < hi || b == WAIT_BUCKETS - 1),
                "{ns} in {b}: {lo}..{hi}"
            );
            assert!(b >= last || ns < 1 << 10, "buckets grow with the wait");
            last = b;
        }
        assert_eq!(wait_bucket(1023), 0);
        assert_eq!(wait_bucket(1024), 1);
        assert_eq!(wait_bucket(1280), 2);
        assert_eq!(wait_bucket(2048), 5);
        assert_eq!(wait_bucket(u64::MAX), WAIT_BUCKETS - 1);
    }

    fn decode_shape() -> Shape {
        Shape {
            slots: 8,
            layers: 2,
            columns: 24,
            positions: 256,
            first_column: 0,
            layer_ids: [1, 14],
            gpu_deadline_ns: 50_000_000,
            row_bytes: ROW_BYTES as u32,
        }
    }

    #[test]
    fn a_header_round_trips_and_its_offsets_hold_what_they_say() {
        let s = decode_shape();
        let h = s.encode().expect("encode");
        let len = s.bytes().expect("bytes");
        assert_eq!(Shape::decode(&h, len).expect("decode"), s);
        // 256 positions x 24 columns x 2 layers: 98,304 bytes of ids, then
        // 3,244,032 of rows, in 3,342,336 + 64 rounded to 4 KiB.
        assert_eq!(s.rows_at(), Some(64 + 98_304));
        assert_eq!(s.stride(), Some(3_346_432));
        assert_eq!(len, 4096 + 8 * 3_346_432);
        assert_eq!(s.id_at(1, 0, 0), 64 + 256 * 24 * 8);
        assert_eq!(s.layer_rows_at(1), s.rows_at().unwrap() + 256 * 24 * 264);
        assert!(s.layer_rows_at(1) + 256 * 24 * 264 <= s.stride().unwrap());
        assert_eq!(s.slot_at(3), 4096 + 3 * 3_346_432);
    }

    #[test]
    fn a_ring_of_another_row_size_states_it_and_v41_rings_stay_version_1() {
        // V4.1's ring: version 1, nothing at the row size's word.
        let v41 = decode_shape();
        let h = v41.encode().expect("encode");
        assert_eq!(&h[8..12], &1u32.to_le_bytes());
        assert_eq!(&h[header::ROW_BYTES..header::ROW_BYTES + 4], &[0; 4]);
        // A version 1 header is read from its first 64 bytes, as always.
        let len = v41.bytes().expect("bytes");
        assert_eq!(Shape::decode(&h[..64], len).expect("v1"), v41);
        // Qwen4Exp's FP8 rows: 16 of 160 bytes a position, one section.
        let q = Shape {
            layers: 1,
            columns: 16,
            layer_ids: [3, 0],
            row_bytes: 160,
            ..v41
        };
        let h = q.encode().expect("encode");
        assert_eq!(&h[8..12], &2u32.to_le_bytes());
        assert_eq!(
            &h[header::ROW_BYTES..header::ROW_BYTES + 4],
            &160u32.to_le_bytes()
        );
        let len = q.bytes().expect("bytes");
        assert_eq!(Shape::decode(&h, len).expect("v2"), q);
        // 256 x 16 x 8 bytes of ids; the rows at their own size.
        assert_eq!(q.rows_at(), Some(64 + 32_768));
        assert_eq!(
            q.stride(),
            Some((64 + 32_768 + 256 * 16 * 160u64).next_multiple_of(4096))
        );
        // NVFP4's 90-byte rows: offsets follow the size, unaligned rows.
        let n = Shape { row_bytes: 90, ..q };
        assert_eq!(
            n.layer_rows_at(0) + 90 * 16 * 256,
            n.rows_at().unwrap() + 368_640
        );
        // A version 2 header cut at 64 bytes, or of a size out of bounds.
        assert!(
            Shape::decode(&h[..64], len)
                .expect_err("short")
                .0
                .contains("row size")
        );
        let mut z = h;
        z[header::ROW_BYTES..header::ROW_BYTES + 4].copy_from_slice(&0u32.to_le_bytes());
        assert!(
            Shape::decode(&z, len)
                .expect_err("zero")
                .0
                .contains("rows of 0 bytes")
        );
        assert!(
            Shape {
                row_bytes: 20_000,
                ..q
            }
            .check()
            .is_err()
        );
        // A version 2 header stating 264 describes V4.1's layout too.
        let mut w = v41.encode().expect("encode");
        w[8..12].copy_from_slice(&2u32.to_le_bytes());
        w[header::ROW_BYTES..header::ROW_BYTES + 4].copy_from_slice(&264u32.to_le_bytes());
        assert_eq!(
            Shape::decode(&w, v41.bytes().unwrap()).expect("v2 of 264"),
            v41
        );
    }

    #[test]
    fn every_bound_is_checked_before_an_offset_is_trusted() {
        let s = decode_shape();
        let len = s.bytes().expect("bytes");
        let bad = |edit: &dyn Fn(&mut Shape)| {
            let mut t = s;
            edit(&mut t);
            t.check().expect_err("refused").0
        };
        assert!(bad(&|t| t.slots = 0).contains("slots"));
        assert!(bad(&|t| t.slots = 65).contains("slots"));
        assert!(bad(&|t| t.layers = 3).contains("layers"));
        assert!(bad(&|t| t.columns = 25).contains("columns"));
        assert!(bad(&|t| t.first_column = 1).contains("columns 1..25"));
        assert!(bad(&|t| t.positions = 0).contains("positions"));
        assert!(bad(&|t| t.positions = 70_000).contains("positions"));
        assert!(bad(&|t| t.layer_ids = [1, 0]).contains("layer section 1"));
        assert!(
            bad(&|t| {
                t.positions = 65_536;
                t.slots = 64
            })
            .contains("GiB")
        );
        let one = Shape {
            layers: 1,
            layer_ids: [14, 0],
            ..s
        };
        one.check().expect("one layer");
        // A header whose stated sizes disagree with its shape, or memory
        // too short for it, or garbage.
        let mut h = s.encode().expect("encode");
        h[header::STRIDE] ^= 1;
        assert!(
            Shape::decode(&h, len)
                .expect_err("stride")
                .0
                .contains("stride")
        );
        let h = s.encode().expect("encode");
        assert!(
            Shape::decode(&h, len - 1)
                .expect_err("short")
                .0
                .contains("bytes of memory")
        );
        assert!(Shape::decode(&[0u8; 64], len).is_err());
        assert!(Shape::decode(&h[..10], len).is_err());
        let mut v = h;
        v[8] = 9;
        assert!(
            Shape::decode(&v, len)
                .expect_err("version")
                .0
                .contains("version 9")
        );
    }
}
