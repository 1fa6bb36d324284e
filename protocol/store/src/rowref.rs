//! Where a resident table's rows lie in its memory, and one row as it
//! lies there: whole (264 bytes back to back, or 15 to a 4 KiB page of a
//! table file) or split (planar: the 256 values in one region, the 8 scale
//! bytes in another; [`crate::kept::KeptLayout::Planar`]).

use engram_protocol::ROW_BYTES;
use engram_protocol::etab::{PAGE_BYTES, ROWS_PER_PAGE};

use crate::kept::{SCALE_BYTES, VALUE_BYTES};

/// How a table's rows lie in its mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLayout {
    /// Row `r` at `r * 264`.
    Packed,
    /// A table file's pages: row `r` at `(r / 15) * 4096 + (r % 15) * 264`.
    Paged,
    /// Row `r`'s values at `r * 256`, its scales at `scales_at + r * 8`.
    Planar {
        /// Where the scales start (right after the values).
        scales_at: usize,
    },
    /// Rows of another encoding than V4.1's (docs/models.md), back to
    /// back: row `r` at `r * row_bytes`.
    Encoded {
        /// Bytes per row.
        row_bytes: usize,
    },
}

impl RowLayout {
    /// Its name in messages and status (`packed`, `paged`, `planar`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Packed | Self::Encoded { .. } => "packed",
            Self::Paged => "paged",
            Self::Planar { .. } => "planar",
        }
    }

    /// Where row `row`'s values start, and where its scales start (264
    /// bytes apart from the row's start, 256 after it, for the whole
    /// layouts). The caller range-checks `row`.
    #[inline]
    pub fn offsets(self, row: u64) -> (usize, usize) {
        let r = row as usize;
        match self {
            Self::Packed => (r * ROW_BYTES, r * ROW_BYTES + VALUE_BYTES as usize),
            Self::Paged => {
                let at = (row / ROWS_PER_PAGE) as usize * PAGE_BYTES as usize
                    + (row % ROWS_PER_PAGE) as usize * ROW_BYTES;
                (at, at + VALUE_BYTES as usize)
            }
            Self::Planar { scales_at } => (
                r * VALUE_BYTES as usize,
                scales_at + r * SCALE_BYTES as usize,
            ),
            // No scales apart: the whole row is its "values".
            Self::Encoded { row_bytes } => (r * row_bytes, (r + 1) * row_bytes),
        }
    }

    /// Bytes per row (264 but for [`Self::Encoded`]).
    #[inline]
    pub fn row_bytes(self) -> usize {
        match self {
            Self::Encoded { row_bytes } => row_bytes,
            _ => ROW_BYTES,
        }
    }

    /// True when a row's bytes are contiguous.
    pub fn whole_rows(self) -> bool {
        !matches!(self, Self::Planar { .. })
    }
}

/// One row as it lies in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowRef<'a> {
    /// Its 264 bytes, contiguous.
    Whole(&'a [u8]),
    /// Its 256 values and its 8 scale bytes, apart.
    Split {
        /// The values.
        values: &'a [u8],
        /// The scale bytes.
        scales: &'a [u8],
    },
}

impl<'a> RowRef<'a> {
    /// A V4.1 row's 256 values (a row of another encoding: all of it).
    pub fn values(&self) -> &'a [u8] {
        match *self {
            Self::Whole(b) => b.get(..VALUE_BYTES as usize).unwrap_or(b),
            Self::Split { values, .. } => values,
        }
    }

    /// A V4.1 row's 8 scale bytes (a row of another encoding: none).
    pub fn scales(&self) -> &'a [u8] {
        match *self {
            Self::Whole(b) => b.get(VALUE_BYTES as usize..).unwrap_or_default(),
            Self::Split { scales, .. } => scales,
        }
    }

    /// Append the row's bytes to `out` (one copy when whole).
    #[inline]
    pub fn extend_into(&self, out: &mut Vec<u8>) {
        match *self {
            Self::Whole(b) => out.extend_from_slice(b),
            Self::Split { values, scales } => {
                out.extend_from_slice(values);
                out.extend_from_slice(scales);
            }
        }
    }

    /// Write the row's bytes to `out` (exactly the row's length).
    #[inline]
    pub fn write_to(&self, out: &mut [u8]) {
        match *self {
            Self::Whole(b) => out.copy_from_slice(b),
            Self::Split { values, scales } => {
                out[..VALUE_BYTES as usize].copy_from_slice(values);
                out[VALUE_BYTES as usize..].copy_from_slice(scales);
            }
        }
    }

    /// The row's bytes in a vector of their own.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(ROW_BYTES);
        self.extend_into(&mut v);
        v
    }
}

/// The row at `offsets` in `map` (`None` when it does not fit).
#[inline]
pub(crate) fn row_in(map: &[u8], layout: RowLayout, row: u64) -> Option<RowRef<'_>> {
    let (values, scales) = layout.offsets(row);
    if layout.whole_rows() {
        return map
            .get(values..values + layout.row_bytes())
            .map(RowRef::Whole);
    }
    Some(RowRef::Split {
        values: map.get(values..values + VALUE_BYTES as usize)?,
        scales: map.get(scales..scales + SCALE_BYTES as usize)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_finds_the_same_row() {
        // Row 20 of a 32-row table in each layout, with bytes that say
        // where they came from.
        let rows = 32u64;
        let mut want = vec![0u8; ROW_BYTES];
        for (i, b) in want.iter_mut().enumerate() {
            *b = (i * 7 + 20) as u8;
        }
        let mut packed = vec![0u8; rows as usize * ROW_BYTES];
        packed[20 * ROW_BYTES..21 * ROW_BYTES].copy_from_slice(&want);
        let mut paged = vec![0u8; 3 * PAGE_BYTES as usize];
        let at = PAGE_BYTES as usize + 5 * ROW_BYTES;
        paged[at..at + ROW_BYTES].copy_from_slice(&want);
        let scales_at = 8192;
        let mut planar = vec![0u8; scales_at + rows as usize * 8];
        planar[20 * 256..21 * 256].copy_from_slice(&want[..256]);
        planar[scales_at + 160..scales_at + 168].copy_from_slice(&want[256..]);
        for (map, layout) in [
            (&packed, RowLayout::Packed),
            (&paged, RowLayout::Paged),
            (&planar, RowLayout::Planar { scales_at }),
        ] {
            let r = row_in(map, layout, 20).expect("row");
            assert_eq!(r.to_vec(), want, "{}", layout.name());
            let mut out = [0u8; ROW_BYTES];
            r.write_to(&mut out);
            assert_eq!(&out[..], &want[..]);
            assert_eq!(r.values(), &want[..256]);
            assert_eq!(r.scales(), &want[256..]);
        }
        // Past the memory: none, not a panic.
        assert!(row_in(&planar, RowLayout::Planar { scales_at }, 1 << 40).is_none());
        assert!(row_in(&packed, RowLayout::Packed, rows).is_none());
    }
}
