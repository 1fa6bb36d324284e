//! Table hot swap: load another version of a served table next to the old
//! one, verify it, then switch under the tables' write lock (a pointer
//! move; lookups in flight finish on the old version first, later ones see
//! the new one). Clients pinned to the old digest get `VersionMismatch`
//! from the switch on; new connections see the new digest in Welcome.
//!
//! RAM: both versions are resident until the switch. A swap is refused up
//! front when the donor's table budget (`ram_gib - headroom_gib`, when it
//! runs from the cluster config) or the machine's available memory would
//! not hold the new version beside everything loaded, unless asked to swap
//! *in place*: the old version is unloaded first (the table is not served,
//! `UnknownTable`, until the new one is loaded).
//!
//! A swap the control plane asks for loads only a file beneath one of the
//! donor's table directories, opened once by descriptor with no symbolic
//! link below the directory (`confine`); one a reload asks for comes from
//! the config itself. Either way the file is opened non-blocking, must be a
//! regular file, and that descriptor is what is checked and loaded.
//!
//! `prepare` does every check that can fail fast (the caller answers with
//! its result), off the serving loop (`prepare_off_loop`: opening and
//! reading a header may block); `run` does the load and the switch.

use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use daemon_runtime::notify::Notifier;
use engram_protocol::TableDigest;
use engram_protocol::etab::{PAGE_BYTES, ROWS_PER_PAGE};

use crate::fdstore::FdStore;
use crate::orders::{SwapAccepted, SwapError, SwapRequest};
use crate::server::Shared;
use crate::status::{DonorState, LoadState};
use cluster_config::MlockMode;
use engram_store::progress::Progress;
use engram_store::resident::{ExpectedTable, LoadOptions, ResidentTable};
use engram_store::table_file::TableFile;

/// What a swap needs from the serving loop.
#[derive(Debug, Clone)]
pub struct SwapContext {
    /// The data plane's state, whose served tables a swap replaces.
    pub shared: Arc<Shared>,
    /// The donor's state, where a swap reports each table's load.
    pub status: Arc<DonorState>,
    /// Where status notifications go (systemd), if anywhere.
    pub notifier: Arc<Notifier>,
    /// Skip recomputing the new version's digest at load.
    pub trust_digest: bool,
    /// Memory locking of the new version.
    pub mlock: MlockMode,
    /// Bytes the tables may take in all (`ram_gib - headroom_gib`), when known.
    pub budget: Option<u64>,
    /// Where new versions are kept for the next start.
    pub fd_store: Arc<FdStore>,
    /// Serve new versions from their files' pages, not a copy.
    pub map_files: bool,
    /// The donor has a host socket: new versions go in a memfd its clients map.
    pub host_shared: bool,
    /// The donor serves RDMA: see [`crate::load::rdma_view`].
    pub serves_rdma: bool,
    /// The NUMA node new versions are bound to.
    pub numa_node: Option<u32>,
    /// Threads that read, place and hash a table (0: every core).
    pub load_threads: usize,
    /// New versions are planar (`host_layout`).
    pub planar: bool,
}

/// A checked swap, ready to load.
#[derive(Debug, Clone)]
pub struct Prepared {
    req: SwapRequest,
    /// The file, opened once: checked here, loaded by `run`.
    file: Arc<File>,
    accepted: SwapAccepted,
    layer: u32,
    rows: u64,
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / GIB)
}

fn shown(dirs: &[PathBuf]) -> String {
    if dirs.is_empty() {
        return "none".into();
    }
    let d: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    d.join(", ")
}

