//! Table memory that outlives the process: a memfd holding the rows, with
//! a record of what they are written last, so the next process (started
//! by systemd, which kept the descriptor in its fd store) can serve them
//! at once instead of reading the table file again.
//!
//! Layout of the memfd: the rows from offset 0 ([`KeptLayout`]: back to
//! back, or planar as the engines' host-table kernels read them), then, in
//! the memfd's last 4 KiB, the record (all integers little-endian):
//!
//! | offset | bytes | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `ENGRKEPT` |
//! | 8 | 4 | record version (1 packed; 2 when bit 1 of the flags may be set) |
//! | 12 | 4 | table id |
//! | 16 | 4 | model layer |
//! | 20 | 4 | flags (bit 0: the digest was verified at load; bit 1: planar) |
//! | 24 | 8 | rows |
//! | 32 | 32 | table digest (BLAKE3) |
//! | 64 | 8 | generation (random, one per load) |
//! | 72 | 8 | load time, Unix milliseconds |
//! | 80 | 8 | XXH3-64 of bytes 0..80 (record versions 1 and 2) |
//!
//! Record version 3 holds rows of another encoding than V4.1's, packed at
//! their own size ([`KeptLayout::Encoded`]; docs/models.md): bytes 80..96
//! are the encoding (its wire kind u16 and values u16, PROTOCOL.md 3.3),
//! the table's F32 scale as its bits (u32), and a u32 that is 1 when the
//! table has one; the XXH3-64 of bytes 0..96 follows at 96. Builds that
//! read only versions 1 and 2 refuse such a copy.
//!
//! The record is written after the last row, so a copy whose load was cut
//! short has none and is refused. The size is sealed (`F_SEAL_SHRINK`,
//! `F_SEAL_GROW`), so a mapping of it can never fault on a truncation, and
//! once the load's writable mapping is gone so are writes (`F_SEAL_WRITE`,
//! [`seal_writes`]): the bytes can then be shared with other processes.
//! Where enough huge pages are reserved (`HugePages_Free`), the memfd is
//! hugetlb-backed (`MFD_HUGETLB`): fewer TLB misses on random rows and
//! pages that are never swapped.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use engram_protocol::{ROW_BYTES, TableDigest};
use thiserror::Error;

/// The record's magic.
const MAGIC: &[u8; 8] = b"ENGRKEPT";
/// The record's version for packed rows (what every build reads).
const VERSION: u32 = 1;
/// The record's version when the flags may say planar: a build that reads
/// only version 1 refuses such a copy instead of serving its bytes as
/// packed rows.
const VERSION_LAYOUT: u32 = 2;
/// The record's version for rows of another encoding than V4.1's.
const VERSION_ENCODED: u32 = 3;
/// Flag bit: the rows are planar.
const PLANAR: u32 = 2;
/// Bytes a version 1 or 2 record takes (then its checksum).
const RECORD: usize = 80;
/// Bytes a version 3 record takes (then its checksum).
const RECORD_ENCODED: usize = 96;
/// The tail the record lives in.
const TAIL: u64 = 4096;
/// The seals every kept memfd carries.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// What a kept copy says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Table id.
    pub id: u32,
    /// Model layer.
    pub layer: u32,
    /// Rows.
    pub rows: u64,
    /// Version.
    pub digest: TableDigest,
    /// One per load: a restarted donor serving the same generation did
    /// not load again.
    pub generation: u64,
    /// When it was loaded (Unix milliseconds).
    pub loaded_unix_ms: u64,
    /// True when the digest was recomputed at load.
    pub verified: bool,
    /// How the rows lie in the memfd.
    pub layout: KeptLayout,
}

/// How a kept memfd's rows lie in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeptLayout {
    /// Row `r`'s 264 bytes at `r * 264` (what the data plane sends).
    #[default]
    Packed,
    /// Every row's 256 E4M3 values first (row `r`'s at `r * 256`), then,
    /// right after them ([`planar_scales_at`], `rows * 256`), every row's
    /// 8 scale bytes (row `r`'s at `scales_at + r * 8`): exactly the host
    /// tables the engines build (vLLM's `weight` then `weight_scale_inv`
    /// in one allocation, SGLang's `weight` then `scale`, which it slices
    /// at `rows * 256`), so an engine hands this memory to its own lookup
    /// as it is.
    Planar,
    /// Rows of another encoding than V4.1's, back to back at their own
    /// size (row `r` at `r * row_bytes`), with the table's scale where the
    /// encoding has one. Never named in a config: a table's file says it.
    Encoded {
        /// How the rows are encoded.
        encoding: engram_protocol::encoding::RowEncoding,
        /// The table's F32 scale, as its bits.
        tensor_scale: Option<u32>,
    },
}

