//! Tables held resident in memory. By default the rows are copied into
//! anonymous memory (or a memfd), packed back to back (264 bytes each, no
//! page slack: 3.3% less RAM than the file's layout). Loading streams the
//! file, verifies the digest on the way (unless told to trust it), asks for
//! huge pages, locks the memory where the limit allows, and leaves the rows
//! read-only. [`Backing::Mapped`] instead serves the rows where they are:
//! the file's own pages in the page cache, read in, hashed and locked.

use std::path::Path;

use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::PAGE_BYTES;
use engram_protocol::{ROW_BYTES, TableDigest};
use memmap2::{Mmap, MmapMut};
use thiserror::Error;

use crate::fill::FillOptions;
use crate::kept::{self, KeptError, KeptLayout, Record};
use crate::progress::Progress;
pub use crate::rowref::{RowLayout, RowRef};
use crate::table_file::{TableFile, TableFileError};

/// Why a table could not be loaded.
#[derive(Debug, Error)]
pub enum LoadError {
    /// Reading the file failed or it is not a valid table.
    #[error(transparent)]
    File(#[from] TableFileError),
    /// The file is not the table the config describes (version, layer or rows).
    #[error("{path}: {what}")]
    Pinned {
        /// The table file, as shown to people.
        path: String,
        /// What differs from the config.
        what: String,
    },
    /// Memory could not be had.
    #[error("{path}: cannot hold {bytes} bytes resident: {source}")]
    Memory {
        /// The table file, as shown to people.
        path: String,
        /// Bytes of table memory asked for.
        bytes: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// `mlock` failed while required.
    #[error(
        "{path}: cannot lock {bytes} bytes of table memory ({source}); raise LimitMEMLOCK (systemd) or `ulimit -l`, or use --mlock try"
    )]
    Mlock {
        /// The table file, as shown to people.
        path: String,
        /// Bytes of table memory to lock.
        bytes: u64,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Whether to lock a resident table's memory (`mlock`): the config's
/// `mlock` key and the donor's `--mlock` flag (with the `clap` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MlockMode {
    /// Lock if the memlock limit allows; otherwise warn once and go on unlocked.
    #[default]
    Try,
    /// Lock or refuse to load (a donor refuses to start).
    Require,
    /// Do not lock.
    Off,
}

/// What the cluster config says a table is: its version, layer and size,
/// checked against a file's header before anything else is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedTable {
    /// The version.
    pub digest: TableDigest,
    /// The model layer.
    pub layer: u32,
    /// The row count.
    pub rows: u64,
}

impl ExpectedTable {
    /// How a file's header differs from this, if it does.
    pub fn mismatch(&self, meta: &engram_protocol::etab::TableMeta) -> Option<String> {
        if meta.digest != self.digest {
            Some(format!(
                "table digest is {} but the config pins {}",
                meta.digest, self.digest
            ))
        } else if meta.layer != self.layer {
            Some(format!(
                "table is layer {} but the config says layer {}",
                meta.layer, self.layer
            ))
        } else if meta.rows != self.rows {
            Some(format!(
                "table has {} rows but the config says {}",
                meta.rows, self.rows
            ))
        } else {
            None
        }
    }
}

/// How a table was loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadReport {
    /// True when the digest was recomputed and matched (for a table whose
    /// file pages were served on, [`LoadReport::reused`]: when it was, by
    /// the process that left the mark).
    pub verified: bool,
    /// True when the memory is locked.
    pub locked: bool,
    /// True when a table served from its file's pages was served on from
    /// a previous process's [`FileMark`]: nothing read or hashed, and the
    /// pages left for the caller to lock.
    pub reused: bool,
}

/// A table file as a donor serving its pages found it once its read lease
/// was held: which file (device and inode) and its change time then, and
/// whether its rows were hashed. Any write, truncation or metadata change
/// moves the change time on (the kernel sets it; no call sets it back),
/// so a later process that finds the same file at the same change time,
/// and holds the lease again, serves the same rows the mark's process
/// checked, without reading or hashing them again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMark {
    /// The file's device (`st_dev`).
    pub dev: u64,
    /// The file's inode (`st_ino`).
    pub ino: u64,
    /// Its change time, whole seconds (`st_ctime`).
    pub ctime_sec: i64,
    /// Its change time, nanoseconds past `ctime_sec` (`st_ctime_nsec`).
    pub ctime_nsec: i64,
    /// The rows were hashed against the header's digest.
    pub verified: bool,
}

impl FileMark {
    /// `file` now, marked `verified`.
    pub fn of(file: &std::fs::File, verified: bool) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata()?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
            ctime_sec: m.ctime(),
            ctime_nsec: m.ctime_nsec(),
            verified,
        })
    }

    /// The same file at the same change time as `other`.
    pub fn same_as(&self, other: &FileMark) -> bool {
        (self.dev, self.ino, self.ctime_sec, self.ctime_nsec)
            == (other.dev, other.ino, other.ctime_sec, other.ctime_nsec)
    }
}

