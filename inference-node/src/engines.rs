//! The engine socket: one rack client per host, shared by every engine
//! process on it (each GPU rank of vLLM or SGLang), instead of one client
//! per rank. `inference-node engines` opens the node's Engram memory once
//! (one connection and one breaker per donor, one SSD copy, one set of
//! probes) and serves a `SOCK_SEQPACKET` Unix socket (PROTOCOL.md
//! section 6):
//!
//! - to each engine it hands, per table, the host-local donor's table
//!   memory when there is one (a read-only memfd, as the donor's own host
//!   socket does; planar when the donor lays it out for engines; an
//!   encoded table's rows back to back at its row size), or says the
//!   table is remote;
//! - it takes the engine's rings (memfds the engine made and registered
//!   with its GPU) and serves them all on one thread ([`RingHub`]): V4.1's
//!   rings of 264-byte rows, or, on a rack of another model family
//!   ([`EngineMemory::Tables`]), rings of its tables' own row size;
//! - when the engine closes the socket, its rings stop being served.
//!
//! Every engine is checked by its credentials (`SO_PEERCRED`) against the
//! allowed users and groups; at most [`MAX_ENGINES`] at once and
//! [`MAX_RINGS`] rings each. A ring's memory is checked before use
//! ([`RingMemory::open`]); a bad message gets a refusal, never a panic,
//! and does not touch other engines.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use daemon_runtime::hostsock::{
    MAX_MESSAGE, listen, peer_credentials, readable, recv, reopen_read_only, send,
};
use engram_store::resident::RowLayout;
use serde_json::json;

use crate::embed::{EmbeddedNode, NodeTables};
use crate::ring::{RingHandle, RingHub, RingMemory, RingOptions};

/// The engine protocol's version.
pub const ENGINE_PROTOCOL: u32 = 1;
/// Engines connected at once.
pub const MAX_ENGINES: usize = 64;
/// Rings one engine may have served at once.
pub const MAX_RINGS: usize = 8;
/// How often threads look for the stop flag.
const WATCH: Duration = Duration::from_millis(50);
/// Tables an engine is told of at most (before `synced`).
pub const MAX_TABLES: usize = 64;

/// What an engine socket serves: V4.1's memory (host-local tables handed
/// over, remote ones through the engines' rings), or a node's tables of any
/// family (host-local ones handed over, every one through rings of its row
/// size).
pub use crate::embed::NodeMemory as EngineMemory;

/// Who may connect (the peer's credentials).
pub use daemon_runtime::hostsock::Access as EngineAccess;

/// A bound engine socket; the file goes when it is dropped.
#[derive(Debug)]
pub struct EngineListener {
    fd: OwnedFd,
    path: PathBuf,
    access: EngineAccess,
    ring: RingOptions,
}

impl EngineListener {
    /// Bind `path` (a stale socket there is replaced; any other file is an
    /// error), mode 0660.
    pub fn bind(path: &Path, access: EngineAccess, ring: RingOptions) -> io::Result<Self> {
        Ok(Self {
            fd: listen(path)?,
            path: path.to_path_buf(),
            access,
            ring,
        })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serve engines until `stop` is set: every engine's rings on one
    /// thread (one [`RingHub`]). `alive` is called every [`WATCH`] while
    /// that thread keeps making passes (a watchdog's ping).
    pub fn run(
        &self,
        mem: &EngineMemory,
        stop: &Arc<AtomicBool>,
        alive: &dyn Fn(),
    ) -> io::Result<()> {
        let hub = Arc::new(RingHub::start(mem.clone(), self.ring).map_err(io::Error::other)?);
        let open = Arc::new(AtomicUsize::new(0));
        while !stop.load(Ordering::Relaxed) {
            if hub.alive(Duration::from_secs(1)) {
                alive();
            }
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
                continue;
            }
            // SAFETY: a new descriptor only we own.
            let client = unsafe { OwnedFd::from_raw_fd(c) };
            self.admit(client, (mem, &hub), stop, &open);
        }
        Ok(())
    }

