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
//! What it is not: a cache on disk. Outside systemd (no `NOTIFY_SOCKET`),
//! with `fd_store = false`, or where the unit gives no store
//! (`FileDescriptorStoreMax=0`: systemd then ignores the request), every
//! start is a normal load.

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd};
use std::sync::{Arc, Mutex};

use cluster_config::daemon::notify::Notifier;
use engram_store::kept;
use engram_store::resident::{Backing, ExpectedTable, ResidentTable};

/// The fd-store names the donor uses start with this.
const PREFIX: &str = "etab-";

/// The donor's side of systemd's fd store.
#[derive(Debug)]
pub struct FdStore {
    notifier: Arc<Notifier>,
    enabled: bool,
    /// Descriptors systemd handed this process, not yet adopted.
    handed: Mutex<Vec<(String, File)>>,
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
                let file = unsafe { File::from_raw_fd(fd) };
                if name.starts_with(PREFIX) {
                    handed.push((name, file));
                } else {
                    tracing::warn!(fd, name = %name, "fd store: a descriptor not named by this donor; closed");
                }
            }
        }
        let enabled = wanted && notifier.is_enabled();
        if !handed.is_empty() {
            tracing::info!(
                count = handed.len(),
                "fd store: systemd handed back {} table copies",
                handed.len()
            );
        }
        Self {
            notifier,
            enabled,
            handed: Mutex::new(handed),
        }
    }

    /// True when a copy may be taken: the store is on and systemd handed
    /// something back (otherwise there is nothing to look up).
    pub fn may_hold(&self) -> bool {
        self.enabled && self.handed.lock().is_ok_and(|h| !h.is_empty())
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
    /// off: the handed copies are then released).
    pub fn take(&self, id: u32, expected: &ExpectedTable, verified: bool) -> Option<ResidentTable> {
        if !self.enabled {
            return None;
        }
        let want = kept::name(id, &expected.digest);
        let mine: Vec<File> = {
            let mut handed = self.handed.lock().ok()?;
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
            match ResidentTable::adopt(id, file, expected) {
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

    /// Hand table `t`'s memfd to the store (nothing when it has none or the
    /// store is off).
    pub fn keep(&self, t: &ResidentTable) {
        let Some(k) = t.kept() else { return };
        if !self.enabled {
            return;
        }
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

    /// Remove the copies named `name` from the store.
    pub fn forget(&self, name: &str) {
        if !self.notifier.is_enabled() {
            return;
        }
        if let Err(e) = self.notifier.remove_fds(name) {
            tracing::warn!(name = %name, "fd store: {e}");
        }
    }

    /// Remove the copy of table `t` (a version no longer served).
    pub fn forget_table(&self, t: &ResidentTable) {
        if t.kept().is_some() {
            self.forget(&kept::name(t.id, &t.digest));
        }
    }

    /// After start: close every handed copy that no table took (another
    /// version, a table no longer served, a refused copy) and remove it
    /// from the store.
    pub fn release_rest(&self) {
        let rest: Vec<(String, File)> = match self.handed.lock() {
            Ok(mut h) => h.drain(..).collect(),
            Err(_) => return,
        };
        let mut names: Vec<String> = rest.into_iter().map(|(n, _)| n).collect();
        names.sort();
        names.dedup();
        for name in names {
            tracing::info!(name = %name, "fd store: copy of a version not served now; released");
            self.forget(&name);
        }
    }
}