/// Where a resident table's memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backing {
    /// Anonymous memory, transparent huge pages where the kernel allows;
    /// gone with the process.
    #[default]
    Anonymous,
    /// A memfd (hugetlb-backed where enough huge pages are reserved) that
    /// systemd can keep in its fd store for the next process ([`crate::kept`]).
    Memfd,
    /// The table file's own pages, mapped read-only from the page cache:
    /// nothing copied, no fresh memory zeroed, so a load costs about what
    /// hashing the file costs. Rows stay in the file's layout (15 to a
    /// 4 KiB page), so the table is not offered over RDMA. What outlives
    /// the process is the page cache and a [`FileMark`] (kept by the donor
    /// in systemd's fd store): a restart that finds the file unchanged
    /// serves its pages without reading or hashing them. The file must not
    /// change in place while served: a read lease is taken where the
    /// kernel grants one, and a writer or truncation then breaks it with
    /// SIGIO to this process (which the donor handles by exiting; the
    /// default action of SIGIO also ends the process), so rows are never
    /// served from a file changing under them. Replace files by renaming.
    Mapped,
}

/// How to load a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// What the config says the table is (checked against the header
    /// first; the digest then against the rows unless `trust_digest`).
    pub pinned: Option<ExpectedTable>,
    /// Skip recomputing the digest.
    pub trust_digest: bool,
    /// Whether to lock the memory.
    pub mlock: MlockMode,
    /// Where the memory comes from.
    pub backing: Backing,
    /// Threads that read, place and hash (at least 1).
    pub threads: usize,
    /// For [`Backing::Mapped`]: the mark a previous process left for this
    /// table's file (systemd's fd store). When the file is that file, at
    /// that change time, and the read lease is held, its pages are served
    /// without being read or hashed again ([`LoadReport::reused`]); a mark
    /// of rows never hashed counts only with `trust_digest`.
    pub known_file: Option<FileMark>,
    /// Bind the copy's memory to this NUMA node (`mbind`, `MPOL_BIND`)
    /// before a page of it is touched; `None`: the kernel's placement.
    /// Not for [`Backing::Mapped`] (the page cache's pages are placed by
    /// whoever read them first).
    pub numa_node: Option<u32>,
    /// For [`Backing::Memfd`]: keep a writable shared view of the memfd
    /// for RDMA registrations ([`Rows::registration_bytes`]), on a kernel
    /// that needs one ([`kept::writable_view_needed`]). The memfd is then
    /// sealed against writers only when it is first handed to another
    /// process ([`kept::seal_future_writes`], which keeps the view), so a
    /// restarted donor can make its view again.
    pub rdma_view: bool,
    /// For [`Backing::Memfd`]: lay the rows out planar
    /// ([`KeptLayout::Planar`]), as engines' host-table kernels read
    /// them. Ignored for the other backings.
    pub planar: bool,
    /// Read, place and hash at this background priority
    /// ([`crate::background`]): a donor's load beside the host's other
    /// work (a node mapping its tables, an engine).
    pub background: Option<crate::background::Background>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            pinned: None,
            trust_digest: false,
            mlock: MlockMode::Try,
            backing: Backing::Anonymous,
            threads: crate::fill::cores(),
            known_file: None,
            numa_node: None,
            rdma_view: false,
            planar: false,
            background: None,
        }
    }
}

/// A table's memory: a read-only mapping whose first `len` bytes are the
/// rows in `layout`: back to back, planar, or a table file's pages (15
/// rows and the slack in each 4 KiB).
#[derive(Debug)]
pub struct Rows {
    map: Mmap,
    len: usize,
    layout: RowLayout,
    /// The mapped file, open while the rows are served: it holds the read
    /// lease.
    file: Option<std::fs::File>,
    /// A writable shared mapping of the same memfd pages, for an RDMA
    /// registration on a kernel that pins only writable shared memory
    /// ([`LoadOptions::rdma_view`]). Nothing writes through it.
    view: Option<MmapMut>,
}

impl Rows {
    /// A copy: `len` bytes of rows in `layout` at the start of `map`.
    fn copy(map: Mmap, len: usize, layout: RowLayout) -> Self {
        Self {
            map,
            len,
            layout,
            file: None,
            view: None,
        }
    }

    /// The bytes an RDMA registration covers: the rows through the
    /// writable view when there is one, else through the serving mapping.
    pub fn registration_bytes(&self) -> &[u8] {
        match &self.view {
            Some(v) => &v[..self.len],
            None => &self.map[..self.len],
        }
    }

    /// True when RDMA registers the rows through a writable view.
    pub fn has_writable_view(&self) -> bool {
        self.view.is_some()
    }

