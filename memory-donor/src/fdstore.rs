//! Tables that survive the donor's own restarts: each table is loaded
//! into a memfd (`engram_store::kept`) that is handed to systemd's file
//! descriptor store (`FDSTORE=1`, `FDNAME=etab-ID-DIGEST16`). When the
//! service restarts (a crash, kill -9, an upgrade with `systemctl
//! restart`), systemd passes the descriptors back (`LISTEN_FDS`,
//! `LISTEN_FDNAMES`) and the donor serves each table that is the version
//! it is configured for at once, without reading its file; a copy of any
//! other version, or one whose load never finished, is closed and removed
//! from the store.
//!
//! A table served from its file's pages (`map_files`) has no copy to
//! keep: the donor keeps a read-only descriptor of the file instead, under
//! a name that carries the [`FileMark`] (`etab-ID-DIGEST16-file-SEC.NSEC-v`:
//! the file's change time once leased, and `v` when its rows were hashed,
//! `t` when trusted). A restart that finds the configured path to be that
//! file at that change time, and takes its lease again, serves its pages
//! at once without reading or hashing them; any write or truncation since
//! (or any other change of the file) moved the change time on, and the
//! file is read and hashed as on a first start.
//!
//! What it is not: a cache on disk. Outside systemd (no `NOTIFY_SOCKET`),
//! with `fd_store = false`, or where the unit gives no store
//! (`FileDescriptorStoreMax=0`: systemd then ignores the request), every
//! start is a normal load.

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd};
use std::sync::Arc;

use daemon_runtime::notify::Notifier;
use engram_protocol::TableDigest;
use engram_store::kept;
use engram_store::kept_checks::{self, KeptChecks};
use engram_store::resident::{Backing, ExpectedTable, FileMark, ResidentTable};
use engram_store::resume::KeptCopies;
use engram_sync::Mutex;

/// The fd-store names the donor uses start with this.
const PREFIX: &str = "etab-";

/// The donor's side of systemd's fd store.
#[derive(Debug)]
pub struct FdStore {
    notifier: Arc<Notifier>,
    enabled: bool,
    /// Descriptors systemd handed this process, not yet adopted.
    handed: Mutex<Vec<(String, File)>>,
    /// Tables' RDMA check words systemd handed back, kept apart: RDMA is
    /// set up after the tables are served (and the rest released).
    checks: Mutex<Vec<(String, File)>>,
}

impl FdStore {
    /// From the environment: the descriptors systemd passed (when
    /// `LISTEN_PID` is this process), and whether to keep tables in the
    /// store (`wanted`, and notifications go to systemd).
    pub fn from_env(notifier: Arc<Notifier>, wanted: bool) -> Self {
        let mut handed = Vec::new();
        if let Ok(fds) = sd_notify::listen_fds_with_names() {
            for (fd, name) in fds {
                // SAFETY: systemd passed these descriptors to this process
                // (LISTEN_PID matched); nothing else in it owns them.
                handed.push((name, unsafe { File::from_raw_fd(fd) }));
            }
        }
        Self::with_handed(notifier, wanted, handed)
    }

    /// The store with `handed` as the descriptors systemd passed back (by
    /// name): [`FdStore::from_env`]'s, or a test's.
    pub fn with_handed(notifier: Arc<Notifier>, wanted: bool, handed: Vec<(String, File)>) -> Self {
        let (mut tables, mut checks) = (Vec::new(), Vec::new());
        for (name, file) in handed {
            if name.starts_with(PREFIX) && name.ends_with(CHECKS_TAG) {
                checks.push((name, file));
            } else if name.starts_with(PREFIX) {
                tables.push((name, file));
            } else {
                tracing::warn!(name = %name, "fd store: a descriptor not named by this donor; closed");
            }
        }
        let enabled = wanted && notifier.is_enabled();
        if !tables.is_empty() {
            tracing::info!(
                count = tables.len(),
                "fd store: systemd handed back {} table copies",
                tables.len()
            );
        }
        Self {
            notifier,
            enabled,
            handed: Mutex::new(tables),
            checks: Mutex::new(checks),
        }
    }

