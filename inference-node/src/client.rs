//! The donor client: one TCP connection to one donor, with the handshake,
//! pinned table versions, and pipelined lookups (many in flight, answered
//! by request id). There is no reader task: a waiting request takes the
//! read side and reads frames for everyone until its own answer arrives,
//! handing the others theirs; so a lone request (the common case: one per
//! table per token) pays no task switch. Each request parses and checks its
//! own answer (checksum included) and copies the rows into the caller's
//! buffer. A request dropped midway (a cancelled hedge) leaves nothing
//! behind: its late answer is discarded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use engram_protocol::messages::{LookupSection, encode_lookup, encode_ping};
use engram_protocol::{
    ErrorCode, Frame, FrameError, FrameHeader, FrameKind, HEADER_LEN, Hello, Limits,
    PROTOCOL_VERSION, ROW_BYTES, TableDigest, TableInfo, decode,
};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;

/// Why a donor could not serve a request. Each variant says whether another
/// source may succeed ([`ClientError::retry_elsewhere`]), so failover is
/// decided from types, not strings.
#[derive(Debug, Clone, Error)]
pub enum ClientError {
    /// The TCP connection could not be made.
    #[error("connecting to {addr}: {message}")]
    Connect { addr: SocketAddr, message: String },
    /// No answer in time.
    #[error("timed out after {0:?} waiting for the donor")]
    Timeout(Duration),
    /// The donor refused the handshake (busy, unauthorized, version, draining).
    #[error("donor refused the connection: {code}: {message}")]
    Refused { code: ErrorCode, message: String },
    /// The donor serves this table at another version than the one pinned.
    #[error("donor {donor} serves table {table} at digest {advertised}, not the pinned {pinned}")]
    DigestMismatch {
        donor: String,
        table: u32,
        pinned: TableDigest,
        advertised: TableDigest,
    },
    /// The donor does not serve a pinned table.
    #[error("donor {donor} does not serve table {table}")]
    TableMissing { donor: String, table: u32 },
    /// The caller asked for a table it did not pin (a caller bug).
    #[error("table {0} was not pinned when connecting")]
    NotPinned(u32),
    /// One section of an answer failed.
    #[error("donor answered table {table} with {code}")]
    Section { table: u32, code: ErrorCode },
    /// The donor answered the request with a typed error.
    #[error("donor error {code}: {message}")]
    Donor { code: ErrorCode, message: String },
    /// The answer's checksum did not match: its rows were discarded.
    #[error("corrupt answer: {0}")]
    Corrupt(String),
    /// The donor broke the protocol; the connection was closed.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Disconnected(String),
    /// The donor said Goodbye: it takes no new requests.
    #[error("donor is draining")]
    Draining,
    /// The request itself is wrong (a caller bug): buffer size, row count.
    #[error("bad request: {0}")]
    BadRequest(String),
}

impl ClientError {
    /// True when another source (a replica, the SSD copy) may well succeed.
    pub fn retry_elsewhere(&self) -> bool {
        match self {
            Self::NotPinned(_) | Self::BadRequest(_) => false,
            // Out of range at the pinned version is out of range everywhere.
            Self::Section { code, .. } | Self::Donor { code, .. } => {
                !matches!(code, ErrorCode::RowOutOfRange | ErrorCode::RequestTooLarge)
            }
            _ => true,
        }
    }
}

/// Default `busy_poll`: longer than a loopback or rack-local answer takes
/// (30-60 us measured), far shorter than a table's window (250 us for
/// table 1 at 100 tokens/s).
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(100);

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Name sent in Hello.
    pub node_name: String,
    /// Credential sent in Hello, if the rack uses one.
    pub credential: Option<Vec<u8>>,
    /// Tables and the digests they must have; a donor that differs is refused.
    pub pinned: Vec<(u32, TableDigest)>,
    /// Time allowed for connect plus handshake.
    pub connect_timeout: Duration,
    /// Largest lookup this client sends (rows); answers are bounded by it.
    pub max_rows: u32,
    /// Poll the socket without sleeping for up to this long while waiting
    /// for an answer (zero: always sleep until readable). Waking a sleeping
    /// thread is most of a loopback round trip, so polling cuts latency at
    /// the cost of a busy core while a fetch waits; the polling task yields
    /// between attempts, so other tasks on its runtime keep running.
    pub busy_poll: Duration,
}