    /// The table file whose pages these are (holding the read lease).
    pub fn file(&self) -> Option<&std::fs::File> {
        self.file.as_ref()
    }

    /// True when the rows are back to back ([`AsRef`] is then exactly
    /// them); false for a table served from its file's pages or planar.
    pub fn is_packed(&self) -> bool {
        self.layout == RowLayout::Packed
    }

    /// How the rows lie in the mapping.
    pub fn layout(&self) -> RowLayout {
        self.layout
    }

    /// Lock the whole mapping (`mlock`), faulting in what is not mapped yet.
    pub fn lock(&self) -> std::io::Result<()> {
        self.map.lock()
    }
}

/// A table's rows as an RDMA registration takes them
/// ([`Rows::registration_bytes`]).
#[derive(Debug, Clone)]
pub struct Registered(pub std::sync::Arc<Rows>);

impl AsRef<[u8]> for Registered {
    fn as_ref(&self) -> &[u8] {
        self.0.registration_bytes()
    }
}

/// The rows back to back; for a table served from its file's pages
/// ([`Rows::is_packed`] false), the pages, slack included.
impl AsRef<[u8]> for Rows {
    fn as_ref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

/// The memfd a table lives in, when it can outlive the process.
#[derive(Debug)]
pub struct Kept {
    /// The memfd.
    pub file: std::fs::File,
    /// What it holds.
    pub record: Record,
    /// The pages it lives in.
    pub pages: kept::Pages,
}

/// A table resident in memory.
#[derive(Debug)]
pub struct ResidentTable {
    /// Id it is served under.
    pub id: u32,
    /// Model layer.
    pub layer: u32,
    /// Row count.
    pub rows: u64,
    /// Version.
    pub digest: TableDigest,
    /// `digest.prefix()`, kept for the lookup path.
    pub digest_prefix: u64,
    /// How its rows are encoded (V4.1's for a kept copy or file pages).
    pub encoding: RowEncoding,
    /// The table's F32 scale, as its bits, for an encoding with one.
    pub tensor_scale: Option<u32>,
    /// Shared with whatever must keep the rows mapped beyond the table
    /// (an RDMA registration).
    mem: std::sync::Arc<Rows>,
    kept: Option<Kept>,
    /// For a table served from its file's pages: its file as found once
    /// leased, and whether its rows were hashed.
    mark: Option<FileMark>,
}

impl ResidentTable {
    /// Row `row` as it lies in memory, or `None` when out of range.
    #[inline]
    pub fn row(&self, row: u64) -> Option<RowRef<'_>> {
        if row >= self.rows {
            return None;
        }
        crate::rowref::row_in(&self.mem.map, self.mem.layout, row)
    }

    /// Bytes per row.
    #[inline]
    pub fn row_bytes(&self) -> usize {
        self.mem.layout.row_bytes()
    }

    /// Map the pages of bytes `range` of the table's memory
    /// ([`Self::memory_bytes`]) into this process now
    /// (`MADV_POPULATE_READ`; a read of each page where the kernel lacks
    /// it), so that no lookup takes a page fault there. For memory another
    /// process filled (a host socket's memfd): its pages exist, but this
    /// process's page tables do not point at them until touched, and a
    /// first touch costs a fault in the middle of a lookup. The call holds
    /// the address space's lock (for reading) while it runs: a large table
    /// is populated a slice at a time ([`crate::background::slices`]).
    ///
    /// Only pages that exist are touched: a kept memfd's holes (a sparse
    /// table's untouched rows) are left alone, since a read fault there
    /// would give the memfd a zeroed page of its own and a 94 GiB table
    /// that holds a few pages would take 94 GiB.
    pub fn populate_range(&self, range: std::ops::Range<usize>) {
        let map = &self.mem.map;
        let end = range.end.min(map.len());
        let start = range.start.min(end);
        let ranges = match &self.kept {
            Some(k) => crate::holes::data_extents(&k.file, start as u64..end as u64),
            None => std::iter::once(start as u64..end as u64).collect(),
        };
        for r in ranges {
            let page = PAGE_BYTES as usize;
            let a = (r.start as usize / page * page).clamp(start / page * page, end);
            let b = (r.end as usize)
                .div_ceil(page)
                .saturating_mul(page)
                .min(end);
            if a < b {
                crate::fill::populate(&map[a..b]);
            }
        }
    }

    /// Every page of the table's memory ([`Self::populate_range`] over it all).
    pub fn populate(&self) {
        self.populate_range(0..self.mem.map.len());
    }

