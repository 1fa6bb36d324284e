//! Row integrity for one-sided reads. A READ bypasses the donor's
//! per-answer checksum, so the donor keeps a check word beside every row:
//! `XXH3-64(row id as u64 LE ++ the row's 264 bytes, seed = the table
//! digest's first 8 bytes as u64 LE)`. The node reads a row and its check
//! word in the same doorbell and recomputes the word before using the row.
//! The seed makes a row of another version fail the check, and the row id
//! makes a row read from the wrong offset fail it.

use engram_protocol::{ROW_BYTES, TableDigest};
use twox_hash::XxHash3_64;

/// Bytes of one check word.
pub const CHECK_BYTES: usize = 8;

/// The seed of a table version's check words.
pub fn seed(digest: &TableDigest) -> u64 {
    digest.prefix()
}

/// The check word of row `row_id` holding `row` (264 bytes).
#[inline]
pub fn check_word(seed: u64, row_id: u64, row: &[u8]) -> u64 {
    let mut buf = [0u8; 8 + ROW_BYTES];
    buf[..8].copy_from_slice(&row_id.to_le_bytes());
    let n = row.len().min(ROW_BYTES);
    buf[8..8 + n].copy_from_slice(&row[..n]);
    XxHash3_64::oneshot_with_seed(seed, &buf)
}

/// The check words of a whole table (`rows` is its row data, 264 bytes a
/// row), 8 bytes LE each, computed on `threads` threads.
pub fn table_checks(seed: u64, rows: &[u8], threads: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows.len() / ROW_BYTES * CHECK_BYTES];
    table_checks_into(seed, rows, &mut out, threads);
    out
}

/// [`table_checks`] into `out` (8 bytes a row of `rows`; extra words of
/// `out` are left as they are).
pub fn table_checks_into(seed: u64, rows: &[u8], out: &mut [u8], threads: usize) {
    let n = (rows.len() / ROW_BYTES).min(out.len() / CHECK_BYTES);
    let out = &mut out[..n * CHECK_BYTES];
    let threads = threads.clamp(1, 64);
    let per = n.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(per * CHECK_BYTES).enumerate() {
            let first = i * per;
            s.spawn(move || {
                for (j, word) in chunk.chunks_exact_mut(CHECK_BYTES).enumerate() {
                    let r = first + j;
                    let row = &rows[r * ROW_BYTES..(r + 1) * ROW_BYTES];
                    word.copy_from_slice(&check_word(seed, r as u64, row).to_le_bytes());
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_checks_match_row_by_row_whatever_the_threads() {
        let rows: Vec<u8> = (0..ROW_BYTES * 37).map(|i| (i * 7 % 251) as u8).collect();
        let one = table_checks(5, &rows, 1);
        for t in [2, 3, 8, 100] {
            assert_eq!(table_checks(5, &rows, t), one, "{t} threads");
        }
        for r in 0..37 {
            let want = check_word(5, r as u64, &rows[r * ROW_BYTES..(r + 1) * ROW_BYTES]);
            assert_eq!(one[r * 8..r * 8 + 8], want.to_le_bytes());
        }
    }

    #[test]
    fn the_word_binds_the_row_id_and_the_version() {
        let row = [9u8; ROW_BYTES];
        let w = check_word(1, 10, &row);
        assert_ne!(w, check_word(1, 11, &row));
        assert_ne!(w, check_word(2, 10, &row));
        let mut other = row;
        other[263] ^= 1;
        assert_ne!(w, check_word(1, 10, &other));
    }
}