impl ClientOptions {
    /// Options with defaults: 1 s to connect, the default row cap, no
    /// credential, `DEFAULT_BUSY_POLL`.
    pub fn new(node_name: impl Into<String>, pinned: Vec<(u32, TableDigest)>) -> Self {
        Self {
            node_name: node_name.into(),
            credential: None,
            pinned,
            connect_timeout: Duration::from_secs(1),
            max_rows: engram_protocol::frame::DEFAULT_MAX_ROWS,
            busy_poll: DEFAULT_BUSY_POLL,
        }
    }
}

/// One section of a lookup: rows of one pinned table.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Table id.
    pub table: u32,
    /// Row ids, answered in this order.
    pub rows: &'a [u64],
}

type Reply = Result<Bytes, ClientError>;

#[derive(Debug, Default)]
struct Pending {
    waiting: HashMap<u64, oneshot::Sender<Reply>>,
    closed: Option<ClientError>,
}

/// The read side: whichever request holds it reads frames for everyone.
#[derive(Debug)]
struct ReadState {
    r: OwnedReadHalf,
    buf: BytesMut,
}

/// The write side, with a reused encoding buffer.
#[derive(Debug)]
struct WriteState {
    w: OwnedWriteHalf,
    out: Vec<u8>,
}

#[derive(Debug)]
struct Inner {
    writer: tokio::sync::Mutex<WriteState>,
    reader: tokio::sync::Mutex<ReadState>,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
    draining: AtomicBool,
    limits: Limits,
    busy_poll: Duration,
}

impl Inner {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fail every waiting request and refuse new ones.
    fn close(&self, why: ClientError) {
        let mut p = self.pending();
        if p.closed.is_none() {
            p.closed = Some(why.clone());
        }
        for (_, tx) in p.waiting.drain() {
            let _ = tx.send(Err(why.clone()));
        }
    }

    /// Handle a frame read by the current reader: return it if it answers
    /// `own`, hand it to the request it answers, or act on it.
    fn dispatch(&self, frame: Bytes, own: u64) -> Result<Option<Bytes>, ClientError> {
        let Ok(Some(h)) = FrameHeader::peek(&frame, &self.limits) else {
            return Err(ClientError::Protocol("unreadable frame header".into()));
        };
        match h.kind {
            FrameKind::Rows | FrameKind::Error | FrameKind::Pong if h.request_id != 0 => {
                if h.request_id == own {
                    return Ok(Some(frame));
                }
                // No waiter: the request was cancelled (a lost hedge); drop the answer.
                if let Some(tx) = self.pending().waiting.remove(&h.request_id) {
                    let _ = tx.send(Ok(frame));
                }
                Ok(None)
            }
            FrameKind::Goodbye => {
                self.draining.store(true, Ordering::Relaxed);
                tracing::debug!("donor said Goodbye");
                Ok(None)
            }
            FrameKind::Error => {
                // An unsolicited error (request id 0) ends the connection.
                let msg = match parse(&frame, &self.limits) {
                    Ok((_, Frame::Error(e))) => format!("{}: {}", e.code, e.message),
                    _ => "unreadable error frame".into(),
                };
                Err(ClientError::Disconnected(format!(
                    "donor closed the connection: {msg}"
                )))
            }
            k => Err(ClientError::Protocol(format!(
                "unexpected {k:?} frame from the donor"
            ))),
        }
    }