    /// Drop this process's page-table entries for bytes `range` of the
    /// table's memory (`MADV_DONTNEED`), for a table in a memfd (loaded
    /// into one, or mapped from another process's): its pages stay in the
    /// memfd, and a later read maps them again. Done a slice at a time
    /// before a large mapping is let go, it keeps the `munmap` (which
    /// holds the address space's lock for writing while it clears the
    /// page tables) short. False, and nothing done, for any other table,
    /// whose pages this would discard.
    pub fn release_range(&self, range: std::ops::Range<usize>) -> bool {
        if self.kept.is_none() {
            return false;
        }
        let Some(bytes) = self.memory_bytes().get(range) else {
            return false;
        };
        if bytes.is_empty() {
            return true;
        }
        // SAFETY: advice over part of a shared mapping of a memfd this
        // table owns: MADV_DONTNEED clears page-table entries only; the
        // pages stay in the memfd and a later read faults them back in.
        unsafe {
            libc::madvise(
                bytes.as_ptr().cast_mut().cast(),
                bytes.len(),
                libc::MADV_DONTNEED,
            ) == 0
        }
    }

    /// What a Welcome says of this table.
    pub fn info(&self) -> engram_protocol::messages::TableInfo {
        engram_protocol::messages::TableInfo {
            encoding: self.encoding,
            tensor_scale: self.tensor_scale,
            ..engram_protocol::messages::TableInfo::v41(self.id, self.layer, self.rows, self.digest)
        }
    }

