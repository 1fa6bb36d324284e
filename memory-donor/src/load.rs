//! Loading a spec's tables resident at start: each taken from systemd's
//! fd store when a copy of exactly its version is there, else read (and
//! verified, unless trusted) into memory, with its state in the donor's
//! status and systemd's status line; then locked. The load parameters a
//! swap uses too (`backing`, `load_threads`, `rdma_view`)
//! live here.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use daemon_runtime::notify::Notifier;

use crate::status::{DonorState, LoadState};
use cluster_config::MlockMode;
use engram_store::progress::Progress;
use engram_store::resident::{Backing, ExpectedTable, LoadError, LoadOptions, ResidentTable};

use crate::fdstore::FdStore;

use crate::spec::{ServeError, ServeSpec, TableSpec};

fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct we pass.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0;
    ok.then_some(r.rlim_cur)
}

/// How much more time a load that is making progress asks systemd for.
const LOAD_EXTEND: Duration = Duration::from_secs(120);

/// Load every table resident, with progress in the log, in `status` (one
/// entry per table of `spec`, in order) and in systemd's status line (each
/// percent also extends the start timeout: a slow load that moves is fine,
/// a stuck one times out).
pub fn load_tables(
    spec: &ServeSpec,
    status: &Arc<DonorState>,
    notifier: &Arc<Notifier>,
    store: &FdStore,
) -> Result<Vec<ResidentTable>, ServeError> {
    let mut tables: Vec<ResidentTable> = Vec::new();
    let mut unlocked = 0u64;
    for (i, st) in status.tables.iter().enumerate().take(spec.tables.len()) {
        let loaded = load_one(spec, i, status, notifier, store).and_then(|(table, report)| {
            if tables.iter().any(|x| x.id == table.id) {
                return Err(ServeError::DuplicateId(table.id));
            }
            Ok((table, report))
        });
        let (table, report) = match loaded {
            Ok(x) => x,
            Err(e) => {
                st.failed(e.to_string());
                return Err(e);
            }
        };
        st.set_state(LoadState::Ready);
        if !report.adopted {
            store.keep(&table);
        }
        tracing::info!(
            table = table.id,
            layer = table.layer,
            rows = table.rows,
            digest = %table.digest,
            verified = report.verified,
            locked = report.locked,
            adopted = report.adopted,
            file_pages = !table.memory().is_packed(),
            "table resident"
        );
        if !report.locked && spec.mlock != MlockMode::Off {
            unlocked += table.bytes();
        }
        tables.push(table);
    }
    store.release_rest();
    if spec.rdma.is_none() {
        // No RDMA now: check words kept for it are of no use.
        store.release_checks();
    }
    if unlocked > 0 {
        let limit = memlock_limit().map_or("unknown".to_string(), |l| {
            if l == libc::RLIM_INFINITY {
                "unlimited".into()
            } else {
                format!("{l} bytes")
            }
        });
        tracing::warn!(
            bytes = unlocked,
            "table memory is not locked (memlock limit: {limit}): it may be swapped out under memory pressure; \
             set LimitMEMLOCK=infinity in the systemd unit or raise `ulimit -l`"
        );
    }
    Ok(tables)
}

/// Whether tables kept in a memfd get a writable view for RDMA: when the
/// donor serves RDMA on a kernel that registers shared memory only through
/// a writable mapping (before Linux 6.2; docs/rdma.md).
pub(crate) fn rdma_view(serves_rdma: bool) -> bool {
    serves_rdma && engram_store::kept::writable_view_needed()
}

/// Where a table loaded now lives: its file's pages (`map_files`), or a
/// copy in memory the fd store can keep; a memfd whenever the donor has a
/// host socket (`host`), whose clients map it.
pub(crate) fn backing(map_files: bool, host: bool, store: &FdStore) -> Backing {
    if map_files {
        Backing::Mapped
    } else if host {
        Backing::Memfd
    } else {
        store.backing()
    }
}

/// How a table came to be resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// The digest was recomputed at this load (or at the load that made an
    /// adopted copy).
    pub verified: bool,
    /// The memory is locked (an adopted copy: being locked in the background).
    pub locked: bool,
    /// Taken from systemd's fd store: nothing was read.
    pub adopted: bool,
}

/// What table `t` must be: the config's pin, else its file's header.
fn expected(t: &TableSpec) -> Option<ExpectedTable> {
    t.pinned.or_else(|| {
        let f = engram_store::table_file::TableFile::open(&t.path).ok()?;
        Some(ExpectedTable {
            digest: f.meta.digest,
            layer: f.meta.layer,
            rows: f.meta.rows,
        })
    })
}