    /// Read frames for everyone until the one answering `own` arrives.
    async fn lead(&self, rd: &mut ReadState, own: u64) -> Reply {
        loop {
            let step = match next_frame(rd, &self.limits, self.busy_poll).await {
                Ok(frame) => self.dispatch(frame, own),
                Err(e) => Err(e),
            };
            match step {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {}
                Err(e) => {
                    self.close(e.clone());
                    return Err(e);
                }
            }
        }
    }
}

/// Read the next whole frame. With `busy_poll`, first spin on
/// non-blocking reads for up to that long before sleeping until the
/// socket is readable: waking a sleeping thread is most of a round trip.
/// One non-blocking `recv` straight from the socket. (tokio's `try_read`
/// answers from its cached readiness, which only its reactor updates, so it
/// cannot see data arrive while we spin.)
fn recv_now(r: &OwnedReadHalf, buf: &mut BytesMut) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let fd = r.as_ref().as_raw_fd();
    let spare = buf.spare_capacity_mut();
    // SAFETY: recv writes at most `spare.len()` bytes into the spare capacity
    // it is given, and returns how many; only those are marked initialized.
    let n = unsafe {
        libc::recv(
            fd,
            spare.as_mut_ptr().cast(),
            spare.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the first `n` spare bytes were just written by recv.
    unsafe { buf.set_len(buf.len() + n as usize) };
    Ok(n as usize)
}

async fn next_frame(
    rd: &mut ReadState,
    limits: &Limits,
    busy_poll: Duration,
) -> Result<Bytes, ClientError> {
    let mut spin_until = (!busy_poll.is_zero()).then(|| Instant::now() + busy_poll);
    loop {
        match FrameHeader::peek(&rd.buf, limits) {
            Err(e) => return Err(ClientError::Protocol(e.to_string())),
            Ok(Some(h)) if rd.buf.len() >= h.frame_len() => {
                return Ok(rd.buf.split_to(h.frame_len()).freeze());
            }
            Ok(Some(h)) => rd.buf.reserve(h.frame_len() - rd.buf.len()),
            Ok(None) => rd.buf.reserve(HEADER_LEN),
        }
        let n = match spin_until {
            Some(until) => match recv_now(&rd.r, &mut rd.buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= until {
                        spin_until = None;
                    }
                    // Yield rather than spin in place: other tasks (the other
                    // table's fetch, hedge timers) keep running meanwhile.
                    tokio::task::yield_now().await;
                    continue;
                }
                r => r,
            },
            None => rd.r.read_buf(&mut rd.buf).await,
        };
        match n {
            Ok(0) => {
                return Err(ClientError::Disconnected(
                    "donor closed the connection".into(),
                ));
            }
            Ok(_) => {}
            Err(e) => return Err(ClientError::Disconnected(e.to_string())),
        }
    }
}

/// Removes a request's entry if its future is dropped before the answer came.
struct PendingGuard<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.inner.pending().waiting.remove(&self.id);
    }
}

/// A connection to one donor. Requests may be issued concurrently from many
/// tasks (`&self`); they are pipelined on the one connection. There is no
/// background task: a waiting request reads the socket for everyone, so a
/// lone request costs no task switch. A Goodbye is noticed by the next
/// request or ping.
#[derive(Debug)]
pub struct DonorClient {
    inner: Inner,
    donor: String,
    addr: SocketAddr,
    tables: Vec<TableInfo>,
    pinned: Vec<(u32, u64)>,
}

fn parse<'a>(frame: &'a [u8], limits: &Limits) -> Result<(FrameHeader, Frame<'a>), ClientError> {
    match decode(frame, limits) {
        Ok(Some(d)) => Ok((d.header, d.frame)),
        Ok(None) => Err(ClientError::Protocol("incomplete frame".into())),
        Err(e @ FrameError::Checksum { .. }) => Err(ClientError::Corrupt(e.to_string())),
        Err(e) => Err(ClientError::Protocol(e.to_string())),
    }
}