    /// Check a new engine and start its thread, or refuse it.
    fn admit(
        &self,
        client: OwnedFd,
        (mem, hub): (&EngineMemory, &Arc<RingHub>),
        stop: &Arc<AtomicBool>,
        open: &Arc<AtomicUsize>,
    ) {
        let refuse = |why: String| {
            tracing::warn!(socket = %self.path.display(), why, "engine socket: refused");
            let _ = send(
                client.as_raw_fd(),
                &json!({"engram_engine": ENGINE_PROTOCOL, "refused": why}),
                None,
            );
        };
        let cred = match peer_credentials(client.as_raw_fd()) {
            Ok(c) => c,
            Err(e) => return refuse(format!("no credentials: {e}")),
        };
        if !self.access.allows(cred.uid, cred.gid) {
            return refuse(format!(
                "uid {} gid {} (pid {}) may not use this engine socket",
                cred.uid, cred.gid, cred.pid
            ));
        }
        if open.fetch_add(1, Ordering::AcqRel) >= MAX_ENGINES {
            open.fetch_sub(1, Ordering::AcqRel);
            return refuse(format!(
                "the engine socket is at its bound of {MAX_ENGINES} engines"
            ));
        }
        tracing::info!(
            pid = cred.pid,
            uid = cred.uid,
            "engine socket: engine attached"
        );
        let (mem, stop, count) = (mem.clone(), Arc::clone(stop), Arc::clone(open));
        let (hub, ring) = (Arc::clone(hub), self.ring);
        let spawned = std::thread::Builder::new()
            .name(format!("engine-{}", cred.pid))
            .spawn(move || {
                if let Err(e) = serve_engine(&client, (&mem, &hub), ring, &stop) {
                    tracing::debug!(pid = cred.pid, error = %e, "engine socket: engine ended");
                }
                tracing::info!(pid = cred.pid, "engine socket: engine detached");
                count.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "engine socket: cannot start an engine thread");
            open.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for EngineListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Tell the engine what the node has, then serve its rings until it
/// closes the socket or the node stops.
fn serve_engine(
    client: &OwnedFd,
    (mem, hub): (&EngineMemory, &RingHub),
    ring: RingOptions,
    stop: &AtomicBool,
) -> io::Result<()> {
    let fd = client.as_raw_fd();
    match mem {
        EngineMemory::V41(m) => hello(fd, m, ring)?,
        EngineMemory::Tables(t) => hello_tables(fd, t, ring)?,
    }
    let mut rings: Vec<RingHandle> = Vec::new();
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    while !stop.load(Ordering::Relaxed) {
        if !readable(fd, WATCH) {
            continue;
        }
        let (n, file) = recv(fd, &mut buf)?;
        if n == 0 {
            return Ok(()); // The engine closed.
        }
        let reply = match parse(&buf[..n]) {
            Some(m) if m.get("ring").is_some() => attach(hub, file, &mut rings),
            _ => {
                json!({"refused": "a message this node does not know (it takes {\"ring\": ...} with a memfd)"})
            }
        };
        send(fd, &reply, None)?;
    }
    Ok(())
}

fn parse(b: &[u8]) -> Option<serde_json::Value> {
    if b.len() > MAX_MESSAGE {
        return None;
    }
    serde_json::from_slice(b).ok()
}

/// The first messages: the node, then one per Engram layer (its memory
/// with a descriptor when a host-local donor's is mapped here, else
/// "remote"), then `synced`.
fn hello(fd: i32, mem: &EmbeddedNode, ring: RingOptions) -> io::Result<()> {
    let (tables, rows) = match (mem.tables(), mem.table_rows()) {
        (Ok(t), Ok(r)) => (t, r),
        _ => return Err(io::Error::other("the node's memory is closed")),
    };
    send(
        fd,
        &json!({
            "engram_engine": ENGINE_PROTOCOL,
            "node": mem.node(),
            "layers": mem.layers(),
            "tables": tables,
            "rows": rows,
            "ring_deadline_ns": ring.deadline.as_nanos() as u64,
            "pid": std::process::id(),
        }),
        None,
    )?;
    for (i, layer) in mem.layers().into_iter().enumerate() {
        let shared = mem
            .table_view(layer, Duration::from_secs(2))
            .ok()
            .filter(|v| v.shared());
        let memory = shared.as_ref().and_then(|v| v.file().map(|f| (v, f)));
        match memory.map(|(v, f)| (v, reopen_read_only(f))) {
            Some((v, Ok(file))) => send(fd, &table_message(v), Some(file.as_raw_fd()))?,
            _ => send(
                fd,
                &json!({"table": tables[i], "layer": layer, "remote": true}),
                None,
            )?,
        }
    }
    send(fd, &json!({"synced": true}), None)
}

/// The first messages for a node's tables of any family: the node (with
/// its family), then one per routed table (its memory with a descriptor
/// when a host-local donor's is mapped here, else "remote", with its
/// encoding either way), then `synced`.
fn hello_tables(fd: i32, t: &NodeTables, ring: RingOptions) -> io::Result<()> {
    let closed = |_| io::Error::other("the node's tables are closed");
    let (family, info) = (t.family().map_err(closed)?, t.tables().map_err(closed)?);
    send(
        fd,
        &json!({
            "engram_engine": ENGINE_PROTOCOL,
            "node": t.node(),
            "family": family.name(),
            "layers": info.iter().map(|i| i.layer).collect::<Vec<_>>(),
            "tables": info.iter().map(|i| i.table).collect::<Vec<_>>(),
            "rows": info.iter().map(|i| i.rows).collect::<Vec<_>>(),
            "ring_deadline_ns": ring.deadline.as_nanos() as u64,
            "pid": std::process::id(),
        }),
        None,
    )?;
    for i in info.iter().take(MAX_TABLES) {
        let shared = t
            .table_view(i.table, Duration::from_secs(2))
            .ok()
            .filter(|v| v.shared());
        let memory = shared.as_ref().and_then(|v| v.file().map(|f| (v, f)));
        match memory.map(|(v, f)| (v, reopen_read_only(f))) {
            Some((v, Ok(file))) => send(fd, &table_message(v), Some(file.as_raw_fd()))?,
            _ => {
                let mut m = json!({
                    "table": i.table,
                    "layer": i.layer,
                    "rows": i.rows,
                    "remote": true,
                    "encoding": i.encoding.name(),
                    "row_bytes": i.row_bytes,
                });
                if let Some(s) = i.tensor_scale {
                    m["tensor_scale"] = json!(s);
                }
                send(fd, &m, None)?
            }
        }
    }
    send(fd, &json!({"synced": true}), None)
}

/// What an engine is told of a host-local table's memory.
fn table_message(v: &crate::embed::TableView) -> serde_json::Value {
    let mut m = json!({
        "table": v.table(),
        "layer": v.layer(),
        "rows": v.rows(),
        "digest": v.digest().to_string(),
        "generation": v.generation().unwrap_or_default(),
        "bytes": v.bytes().len(),
        "layout": v.layout().name(),
        "encoding": v.encoding().name(),
        "row_bytes": v.row_bytes(),
    });
    if let Some(s) = v.tensor_scale() {
        m["tensor_scale"] = json!(s);
    }
    if let RowLayout::Planar { scales_at } = v.layout() {
        m["values_at"] = json!(0);
        m["scales_at"] = json!(scales_at);
    }
    m
}

/// Take a ring: check its memory and serve it.
fn attach(hub: &RingHub, file: Option<File>, rings: &mut Vec<RingHandle>) -> serde_json::Value {
    let refused = |why: String| json!({"ring": "refused", "why": why});
    if rings.len() >= MAX_RINGS {
        return refused(format!(
            "an engine may have {MAX_RINGS} rings served at once"
        ));
    }
    let Some(file) = file else {
        return refused("the message carries no memfd".into());
    };
    let ring = match RingMemory::open(file) {
        Ok(r) => Arc::new(r),
        Err(e) => return refused(e.to_string()),
    };
    let shape = *ring.shape();
    match hub.add(ring) {
        Ok(s) => {
            let reply = json!({
                "ring": "serving",
                "slots": shape.slots,
                "positions": shape.positions,
                "deadline_ns": s.deadline().as_nanos() as u64,
            });
            rings.push(s);
            reply
        }
        Err(e) => refused(e.to_string()),
    }
}

/// What the node says of one Engram layer's table to an engine.
#[derive(Debug)]
pub struct EngineTable {
    /// The Engram layer.
    pub layer: u32,
    /// The table id.
    pub table: u32,
    /// The host-local donor's memory of it (read-only memfd) and the
    /// message that came with it, or `None`: the table is remote (rows
    /// come through a ring).
    pub memory: Option<(File, serde_json::Value)>,
    /// The node's message of it (a remote table's too).
    pub message: serde_json::Value,
}

/// An engine's end of the engine socket: what the node has, and its rings.
#[derive(Debug)]
pub struct EngineClient {
    sock: OwnedFd,
    /// The node's first message (`node`, `layers`, `tables`, `rows`,
    /// `ring_deadline_ns`).
    pub hello: serde_json::Value,
    /// Each table the node told of (V4.1's: layers 1 and 14).
    pub tables: Vec<EngineTable>,
}

impl EngineClient {
    /// Connect to the engine socket at `path` and read what the node has
    /// (at most `wait` for each message).
    pub fn connect(path: &Path, wait: Duration) -> io::Result<Self> {
        let sock = daemon_runtime::hostsock::connect(path)?;
        let hello = next(&sock, wait)?.0;
        if let Some(why) = hello.get("refused").and_then(|v| v.as_str()) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                why.to_string(),
            ));
        }
        if hello.get("engram_engine").and_then(|v| v.as_u64()) != Some(u64::from(ENGINE_PROTOCOL)) {
            return Err(io::Error::other(format!("not an engine socket: {hello}")));
        }
        let mut tables = Vec::new();
        loop {
            let (m, file) = next(&sock, wait)?;
            if m.get("synced").is_some() {
                break;
            }
            if tables.len() >= MAX_TABLES {
                return Err(io::Error::other(format!(
                    "more than {MAX_TABLES} tables before synced"
                )));
            }
            let num = |k: &str| m.get(k).and_then(|v| v.as_u64()).unwrap_or_default() as u32;
            let memory = match (m.get("remote").is_some(), file) {
                (false, Some(f)) => Some((f, m.clone())),
                _ => None,
            };
            tables.push(EngineTable {
                layer: num("layer"),
                table: num("table"),
                memory,
                message: m,
            });
        }
        Ok(Self {
            sock,
            hello,
            tables,
        })
    }

    /// Hand the node `ring` to serve; its reply (`"ring": "serving"` with
    /// the client's deadline, or `"refused"` with why).
    pub fn attach(&self, ring: &RingMemory, wait: Duration) -> io::Result<serde_json::Value> {
        send(
            self.sock.as_raw_fd(),
            &json!({"ring": {"slots": ring.shape().slots}}),
            Some(ring.file().as_raw_fd()),
        )?;
        Ok(next(&self.sock, wait)?.0)
    }

    /// The socket (an engine may watch it: readable with nothing to read
    /// means the node went).
    pub fn socket(&self) -> &OwnedFd {
        &self.sock
    }
}

/// The next message on `sock` and its descriptor, within `wait`.
fn next(sock: &OwnedFd, wait: Duration) -> io::Result<(serde_json::Value, Option<File>)> {
    if !readable(sock.as_raw_fd(), wait) {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the node said nothing",
        ));
    }
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    let (n, file) = recv(sock.as_raw_fd(), &mut buf)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the node closed the socket",
        ));
    }
    let m = parse(&buf[..n]).ok_or_else(|| io::Error::other("a message that is not JSON"))?;
    Ok((m, file))
}
