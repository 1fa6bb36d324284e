//! Loading a spec's tables resident at start, through the store's start
//! decision (`engram_store::resume`: the copy of exactly its version kept
//! in systemd's fd store, its file's pages as the previous process left
//! them, or a load, verified unless trusted), with each table's state in
//! the donor's status, its progress in systemd's status line, and what
//! happened in the log. The load parameters a swap uses too (`backing`,
//! `load_threads`, `rdma_view`, the `BACKGROUND` priority) live here.

use std::sync::Arc;
use std::time::Duration;

use cluster_config::MlockMode;
use daemon_runtime::notify::Notifier;
use engram_store::progress::Progress;
use engram_store::resident::{Backing, LoadOptions, ResidentTable};
use engram_store::resume::{How, Resumed, resume_or_load};
use engram_store::table_file::TableFile;

use crate::fdstore::FdStore;
use crate::spec::{ServeError, ServeSpec, TableSpec};
use crate::status::{DonorState, LoadState};

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
        st.resident(table.memory_bytes().len() as u64);
        st.set_state(LoadState::Ready);
        if report.how == How::Loaded {
            store.keep(&table);
        }
        tracing::info!(
            table = table.id,
            layer = table.layer,
            rows = table.rows,
            digest = %table.digest,
            verified = report.verified,
            locked = report.locked,
            how = ?report.how,
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

/// Table `i` of `spec` made resident by the store's start decision
/// (`engram_store::resume`: a kept copy adopted, its file's pages served
/// on, or a load), reported into `status.tables[i]` and the log.
fn load_one(
    spec: &ServeSpec,
    i: usize,
    status: &Arc<DonorState>,
    notifier: &Arc<Notifier>,
    store: &FdStore,
) -> Result<(ResidentTable, Resumed), ServeError> {
    let t = &spec.tables[i];
    check_encoding(t)?;
    let progress = |f: &TableFile| Some(load_progress(t, i, f, status, notifier));
    let opts = LoadOptions {
        pinned: t.pinned,
        trust_digest: spec.trust_digest,
        mlock: spec.mlock,
        backing: backing(spec.map_files, spec.host.is_some(), store),
        threads: load_threads(spec.load_threads),
        known_file: None,
        numa_node: spec.numa_node,
        rdma_view: rdma_view(spec.rdma.is_some()),
        planar: spec.host_layout == cluster_config::KeptLayout::Planar,
        background: Some(BACKGROUND),
    };
    let (table, resumed) = resume_or_load(t.id, &t.path, &opts, store, progress)?;
    let st = &status.tables[i];
    match resumed.how {
        How::Loaded => {}
        How::FilePages => {
            st.progress(table.rows, table.rows);
            tracing::info!(
                table = table.id,
                "table adopted from the fd store: serving the file's pages as the previous process left them (the file unchanged since), not read or hashed"
            );
        }
        How::Adopted => {
            let record = table.kept().map(|k| k.record);
            st.opened(table.id, table.layer, table.rows, table.digest);
            st.row_bytes(table.row_bytes());
            st.progress(table.rows, table.rows);
            let age_s = record.map_or(0, |r| {
                engram_store::kept::unix_ms().saturating_sub(r.loaded_unix_ms) / 1000
            });
            tracing::info!(
                table = table.id,
                generation = record.map_or(0, |r| r.generation),
                loaded_s_ago = age_s,
                pages = table.kept().map_or("-", |k| k.pages.name()),
                "table adopted from the fd store: serving the copy the previous process loaded, file not read"
            );
        }
    }
    warn_planar_pages(&table);
    Ok((table, resumed))
}

/// A table file whose rows are not of the encoding the config declares is
/// refused before it is read (its header only; a file that cannot be read
/// is left to the load, which says why).
fn check_encoding(t: &TableSpec) -> Result<(), ServeError> {
    let Some(want) = t.encoding else {
        return Ok(());
    };
    let refuse = |what: String| {
        Err(ServeError::Load(
            engram_store::resident::LoadError::Pinned {
                path: t.path.display().to_string(),
                what,
            },
        ))
    };
    match TableFile::read_meta(&t.path) {
        Ok((meta, _)) if meta.encoding != want => refuse(format!(
            "its rows are {} but the config says encoding = \"{}\"",
            meta.encoding.name(),
            want.name()
        )),
        // The digest covers the rows, not the scale they are read with.
        Ok((meta, _)) if t.tensor_scale.is_some() && meta.tensor_scale != t.tensor_scale => {
            refuse(format!(
                "its table scale is {} but the config says tensor_scale = {}",
                meta.tensor_scale
                    .map_or("none".into(), |b| f32::from_bits(b).to_string()),
                t.tensor_scale
                    .map_or("none".into(), |b| f32::from_bits(b).to_string())
            ))
        }
        _ => Ok(()),
    }
}

/// Loudly, once per table: a planar table (for engines' own kernels) that
/// is not on reserved huge pages. A GPU reads it through its own page
/// tables, and on 4 KiB pages (or transparent huge pages it may not map
/// as such) misses its TLB on nearly every row: SGLang measures its host
/// lookups about 10x slower so; the donor's own gather is 45% slower on
/// 4 KiB pages here.
fn warn_planar_pages(table: &ResidentTable) {
    let Some(k) = table.kept() else { return };
    if k.record.layout == engram_store::kept::KeptLayout::Planar
        && k.pages != engram_store::kept::Pages::HugeTlb
    {
        tracing::warn!(
            table = table.id,
            pages = k.pages.name(),
            "a planar table for engines is not on reserved huge pages: GPUs reading it \
             through their page tables miss the TLB on nearly every row (about 10x slower \
             host lookups, by SGLang's measure); reserve them (vm.nr_hugepages: \
             ceil(table bytes / 2 MiB) per table) and restart the donor"
        );
    }
}

/// A load's progress: in table `i`'s status, the log, and systemd's status
/// line (each percent extends the start timeout).
fn load_progress(
    t: &TableSpec,
    i: usize,
    f: &TableFile,
    status: &Arc<DonorState>,
    notifier: &Arc<Notifier>,
) -> Progress {
    let m = &f.meta;
    let id = t.id.unwrap_or(m.layer);
    status.tables[i].opened(id, m.layer, m.rows, m.digest);
    status.tables[i].row_bytes(f.row_bytes());
    let what = format!("loading {}", t.path.display());
    let (status, total, notifier) = (Arc::clone(status), m.rows, Arc::clone(notifier));
    let mut last_pct = u64::MAX;
    Progress::log(what, total, f.row_bytes() as u64).with_tap(move |done| {
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

/// The priority a donor reads, places and hashes a table at, at start or
/// in a swap: the lowest normal one. A load is work beside the host's
/// other work (a node on the same host mapping its tables, an engine, the
/// donor's own connection threads): on an idle host it runs as fast as
/// before, on a busy one it gives way, but it is never starved (a swap
/// must end).
pub(crate) const BACKGROUND: engram_store::background::Background =
    engram_store::background::Background::Low;

/// Load threads for a configured count (0: every core).
pub(crate) fn load_threads(n: usize) -> usize {
    if n == 0 {
        engram_store::fill::cores()
    } else {
        n
    }
}