impl KeptLayout {
    /// Its name in configs, messages and status.
    pub fn name(self) -> &'static str {
        match self {
            Self::Packed | Self::Encoded { .. } => "packed",
            Self::Planar => "planar",
        }
    }

    /// The layout named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "packed" => Some(Self::Packed),
            "planar" => Some(Self::Planar),
            _ => None,
        }
    }

    /// Bytes `rows` rows take in this layout; `None` on overflow.
    pub fn rows_len(self, rows: u64) -> Option<u64> {
        match self {
            Self::Packed => rows.checked_mul(ROW_BYTES as u64),
            Self::Planar => planar_scales_at(rows)?.checked_add(rows.checked_mul(SCALE_BYTES)?),
            Self::Encoded { encoding, .. } => rows.checked_mul(encoding.row_bytes() as u64),
        }
    }
}

/// Scale bytes a row carries (the last 8 of its 264).
pub const SCALE_BYTES: u64 = 8;
/// Value bytes a row carries (the first 256 of its 264).
pub const VALUE_BYTES: u64 = 256;

/// Where a planar table's scales start: right after its values, as the
/// engines slice their own host tables. `None` on overflow.
pub fn planar_scales_at(rows: u64) -> Option<u64> {
    rows.checked_mul(VALUE_BYTES)
}

impl Record {
    /// The name the copy is kept under in systemd's fd store: the table
    /// id and the first 16 hex digits of its digest.
    pub fn name(&self) -> String {
        name(self.id, &self.digest)
    }

    fn encode(&self) -> [u8; RECORD_ENCODED + 8] {
        let mut b = [0u8; RECORD_ENCODED + 8];
        b[0..8].copy_from_slice(MAGIC);
        let (version, planar) = match self.layout {
            KeptLayout::Packed => (VERSION, 0),
            KeptLayout::Planar => (VERSION_LAYOUT, PLANAR),
            KeptLayout::Encoded { .. } => (VERSION_ENCODED, 0),
        };
        b[8..12].copy_from_slice(&version.to_le_bytes());
        b[12..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.layer.to_le_bytes());
        b[20..24].copy_from_slice(&(u32::from(self.verified) | planar).to_le_bytes());
        b[24..32].copy_from_slice(&self.rows.to_le_bytes());
        b[32..64].copy_from_slice(&self.digest.0);
        b[64..72].copy_from_slice(&self.generation.to_le_bytes());
        b[72..80].copy_from_slice(&self.loaded_unix_ms.to_le_bytes());
        let end = match self.layout {
            KeptLayout::Encoded {
                encoding,
                tensor_scale,
            } => {
                let (kind, values) = encoding.wire_code();
                b[80..82].copy_from_slice(&kind.to_le_bytes());
                b[82..84].copy_from_slice(&values.to_le_bytes());
                b[84..88].copy_from_slice(&tensor_scale.unwrap_or(0).to_le_bytes());
                b[88..92].copy_from_slice(&u32::from(tensor_scale.is_some()).to_le_bytes());
                RECORD_ENCODED
            }
            _ => RECORD,
        };
        let sum = twox_hash::XxHash3_64::oneshot(&b[..end]);
        b[end..end + 8].copy_from_slice(&sum.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Self, KeptError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if b.len() < RECORD_ENCODED + 8 || &b[0..8] != MAGIC {
            return Err(KeptError::NoRecord);
        }
        let version = u32_at(8);
        let end = match version {
            VERSION | VERSION_LAYOUT => RECORD,
            VERSION_ENCODED => RECORD_ENCODED,
            _ => {
                return Err(KeptError::Bad(format!(
                    "record version {version} (this build reads {VERSION} to {VERSION_ENCODED})"
                )));
            }
        };
        if twox_hash::XxHash3_64::oneshot(&b[..end]) != u64_at(end) {
            return Err(KeptError::Bad(
                "the record's checksum does not match".into(),
            ));
        }
        let encoded = if version == VERSION_ENCODED {
            let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
            let encoding =
                engram_protocol::encoding::RowEncoding::from_wire(u16_at(80), u16_at(82))
                    .ok_or_else(|| KeptError::Bad("the record names an unknown encoding".into()))?;
            let tensor_scale = (u32_at(88) == 1).then(|| u32_at(84));
            if tensor_scale.is_some() != encoding.has_tensor_scale() {
                return Err(KeptError::Bad(
                    "the record's table scale does not fit its encoding".into(),
                ));
            }
            Some(KeptLayout::Encoded {
                encoding,
                tensor_scale,
            })
        } else {
            None
        };
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&b[32..64]);
        Ok(Self {
            id: u32_at(12),
            layer: u32_at(16),
            verified: u32_at(20) & 1 == 1,
            layout: match encoded {
                Some(layout) => layout,
                None if version == VERSION_LAYOUT && u32_at(20) & PLANAR != 0 => KeptLayout::Planar,
                None => KeptLayout::Packed,
            },
            rows: u64_at(24),
            digest: TableDigest(digest),
            generation: u64_at(64),
            loaded_unix_ms: u64_at(72),
        })
    }
}