    /// Ask the CPU to start loading row `row` into cache (a hint; no effect
    /// when out of range). Issuing this for every row of a lookup before
    /// copying any of them overlaps their DRAM latencies: measured on a
    /// 1 GiB table, 24 random rows take 2.9 us instead of 5.3 us.
    #[inline]
    pub fn prefetch(&self, row: u64) {
        #[cfg(target_arch = "x86_64")]
        if row < self.rows {
            let (values, scales) = self.mem.layout.offsets(row);
            let base = self.mem.map.as_ptr();
            let (start, len) = if self.mem.layout.whole_rows() {
                (base.wrapping_add(values), self.mem.layout.row_bytes())
            } else {
                prefetch_line(base.wrapping_add(scales));
                (base.wrapping_add(values), kept::VALUE_BYTES as usize)
            };
            let first = start as usize & !63;
            let mut line = first;
            while line < start as usize + len {
                prefetch_line(line as *const u8);
                line += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = row;
    }

    /// The rows' memory (264 bytes a row, back to back, unless the table
    /// is served from its file's pages or planar), shared: it stays mapped
    /// while any holder keeps it, after the table itself is dropped.
    pub fn memory(&self) -> std::sync::Arc<Rows> {
        std::sync::Arc::clone(&self.mem)
    }

    /// The mapping's bytes: the rows back to back (row `r` at `r * 264`),
    /// or for a table served from its file's pages, those pages.
    pub fn memory_bytes(&self) -> &[u8] {
        self.mem.as_ref().as_ref()
    }

    /// Resident bytes: the rows, or for a table served from its file's
    /// pages, those pages (3.4% more: the slack).
    pub fn bytes(&self) -> u64 {
        self.mem.len as u64
    }

    /// For a table served from its file's pages, leased: the file as
    /// found then, and whether its rows were hashed ([`FileMark`]).
    pub fn file_mark(&self) -> Option<FileMark> {
        self.mark
    }

    /// The memfd the table lives in, when it was loaded with
    /// [`Backing::Memfd`] or adopted.
    pub fn kept(&self) -> Option<&Kept> {
        self.kept.as_ref()
    }

    /// Lock the table's memory (`mlock`), faulting in what is not mapped
    /// yet: for an adopted table, whose pages this process has not touched.
    pub fn lock(&self) -> std::io::Result<()> {
        self.mem.map.lock()
    }

    /// Load `path` resident under `id`. `pinned` is what the config says the
    /// table is (checked against the header first; the digest then against
    /// the rows unless `trust_digest`).
    pub fn load(
        id: u32,
        path: &Path,
        pinned: Option<ExpectedTable>,
        trust_digest: bool,
        mlock: MlockMode,
        progress: impl FnOnce(&TableFile) -> Option<Progress>,
    ) -> Result<(Self, LoadReport), LoadError> {
        let opts = LoadOptions {
            pinned,
            trust_digest,
            mlock,
            ..LoadOptions::default()
        };
        Self::load_with(Some(id), path, &opts, progress)
    }

    /// Load `path` resident under `id` (`None`: the table's layer), read,
    /// placed and hashed on `opts.threads` threads ([`crate::fill`]), the
    /// memory locked as it fills where `opts.mlock` asks.
    pub fn load_with(
        id: Option<u32>,
        path: &Path,
        opts: &LoadOptions,
        progress: impl FnOnce(&TableFile) -> Option<Progress>,
    ) -> Result<(Self, LoadReport), LoadError> {
        Self::load_table(id, TableFile::open_any(path)?, opts, progress)
    }

    /// [`ResidentTable::load_with`] for a table file already open.
    pub fn load_table(
        id: Option<u32>,
        file: TableFile,
        opts: &LoadOptions,
        progress: impl FnOnce(&TableFile) -> Option<Progress>,
    ) -> Result<(Self, LoadReport), LoadError> {
        if let Some(hint) = file.page_sums_hint() {
            tracing::warn!("{hint}");
        }
        let progress = progress(&file);
        let shown = file.path.display().to_string();
        if let Some(pin) = opts.pinned
            && let Some(what) = pin.mismatch(&file.meta)
        {
            return Err(LoadError::Pinned { path: shown, what });
        }
        // Rows of another encoding than V4.1's: packed at their own size,
        // in a memfd the next process may adopt where a copy or the file's
        // pages were asked for (shared on the host socket like any kept
        // copy; not served from the file's pages or offered over RDMA yet:
        // docs/models.md).
        let encoded = (file.meta.encoding != RowEncoding::V41).then_some(KeptLayout::Encoded {
            encoding: file.meta.encoding,
            tensor_scale: file.meta.tensor_scale,
        });
        let backing = match (encoded, opts.backing) {
            (Some(_), b @ (Backing::Mapped | Backing::Memfd)) => {
                tracing::warn!(
                    table = %file.path.display(),
                    encoding = %file.meta.encoding.name(),
                    asked = ?b,
                    "rows of this encoding are held packed in a memfd (kept across restarts): \
                     not served from the file's pages and not offered over RDMA (docs/models.md)"
                );
                Backing::Memfd
            }
            (_, b) => b,
        };
        let planar = encoded.is_none() && opts.planar && backing == Backing::Memfd;
        let kept_layout = match encoded {
            Some(layout) => layout,
            None if planar => KeptLayout::Planar,
            None => KeptLayout::Packed,
        };
        let bytes = kept_layout.rows_len(file.meta.rows).unwrap_or(u64::MAX);
        let memory = |source| LoadError::Memory {
            path: shown.clone(),
            bytes,
            source,
        };
        let len = usize::try_from(bytes)
            .map_err(|_| memory(std::io::Error::other("larger than the address space")))?;
        let (mut map, memfd) = match backing {
            Backing::Mapped => return Self::load_mapped(id, file, opts, progress),
            Backing::Anonymous => (MmapMut::map_anon(len).map_err(memory)?, None),
            Backing::Memfd => memfd_map(file.meta.rows, kept_layout, &memory)?,
        };
        let layout = row_layout(kept_layout, file.meta.rows)
            .ok_or_else(|| memory(std::io::Error::other("larger than the address space")))?;
        let mlock_err = |source| LoadError::Mlock {
            path: shown.clone(),
            bytes,
            source,
        };
        let locked = fill_memory(
            &file,
            &mut map,
            (len, layout),
            opts,
            progress,
            &memory,
            &mlock_err,
        )?;
        let id = id.unwrap_or(file.meta.layer);
        let kept = match memfd {
            Some((f, hugetlb)) => {
                let verified = !opts.trust_digest;
                let made = (id, kept_layout, verified);
                Some(keep(f, hugetlb, &mut map, made, &file, &memory)?)
            }
            None => None,
        };
        let (map, view) = match &kept {
            Some(k) => {
                let relock = locked.then_some(opts.mlock);
                map_sealed(k, map, opts.rdma_view, relock, &memory, &mlock_err)?
            }
            None => (map.make_read_only().map_err(memory)?, None),
        };
        let digest = file.meta.digest;
        let table = Self {
            id,
            layer: file.meta.layer,
            rows: file.meta.rows,
            digest,
            digest_prefix: digest.prefix(),
            encoding: file.meta.encoding,
            tensor_scale: file.meta.tensor_scale,
            mem: std::sync::Arc::new(Rows {
                view,
                ..Rows::copy(map, len, layout)
            }),
            kept,
            mark: None,
        };
        Ok((
            table,
            LoadReport {
                verified: !opts.trust_digest,
                locked,
                reused: false,
            },
        ))
    }

    /// Serve a copy a previous process kept (a memfd from systemd's fd
    /// store) as table `expected`: refused unless its record is complete
    /// and names exactly that version, layer and size. Nothing is read but
    /// the record; the memory is not locked ([`Self::lock`] does that).
    ///
    /// With `rdma_view` ([`LoadOptions::rdma_view`]) a copy not yet sealed
    /// against writers gets its writable view for RDMA and stays unsealed
    /// until first shared; a sealed one cannot (its RDMA registration then
    /// fails on such a kernel, and the table is read over the other
    /// transports until it is reloaded).
    pub fn adopt(
        id: u32,
        file: std::fs::File,
        expected: &ExpectedTable,
        rdma_view: bool,
    ) -> Result<Self, KeptError> {
        let (record, flen) = kept::inspect(&file)?;
        if record.id != id {
            return Err(KeptError::Bad(format!(
                "it holds table {}, not table {id}",
                record.id
            )));
        }
        if record.digest != expected.digest {
            return Err(KeptError::Bad(format!(
                "it holds version {} but the config pins {}",
                record.digest, expected.digest
            )));
        }
        if (record.layer, record.rows) != (expected.layer, expected.rows) {
            return Err(KeptError::Bad(format!(
                "it holds layer {} with {} rows, the config says layer {} with {} rows",
                record.layer, record.rows, expected.layer, expected.rows
            )));
        }
        let too_big = || KeptError::Bad("larger than the address space".into());
        let flen = usize::try_from(flen).map_err(|_| too_big())?;
        let sealed = kept::is_sealed_read_only(&file);
        let view = match (rdma_view, sealed) {
            (true, false) => Some(kept::writable_view(&file, flen)?),
            (true, true) => {
                tracing::warn!(
                    table = id,
                    "the kept copy is sealed against writers (it was shared on the host socket): \
                     this kernel registers RDMA memory only through a writable mapping, so the \
                     table is read over the other transports until it is reloaded"
                );
                None
            }
            // A copy kept by an older donor may lack the write seal: added
            // now, before anything maps it (the kernel refuses it beside a
            // writable mapping, which nothing here has). Without it the
            // table is still served, but not shared with other processes.
            (false, false) => {
                if let Err(e) = kept::seal_writes(&file) {
                    tracing::warn!(table = id, error = %e, "the kept copy cannot be sealed against writes: it will not be shared on the host socket");
                }
                None
            }
            (false, true) => None,
        };
        let len = record
            .layout
            .rows_len(record.rows)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(too_big)?;
        let layout = row_layout(record.layout, record.rows).ok_or_else(too_big)?;
        let (encoding, tensor_scale) = match record.layout {
            KeptLayout::Encoded {
                encoding,
                tensor_scale,
            } => (encoding, tensor_scale),
            _ => (RowEncoding::V41, None),
        };
        // SAFETY: the memfd's size is sealed, so the mapping cannot lose
        // pages under us; it is mapped read-only.
        let map =
            unsafe { memmap2::MmapOptions::new().len(flen).map(&file) }.map_err(|source| {
                KeptError::Io {
                    op: "mapping the memfd",
                    source,
                }
            })?;
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Self {
            id,
            layer: record.layer,
            rows: record.rows,
            digest: record.digest,
            digest_prefix: record.digest.prefix(),
            encoding,
            tensor_scale,
            mem: std::sync::Arc::new(Rows {
                view,
                ..Rows::copy(map, len, layout)
            }),
            kept: Some(Kept {
                pages: kept::pages(&file),
                file,
                record,
            }),
            mark: None,
        })
    }
}

/// Where the rows of `rows` lie in memory kept in `layout`; `None` when
/// that does not fit the address space.
fn row_layout(layout: KeptLayout, rows: u64) -> Option<RowLayout> {
    Some(match layout {
        KeptLayout::Packed => RowLayout::Packed,
        KeptLayout::Planar => RowLayout::Planar {
            scales_at: usize::try_from(kept::planar_scales_at(rows)?).ok()?,
        },
        KeptLayout::Encoded { encoding, .. } => RowLayout::Encoded {
            row_bytes: encoding.row_bytes(),
        },
    })
}

/// The digest a load computed (if it did) against the header's; the
/// progress finished when it matches.
fn check_digest(
    file: &TableFile,
    digest: Option<TableDigest>,
    progress: Option<Progress>,
) -> Result<(), LoadError> {
    if let Some(actual) = digest
        && actual != file.meta.digest
    {
        return Err(TableFileError::DigestMismatch {
            path: file.path.clone(),
            expected: file.meta.digest,
            actual,
        }
        .into());
    }
    if let Some(p) = progress {
        p.finish();
    }
    Ok(())
}

impl ResidentTable {
    /// [`Backing::Mapped`]: map the file's pages, take a read lease, and
    /// read (and hash) every page on `opts.threads` threads, locking them
    /// as they come in where `opts.mlock` asks. With `opts.known_file`
    /// naming this file unchanged and the lease held, nothing is read or
    /// hashed: the pages are mapped and left for the caller to lock.
    fn load_mapped(
        id: Option<u32>,
        file: TableFile,
        opts: &LoadOptions,
        progress: Option<Progress>,
    ) -> Result<(Self, LoadReport), LoadError> {
        let shown = file.path.display().to_string();
        let bytes = file.meta.rows * ROW_BYTES as u64;
        let memory = |source| LoadError::Memory {
            path: shown.clone(),
            bytes,
            source,
        };
        let span = usize::try_from(file.layout.pages * PAGE_BYTES)
            .map_err(|_| memory(std::io::Error::other("larger than the address space")))?;
        let handle = file.handle().try_clone().map_err(memory)?;
        let leased = take_read_lease(&handle, &shown);
        // Once leased, nobody changes the file unseen: its state now is
        // what is served.
        let now = FileMark::of(&handle, !opts.trust_digest).map_err(memory)?;
        let reused = opts
            .known_file
            .filter(|k| leased && k.same_as(&now) && (k.verified || opts.trust_digest));
        if opts.known_file.is_some() && reused.is_none() {
            tracing::info!(
                file = shown,
                leased,
                "the file changed since the previous process loaded it (or is not leased): reading it again"
            );
        }
        // SAFETY: mapped read-only; the file is not to change while served,
        // and a writer breaks the read lease first (see `Backing::Mapped`).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(file.layout.data_start)
                .len(span)
                .map(&handle)
        }
        .map_err(memory)?;
        let (verified, locked) = match reused {
            Some(k) => (k.verified, false),
            None => {
                let mlock_err = |source| LoadError::Mlock {
                    path: shown.clone(),
                    bytes,
                    source,
                };
                let locked = lock_on_fault(&map, opts.mlock).map_err(mlock_err)?;
                read_mapped(&file, &map, opts, progress)?;
                (!opts.trust_digest, locked)
            }
        };
        let digest = file.meta.digest;
        let table = Self {
            id: id.unwrap_or(file.meta.layer),
            layer: file.meta.layer,
            rows: file.meta.rows,
            digest,
            digest_prefix: digest.prefix(),
            encoding: RowEncoding::V41,
            tensor_scale: None,
            mem: std::sync::Arc::new(Rows {
                map,
                len: span,
                layout: RowLayout::Paged,
                file: Some(handle),
                view: None,
            }),
            kept: None,
            // Only a leased file is known not to have changed since.
            mark: leased.then_some(FileMark { verified, ..now }),
        };
        Ok((
            table,
            LoadReport {
                verified,
                locked,
                reused: reused.is_some(),
            },
        ))
    }
}