    /// True when tables (and check words) are kept for the next start.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The RDMA check words of table `id` at `digest` (`rows` rows) a
    /// previous process kept, when complete and intact (others under that
    /// name are removed from the store).
    pub fn take_checks(&self, id: u32, rows: u64, digest: &TableDigest) -> Option<KeptChecks> {
        if !self.enabled {
            return None;
        }
        let want = kept_checks::name(id, digest);
        let mine: Vec<File> = {
            let mut all = self.checks.lock();
            let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(n, _)| *n == want);
            *all = rest;
            mine.into_iter().map(|(_, f)| f).collect()
        };
        let mut taken = None;
        for file in mine {
            if taken.is_some() {
                continue;
            }
            match KeptChecks::open(file, id, rows, digest) {
                Ok(k) => taken = Some(k),
                Err(e) => {
                    tracing::warn!(table = id, name = %want, "fd store: check words refused: {e}; computed again")
                }
            }
        }
        if taken.is_none() {
            self.forget(&want);
        }
        taken
    }

    /// Hand table `id`'s check words at `digest` to the store.
    pub fn keep_checks(&self, id: u32, digest: &TableDigest, checks: &KeptChecks) {
        if !self.enabled {
            return;
        }
        let name = kept_checks::name(id, digest);
        match self.notifier.store_fd(&name, checks.file().as_fd()) {
            Ok(()) => {
                tracing::info!(table = id, name = %name, "fd store: RDMA check words kept for the next start")
            }
            Err(e) => tracing::warn!(
                table = id,
                "fd store: {e}; the next start computes this table's check words again"
            ),
        }
    }

    /// Close the check words no table took (versions not served now, or
    /// a donor without RDMA now) and remove them from the store.
    pub fn release_checks(&self) {
        let rest: Vec<String> = self.checks.lock().drain(..).map(|(n, _)| n).collect();
        for name in rest {
            tracing::info!(name = %name, "fd store: check words not used now; released");
            self.forget(&name);
        }
    }

    /// True when a copy may be taken: the store is on and systemd handed
    /// something back (otherwise there is nothing to look up).
    pub fn may_hold(&self) -> bool {
        self.enabled && !self.handed.lock().is_empty()
    }

    /// Where a table loaded now should live.
    pub fn backing(&self) -> Backing {
        if self.enabled {
            Backing::Memfd
        } else {
            Backing::Anonymous
        }
    }

    /// The copy of table `id` at exactly `expected`, if systemd handed one
    /// back that is complete and intact, and whose digest was verified when
    /// it was loaded if `verified` asks for that (never when the store is
    /// off: the handed copies are then released); with `rdma_view`, with
    /// its writable view for RDMA where it can have one.
    pub fn take(
        &self,
        id: u32,
        expected: &ExpectedTable,
        verified: bool,
        rdma_view: bool,
    ) -> Option<ResidentTable> {
        if !self.enabled {
            return None;
        }
        let want = kept::name(id, &expected.digest);
        let mine: Vec<File> = {
            let mut handed = self.handed.lock();
            let (mine, rest): (Vec<_>, Vec<_>) =
                handed.drain(..).partition(|(name, _)| *name == want);
            *handed = rest;
            mine.into_iter().map(|(_, f)| f).collect()
        };
        let (any, several) = (!mine.is_empty(), mine.len() > 1);
        let mut adopted = None;
        for file in mine {
            if adopted.is_some() {
                continue;
            }
            match ResidentTable::adopt(id, file, expected, rdma_view) {
                Ok(t) if verified && !t.kept().is_some_and(|k| k.record.verified) => {
                    tracing::warn!(
                        table = id,
                        name = %want,
                        "fd store: copy refused: it was loaded with --trust-digest (its digest was never checked) and this donor checks digests"
                    );
                }
                Ok(t) => adopted = Some(t),
                Err(e) => tracing::warn!(table = id, name = %want, "fd store: copy refused: {e}"),
            }
        }
        if several || (any && adopted.is_none()) {
            // Removing a name removes every descriptor under it: the
            // adopted one is stored again.
            self.forget(&want);
            if let Some(t) = &adopted {
                self.keep(t);
            }
        }
        adopted
    }

    /// The mark the previous process left for table `id` served from its
    /// file's pages at `expected`'s version, with its name in the store:
    /// when the descriptor it kept is still the file at the marked change
    /// time, and (for a donor that checks digests, `verified`) its rows
    /// were hashed. The mark's device and inode are the kept file's, so a
    /// load of another file at the configured path does not match. Marks
    /// that do not count are removed from the store.
    pub fn take_file(
        &self,
        id: u32,
        expected: &ExpectedTable,
        verified: bool,
    ) -> Option<(FileMark, String)> {
        if !self.enabled {
            return None;
        }
        let prefix = format!("{}{FILE_TAG}", kept::name(id, &expected.digest));
        let mut mine: Vec<(String, File)> = {
            let mut handed = self.handed.lock();
            let (mine, rest): (Vec<_>, Vec<_>) = handed
                .drain(..)
                .partition(|(name, _)| name.starts_with(&prefix));
            *handed = rest;
            mine
        };
        let found = match mine.len() {
            1 => mine.pop(),
            _ => None,
        };
        let forget_all = |mine: &[(String, File)]| {
            for (name, _) in mine {
                self.forget(name);
            }
        };
        forget_all(&mine);
        let (name, file) = found?;
        let refuse = |why: &str| {
            tracing::info!(table = id, name = %name, "fd store: table file mark not used: {why}; the file is read again");
            self.forget(&name);
            None
        };
        let Some(marked) = parse_mark(&name[prefix.len()..]) else {
            return refuse("not a mark this donor writes");
        };
        let now = match FileMark::of(&file, marked.verified) {
            Ok(m) => m,
            Err(e) => return refuse(&format!("cannot stat the kept file: {e}")),
        };
        if (now.ctime_sec, now.ctime_nsec) != (marked.ctime_sec, marked.ctime_nsec) {
            return refuse("the file changed since it was loaded");
        }
        if verified && !marked.verified {
            return refuse(
                "it was loaded with --trust-digest (its rows were never hashed) and this donor checks digests",
            );
        }
        Some((now, name))
    }

    /// Hand table `t`'s memfd to the store, or for a table served from its
    /// file's pages a read-only descriptor of the file under its mark
    /// (nothing when it has neither or the store is off).
    pub fn keep(&self, t: &ResidentTable) {
        if !self.enabled {
            return;
        }
        let Some(k) = t.kept() else {
            self.keep_file(t);
            return;
        };
        if k.pages == kept::Pages::Small {
            tracing::warn!(
                table = t.id,
                "table memory is in 4 KiB pages: shared memory gets no transparent huge pages \
                 here (shmem_enabled=never), and random row reads are slower (45% measured); \
                 install systemd/tmpfiles.d/engram-rack.conf (it sets shmem_enabled=advise) \
                 or reserve huge pages (vm.nr_hugepages), or set fd_store = false"
            );
        }
        let name = k.record.name();
        match self.notifier.store_fd(&name, k.file.as_fd()) {
            Ok(()) => tracing::info!(
                table = t.id,
                name = %name,
                generation = k.record.generation,
                pages = k.pages.name(),
                "fd store: table kept for the next start"
            ),
            Err(e) => tracing::warn!(
                table = t.id,
                "fd store: {e}; the next start loads this table from its file"
            ),
        }
    }

    /// Keep a read-only descriptor of the file table `t` is served from,
    /// named by its mark. A descriptor of its own, opened again through
    /// `/proc/self/fd` (not a duplicate of the one holding the read lease,
    /// which would then outlive this process in systemd's hands).
    fn keep_file(&self, t: &ResidentTable) {
        use std::os::fd::AsRawFd;
        let (Some(mark), memory) = (t.file_mark(), t.memory()) else {
            return;
        };
        let Some(leased) = memory.file() else { return };
        let name = file_name(t.id, &t.digest, &mark);
        let reopened = File::open(format!("/proc/self/fd/{}", leased.as_raw_fd()));
        let result = reopened
            .map_err(|e| format!("cannot open the table file again: {e}"))
            .and_then(|f| {
                self.notifier
                    .store_fd(&name, f.as_fd())
                    .map_err(|e| e.to_string())
            });
        match result {
            Ok(()) => tracing::info!(
                table = t.id,
                name = %name,
                "fd store: table file kept for the next start (its pages are served again without being read while it is unchanged)"
            ),
            Err(e) => tracing::warn!(
                table = t.id,
                "fd store: {e}; the next start reads and hashes this table's file again"
            ),
        }
    }

    /// Remove the copies named `name` from the store.
    pub fn forget(&self, name: &str) {
        self.forgetter(name.to_string())();
    }

    /// Something that removes the copies named `name` from the store when
    /// called, from any thread.
    pub fn forgetter(&self, name: String) -> impl FnOnce() + Send + 'static {
        let notifier = Arc::clone(&self.notifier);
        move || {
            if !notifier.is_enabled() {
                return;
            }
            if let Err(e) = notifier.remove_fds(&name) {
                tracing::warn!(name = %name, "fd store: {e}");
            }
        }
    }

    /// Remove the copy of table `t` (a version no longer served), or the
    /// descriptor of its file.
    pub fn forget_table(&self, t: &ResidentTable) {
        self.forget(&kept_checks::name(t.id, &t.digest));
        if t.kept().is_some() {
            self.forget(&kept::name(t.id, &t.digest));
        } else if let Some(mark) = t.file_mark() {
            self.forget(&file_name(t.id, &t.digest, &mark));
        }
    }

    /// After start: close every handed copy that no table took (another
    /// version, a table no longer served, a refused copy) and remove it
    /// from the store.
    pub fn release_rest(&self) {
        let rest: Vec<(String, File)> = self.handed.lock().drain(..).collect();
        let mut names: Vec<String> = rest.into_iter().map(|(n, _)| n).collect();
        names.sort();
        names.dedup();
        for name in names {
            tracing::info!(name = %name, "fd store: copy of a version not served now; released");
            self.forget(&name);
        }
    }
}

