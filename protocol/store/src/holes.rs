//! Holes in sparse files: where a file (a table file, or a memfd on tmpfs)
//! has no data, it reads as zeros, and nothing needs to be read, copied,
//! checked or faulted in there to know it. A full-size V4.1 table whose
//! untouched pages are holes (`memory-donor gen --sparse-rows`) is how this
//! machine checks 94 GiB tables end to end; real tables have no holes and
//! take the ordinary path, one `lseek` per 4 MiB more.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;

use engram_protocol::etab::{PAGE_BYTES, page_checksum};

/// Zero bytes to hash or compare against, without allocating per use.
pub static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// True when bytes `offset..offset + len` of `file` are one hole: the
/// next data at or after `offset` (`SEEK_DATA`) starts at or after the
/// end. False when there is data there, or when the file system cannot
/// say (then the bytes are read as usual). Moves the descriptor's file
/// offset, which positional reads never use.
pub fn is_hole(file: &File, offset: u64, len: u64) -> bool {
    let Ok(off) = libc::off_t::try_from(offset) else {
        return false;
    };
    if len == 0 {
        return false;
    }
    // SAFETY: lseek on a descriptor we hold open; it reads no memory.
    let data = unsafe { libc::lseek(file.as_raw_fd(), off, libc::SEEK_DATA) };
    if data < 0 {
        // ENXIO: no data after `offset` at all.
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
    }
    data as u64 >= offset.saturating_add(len)
}

/// The parts of `range` of `file` that hold data (`SEEK_DATA` and
/// `SEEK_HOLE`), in order; the whole range when the file system cannot
/// say.
pub fn data_extents(file: &File, range: Range<u64>) -> Vec<Range<u64>> {
    let fd = file.as_raw_fd();
    let seek = |at: u64, whence| {
        let at = libc::off_t::try_from(at).ok()?;
        // SAFETY: lseek on a descriptor we hold open; it reads no memory.
        let r = unsafe { libc::lseek(fd, at, whence) };
        if r >= 0 {
            Some(Ok(r as u64))
        } else if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
            Some(Err(()))
        } else {
            None
        }
    };
    let mut out = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let start = match seek(at, libc::SEEK_DATA) {
            Some(Ok(s)) => s,
            Some(Err(())) => break,
            None => return vec![range],
        };
        if start >= range.end {
            break;
        }
        let end = match seek(start, libc::SEEK_HOLE) {
            Some(Ok(e)) => e.min(range.end),
            _ => range.end,
        };
        out.push(start..end.max(start + 1));
        at = end.max(start + 1);
    }
    out
}

/// The checksum a page of zeros has in `page_xxh3`.
pub fn zero_page_checksum() -> u64 {
    page_checksum(&ZEROS[..PAGE_BYTES as usize])
}

/// Feed `len` zero bytes to `h`.
pub fn hash_zeros(h: &mut blake3::Hasher, mut len: usize) {
    while len > 0 {
        let n = len.min(ZEROS.len());
        h.update(&ZEROS[..n]);
        len -= n;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn holes_and_extents_of_a_sparse_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sparse");
        let f = File::create(&path).expect("create");
        let mib = 1u64 << 20;
        f.set_len(64 * mib).expect("set_len");
        f.write_all_at(&[1u8; 4096], 8 * mib).expect("write");
        f.write_all_at(&[2u8; 4096], 40 * mib).expect("write");
        f.sync_all().expect("sync");
        let f = File::open(&path).expect("open");
        // A file system without SEEK_DATA reports everything as data: the
        // answers below are then the conservative ones.
        let extents = data_extents(&f, 0..64 * mib);
        if extents.len() == 1 && extents[0] == (0..64 * mib) {
            assert!(!is_hole(&f, 0, mib));
            eprintln!("skipped: this file system does not report holes");
            return;
        }
        assert!(is_hole(&f, 0, 8 * mib));
        assert!(!is_hole(&f, 0, 8 * mib + 1));
        assert!(!is_hole(&f, 8 * mib, 4096));
        assert!(is_hole(&f, 48 * mib, 16 * mib), "after the last data");
        assert!(!is_hole(&f, 0, 0));
        assert_eq!(extents.len(), 2, "{extents:?}");
        assert!(extents[0].contains(&(8 * mib)) && extents[1].contains(&(40 * mib)));
        assert!(extents.iter().all(|e| e.end <= 64 * mib));
        assert!(data_extents(&f, 50 * mib..60 * mib).is_empty());
    }

    #[test]
    fn zeros_hash_and_sum_as_zeros() {
        let mut a = blake3::Hasher::new();
        hash_zeros(&mut a, 200_000);
        assert_eq!(a.finalize(), blake3::hash(&vec![0u8; 200_000]));
        assert_eq!(zero_page_checksum(), page_checksum(&[0u8; 4096]));
    }
}
