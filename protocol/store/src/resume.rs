//! How a table becomes resident when a process starts: the whole decision
//! between taking the copy a previous process kept, serving its file's
//! pages as that process left them, and loading the file again.
//!
//! 1. With copies to look at ([`KeptCopies::may_hold`]), the table's
//!    version is the pin, else its file's header.
//! 2. A table kept in memory ([`Backing::Memfd`] or anonymous): the kept
//!    copy of exactly that version is adopted, nothing read
//!    ([`ResidentTable::adopt`]). A donor that checks digests takes only a
//!    copy whose digest was checked.
//! 3. A table served from its file's pages ([`Backing::Mapped`]): the mark
//!    the previous process left ([`FileMark`]) lets the load serve the
//!    same file at the same change time without reading or hashing it;
//!    its pages are then checked against the file's page checksums in the
//!    background, and a mismatch is handed to the caller
//!    ([`KeptCopies::file_changed`]).
//! 4. Anything else is loaded (read, placed, verified unless trusted), and
//!    a mark that did not count is forgotten.
//!
//! An adopted table's memory is locked as `mlock` asks: before serving
//! with `require`, in the background with `try`. The caller keeps the
//! store (systemd's fd store, for the donor) behind [`KeptCopies`], and
//! reports and logs what happened from the returned [`Resumed`].

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::progress::Progress;
use crate::resident::{
    Backing, ExpectedTable, FileMark, LoadError, LoadOptions, MlockMode, ResidentTable,
};
use crate::table_file::TableFile;
use engram_protocol::encoding::RowEncoding;

/// Copies a previous process kept (the donor's view of systemd's fd store).
pub trait KeptCopies {
    /// Whether any copy may be there: when not, no file header is read
    /// to compare with.
    fn may_hold(&self) -> bool;

    /// The kept copy of table `id` at exactly `expected`, complete and
    /// intact, whose digest was checked when it was loaded if `verified`
    /// asks for that; with `rdma_view`, with its writable view for RDMA
    /// where it can have one.
    fn take(
        &self,
        id: u32,
        expected: &ExpectedTable,
        verified: bool,
        rdma_view: bool,
    ) -> Option<ResidentTable>;

    /// The mark a previous process left for table `id` served from its
    /// file's pages at `expected`'s version, with the name it is kept
    /// under; only a mark whose rows were hashed when `verified`.
    fn take_file(
        &self,
        id: u32,
        expected: &ExpectedTable,
        verified: bool,
    ) -> Option<(FileMark, String)>;

    /// Remove the mark kept under `name` (it did not count).
    fn forget(&self, name: &str);

    /// What to do, on the checking thread, when a table served on from its
    /// file's pages (the mark kept under `name`) does not match the file's
    /// page checksums: the file changed without its change time moving.
    /// The donor forgets the mark and exits.
    fn file_changed(&self, name: String) -> Box<dyn FnOnce() + Send + 'static>;
}

/// How a table came to be resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// The kept copy was adopted: nothing was read.
    Adopted,
    /// The file's pages were served on from the previous process's mark:
    /// nothing was read or hashed; the pages are being checked.
    FilePages,
    /// The file was loaded.
    Loaded,
}

/// What [`resume_or_load`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    /// How the table came to be resident.
    pub how: How,
    /// The digest was recomputed at this load, or at the load that made
    /// the adopted copy or the mark.
    pub verified: bool,
    /// The memory is locked (adopted with `try`: being locked in the
    /// background).
    pub locked: bool,
}