/// The start decision's view of the store (`engram_store::resume`).
impl KeptCopies for FdStore {
    fn may_hold(&self) -> bool {
        FdStore::may_hold(self)
    }

    fn take(
        &self,
        id: u32,
        expected: &ExpectedTable,
        verified: bool,
        rdma_view: bool,
    ) -> Option<ResidentTable> {
        FdStore::take(self, id, expected, verified, rdma_view)
    }

    fn take_file(
        &self,
        id: u32,
        expected: &ExpectedTable,
        verified: bool,
    ) -> Option<(FileMark, String)> {
        FdStore::take_file(self, id, expected, verified)
    }

    fn forget(&self, name: &str) {
        FdStore::forget(self, name);
    }

    /// The mark is removed from the store, so that the next start reads
    /// and verifies the file, and the donor exits with code 3, as when the
    /// file is opened for writing.
    fn file_changed(&self, name: String) -> Box<dyn FnOnce() + Send + 'static> {
        let forget = self.forgetter(name);
        Box::new(move || {
            tracing::error!(
                "a table's file changed on disk under its pages: its mark is removed from the fd store and the donor exits (the next start reads and verifies the file)"
            );
            forget();
            std::process::exit(3);
        })
    }
}

/// What ends the name of a table version's kept RDMA check words.
const CHECKS_TAG: &str = "-checks";