/// The fd-store name of table `id` at version `digest`.
pub fn name(id: u32, digest: &TableDigest) -> String {
    format!("etab-{id}-{}", &digest.to_hex()[..16])
}

/// Why a kept copy is not used.
#[derive(Debug, Error)]
pub enum KeptError {
    /// The OS refused an operation.
    #[error("{op}: {source}")]
    Io {
        /// The operation that failed (for example `memfd_create`).
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// No complete record: the load that made it did not finish.
    #[error("no record of what it holds (its load did not finish)")]
    NoRecord,
    /// The record or the memfd is not consistent.
    #[error("{0}")]
    Bad(String),
}

impl KeptError {
    /// As an IO error (for callers that report memory failures as such).
    pub fn into_io(self) -> std::io::Error {
        match self {
            Self::Io { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        }
    }
}

pub(crate) fn os(op: &'static str) -> impl FnOnce(std::io::Error) -> KeptError {
    move |source| KeptError::Io { op, source }
}

/// Bytes a memfd holding `rows` rows in `layout` and the record takes
/// (before any rounding up to the huge page size).
/// `None` when that overflows.
pub fn memfd_len(rows: u64, layout: KeptLayout) -> Option<u64> {
    layout
        .rows_len(rows)?
        .div_ceil(TAIL)
        .checked_mul(TAIL)?
        .checked_add(TAIL)
}

/// The huge page size and how many bytes of the host's huge page pool are
/// free, from `/proc/meminfo`: free pages less those already promised to
/// mappings that have not touched them yet (`HugePages_Rsvd`).
pub fn huge_pages_free() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let size = meminfo_field(&text, "Hugepagesize:")?.saturating_mul(1024);
    let free = meminfo_field(&text, "HugePages_Free:")?;
    let promised = meminfo_field(&text, "HugePages_Rsvd:").unwrap_or(0);
    (size > 0).then_some((size, free.saturating_sub(promised).saturating_mul(size)))
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&text, "MemAvailable:").map(|kb| kb.saturating_mul(1024))
}

/// The number after `key` (with its colon) in `/proc/meminfo`'s text: kB
/// for sizes, a count for page counts.
fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// The pages a memfd's rows live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Reserved huge pages (`MFD_HUGETLB`): never swapped, no TLB pressure.
    HugeTlb,
    /// Transparent huge pages for shared memory (`shmem_enabled` is
    /// `advise` or wider, and the mapping asks for them).
    Thp,
    /// 4 KiB pages (`shmem_enabled` is `never`): random row reads measured
    /// 45% slower than on huge pages here (8 GiB, 24 random rows).
    Small,
}

impl Pages {
    /// What a memfd that is not hugetlb-backed gets, from the kernel's
    /// `shmem_enabled` setting (the selected value is in brackets).
    pub fn for_shmem() -> Self {
        let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .unwrap_or_default();
        let selected = setting
            .split_whitespace()
            .find(|w| w.starts_with('['))
            .unwrap_or("[never]");
        match selected {
            "[always]" | "[within_size]" | "[advise]" | "[force]" => Self::Thp,
            _ => Self::Small,
        }
    }

    /// How the log and the status show it.
    pub fn name(self) -> &'static str {
        match self {
            Self::HugeTlb => "hugetlb",
            Self::Thp => "thp",
            Self::Small => "4k",
        }
    }
}