/// Make table `id` at `path` resident (the module documentation gives the
/// order): adopted from `kept`, served on from its file's pages, or
/// loaded with `opts` (whose `known_file` this sets) and `progress`.
pub fn resume_or_load(
    id: Option<u32>,
    path: &Path,
    opts: &LoadOptions,
    kept: &dyn KeptCopies,
    progress: impl FnOnce(&TableFile) -> Option<Progress>,
) -> Result<(ResidentTable, Resumed), LoadError> {
    let verify = !opts.trust_digest;
    let mut known: Option<(FileMark, String)> = None;
    // The file's header is read for its version only when there is a copy
    // to compare it with.
    if let Some(want) = kept.may_hold().then(|| expected(opts, path)).flatten() {
        let id = id.unwrap_or(want.layer);
        // A table of another encoding than V4.1's is kept in a memfd even
        // where its file's pages were asked for (ResidentTable::load_table).
        let encoded =
            || TableFile::read_meta(path).is_ok_and(|(m, _)| m.encoding != RowEncoding::V41);
        if opts.backing == Backing::Mapped && !encoded() {
            known = kept.take_file(id, &want, verify);
        } else if let Some(table) = kept.take(id, &want, verify, opts.rdma_view) {
            let verified = table.kept().is_some_and(|k| k.record.verified);
            let locked = lock_adopted(&table, opts.mlock)?;
            let how = How::Adopted;
            return Ok((
                table,
                Resumed {
                    how,
                    verified,
                    locked,
                },
            ));
        }
    }
    let opts = LoadOptions {
        known_file: known.as_ref().map(|(mark, _)| *mark),
        ..*opts
    };
    let (table, report) = ResidentTable::load_with(id, path, &opts, progress)?;
    if report.reused {
        let locked = lock_adopted(&table, opts.mlock)?;
        if let Some((_, name)) = known {
            check_pages(&table, path, kept.file_changed(name));
        }
        let (how, verified) = (How::FilePages, report.verified);
        return Ok((
            table,
            Resumed {
                how,
                verified,
                locked,
            },
        ));
    }
    if let Some((_, stale)) = &known {
        // Replaced by the mark of this load.
        kept.forget(stale);
    }
    let (how, verified, locked) = (How::Loaded, report.verified, report.locked);
    Ok((
        table,
        Resumed {
            how,
            verified,
            locked,
        },
    ))
}

/// What the table at `path` must be: the pin, else its file's header.
fn expected(opts: &LoadOptions, path: &Path) -> Option<ExpectedTable> {
    opts.pinned.or_else(|| {
        let f = TableFile::open_any(path).ok()?;
        Some(ExpectedTable {
            digest: f.meta.digest,
            layer: f.meta.layer,
            rows: f.meta.rows,
        })
    })
}

/// Lock a table this process did not load: with `require`, now (a pass
/// over its pages before serving); with `try`, in the background while
/// it serves (true when that started).
fn lock_adopted(table: &ResidentTable, mode: MlockMode) -> Result<bool, LoadError> {
    match mode {
        MlockMode::Off => Ok(false),
        MlockMode::Require => {
            table.lock().map_err(|source| LoadError::Mlock {
                path: format!("table {} (adopted)", table.id),
                bytes: table.bytes(),
                source,
            })?;
            Ok(true)
        }
        MlockMode::Try => {
            let (memory, id) = (table.memory(), table.id);
            let spawned = std::thread::Builder::new()
                .name(format!("lock-{id}"))
                .spawn(move || {
                    let began = std::time::Instant::now();
                    match memory.lock() {
                        Ok(()) => tracing::info!(
                            table = id,
                            took_ms = began.elapsed().as_millis() as u64,
                            "adopted table's memory locked"
                        ),
                        Err(e) => tracing::warn!(
                            table = id,
                            "adopted table's memory not locked ({e}); raise LimitMEMLOCK"
                        ),
                    }
                });
            Ok(spawned.is_ok())
        }
    }
}

/// A table served on from its file's pages without being read: check
/// every page against the file's page checksums, in the background (pages
/// the kernel dropped while no process held the file are read from the
/// disk again). A page that does not match means the file changed on disk
/// without its change time moving: it is logged and `changed` runs.
fn check_pages(table: &ResidentTable, shown: &Path, changed: Box<dyn FnOnce() + Send + 'static>) {
    let (memory, id, shown) = (table.memory(), table.id, shown.display().to_string());
    // The served file itself, whatever the path names by now.
    let Some(served) = memory
        .file()
        .map(|f| PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())))
    else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name(format!("check-{id}"))
        .spawn(move || {
            let began = std::time::Instant::now();
            let sums = match TableFile::open(&served).and_then(|f| f.read_page_sums()) {
                Ok(Some(sums)) => sums,
                Ok(None) => {
                    tracing::info!(table = id, file = shown, "no page checksums: the pages of a table served on from its file are not checked");
                    return;
                }
                Err(e) => {
                    tracing::warn!(table = id, file = shown, "cannot read the page checksums to check a table served on from its file: {e}");
                    return;
                }
            };
            match crate::verify::first_bad_page((*memory).as_ref(), &sums) {
                None => tracing::info!(
                    table = id,
                    pages = sums.len(),
                    took_ms = began.elapsed().as_millis() as u64,
                    "the pages of a table served on from its file match the file's page checksums"
                ),
                Some(page) => {
                    tracing::error!(
                        table = id,
                        page,
                        file = shown,
                        "a page of a table served on from its file does not match its checksum: the file changed on disk without its change time moving"
                    );
                    changed();
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(
            table = id,
            "cannot start checking the pages of a table served on from its file: {e}"
        );
    }
}

#[cfg(test)]
mod tests;