/// After a copy's name, what names a kept table file.
const FILE_TAG: &str = "-file-";

/// The store name of table `id`'s file at `digest`, marked `mark`.
pub fn file_name(id: u32, digest: &TableDigest, mark: &FileMark) -> String {
    format!(
        "{}{FILE_TAG}{}.{:09}-{}",
        kept::name(id, digest),
        mark.ctime_sec,
        mark.ctime_nsec,
        if mark.verified { "v" } else { "t" }
    )
}

/// The change time and the hashed flag of a mark (`SEC.NSEC-v` or `-t`);
/// the device and inode are left 0 (the kept descriptor gives them).
fn parse_mark(s: &str) -> Option<FileMark> {
    let (time, flag) = s.rsplit_once('-')?;
    let verified = match flag {
        "v" => true,
        "t" => false,
        _ => return None,
    };
    let (sec, nsec) = time.split_once('.')?;
    let ctime_nsec: i64 = nsec.parse().ok()?;
    if nsec.len() != 9 || !(0..1_000_000_000).contains(&ctime_nsec) {
        return None;
    }
    Some(FileMark {
        dev: 0,
        ino: 0,
        ctime_sec: sec.parse().ok()?,
        ctime_nsec,
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_mark_survives_its_name_and_a_bad_one_is_refused() {
        let digest = TableDigest([7; 32]);
        for (sec, nsec, verified) in [
            (1_764_000_000i64, 5i64, true),
            (0, 999_999_999, false),
            (-3, 0, true),
        ] {
            let mark = FileMark {
                dev: 0,
                ino: 0,
                ctime_sec: sec,
                ctime_nsec: nsec,
                verified,
            };
            let name = file_name(14, &digest, &mark);
            assert!(name.starts_with(&kept::name(14, &digest)), "{name}");
            assert!(name.len() <= 255 && !name.contains(':'), "{name}");
            let prefix = format!("{}{FILE_TAG}", kept::name(14, &digest));
            assert_eq!(parse_mark(&name[prefix.len()..]), Some(mark), "{name}");
        }
        for bad in [
            "",
            "1.5-v",
            "1.000000005-x",
            "1.000000005",
            "a.000000005-v",
            "1.1000000000-v",
            "1.-00000005-t",
        ] {
            assert_eq!(parse_mark(bad), None, "{bad:?}");
        }
    }
}
