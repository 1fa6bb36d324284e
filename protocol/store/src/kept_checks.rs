//! A table version's RDMA check words (8 bytes a row, `engram_rdma::check`)
//! kept beside the table in systemd's fd store, so that a restarted donor
//! registers them at once instead of hashing every row again (about 15 s
//! of one core for a 94.4 GiB table).
//!
//! Layout of the memfd: the words back to back from offset 0, then, in
//! its last 4 KiB, the record (integers little-endian):
//!
//! | offset | bytes | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `ENGRCHKS` |
//! | 8 | 4 | record version (1) |
//! | 12 | 4 | table id |
//! | 16 | 8 | rows |
//! | 24 | 32 | table digest |
//! | 56 | 8 | XXH3-64 of the words |
//! | 64 | 8 | XXH3-64 of bytes 0..64 |
//!
//! The record is written after the last word, and the words' hash is
//! checked when a copy is taken back (a fraction of recomputing them), so
//! a cut-short or damaged copy is refused and the words computed again.
//! The memfd is sealed against resizing only: it is never handed to
//! another process, and the mapping RDMA registers is writable, as kernels
//! before 6.2 need (`kept::writable_view_needed`).

use std::fs::File;

use engram_protocol::TableDigest;
use memmap2::MmapMut;
use twox_hash::XxHash3_64;

use crate::kept::{self, KeptError};

/// Bytes of one check word.
pub const WORD: u64 = 8;
const MAGIC: &[u8; 8] = b"ENGRCHKS";
const VERSION: u32 = 1;
const RECORD: usize = 64;
const TAIL: u64 = 4096;

/// The fd-store name of table `id`'s check words at `digest`.
pub fn name(id: u32, digest: &TableDigest) -> String {
    format!("{}-checks", kept::name(id, digest))
}

/// Check words in a memfd, mapped writable: what an RDMA registration
/// takes ([`AsRef`] is exactly the words).
#[derive(Debug)]
pub struct KeptChecks {
    map: MmapMut,
    len: usize,
    file: File,
}

impl AsRef<[u8]> for KeptChecks {
    fn as_ref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl KeptChecks {
    /// The memfd (to hand to the fd store).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// A new memfd for `rows` words, and `fill` writing them (the
    /// slice it is given is exactly the words); then the record is written
    /// and the size sealed.
    pub fn create(
        id: u32,
        rows: u64,
        digest: &TableDigest,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<Self, KeptError> {
        let too_big = || KeptError::Bad(format!("{rows} rows of check words"));
        let words = rows.checked_mul(WORD).ok_or_else(too_big)?;
        let flen = words.checked_add(TAIL).ok_or_else(too_big)?;
        let len = usize::try_from(words).map_err(|_| too_big())?;
        let file = kept::memfd(0)?;
        file.set_len(flen)
            .map_err(kept::os("sizing the check words' memfd"))?;
        let mut map = map(&file, flen)?;
        fill(&mut map[..len]);
        let record = encode(id, rows, digest, XxHash3_64::oneshot(&map[..len]));
        map[len..len + RECORD + 8].copy_from_slice(&record);
        kept::seal(&file)?;
        Ok(Self { map, len, file })
    }

    /// Take back a copy a previous process kept: refused unless its
    /// record is complete and names exactly table `id` at `digest` with
    /// `rows` rows, and its words hash to what the record says.
    pub fn open(file: File, id: u32, rows: u64, digest: &TableDigest) -> Result<Self, KeptError> {
        let flen = file
            .metadata()
            .map_err(kept::os("reading the check words' memfd size"))?
            .len();
        let words = rows.checked_mul(WORD).and_then(|w| w.checked_add(TAIL));
        if words != Some(flen) {
            return Err(KeptError::Bad(format!(
                "{flen} bytes, not the size of {rows} rows' check words"
            )));
        }
        let len = usize::try_from(rows * WORD)
            .map_err(|_| KeptError::Bad("larger than the address space".into()))?;
        let map = map(&file, flen)?;
        let rec = &map[len..len + RECORD + 8];
        let sum = u64::from_le_bytes(rec[RECORD..RECORD + 8].try_into().unwrap_or_default());
        if &rec[..8] != MAGIC || XxHash3_64::oneshot(&rec[..RECORD]) != sum {
            return Err(KeptError::Bad(
                "no complete record (its writing was cut short)".into(),
            ));
        }
        let words_sum = u64::from_le_bytes(rec[56..64].try_into().unwrap_or_default());
        if rec[..56] != encode(id, rows, digest, words_sum)[..56] {
            return Err(KeptError::Bad(
                "the words of another table, version or size".into(),
            ));
        }
        if XxHash3_64::oneshot(&map[..len]) != words_sum {
            return Err(KeptError::Bad(
                "the words changed since they were kept".into(),
            ));
        }
        Ok(Self { map, len, file })
    }
}

fn map(file: &File, flen: u64) -> Result<MmapMut, KeptError> {
    let flen = usize::try_from(flen)
        .map_err(|_| KeptError::Bad("larger than the address space".into()))?;
    // SAFETY: a memfd this process holds, sized before (and sealed against
    // resizing once written), so the mapping cannot lose its pages.
    unsafe { memmap2::MmapOptions::new().len(flen).map_mut(file) }.map_err(|source| KeptError::Io {
        op: "mapping the check words' memfd",
        source,
    })
}

fn encode(id: u32, rows: u64, digest: &TableDigest, words_sum: u64) -> [u8; RECORD + 8] {
    let mut b = [0u8; RECORD + 8];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&id.to_le_bytes());
    b[16..24].copy_from_slice(&rows.to_le_bytes());
    b[24..56].copy_from_slice(&digest.0);
    b[56..64].copy_from_slice(&words_sum.to_le_bytes());
    let sum = XxHash3_64::oneshot(&b[..RECORD]);
    b[RECORD..].copy_from_slice(&sum.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn kept_words_come_back_only_for_their_table_version_and_intact() {
        let d = TableDigest([9; 32]);
        let fill = |w: &mut [u8]| w.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let k = KeptChecks::create(3, 100, &d, fill).expect("created");
        assert_eq!(k.as_ref().len(), 800);
        let dup = || k.file().try_clone().expect("dup");
        let back = KeptChecks::open(dup(), 3, 100, &d).expect("taken back");
        assert_eq!(back.as_ref(), k.as_ref());
        for (id, rows, digest) in [(4, 100, d), (3, 99, d), (3, 100, TableDigest([8; 32]))] {
            assert!(
                KeptChecks::open(dup(), id, rows, &digest).is_err(),
                "{id} {rows}"
            );
        }
        // A damaged word is refused.
        dup().write_all_at(&[0xFF], 17).expect("written");
        let e = KeptChecks::open(dup(), 3, 100, &d).expect_err("damaged");
        assert!(
            e.to_string().contains("changed since they were kept"),
            "{e}"
        );
        // So is a copy whose record was never written.
        let cut = kept::memfd(0).expect("memfd");
        cut.set_len(800 + TAIL).expect("sized");
        assert!(KeptChecks::open(cut, 3, 100, &d).is_err());
    }
}