/// Ask for a read lease on `file` (`F_SETLEASE`, `F_RDLCK`), so that
/// another process opening it for writing or truncating it must wait
/// while this one is told (SIGIO). Refused when the file is open for
/// writing somewhere, or not ours without `CAP_LEASE`: then a warning,
/// and the table is served without that guard (false).
fn take_read_lease(file: &std::fs::File, shown: &str) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor we own; F_SETLEASE takes an int.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(
            file = shown,
            error = %e,
            "no read lease on a table served from its file's pages: a process that rewrote it in place would change rows being served; replace table files by renaming them"
        );
    }
    r == 0
}

/// Lock `map` as its pages are first touched (`mlock2(MLOCK_ONFAULT)`):
/// filling it locks it, with no pass of its own. `Ok(false)` when not
/// asked to, or when asked to try and the memlock limit does not allow it.
fn lock_on_fault(map: &[u8], mode: MlockMode) -> Result<bool, std::io::Error> {
    if mode == MlockMode::Off {
        return Ok(false);
    }
    // SAFETY: the range is exactly a mapping we own; mlock2 only changes
    // how its pages are held.
    let r = unsafe { libc::mlock2(map.as_ptr().cast(), map.len(), libc::MLOCK_ONFAULT) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if mode == MlockMode::Require {
        return Err(e);
    }
    Ok(false)
}

/// Fill `map`'s first `len` bytes with `file`'s rows: the memory bound
/// to its NUMA node, advised into huge pages and locked as `opts` say, the
/// rows read and placed on `opts.threads` threads and their digest
/// checked (unless trusted). Whether the memory is locked.
fn fill_memory(
    file: &TableFile,
    map: &mut MmapMut,
    (len, layout): (usize, RowLayout),
    opts: &LoadOptions,
    mut progress: Option<Progress>,
    memory: &dyn Fn(std::io::Error) -> LoadError,
    mlock_err: &dyn Fn(std::io::Error) -> LoadError,
) -> Result<bool, LoadError> {
    if let Some(node) = opts.numa_node {
        crate::numa::bind(map, node).map_err(memory)?;
    }
    // Huge pages cut TLB misses on random row reads; advisory, so failure is fine.
    let _ = map.advise(memmap2::Advice::HugePage);
    let locked = lock_on_fault(map, opts.mlock).map_err(mlock_err)?;
    let fill = FillOptions {
        threads: opts.threads.max(1),
        digest: !opts.trust_digest,
        background: opts.background,
        // The memory is new: a hole in the file stays untouched there.
        skip_holes: true,
        ..FillOptions::default()
    };
    let digest = match layout {
        RowLayout::Planar { scales_at } => {
            let (values, scales) = map[..len].split_at_mut(scales_at);
            let rows = file.meta.rows as usize;
            let values = &mut values[..rows * kept::VALUE_BYTES as usize];
            crate::fill::fill_planar(file, values, scales, fill, progress.as_mut())?
        }
        _ => crate::fill::fill(file, &mut map[..len], fill, progress.as_mut())?,
    };
    check_digest(file, digest, progress)?;
    Ok(locked)
}

/// Read a mapped table file's pages in (on `opts.threads` threads), its
/// digest checked unless `opts.trust_digest`.
fn read_mapped(
    file: &TableFile,
    map: &Mmap,
    opts: &LoadOptions,
    mut progress: Option<Progress>,
) -> Result<(), LoadError> {
    let touch = FillOptions {
        threads: opts.threads.max(1),
        digest: !opts.trust_digest,
        drop_behind: false,
        background: opts.background,
        ..FillOptions::default()
    };
    let digest = crate::fill::touch_mapped(file, map, touch, progress.as_mut())?;
    check_digest(file, digest, progress)
}

/// A filled memfd made a copy the next process may adopt: its record
/// (table `id` of `file`, `verified` or not) written after the rows.
fn keep(
    f: std::fs::File,
    hugetlb: bool,
    map: &mut MmapMut,
    (id, layout, verified): (u32, KeptLayout, bool),
    file: &TableFile,
    memory: &dyn Fn(std::io::Error) -> LoadError,
) -> Result<Kept, LoadError> {
    let record = Record {
        id,
        layer: file.meta.layer,
        rows: file.meta.rows,
        digest: file.meta.digest,
        generation: kept::generation(),
        loaded_unix_ms: kept::unix_ms(),
        verified,
        layout,
    };
    kept::finish(&f, map, &record).map_err(|e| memory(e.into_io()))?;
    let pages = if hugetlb {
        kept::Pages::HugeTlb
    } else {
        kept::Pages::for_shmem()
    };
    Ok(Kept {
        pages,
        file: f,
        record,
    })
}

/// Prefetch the cache line at `p` (a hint: never faults).
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_line(p: *const u8) {
    // SAFETY: SSE is part of the x86_64 baseline, and a prefetch never
    // faults or reads memory architecturally (any address is fine).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
}

/// A memfd for `rows` rows in `layout` (in huge pages where the system
/// has them) and its writable mapping, to be filled; whether it is in
/// huge pages.
fn memfd_map(
    rows: u64,
    layout: KeptLayout,
    memory: &dyn Fn(std::io::Error) -> LoadError,
) -> Result<(MmapMut, Option<(std::fs::File, bool)>), LoadError> {
    let (f, flen, huge) = kept::create(rows, layout, true).map_err(|e| memory(e.into_io()))?;
    match map_memfd(&f, flen) {
        Ok(map) => Ok((map, Some((f, huge)))),
        // Huge pages free when counted can be gone when mapped (another
        // process reserved them, or the pool shrank): ordinary pages then.
        Err(e) if huge => {
            tracing::warn!("huge pages counted free could not be mapped ({e}); ordinary pages");
            drop(f);
            let (f, flen, _) =
                kept::create(rows, layout, false).map_err(|e| memory(e.into_io()))?;
            let map = map_memfd(&f, flen).map_err(memory)?;
            Ok((map, Some((f, false))))
        }
        Err(e) => Err(memory(e)),
    }
}

fn map_memfd(f: &std::fs::File, flen: u64) -> std::io::Result<MmapMut> {
    let flen = usize::try_from(flen)
        .map_err(|_| std::io::Error::other("larger than the address space"))?;
    // SAFETY: the memfd is ours alone until it is handed on, and its size
    // is fixed (sealed once filled).
    unsafe { memmap2::MmapOptions::new().len(flen).map_mut(f) }
}

/// A filled memfd's rows mapped again read-only: the writable mapping `map`
/// goes (or stays as the RDMA view, with `rdma_view`), the memfd is sealed
/// against writes (or, with a view, when first shared), and the new
/// mapping is locked again where `relock` says.
fn map_sealed(
    k: &Kept,
    map: MmapMut,
    rdma_view: bool,
    relock: Option<MlockMode>,
    memory: &dyn Fn(std::io::Error) -> LoadError,
    mlock_err: &dyn Fn(std::io::Error) -> LoadError,
) -> Result<(Mmap, Option<MmapMut>), LoadError> {
    let flen = map.len();
    let view = if rdma_view {
        Some(map)
    } else {
        drop(map);
        kept::seal_writes(&k.file).map_err(|e| memory(e.into_io()))?;
        None
    };
    // SAFETY: the memfd is sealed against resizing, so its pages cannot go
    // away under the mapping, and against writes (or nothing writes through
    // the view kept).
    let map = unsafe { memmap2::MmapOptions::new().len(flen).map(&k.file) }.map_err(memory)?;
    let _ = map.advise(memmap2::Advice::HugePage);
    if let Some(mode) = relock {
        lock_on_fault(&map, mode).map_err(mlock_err)?;
    }
    Ok((map, view))
}

#[cfg(test)]
mod tests;
