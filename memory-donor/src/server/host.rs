//! The host socket (`unix://PATH`): processes on the donor's own host map
//! its tables' memory instead of asking for rows. A `SOCK_SEQPACKET` Unix
//! socket; each client is checked by `SO_PEERCRED` against the allowed
//! user and group ids, then sent one message per served table, each with a
//! read-only descriptor of the table's memfd (`SCM_RIGHTS`), sealed against
//! writes, shrinking and growing, so no process, the donor included, can
//! change a byte under a mapping or make it fault. A swap or reload sends
//! the new version's message; a table that stops being served is said to
//! be gone. The wire format is PROTOCOL.md section 5; the packets are
//! `daemon_runtime::hostsock`'s.
//!
//! One thread accepts; each client has a thread that sends what changed,
//! looking every [`WATCH`], until the client closes or the donor drains.
//! At most [`MAX_CLIENTS`] clients at once; more are refused.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use daemon_runtime::hostsock::{
    HOST_PROTOCOL, listen, peer_credentials, readable, reopen_read_only, send,
};
use engram_store::kept;
use serde_json::json;

use super::Shared;

/// How often a client's thread looks for changed tables.
const WATCH: Duration = Duration::from_millis(50);
/// Host clients at once.
pub const MAX_CLIENTS: usize = 64;
/// The longest a send to a client may wait (a client that stops reading).
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Who may connect (the peer's credentials).
pub use daemon_runtime::hostsock::Access as HostAccess;

/// What the host socket serves: where, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    /// The socket's path.
    pub path: PathBuf,
    /// Who may connect.
    pub access: HostAccess,
}

/// A bound host socket; the file is removed when it is dropped.
#[derive(Debug)]
pub struct HostListener {
    fd: OwnedFd,
    spec: HostSpec,
}

impl HostListener {
    /// Bind `spec.path` (a stale socket file left by an earlier process is
    /// replaced; any other file there is an error), readable and writable
    /// by its owner and group (0660).
    pub fn bind(spec: HostSpec) -> io::Result<Self> {
        let fd = listen(&spec.path)?;
        Ok(Self { fd, spec })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.spec.path
    }

    /// Accept and serve clients on a thread of its own until the donor
    /// drains.
    pub fn spawn(self, shared: Arc<Shared>) -> io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name("host-accept".into())
            .spawn(move || self.accept_loop(&shared))
    }

    fn accept_loop(&self, shared: &Arc<Shared>) {
        let open = Arc::new(AtomicUsize::new(0));
        while !shared.is_draining() {
            // Wake up now and then to see the drain.
            if !readable(self.fd.as_raw_fd(), WATCH) {
                continue;
            }
            // SAFETY: accept4 on our listening socket; no address wanted.
            let c = unsafe {
                libc::accept4(
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if c < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted && e.kind() != io::ErrorKind::WouldBlock {
                    tracing::warn!(error = %e, "host socket: accept failed");
                    std::thread::sleep(WATCH);
                }
                continue;
            }
            // SAFETY: accept4 returned a new descriptor only we own.
            let client = unsafe { OwnedFd::from_raw_fd(c) };
            // A client that stops reading ends its own thread, not the
            // donor's: sends wait at most this long.
            let limit = libc::timeval {
                tv_sec: SEND_TIMEOUT.as_secs() as libc::time_t,
                tv_usec: 0,
            };
            // SAFETY: setsockopt on our own socket with a timeval we own.
            unsafe {
                libc::setsockopt(
                    client.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_SNDTIMEO,
                    (&raw const limit).cast(),
                    size_of::<libc::timeval>() as libc::socklen_t,
                );
            }
            self.admit(client, shared, &open);
        }
    }

    /// Check a new client's credentials and start its thread, or refuse it.
    fn admit(&self, client: OwnedFd, shared: &Arc<Shared>, open: &Arc<AtomicUsize>) {
        let refuse = |client: &OwnedFd, reason: &'static str, why: &str| {
            shared.stats.refusal("host", reason);
            if let Some(suppressed) = super::CONN_WARN.allow() {
                tracing::warn!(socket = %self.spec.path.display(), reason, why, suppressed, "host socket: client refused");
            }
            let _ = send(
                client.as_raw_fd(),
                &json!({"engram_host": HOST_PROTOCOL, "refused": why}),
                None,
            );
        };
        let cred = match peer_credentials(client.as_raw_fd()) {
            Ok(c) => c,
            Err(e) => {
                refuse(&client, "no_credentials", &e.to_string());
                return;
            }
        };
        if !self.spec.access.allows(cred.uid, cred.gid) {
            let why = format!(
                "uid {} gid {} (pid {}) is not allowed on this donor's host socket (the donor's host_uids and host_gids)",
                cred.uid, cred.gid, cred.pid
            );
            refuse(&client, "peer_not_allowed", &why);
            return;
        }
        if open.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
            open.fetch_sub(1, Ordering::AcqRel);
            refuse(
                &client,
                "host_busy",
                &format!("the host socket is at its bound of {MAX_CLIENTS} clients"),
            );
            return;
        }
        tracing::info!(
            uid = cred.uid,
            gid = cred.gid,
            pid = cred.pid,
            "host socket: client admitted"
        );
        let (shared, open) = (Arc::clone(shared), Arc::clone(open));
        let spawned = std::thread::Builder::new()
            .name(format!("host-{}", cred.pid))
            .spawn(move || {
                if let Err(e) = serve_client(&client, &shared) {
                    tracing::debug!(pid = cred.pid, error = %e, "host socket: client ended");
                }
                open.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "host socket: cannot start a client thread");
        }
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.spec.path);
    }
}