/// Take table `i` of `spec` from the fd store if a copy of exactly its
/// version is there; else load it, reporting into `status.tables[i]`.
fn load_one(
    spec: &ServeSpec,
    i: usize,
    status: &Arc<DonorState>,
    notifier: &Arc<Notifier>,
    store: &FdStore,
) -> Result<(ResidentTable, Loaded), ServeError> {
    let t = &spec.tables[i];
    // What the previous process left of a table served from its file's
    // pages: the file's mark, and its name in the store.
    let mut known: Option<(engram_store::resident::FileMark, String)> = None;
    // The file's header is read for its version only when there is a copy
    // to compare it with.
    if let Some(want) = store.may_hold().then(|| expected(t)).flatten() {
        let id = t.id.unwrap_or(want.layer);
        if spec.map_files {
            known = store.take_file(id, &want, !spec.trust_digest);
        } else if let Some(table) = store.take(
            id,
            &want,
            !spec.trust_digest,
            rdma_view(spec.rdma.is_some()),
        ) {
            return adopted(spec, i, status, table);
        }
    }
    let progress =
        |f: &engram_store::table_file::TableFile| Some(load_progress(t, i, f, status, notifier));
    let opts = LoadOptions {
        pinned: t.pinned,
        trust_digest: spec.trust_digest,
        mlock: spec.mlock,
        backing: backing(spec.map_files, spec.host.is_some(), store),
        threads: load_threads(spec.load_threads),
        known_file: known.as_ref().map(|(mark, _)| *mark),
        numa_node: spec.numa_node,
        rdma_view: rdma_view(spec.rdma.is_some()),
    };
    let (table, report) = ResidentTable::load_with(t.id, &t.path, &opts, progress)?;
    if report.reused {
        status.tables[i].progress(table.rows, table.rows);
        tracing::info!(
            table = table.id,
            "table adopted from the fd store: serving the file's pages as the previous process left them (the file unchanged since), not read or hashed"
        );
        let locked = lock_adopted(&table, spec.mlock)?;
        if let Some((_, name)) = known {
            check_reused_pages(&table, &t.path, store.forgetter(name));
        }
        return Ok((
            table,
            Loaded {
                verified: report.verified,
                locked,
                adopted: true,
            },
        ));
    }
    if let Some((_, stale)) = &known {
        // Replaced by the mark of this load.
        store.forget(stale);
    }
    Ok((
        table,
        Loaded {
            verified: report.verified,
            locked: report.locked,
            adopted: false,
        },
    ))
}

/// Serve a copy of table `i` taken from the fd store, loaded by the
/// previous process.
fn adopted(
    spec: &ServeSpec,
    i: usize,
    status: &Arc<DonorState>,
    table: ResidentTable,
) -> Result<(ResidentTable, Loaded), ServeError> {
    let id = table.id;
    let record = table.kept().map(|k| k.record);
    status.tables[i].opened(id, table.layer, table.rows, table.digest);
    status.tables[i].progress(table.rows, table.rows);
    let age_s = record.map_or(0, |r| {
        engram_store::kept::unix_ms().saturating_sub(r.loaded_unix_ms) / 1000
    });
    tracing::info!(
        table = id,
        generation = record.map_or(0, |r| r.generation),
        loaded_s_ago = age_s,
        pages = table.kept().map_or("-", |k| k.pages.name()),
        "table adopted from the fd store: serving the copy the previous process loaded, file not read"
    );
    let locked = lock_adopted(&table, spec.mlock)?;
    let verified = record.is_some_and(|r| r.verified);
    Ok((
        table,
        Loaded {
            verified,
            locked,
            adopted: true,
        },
    ))
}

/// A load's progress: in table `i`'s status, the log, and systemd's status
/// line (each percent extends the start timeout).
fn load_progress(
    t: &TableSpec,
    i: usize,
    f: &engram_store::table_file::TableFile,
    status: &Arc<DonorState>,
    notifier: &Arc<Notifier>,
) -> Progress {
    let m = &f.meta;
    let id = t.id.unwrap_or(m.layer);
    status.tables[i].opened(id, m.layer, m.rows, m.digest);
    let what = format!("loading {}", t.path.display());
    let (status, total, notifier) = (Arc::clone(status), m.rows, Arc::clone(notifier));
    let mut last_pct = u64::MAX;
    Progress::log(what, total, engram_protocol::ROW_BYTES as u64).with_tap(move |done| {
        status.tables[i].progress(done, total);
        let pct = done * 100 / total.max(1);
        if pct != last_pct {
            last_pct = pct;
            let line = format!("loading table {id}: {pct}%");
            if let Err(e) = notifier.extend_timeout(LOAD_EXTEND, &line) {
                tracing::debug!(error = %e, "sd_notify");
            }
        }
    })
}

/// Load threads for a configured count (0: every core).
pub(crate) fn load_threads(n: usize) -> usize {
    if n == 0 {
        engram_store::fill::cores()
    } else {
        n
    }
}

/// Lock an adopted table's memory: with `require`, now (a pass over its
/// pages before serving); with `try`, in the background while it serves.
fn lock_adopted(table: &ResidentTable, mode: MlockMode) -> Result<bool, ServeError> {
    match mode {
        MlockMode::Off => Ok(false),
        MlockMode::Require => {
            table.lock().map_err(|source| {
                ServeError::Load(LoadError::Mlock {
                    path: format!("table {} (adopted)", table.id),
                    bytes: table.bytes(),
                    source,
                })
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
/// the kernel dropped while no donor held the file are read from the disk
/// again). A page that does not match means the file changed on disk
/// without its change time moving: the donor says so, removes the mark
/// from the fd store (`forget`), so that the next start reads and verifies
/// the file, and exits with code 3, as when the file is opened for writing.
fn check_reused_pages(table: &ResidentTable, shown: &Path, forget: impl FnOnce() + Send + 'static) {
    use std::os::fd::AsRawFd;
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
            let sums = engram_store::table_file::TableFile::open(&served)
                .and_then(|f| f.read_page_sums());
            let sums = match sums {
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
            match engram_store::verify::first_bad_page((*memory).as_ref(), &sums) {
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
                        "a page of a table served on from its file does not match its checksum: the file changed on disk without its change time moving; its mark is removed from the fd store and the donor exits (the next start reads and verifies the file)"
                    );
                    forget();
                    std::process::exit(3);
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