/// The file a control-plane swap may load, opened once: `path` must be
/// absolute, without `..`, and beneath one of `dirs` (as configured, or
/// with the directory's own symlinks resolved); below that directory every
/// component is opened relative to the one above with `O_NOFOLLOW` (the
/// equivalent of openat2's `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), the
/// file itself non-blocking (a FIFO cannot stall the donor). Errors name
/// only `path` and `dirs`, never where a link would lead.
pub fn confine(path: &Path, dirs: &[PathBuf]) -> Result<File, SwapError> {
    let shown_path = path.display();
    if !path.is_absolute() {
        return Err(SwapError::NotAllowed(format!(
            "{shown_path}: give the new file's absolute path"
        )));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(SwapError::NotAllowed(format!(
            "{shown_path}: a path with `..` is refused; name the file inside a table directory ({})",
            shown(dirs)
        )));
    }
    let mut candidates: Vec<PathBuf> = dirs.to_vec();
    for d in dirs {
        if let Ok(real) = std::fs::canonicalize(d)
            && !candidates.contains(&real)
        {
            candidates.push(real);
        }
    }
    let beneath = candidates
        .iter()
        .filter_map(|d| {
            let rel = path.strip_prefix(d).ok()?;
            (rel.components().next().is_some()).then_some((d, rel))
        })
        .max_by_key(|(d, _)| d.as_os_str().len());
    let Some((dir, rel)) = beneath else {
        return Err(SwapError::NotAllowed(format!(
            "{shown_path} is outside the donor's table directories ({}): a swap loads only \
             files under `table_dir` (or the directories of its configured tables)",
            shown(dirs)
        )));
    };
    open_beneath(dir, rel).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP | libc::ENOTDIR) => SwapError::NotAllowed(format!(
            "{shown_path}: a swap opens no symbolic link (and nothing but directories) below the \
             table directory {}; name the real file",
            dir.display()
        )),
        _ => SwapError::BadFile(format!("{shown_path}: {e}")),
    })
}