/// A new memfd for `rows` rows in `layout`, sized and sealed against
/// resizing later; hugetlb-backed when enough huge pages are free and
/// `huge` allows. Returns the file, its length, and whether it is
/// hugetlb-backed.
pub fn create(rows: u64, layout: KeptLayout, huge: bool) -> Result<(File, u64, bool), KeptError> {
    let small = memfd_len(rows, layout).ok_or_else(|| KeptError::Bad(format!("{rows} rows")))?;
    if huge
        && let Some((page, free)) = huge_pages_free()
        && page > 4096
    {
        let len = small.next_multiple_of(page);
        if free >= len
            && let Ok(f) = memfd(libc::MFD_HUGETLB)
            && f.set_len(len).is_ok()
        {
            return Ok((f, len, true));
        }
    }
    let f = memfd(0)?;
    f.set_len(small).map_err(os("sizing the memfd"))?;
    Ok((f, small, false))
}

pub(crate) fn memfd(flags: libc::c_uint) -> Result<File, KeptError> {
    // SAFETY: the name is a NUL-terminated literal; memfd_create returns a
    // new descriptor we then own, or -1.
    let fd = unsafe {
        libc::memfd_create(
            c"engram-table".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | flags,
        )
    };
    if fd < 0 {
        return Err(KeptError::Io {
            op: "memfd_create",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Write `record` into the tail of `map` (the memfd's whole mapping,
/// writable) and seal the memfd's size. Call after the last row is in.
pub fn finish(file: &File, map: &mut [u8], record: &Record) -> Result<(), KeptError> {
    let at = map.len() - TAIL as usize;
    map[at..at + RECORD_ENCODED + 8].copy_from_slice(&record.encode());
    seal(file)
}

pub(crate) fn seal(file: &File) -> Result<(), KeptError> {
    // SAFETY: fcntl on a descriptor we own with integer arguments.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) };
    if r < 0 {
        return Err(KeptError::Io {
            op: "sealing the memfd",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Seal the memfd against writes too (`F_SEAL_WRITE`): no process, this
/// one included, can change its rows again, so it can be handed to other
/// processes (the donor's host socket). The kernel refuses while any
/// writable shared mapping of it exists: call it with none (after the
/// load's mapping is gone). Sealing again is harmless.
pub fn seal_writes(file: &File) -> Result<(), KeptError> {
    // SAFETY: fcntl on a descriptor we own with integer arguments.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
    if r < 0 {
        return Err(KeptError::Io {
            op: "sealing the memfd against writes",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Seal the memfd against new writers (`F_SEAL_FUTURE_WRITE`, Linux 5.1):
/// no `write` and no new writable shared mapping, in this process or any
/// other, while the writable views that exist already stay. The donor
/// keeps one such view of a table it serves over RDMA on a kernel that
/// registers only writable shared memory ([`writable_view_needed`]) and
/// never writes through it.
pub fn seal_future_writes(file: &File) -> Result<(), KeptError> {
    // SAFETY: fcntl on a descriptor we own with integer arguments.
    let r = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_FUTURE_WRITE,
        )
    };
    if r < 0 {
        return Err(KeptError::Io {
            op: "sealing the memfd against new writers",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// True when `file` is a memfd sealed against writes (or new writers),
/// shrinking and growing: no process it is handed to can change its bytes,
/// and they can never go away under a mapping.
pub fn is_sealed_read_only(file: &File) -> bool {
    // SAFETY: fcntl on a descriptor the caller owns.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0
        && seals & SEALS == SEALS
        && seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE) != 0
}

/// Make sure no process `file` is handed to can change it: sealed against
/// writes already, or sealed against new writers now (a copy kept with a
/// writable RDMA view, which stays; nothing writes through it). False
/// (logged) when it cannot be sealed: it is then not shared.
pub fn seal_for_sharing(file: &File) -> bool {
    if is_sealed_read_only(file) {
        return true;
    }
    match seal_future_writes(file) {
        Ok(()) => is_sealed_read_only(file),
        Err(e) => {
            tracing::warn!(error = %e, "a kept copy cannot be sealed: it is not shared");
            false
        }
    }
}

/// Whether this kernel pins a read-only RDMA registration of shared
/// memory only through a writable mapping: before Linux 6.2,
/// `ib_umem_get` pins every registration with `FOLL_WRITE | FOLL_FORCE`,
/// which fails (`EFAULT`) on a `MAP_SHARED` mapping that is not writable.
pub fn writable_view_needed() -> bool {
    kernel_release().is_none_or(|v| v < (6, 2))
}

/// The running kernel's major and minor version (`uname -r`).
pub fn kernel_release() -> Option<(u32, u32)> {
    // SAFETY: uname fills the struct it is given; all-zero is a valid one.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out pointer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    let bytes: Vec<u8> = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    parse_release(&String::from_utf8_lossy(&bytes))
}

fn parse_release(r: &str) -> Option<(u32, u32)> {
    let mut it = r.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// A writable shared mapping of a kept memfd's first `len` bytes, for an
/// RDMA registration that needs one ([`writable_view_needed`]). Nothing
/// writes through it. Fails once the memfd is sealed against writes or
/// new writers: make it first.
pub fn writable_view(file: &File, len: usize) -> Result<memmap2::MmapMut, KeptError> {
    // SAFETY: the memfd's size is sealed, so the mapping cannot lose pages;
    // no code writes through it (it is handed to the NIC as read-only).
    unsafe { memmap2::MmapOptions::new().len(len).map_mut(file) }.map_err(|source| KeptError::Io {
        op: "mapping the memfd writable for RDMA",
        source,
    })
}

/// Read and check a kept memfd's record: sealed against resizing, its
/// length consistent with its rows, the record complete and intact.
/// Returns the record and the memfd's length.
pub fn inspect(file: &File) -> Result<(Record, u64), KeptError> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(KeptError::Bad(format!(
            "not a sealable memfd ({})",
            std::io::Error::last_os_error()
        )));
    }
    if seals & SEALS != SEALS {
        return Err(KeptError::Bad("its size is not sealed".into()));
    }
    let len = file.metadata().map_err(os("stat"))?.len();
    if len < TAIL {
        return Err(KeptError::Bad(format!(
            "{len} bytes: too small to hold a record"
        )));
    }
    let mut tail = [0u8; RECORD_ENCODED + 8];
    file.read_exact_at(&mut tail, len - TAIL)
        .map_err(os("reading the record"))?;
    let record = Record::decode(&tail)?;
    if memfd_len(record.rows, record.layout).is_none_or(|need| len < need) {
        return Err(KeptError::Bad(format!(
            "{len} bytes cannot hold the {} rows its record names",
            record.rows
        )));
    }
    Ok((record, len))
}

/// The pages a kept memfd lives in.
pub fn pages(file: &File) -> Pages {
    if is_hugetlb(file) {
        Pages::HugeTlb
    } else {
        Pages::for_shmem()
    }
}

/// True when `file` lives on hugetlbfs.
pub fn is_hugetlb(file: &File) -> bool {
    // SAFETY: fstatfs writes only into the zeroed struct we pass.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the descriptor is open.
    let r = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    r == 0 && st.f_type == libc::HUGETLBFS_MAGIC
}

/// A random generation number.
pub fn generation() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most the 8 bytes we pass.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Not secret, only distinct: time and pid will do.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ (u64::from(std::process::id()) << 40);
    }
    u64::from_le_bytes(b)
}

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_parse() {
        assert_eq!(parse_release("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(parse_release("6.2.0"), Some((6, 2)));
        assert_eq!(parse_release("6.18.44-fc-v1098"), Some((6, 18)));
        assert_eq!(parse_release("4.18.0-513.el8.x86_64"), Some((4, 18)));
        assert_eq!(parse_release("garbage"), None);
        assert!(kernel_release().is_some());
    }

    #[test]
    fn a_sealed_memfd_without_a_record_and_records_round_trip() {
        let (f, len, huge) = create(100, KeptLayout::Packed, false).expect("memfd");
        assert!(!huge && !is_hugetlb(&f));
        assert_eq!(len, memfd_len(100, KeptLayout::Packed).expect("len"));
        seal(&f).expect("seal");
        assert!(matches!(inspect(&f), Err(KeptError::NoRecord)));
        // Sealed: it cannot grow or shrink.
        assert!(f.set_len(len * 2).is_err());
        let r = Record {
            id: 14,
            layer: 14,
            rows: 100,
            digest: TableDigest([3; 32]),
            generation: generation(),
            loaded_unix_ms: unix_ms(),
            verified: false,
            layout: KeptLayout::Packed,
        };
        assert_eq!(Record::decode(&r.encode()).expect("decode"), r);
        // Packed records stay version 1, which every build reads.
        assert_eq!(&r.encode()[8..12], &1u32.to_le_bytes());
        f.write_all_at(&r.encode(), len - TAIL).expect("write");
        assert_eq!(inspect(&f).expect("inspect"), (r, len));
        // A record naming more rows than the memfd holds.
        let big = Record { rows: 1 << 40, ..r };
        f.write_all_at(&big.encode(), len - TAIL).expect("write");
        assert!(
            inspect(&f)
                .expect_err("size")
                .to_string()
                .contains("cannot hold")
        );
        let huge_rows = Record {
            rows: u64::MAX,
            ..r
        };
        f.write_all_at(&huge_rows.encode(), len - TAIL)
            .expect("write");
        assert!(inspect(&f).is_err());
        assert!(memfd_len(u64::MAX, KeptLayout::Packed).is_none());
        assert!(memfd_len(u64::MAX / 200, KeptLayout::Planar).is_none());
    }

    /// Rows of another encoding: a version 3 record with the encoding and
    /// the table scale, a memfd sized by their row size; a record whose
    /// encoding is not one, or whose scale does not fit it, is refused.
    #[test]
    fn encoded_records_are_version_3_and_size_their_memfd() {
        use engram_protocol::encoding::RowEncoding;
        let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
        let layout = KeptLayout::Encoded {
            encoding: fp8,
            tensor_scale: Some(0.5f32.to_bits()),
        };
        let r = Record {
            id: 2,
            layer: 1,
            rows: 1000,
            digest: TableDigest([5; 32]),
            generation: 7,
            loaded_unix_ms: 8,
            verified: true,
            layout,
        };
        let b = r.encode();
        assert_eq!(&b[8..12], &3u32.to_le_bytes());
        assert_eq!(Record::decode(&b).expect("decode"), r);
        assert_eq!(layout.rows_len(1000), Some(160_000));
        assert_eq!(layout.name(), "packed");
        let (f, len, _) = create(1000, layout, false).expect("memfd");
        assert_eq!(len, memfd_len(1000, layout).expect("len"));
        seal(&f).expect("seal");
        f.write_all_at(&b, len - TAIL).expect("write");
        assert_eq!(inspect(&f).expect("inspect"), (r, len));
        let resum = |b: &mut [u8; RECORD_ENCODED + 8]| {
            let sum = twox_hash::XxHash3_64::oneshot(&b[..RECORD_ENCODED]);
            b[RECORD_ENCODED..].copy_from_slice(&sum.to_le_bytes());
        };
        let mut unknown = b;
        unknown[80] = 9;
        resum(&mut unknown);
        assert!(Record::decode(&unknown).is_err(), "kind 9");
        let mut no_scale = b;
        no_scale[88] = 0;
        resum(&mut no_scale);
        assert!(Record::decode(&no_scale).is_err(), "FP8 without its scale");
        let mut flipped = b;
        flipped[84] ^= 1;
        assert!(Record::decode(&flipped).is_err(), "checksum");
    }

    #[test]
    fn planar_records_are_version_2_and_size_their_memfd() {
        let r = Record {
            id: 1,
            layer: 1,
            rows: 1000,
            digest: TableDigest([9; 32]),
            generation: 7,
            loaded_unix_ms: 8,
            verified: true,
            layout: KeptLayout::Planar,
        };
        let b = r.encode();
        assert_eq!(&b[8..12], &2u32.to_le_bytes());
        assert_eq!(Record::decode(&b).expect("decode"), r);
        // Values 256,000 bytes, then 8,000 of scales: 264,000, as packed.
        assert_eq!(planar_scales_at(1000), Some(256_000));
        assert_eq!(KeptLayout::Planar.rows_len(1000), Some(264_000));
        assert_eq!(
            memfd_len(1000, KeptLayout::Planar),
            memfd_len(1000, KeptLayout::Packed)
        );
        // A version-1 record never reads as planar, whatever its flags.
        let mut old = b;
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
        let sum = twox_hash::XxHash3_64::oneshot(&old[..RECORD]);
        old[RECORD..RECORD + 8].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(
            Record::decode(&old).expect("decode").layout,
            KeptLayout::Packed
        );
        // A future version is refused by name.
        let mut new = b;
        new[8..12].copy_from_slice(&4u32.to_le_bytes());
        let sum = twox_hash::XxHash3_64::oneshot(&new[..RECORD]);
        new[RECORD..RECORD + 8].copy_from_slice(&sum.to_le_bytes());
        assert!(
            Record::decode(&new)
                .expect_err("v4")
                .to_string()
                .contains("record version 4")
        );
        // Past 64 GiB of values: the real V4.1 table.
        let rows = 384_016_682u64;
        let at = planar_scales_at(rows).expect("at");
        assert!(at > 64 << 30 && at == rows * 256);
    }
}