impl DonorClient {
    /// Connect, say Hello, and check the Welcome against the pinned tables.
    pub async fn connect(addr: SocketAddr, opts: &ClientOptions) -> Result<Self, ClientError> {
        let t = opts.connect_timeout;
        tokio::time::timeout(t, Self::connect_inner(addr, opts))
            .await
            .map_err(|_| ClientError::Timeout(t))?
    }

    async fn connect_inner(addr: SocketAddr, opts: &ClientOptions) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| ClientError::Connect {
                addr,
                message: e.to_string(),
            })?;
        stream.set_nodelay(true).map_err(|e| ClientError::Connect {
            addr,
            message: e.to_string(),
        })?;
        let (r, mut w) = stream.into_split();
        let limits = Limits::for_caps(opts.max_rows, engram_protocol::frame::DEFAULT_MAX_SECTIONS);
        let mut out = Vec::with_capacity(1024);
        let cred = opts.credential.as_deref().unwrap_or_default();
        Hello {
            version: PROTOCOL_VERSION,
            node: &opts.node_name,
            credential: cred,
        }
        .encode(&mut out, 0)
        .map_err(|e| ClientError::BadRequest(e.to_string()))?;
        w.write_all(&out)
            .await
            .map_err(|e| ClientError::Disconnected(e.to_string()))?;
        let mut rd = ReadState {
            r,
            buf: BytesMut::with_capacity(64 << 10),
        };
        let frame = next_frame(&mut rd, &limits, Duration::ZERO).await?;
        let (donor, tables, max_rows) = match parse(&frame, &limits)?.1 {
            Frame::Welcome(w) => (
                w.donor.to_string(),
                w.tables().collect::<Vec<_>>(),
                w.max_rows,
            ),
            Frame::Error(e) => {
                return Err(ClientError::Refused {
                    code: e.code,
                    message: e.message.to_string(),
                });
            }
            Frame::Goodbye(_) => return Err(ClientError::Draining),
            _ => return Err(ClientError::Protocol("expected Welcome".into())),
        };
        let mut pinned = Vec::new();
        for &(table, digest) in &opts.pinned {
            let t = tables.iter().find(|t| t.table_id == table).ok_or_else(|| {
                ClientError::TableMissing {
                    donor: donor.clone(),
                    table,
                }
            })?;
            if t.digest != digest {
                return Err(ClientError::DigestMismatch {
                    donor: donor.clone(),
                    table,
                    pinned: digest,
                    advertised: t.digest,
                });
            }
            pinned.push((table, digest.prefix()));
        }
        // Requests are bounded by the smaller of the two caps.
        let limits = Limits::for_caps(max_rows.min(opts.max_rows).max(1), limits.max_sections);
        let inner = Inner {
            writer: tokio::sync::Mutex::new(WriteState { w, out }),
            reader: tokio::sync::Mutex::new(rd),
            pending: Mutex::new(Pending::default()),
            next_id: AtomicU64::new(1),
            draining: AtomicBool::new(false),
            limits,
            busy_poll: opts.busy_poll,
        };
        Ok(Self {
            inner,
            donor,
            addr,
            tables,
            pinned,
        })
    }

    /// The donor's name (from Welcome).
    pub fn donor(&self) -> &str {
        &self.donor
    }

    /// The address connected to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The tables the donor announced.
    pub fn tables(&self) -> &[TableInfo] {
        &self.tables
    }

    /// Most rows one lookup may carry on this connection.
    pub fn max_rows(&self) -> u32 {
        self.inner.limits.max_rows
    }

    /// True once the donor said Goodbye: send nothing new here.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Relaxed)
    }

    /// True once the connection failed or closed.
    pub fn is_closed(&self) -> bool {
        self.inner.pending().closed.is_some()
    }

    /// Send one frame built by `encode` and wait for the frame answering it.
    async fn request(
        &self,
        encode: impl FnOnce(&mut Vec<u8>, u64) -> Result<(), ClientError>,
    ) -> Reply {
        if self.is_draining() {
            return Err(ClientError::Draining);
        }
        let inner = &self.inner;
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        {
            let mut p = inner.pending();
            if let Some(e) = &p.closed {
                return Err(e.clone());
            }
            p.waiting.insert(id, tx);
        }
        let _guard = PendingGuard { inner, id };
        {
            let mut ws = inner.writer.lock().await;
            let WriteState { w, out } = &mut *ws;
            out.clear();
            encode(out, id)?;
            if let Err(e) = w.write_all(out).await {
                let err = ClientError::Disconnected(e.to_string());
                inner.close(err.clone());
                return Err(err);
            }
        }
        // Either another request reads our answer for us, or we take the
        // read side and read for everyone until our answer comes.
        tokio::select! {
            biased;
            r = &mut rx => r.unwrap_or_else(|_| Err(ClientError::Disconnected("connection closed".into()))),
            mut rd = inner.reader.lock() => match rx.try_recv() {
                Ok(r) => r,
                Err(_) => inner.lead(&mut rd, id).await,
            },
        }
    }

    /// Fetch rows of one or more pinned tables in one message. `out` receives
    /// the rows back to back, sections in order, 264 bytes each; its length
    /// must be exactly the total row count times 264.
    pub async fn lookup(
        &self,
        requests: &[Request<'_>],
        out: &mut [u8],
    ) -> Result<(), ClientError> {
        let total: usize = requests.iter().map(|r| r.rows.len()).sum();
        if out.len() != total * ROW_BYTES {
            return Err(ClientError::BadRequest(format!(
                "output buffer is {} bytes, {total} rows need {}",
                out.len(),
                total * ROW_BYTES
            )));
        }
        if total > self.inner.limits.max_rows as usize {
            return Err(ClientError::BadRequest(format!(
                "{total} rows exceed this connection's cap of {}",
                self.inner.limits.max_rows
            )));
        }
        let mut sections = Vec::with_capacity(requests.len());
        for r in requests {
            let prefix = self
                .pinned
                .iter()
                .find(|p| p.0 == r.table)
                .ok_or(ClientError::NotPinned(r.table))?
                .1;
            sections.push(LookupSection {
                table_id: r.table,
                digest_prefix: prefix,
                rows: r.rows,
            });
        }
        let frame = self
            .request(|buf, id| {
                encode_lookup(buf, id, &sections)
                    .map_err(|e| ClientError::BadRequest(e.to_string()))
            })
            .await?;
        match parse(&frame, &self.inner.limits)?.1 {
            Frame::Rows(rows) => {
                if rows.section_count() as usize != requests.len() {
                    return Err(ClientError::Protocol(
                        "answer has another section count".into(),
                    ));
                }
                let mut at = 0;
                for ((s, data), req) in rows.sections().zip(requests) {
                    if s.table_id != req.table {
                        return Err(ClientError::Protocol(
                            "answer sections are out of order".into(),
                        ));
                    }
                    if let Some(code) = s.status {
                        return Err(ClientError::Section {
                            table: s.table_id,
                            code,
                        });
                    }
                    if data.len() != req.rows.len() * ROW_BYTES {
                        return Err(ClientError::Protocol("answer has another row count".into()));
                    }
                    out[at..at + data.len()].copy_from_slice(data);
                    at += data.len();
                }
                Ok(())
            }
            Frame::Error(e) => Err(ClientError::Donor {
                code: e.code,
                message: e.message.to_string(),
            }),
            _ => Err(ClientError::Protocol("unexpected answer to Lookup".into())),
        }
    }

    /// Round-trip a Ping; returns the time it took.
    pub async fn ping(&self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        let frame = self
            .request(|buf, id| {
                encode_ping(buf, id, false);
                Ok(())
            })
            .await?;
        match parse(&frame, &self.inner.limits)?.1 {
            Frame::Pong => Ok(start.elapsed()),
            Frame::Error(e) => Err(ClientError::Donor {
                code: e.code,
                message: e.message.to_string(),
            }),
            _ => Err(ClientError::Protocol("unexpected answer to Ping".into())),
        }
    }
}