/// What a client was last told of one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Told {
    table: u32,
    digest: engram_protocol::TableDigest,
    generation: Option<u64>,
}

/// A table's memory as handed to a client.
#[derive(Debug)]
struct Shareable {
    /// A read-only open of the memfd.
    file: File,
    bytes: u64,
    layer: u32,
    rows: u64,
    layout: kept::KeptLayout,
}

/// The tables served now, as the client would be told of them, with a
/// read-only descriptor for each shared one it was not told of yet (a
/// descriptor opened under the tables' lock: a swap cannot close the
/// memfd in between).
fn snapshot(shared: &Shared, told: &[Told]) -> io::Result<Vec<(Told, Option<Shareable>)>> {
    let tables = shared.tables();
    let mut out = Vec::with_capacity(tables.len());
    for t in tables.iter() {
        let now = Told {
            table: t.id,
            digest: t.digest,
            generation: t.kept().map(|k| k.record.generation),
        };
        let copy = match t.kept() {
            Some(k) if !told.contains(&now) && kept::seal_for_sharing(&k.file) => Some(Shareable {
                file: reopen_read_only(&k.file)?,
                bytes: k.file.metadata()?.len(),
                layer: t.layer,
                rows: t.rows,
                layout: k.record.layout,
            }),
            _ => None,
        };
        out.push((now, copy));
    }
    Ok(out)
}

/// The message that hands over table `t`'s memory `c`: where its rows
/// lie (a planar table says where its scales start).
fn table_message(t: &Told, c: &Shareable, digest: &str) -> serde_json::Value {
    let mut m = json!({
        "table": t.table,
        "layer": c.layer,
        "rows": c.rows,
        "digest": digest,
        "generation": t.generation.unwrap_or_default(),
        "layout": c.layout.name(),
        "bytes": c.bytes,
    });
    match c.layout {
        kept::KeptLayout::Planar => {
            m["values_at"] = json!(0);
            m["scales_at"] = json!(kept::planar_scales_at(c.rows).unwrap_or_default());
        }
        // Rows of another encoding: packed at their own size, which a
        // client of V4.1's rows alone refuses (the record names it too).
        kept::KeptLayout::Encoded { encoding, .. } => {
            m["encoding"] = json!(encoding.name());
            m["row_bytes"] = json!(encoding.row_bytes());
        }
        kept::KeptLayout::Packed => {}
    }
    m
}

/// Send the client what changed since `told`, until it closes or the
/// donor drains.
fn serve_client(client: &OwnedFd, shared: &Shared) -> io::Result<()> {
    let fd = client.as_raw_fd();
    send(
        fd,
        &json!({"engram_host": HOST_PROTOCOL, "donor": shared.config().name}),
        None,
    )?;
    let mut told: Vec<Told> = Vec::new();
    let mut synced = false;
    loop {
        let now = snapshot(shared, &told)?;
        for (t, copy) in &now {
            if told.contains(t) {
                continue;
            }
            let digest = t.digest.to_string();
            match copy {
                Some(c) => send(fd, &table_message(t, c, &digest), Some(c.file.as_raw_fd()))?,
                None => send(
                    fd,
                    &json!({
                        "table": t.table,
                        "digest": digest,
                        "unshared": "not in a sealed memfd (map_files, or a copy that could not be sealed): ask the donor over the network",
                    }),
                    None,
                )?,
            }
        }
        for t in &told {
            if !now.iter().any(|(n, _)| n.table == t.table) {
                send(fd, &json!({"table": t.table, "gone": true}), None)?;
            }
        }
        told = now.into_iter().map(|(t, _)| t).collect();
        if !synced {
            send(fd, &json!({"synced": true}), None)?;
            synced = true;
        }
        if shared.is_draining() {
            return Ok(());
        }
        // The client sends nothing: readable means it closed (or broke
        // the protocol, which ends it too).
        if readable(fd, WATCH) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_is_by_user_or_group_and_defaults_to_the_donors_own() {
        // SAFETY: getuid and getgid cannot fail.
        let (me, group) = unsafe { (libc::getuid(), libc::getgid()) };
        let default = HostAccess::default();
        assert!(default.allows(me, 12_345));
        assert!(default.allows(54_321, group));
        assert!(!default.allows(me.wrapping_add(1), group.wrapping_add(1)));
        let listed = HostAccess {
            uids: vec![1000],
            gids: vec![2000],
        };
        assert!(listed.allows(1000, 1));
        assert!(listed.allows(1, 2000));
        assert!(!listed.allows(me.wrapping_add(1_000_000), group.wrapping_add(1_000_000)));
    }
}