/// Open `rel` (normal components only) beneath `dir`, following no symbolic
/// link below `dir`; the last component read-only and non-blocking.
fn open_beneath(dir: &Path, rel: &Path) -> std::io::Result<File> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    let names: Vec<&std::ffi::OsStr> = rel
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    let cstr = |b: &[u8]| {
        CString::new(b).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let open = |at: Option<&OwnedFd>, name: &CString, flags: i32| -> std::io::Result<OwnedFd> {
        let base = at.map_or(libc::AT_FDCWD, AsRawFd::as_raw_fd);
        // SAFETY: `name` is a valid C string; the result is checked.
        let fd = unsafe { libc::openat(base, name.as_ptr(), flags) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor openat just returned, owned by no one else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    // The directory itself as configured (its own symlinks are the operator's).
    let mut at = open(
        None,
        &cstr(dir.as_os_str().as_bytes())?,
        libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
    )?;
    for (i, name) in names.iter().enumerate() {
        let last = i + 1 == names.len();
        let flags = if last {
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_CLOEXEC
        } else {
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC
        };
        at = open(Some(&at), &cstr(name.as_bytes())?, flags)?;
    }
    if names.is_empty() {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    Ok(File::from(at))
}

/// A file the config names (a reload's swap), opened non-blocking.
pub fn open_configured(path: &Path) -> Result<File, SwapError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| SwapError::BadFile(format!("{}: {e}", path.display())))
}

/// Open the file (`confine` beneath `dirs` for a control-plane swap, else as
/// the config names it) and `prepare`, on a blocking thread: a slow disk or
/// a FIFO never stalls the serving loop.
pub async fn prepare_off_loop(
    cx: &SwapContext,
    req: SwapRequest,
    dirs: Option<Vec<PathBuf>>,
) -> Result<Prepared, SwapError> {
    let cx = cx.clone();
    tokio::task::spawn_blocking(move || {
        let file = match &dirs {
            Some(d) => confine(&req.path, d)?,
            None => open_configured(&req.path)?,
        };
        prepare(&cx, req, file)
    })
    .await
    .map_err(|e| SwapError::Load(format!("preparing the swap: {e}")))?
}

/// Check `req` against what is served, the file's header and the RAM there is.
pub fn prepare(cx: &SwapContext, req: SwapRequest, file: File) -> Result<Prepared, SwapError> {
    let (old, old_bytes, old_layer, in_use) = {
        let tables = cx.shared.tables();
        let t = tables
            .iter()
            .find(|t| t.id == req.table)
            .ok_or(SwapError::UnknownTable(req.table))?;
        let in_use: u64 = tables.iter().map(ResidentTable::bytes).sum();
        (t.digest, t.bytes(), t.layer, in_use)
    };
    let dup = file
        .try_clone()
        .map_err(|e| SwapError::BadFile(format!("{}: {e}", req.path.display())))?;
    let table_file =
        TableFile::from_file_any(dup, &req.path).map_err(|e| SwapError::BadFile(e.to_string()))?;
    let m = &table_file.meta;
    let shown = req.path.display().to_string();
    if let Some(expected) = req.expected
        && expected != m.digest
    {
        return Err(SwapError::WrongVersion {
            path: shown,
            expected,
            actual: m.digest,
        });
    }
    if m.layer != old_layer {
        return Err(SwapError::BadFile(format!(
            "{shown} is layer {}, table {} is layer {old_layer}",
            m.layer, req.table
        )));
    }
    if m.digest == old {
        return Err(SwapError::AlreadyServed {
            table: req.table,
            digest: old,
        });
    }
    // Served from its file's pages, a table holds them whole, slack included.
    let bytes = if cx.map_files {
        m.rows.div_ceil(ROWS_PER_PAGE) * PAGE_BYTES
    } else {
        m.rows * table_file.row_bytes() as u64
    };
    check_room(cx, &req, bytes, in_use, old_bytes)?;
    let accepted = SwapAccepted {
        old,
        new: m.digest,
        bytes,
        in_place: req.in_place,
    };
    Ok(Prepared {
        req,
        file: Arc::new(file),
        accepted,
        layer: m.layer,
        rows: m.rows,
    })
}

/// Room for a new version of `bytes`: beside everything loaded (`in_use`),
/// or in the place of the old one (`old_bytes`, in place), within the
/// donor's table budget and the machine's available memory.
fn check_room(
    cx: &SwapContext,
    req: &SwapRequest,
    bytes: u64,
    in_use: u64,
    old_bytes: u64,
) -> Result<(), SwapError> {
    let avail = engram_store::kept::mem_available();
    let (room_budget, room_machine) = if req.in_place {
        (
            cx.budget.map(|b| b.saturating_sub(in_use - old_bytes)),
            avail.map(|a| a + old_bytes),
        )
    } else {
        (cx.budget.map(|b| b.saturating_sub(in_use)), avail)
    };
    let how = if req.in_place {
        "in place of"
    } else {
        "beside"
    };
    if let Some(room) = room_budget
        && bytes > room
    {
        return Err(SwapError::NoRoom(format!(
            "table {}: the new version ({}) does not fit {how} the tables loaded ({}) within the \
             donor's table budget of {} (ram_gib - headroom_gib){}",
            req.table,
            gib(bytes),
            gib(in_use),
            gib(cx.budget.unwrap_or(0)),
            if req.in_place {
                ""
            } else {
                "; swap in place (a short outage of this table) to need one version only"
            }
        )));
    }
    if let Some(room) = room_machine
        && bytes > room
    {
        return Err(SwapError::NoRoom(format!(
            "table {}: the new version ({}) needs more than the {} of memory available{}",
            req.table,
            gib(bytes),
            gib(room),
            if req.in_place {
                ""
            } else {
                "; swap in place (a short outage of this table) to need one version only"
            }
        )));
    }
    Ok(())
}

impl Prepared {
    /// What was accepted.
    pub fn accepted(&self) -> SwapAccepted {
        self.accepted
    }
}

/// The status entry of table `id`.
fn status_index(status: &DonorState, id: u32) -> Option<usize> {
    status.tables.iter().position(|t| t.view().id == id)
}

/// Load the new version and switch to it.
pub async fn run(cx: SwapContext, p: Prepared) -> Result<(), SwapError> {
    let began = Instant::now();
    let id = p.req.table;
    let si = status_index(&cx.status, id);
    let new = p.accepted.new;
    tracing::info!(
        table = id,
        path = %p.req.path.display(),
        old = %p.accepted.old,
        new = %new,
        in_place = p.req.in_place,
        "swap: loading the new version"
    );
    if p.req.in_place {
        unload_for_in_place(&cx, &p, si).await;
    }
    let loaded = {
        let (cx2, p2) = (cx.clone(), p.clone());
        tokio::task::spawn_blocking(move || load(&cx2, &p2, si)).await
    };
    let table = match loaded {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(failed(&cx, &p, si, e)),
        Err(e) => return Err(failed(&cx, &p, si, e.to_string())),
    };
    cx.fd_store.keep(&table);
    let memory = table.memory_bytes().len() as u64;
    let old = {
        let mut tables = cx.shared.tables_mut();
        match tables.iter().position(|t| t.id == id) {
            Some(i) => Some(std::mem::replace(&mut tables[i], table)),
            None => {
                tables.push(table);
                None
            }
        }
    };
    // RDMA follows: the new version registered, then the old one
    // deregistered, so a node still reading the old region gets a remote
    // access error and learns the new one.
    retire(&cx, old).await;
    if let Some(i) = si {
        cx.status.tables[i].resident(memory);
        cx.status.tables[i].replaced(p.req.path.clone(), p.rows, new, LoadState::Ready);
    }
    let took = began.elapsed();
    tracing::info!(
        table = id,
        old = %p.accepted.old,
        new = %new,
        rows = p.rows,
        took_ms = took.as_millis() as u64,
        "table swapped"
    );
    let _ = cx
        .notifier
        .status(&format!("table {id} swapped to {}", short(new)));
    Ok(())
}

/// A version no longer served: out of the fd store, unmapped, and RDMA's
/// registrations brought in line with the tables served now.
async fn retire(cx: &SwapContext, old: Option<ResidentTable>) {
    if let Some(t) = &old {
        cx.fd_store.forget_table(t);
    }
    drop(old);
    let sh = Arc::clone(&cx.shared);
    let _ = tokio::task::spawn_blocking(move || sh.sync_rdma()).await;
}

/// A swap in place: the old version unloaded first (and deregistered
/// from RDMA), so both never take memory at once; the table is not served
/// until the new version is loaded.
async fn unload_for_in_place(cx: &SwapContext, p: &Prepared, si: Option<usize>) {
    let id = p.req.table;
    let old = {
        let mut tables = cx.shared.tables_mut();
        tables
            .iter()
            .position(|t| t.id == id)
            .map(|i| tables.remove(i))
    };
    // Unmapped here, outside the lock (and deregistered from RDMA, whose
    // registration holds the rows mapped until then).
    retire(cx, old).await;
    if let Some(i) = si {
        cx.status.tables[i].replaced(
            p.req.path.clone(),
            p.rows,
            p.accepted.new,
            LoadState::Loading,
        );
    }
    tracing::warn!(
        table = id,
        "swap in place: table unloaded; not served until the new version is loaded"
    );
}

fn short(d: TableDigest) -> String {
    d.to_hex().chars().take(12).collect()
}

fn failed(cx: &SwapContext, p: &Prepared, si: Option<usize>, why: String) -> SwapError {
    let msg = format!(
        "swap of table {} to {} from {} failed: {why}",
        p.req.table,
        p.accepted.new,
        p.req.path.display()
    );
    if let Some(i) = si {
        if p.req.in_place {
            cx.status.tables[i].failed(msg.clone());
        } else {
            cx.status.tables[i].note_error(msg.clone());
        }
    }
    if p.req.in_place {
        tracing::error!(table = p.req.table, "{msg}; the table is NOT served now");
    } else {
        tracing::error!(
            table = p.req.table,
            "{msg}; the old version is still served"
        );
    }
    let _ = cx.notifier.status(&msg);
    SwapError::Load(why)
}

/// Load the new version (blocking), with its progress in the log, in
/// systemd's status line, and (in place) in the table's load state.
fn load(cx: &SwapContext, p: &Prepared, si: Option<usize>) -> Result<ResidentTable, String> {
    let id = p.req.table;
    let pin = ExpectedTable {
        digest: p.accepted.new,
        layer: p.layer,
        rows: p.rows,
    };
    let (status, notifier, in_place) = (
        Arc::clone(&cx.status),
        Arc::clone(&cx.notifier),
        p.req.in_place,
    );
    let progress = move |f: &TableFile| {
        let total = f.meta.rows;
        let mut last_pct = u64::MAX;
        Some(
            Progress::log(
                format!("swap: loading {}", p.req.path.display()),
                total,
                f.row_bytes() as u64,
            )
            .with_tap(move |done| {
                if in_place && let Some(i) = si {
                    status.tables[i].progress(done, total);
                }
                let pct = done * 100 / total.max(1);
                if pct != last_pct {
                    last_pct = pct;
                    let _ = notifier.status(&format!("swapping table {id}: {pct}%"));
                }
            }),
        )
    };
    let opts = LoadOptions {
        pinned: Some(pin),
        trust_digest: cx.trust_digest,
        mlock: cx.mlock,
        backing: crate::load::backing(cx.map_files, cx.host_shared, &cx.fd_store),
        threads: crate::load::load_threads(cx.load_threads),
        known_file: None,
        numa_node: cx.numa_node,
        rdma_view: crate::load::rdma_view(cx.serves_rdma),
        planar: cx.planar,
        background: Some(crate::load::BACKGROUND),
    };
    // The descriptor `prepare` checked: the name is not opened again.
    let file = p
        .file
        .try_clone()
        .map_err(|e| format!("{}: {e}", p.req.path.display()))?;
    let file = TableFile::from_file_any(file, &p.req.path).map_err(|e| e.to_string())?;
    let (table, _report) =
        ResidentTable::load_table(Some(id), file, &opts, progress).map_err(|e| e.to_string())?;
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_open_only_real_files_beneath_the_table_directories() {
        use std::io::Read;
        let root = tempfile::tempdir().expect("tempdir");
        let tables = root.path().join("tables");
        let other = root.path().join("other");
        std::fs::create_dir_all(tables.join("sub")).expect("mkdir");
        std::fs::create_dir_all(&other).expect("mkdir");
        let inside = tables.join("v2.etab");
        let outside = other.join("v2.etab");
        std::fs::write(&inside, b"inside").expect("write");
        std::fs::write(tables.join("sub/v3.etab"), b"sub").expect("write");
        std::fs::write(&outside, b"outside").expect("write");
        let dirs = vec![tables.clone()];
        let read = |mut f: File| {
            let mut s = String::new();
            f.read_to_string(&mut s).expect("read");
            s
        };

        assert_eq!(read(confine(&inside, &dirs).expect("inside")), "inside");
        assert_eq!(
            read(confine(&tables.join("sub/v3.etab"), &dirs).expect("below")),
            "sub"
        );
        let not_allowed = |p: &Path| match confine(p, &dirs) {
            Err(SwapError::NotAllowed(m)) => m,
            other => panic!("{}: {other:?}", p.display()),
        };
        let m = not_allowed(&outside);
        assert!(m.contains("outside the donor's table directories"), "{m}");
        assert!(m.contains(&tables.display().to_string()), "{m}");
        // `..` is refused even when it would land inside.
        let m = not_allowed(&tables.join("../tables/v2.etab"));
        assert!(m.contains("`..`"), "{m}");
        assert!(not_allowed(&tables.join("../other/v2.etab")).contains("`..`"));
        assert!(not_allowed(Path::new("tables/v2.etab")).contains("absolute"));
        // A symlink below the directory is refused, wherever it points, and
        // the error does not say where.
        let link = tables.join("escape.etab");
        std::os::unix::fs::symlink(&outside, &link).expect("symlink");
        let m = not_allowed(&link);
        assert!(m.contains("no symbolic link"), "{m}");
        assert!(!m.contains(&other.display().to_string()), "{m}");
        let inner = tables.join("inner.etab");
        std::os::unix::fs::symlink(&inside, &inner).expect("symlink");
        assert!(not_allowed(&inner).contains("no symbolic link"));
        let dir_link = tables.join("elsewhere");
        std::os::unix::fs::symlink(&other, &dir_link).expect("symlink");
        assert!(not_allowed(&dir_link.join("v2.etab")).contains("no symbolic link"));
        // A symlinked table directory is the operator's: names through it,
        // or through where it resolves to, both open the file.
        let via = root.path().join("via");
        std::os::unix::fs::symlink(&tables, &via).expect("symlink");
        let via_dirs = std::slice::from_ref(&via);
        assert_eq!(
            read(confine(&via.join("v2.etab"), via_dirs).expect("via")),
            "inside"
        );
        assert_eq!(
            read(confine(&inside, via_dirs).expect("resolved")),
            "inside"
        );
        // The directory itself is not a file in it; a prefix of a name is not a parent.
        assert!(matches!(
            confine(&tables, &dirs),
            Err(SwapError::NotAllowed(_))
        ));
        let sibling = root.path().join("tables2");
        std::fs::create_dir_all(&sibling).expect("mkdir");
        std::fs::write(sibling.join("v2.etab"), b"x").expect("write");
        assert!(matches!(
            confine(&sibling.join("v2.etab"), &dirs),
            Err(SwapError::NotAllowed(_))
        ));
        // A missing file is a bad file, not a permission problem.
        assert!(matches!(
            confine(&tables.join("missing.etab"), &dirs),
            Err(SwapError::BadFile(_))
        ));
        // No directories: nothing may be loaded.
        assert!(matches!(
            confine(&inside, &[]),
            Err(SwapError::NotAllowed(_))
        ));
        // A FIFO opens at once (non-blocking), and is then refused as no
        // regular file, by the same descriptor.
        let fifo = tables.join("fifo.etab");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("cstr");
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let f = confine(&fifo, &dirs).expect("opens without a writer");
        let e = TableFile::from_file(f, &fifo).expect_err("refused");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
