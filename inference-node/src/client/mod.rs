//! The donor client: one connection to one donor (TCP, TLS or a QUIC
//! stream), with the handshake,
//! pinned table versions, and pipelined lookups (many in flight, answered
//! by request id), each bounded by a deadline.
//!
//! There is no reader task: a waiting request takes the read side and reads
//! frames for everyone until its own answer arrives, handing the others
//! theirs; so a lone request (the common case: one per table per token)
//! pays no task switch. Each request parses and checks its own answer
//! (checksum included) and copies the rows into the caller's buffer. A
//! request dropped midway (a cancelled hedge, a deadline) leaves the
//! connection usable: its half-written frame is finished by the next writer
//! and its late answer is discarded.
//!
//! Layers: `wire` (socket <-> frames, shared read and write state) and this
//! module (the API: handshake, lookups, pings).

mod deadline;
mod error;
mod quiet;
mod wire;

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use engram_sync::Mutex;

pub use cluster_config::Transport;
use cluster_config::records::{Handshake, Progress, Records};
use engram_protocol::messages::LookupSection;
use engram_protocol::session::client::{self, ClientConfig, ClientSession, Kind};
use engram_protocol::{ROW_BYTES, TableDigest, TableInfo};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

pub use error::ClientError;
use wire::{
    Answer, Direct, Inner, Next, PendingGuard, ReadHalf, ReadState, Reply, Waiter, WriteHalf,
    WriteState, next_frame,
};

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
    /// Deadline of a `lookup` or `ping` (use `lookup_until` for another).
    pub lookup_timeout: Duration,
    /// Largest lookup this client sends (rows); answers are bounded by it.
    pub max_rows: u32,
    /// Poll the socket without sleeping for up to this long while waiting
    /// for an answer (zero: always sleep until readable). Waking a sleeping
    /// thread is most of a loopback round trip, so polling cuts latency at
    /// the cost of a busy core while a fetch waits; the polling task yields
    /// between attempts, so other tasks on its runtime keep running.
    pub busy_poll: Duration,
    /// How the donor is spoken to at the address given to `connect`.
    pub transport: Transport,
    /// The TLS client configuration and the donor's name its certificate
    /// must carry (needed for `tls` and `quic`).
    pub tls: Option<TlsClient>,
    /// Source address of the connection (a link's own IP).
    pub bind: Option<IpAddr>,
    /// Network interface the connection must use (`SO_BINDTODEVICE`).
    pub interface: Option<String>,
    /// The protocol version said in Hello: 1 (the default; every donor
    /// answers it, tables of V4.1's rows only) or
    /// [`engram_protocol::PROTOCOL_VERSION`] (tables of any row encoding,
    /// from donors of this build on: PROTOCOL.md 3.2).
    pub version: u16,
}

/// What a TLS or QUIC client needs: the node's TLS state (the rack CA, its
/// certificate; reloadable) and the name the donor's certificate must carry.
#[derive(Debug, Clone)]
pub struct TlsClient {
    /// The node's TLS state; each connection takes its configuration now.
    pub tls: Arc<crate::tls::NodeTls>,
    /// The donor's name.
    pub server_name: rustls::pki_types::ServerName<'static>,
}

impl PartialEq for TlsClient {
    /// The same node state and donor name (the material inside may be reloaded).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.tls, &other.tls) && self.server_name == other.server_name
    }
}

/// The credential a Hello carries: the rack credential only where it is
/// the proof, plain TCP. Over TLS and QUIC the certificate is, and the
/// donor ignores a credential there, so it is not handed to every donor
/// the node speaks to.
fn hello_credential(opts: &ClientOptions) -> &[u8] {
    match opts.transport {
        Transport::Tcp => opts.credential.as_deref().unwrap_or_default(),
        _ => &[],
    }
}

impl ClientOptions {
    /// Options with the node's defaults (`cluster_config::DEFAULT_CONNECT_TIMEOUT_MS`
    /// to connect, `DEFAULT_LOOKUP_TIMEOUT_MS` per lookup), the default
    /// row cap, no credential, `DEFAULT_BUSY_POLL`.
    pub fn new(node_name: impl Into<String>, pinned: Vec<(u32, TableDigest)>) -> Self {
        Self {
            node_name: node_name.into(),
            credential: None,
            pinned,
            connect_timeout: Duration::from_millis(cluster_config::DEFAULT_CONNECT_TIMEOUT_MS),
            lookup_timeout: Duration::from_millis(cluster_config::DEFAULT_LOOKUP_TIMEOUT_MS),
            max_rows: engram_protocol::frame::DEFAULT_MAX_ROWS,
            busy_poll: DEFAULT_BUSY_POLL,
            transport: Transport::Tcp,
            tls: None,
            bind: None,
            interface: None,
            version: engram_protocol::PROTOCOL_VERSION_V1,
        }
    }
}

/// A TCP connection to `addr` from the link `opts` names, if any.
async fn dial(addr: SocketAddr, opts: &ClientOptions) -> std::io::Result<TcpStream> {
    if opts.bind.is_none() && opts.interface.is_none() {
        return TcpStream::connect(addr).await;
    }
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    if let Some(dev) = &opts.interface {
        socket.bind_device(Some(dev.as_bytes())).map_err(|e| {
            std::io::Error::new(e.kind(), format!("binding to interface {dev}: {e}"))
        })?;
    }
    if let Some(ip) = opts.bind {
        socket
            .bind(SocketAddr::new(ip, 0))
            .map_err(|e| std::io::Error::new(e.kind(), format!("binding to {ip}: {e}")))?;
    }
    socket.connect(addr).await
}

/// A UDP socket for a QUIC connection to `addr`, bound to the link `opts` names.
fn quic_socket(addr: SocketAddr, opts: &ClientOptions) -> std::io::Result<std::net::UdpSocket> {
    let any: IpAddr = if addr.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let socket = std::net::UdpSocket::bind(SocketAddr::new(opts.bind.unwrap_or(any), 0))?;
    if let Some(dev) = &opts.interface {
        use std::os::fd::AsRawFd;
        // SAFETY: setsockopt reads `dev.len()` bytes from `dev`, which outlives the call.
        let r = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_BINDTODEVICE,
                dev.as_ptr().cast(),
                dev.len() as libc::socklen_t,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return Err(std::io::Error::new(
                e.kind(),
                format!("binding to interface {dev}: {e}"),
            ));
        }
    }
    Ok(socket)
}

/// Why a QUIC connection ended, from its close, in place of `e`: a donor
/// that turns a client away closes the connection with code 1 and a reason.
fn quic_refusal(conn: &quinn::Connection, e: ClientError) -> ClientError {
    match conn.close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(close))
            if close.error_code == 1u32.into() =>
        {
            ClientError::Refused {
                code: engram_protocol::ErrorCode::Unauthorized,
                message: String::from_utf8_lossy(&close.reason).into_owned(),
            }
        }
        Some(reason) => ClientError::Disconnected(format!("QUIC: {reason}")),
        None => e,
    }
}

/// A QUIC connection to `addr` and the stream its session runs on.
async fn dial_quic(
    addr: SocketAddr,
    opts: &ClientOptions,
) -> Result<
    (
        quinn::Endpoint,
        quinn::Connection,
        quinn::SendStream,
        quinn::RecvStream,
    ),
    ClientError,
> {
    let err = |message: String| ClientError::Connect { addr, message };
    let tls = opts.tls.as_ref().ok_or_else(|| {
        ClientError::BadRequest("a quic:// donor needs the rack's PKI ([rack.tls])".into())
    })?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls.tls.client_config())
        .map_err(|e| err(format!("QUIC: {e}")))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    // The node's side of a long-lived session: keep it open while idle.
    transport.keep_alive_interval(Some(Duration::from_secs(5)));
    transport.max_concurrent_uni_streams(0u32.into());
    config.transport_config(Arc::new(transport));
    let socket = quic_socket(addr, opts).map_err(|e| err(e.to_string()))?;
    let endpoint = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        None,
        socket,
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|e| err(e.to_string()))?;
    let name = tls.server_name.to_str();
    let conn = endpoint
        .connect_with(config, addr, &name)
        .map_err(|e| err(format!("QUIC: {e}")))?
        .await
        .map_err(|e| err(format!("QUIC handshake: {e}")))?;
    // A donor that refuses the node closes the connection right after
    // the handshake, with its reason.
    let (send, recv) = conn
        .open_bi()
        .await
        .map_err(|e| quic_refusal(&conn, err(format!("QUIC stream: {e}"))))?;
    Ok((endpoint, conn, send, recv))
}

/// What a TLS handshake leaves: the session's records, ciphertext the
/// donor sent right after it, and application data that came with it.
struct Handshaken {
    records: Records,
    cipher: Vec<u8>,
    plain: Vec<u8>,
}

/// Run a TLS client handshake over `stream` to completion (rustls'
/// unbuffered API); the records are then sealed and opened in place
/// (cluster_config::records).
async fn tls_handshake(stream: &mut TcpStream, mut hs: Handshake) -> Result<Handshaken, String> {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 16 << 10];
    let (mut incoming, mut out, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    loop {
        let r = hs.advance(&mut incoming, &mut out, &mut plain);
        // On an error, `out` holds our alert: sent before saying what went
        // wrong, with the usual cause.
        let sent = stream.write_all(&out).await;
        out.clear();
        match r {
            Err(e) => {
                let hint = match e {
                    rustls::Error::InvalidMessage(_) => {
                        " (is this a plaintext tcp:// port of the donor?)"
                    }
                    _ => "",
                };
                return Err(format!("{e}{hint}"));
            }
            Ok(Progress::Done) => {
                sent.map_err(|e| e.to_string())?;
                break;
            }
            Ok(Progress::NeedInput) => sent.map_err(|e| e.to_string())?,
        }
        let n = stream.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the donor closed the connection during the TLS handshake".into());
        }
        incoming.extend_from_slice(&buf[..n]);
    }
    Ok(Handshaken {
        records: hs.into_records().map_err(|e| e.to_string())?,
        cipher: incoming,
        plain,
    })
}

/// What a session runs over: the byte stream's halves, the TCP socket (for
/// busy-polling and the drained half-close), the TLS records, the QUIC
/// connection, and what a TLS handshake left over (ciphertext, plaintext).
struct Carrier {
    r: Box<dyn ReadHalf>,
    w: Box<dyn WriteHalf>,
    fd: Option<std::os::fd::RawFd>,
    /// The halves keep the socket out of the runtime's reactor.
    quiet: bool,
    tls: Option<wire::TlsRecords>,
    quic: Option<(quinn::Endpoint, quinn::Connection)>,
    left: Option<(Vec<u8>, Vec<u8>)>,
}

/// A TCP connection to `addr`, through a TLS handshake when `tls`.
async fn dial_stream(
    addr: SocketAddr,
    opts: &ClientOptions,
    tls: bool,
) -> Result<Carrier, ClientError> {
    let connect_err = |e: std::io::Error| ClientError::Connect {
        addr,
        message: e.to_string(),
    };
    let mut stream = dial(addr, opts).await.map_err(connect_err)?;
    stream.set_nodelay(true).map_err(connect_err)?;
    let (records, left) = if tls {
        let tls = opts.tls.as_ref().ok_or_else(|| {
            ClientError::BadRequest("a tls:// donor needs the rack's PKI ([rack.tls])".into())
        })?;
        let hs = Handshake::client(tls.tls.client_config(), tls.server_name.clone())
            .map_err(|e| connect_err(std::io::Error::other(e)))?;
        let done =
            tls_handshake(&mut stream, hs)
                .await
                .map_err(|message| ClientError::Connect {
                    addr,
                    message: format!("TLS handshake: {message}"),
                })?;
        (
            Some(Arc::new(Mutex::new(done.records))),
            Some((done.cipher, done.plain)),
        )
    } else {
        (None, None)
    };
    let fd = stream.as_raw_fd();
    // A polling client reads the socket itself: out of the runtime's
    // reactor until it must wait (`quiet`). One that sleeps waits there
    // every time, so its socket stays in.
    let (r, w, quiet): (Box<dyn ReadHalf>, Box<dyn WriteHalf>, bool) = if opts.busy_poll.is_zero() {
        let (r, w) = stream.into_split();
        (Box::new(r), Box::new(w), false)
    } else {
        let std = stream.into_std().map_err(connect_err)?;
        let (r, w) = quiet::split(std).map_err(connect_err)?;
        (Box::new(r), Box::new(w), true)
    };
    Ok(Carrier {
        r,
        w,
        quiet,
        fd: Some(fd),
        tls: records,
        quic: None,
        left,
    })
}

/// One section of a lookup: rows of one pinned table.
pub use engram_protocol::session::client::Request;

/// A connection to one donor. Requests may be issued concurrently from many
/// tasks (`&self`); they are pipelined on the one connection. A Goodbye is
/// noticed by the next request (or by the one reading when it arrives);
/// after it the client sends nothing new and closes its side once its last
/// request is answered.
#[derive(Debug)]
pub struct DonorClient {
    inner: Inner,
    donor: String,
    addr: SocketAddr,
    tables: Vec<TableInfo>,
    /// Each pinned table's row size in the wire's form (0: V4.1's 264),
    /// from the Welcome once: a lookup scans the pins, never the Welcome's
    /// whole list.
    row_sizes: Vec<(u32, u16)>,
    lookup_timeout: Duration,
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
        let carrier = match opts.transport {
            Transport::Quic => {
                let (endpoint, conn, send, recv) = dial_quic(addr, opts).await?;
                Carrier {
                    r: Box::new(recv),
                    w: Box::new(send),
                    fd: None,
                    quiet: false,
                    tls: None,
                    quic: Some((endpoint, conn)),
                    left: None,
                }
            }
            transport => dial_stream(addr, opts, transport == Transport::Tls).await?,
        };
        let Carrier {
            r,
            w,
            fd,
            quic,
            quiet,
            ..
        } = carrier;
        let (session, left) = (carrier.tls, carrier.left);
        let mut proto: wire::Session = ClientSession::new(ClientConfig {
            node: opts.node_name.clone(),
            credential: hello_credential(opts).to_vec(),
            pinned: opts.pinned.clone(),
            max_rows: opts.max_rows,
            version: opts.version,
        });
        let mut out = Vec::with_capacity(1024);
        proto.hello(&mut out)?;
        let mut ws = WriteState {
            w,
            out,
            written: 0,
            tls: session.clone(),
            plain: Vec::new(),
        };
        // Over QUIC the donor's reason for a refusal travels in the
        // connection's close, which can come before the Hello is even out.
        let refused = |e: ClientError| match &quic {
            Some((_, c)) => quic_refusal(c, e),
            None => e,
        };
        ws.seal()?;
        if let Err(e) = ws.finish().await {
            return Err(refused(ClientError::Disconnected(e.to_string())));
        }
        let mut rd = ReadState::new(r, fd, session);
        rd.quiet = quiet;
        if let Some((cipher, plain)) = left {
            rd.cipher.extend_from_slice(&cipher);
            rd.buf.extend_from_slice(&plain);
        }
        let frame = match next_frame(&mut rd, proto.limits(), Duration::ZERO, None).await {
            Ok(Next::Frame(f)) => f,
            Ok(Next::Own) => return Err(ClientError::Protocol("Rows before Welcome".into())),
            // A TLS port answers a plaintext Hello with a TLS alert record.
            Err(_) if rd.tls.is_none() && quic.is_none() && rd.buf.starts_with(&[0x15, 0x03]) => {
                return Err(ClientError::Connect {
                    addr,
                    message: "the donor answered with a TLS alert: this is a tls:// port (dial \
                              it as tls:// with a rack certificate)"
                        .into(),
                });
            }
            Err(e) => return Err(refused(e)),
        };
        proto.welcome(&frame)?;
        let (donor, tables) = (proto.donor().to_string(), proto.tables().to_vec());
        let row_sizes = opts
            .pinned
            .iter()
            .map(|&(table, _)| {
                let size = tables
                    .iter()
                    .find(|t| t.table_id == table)
                    .map_or(0, client::wire_row_bytes);
                (table, size)
            })
            .collect();
        let inner = Inner {
            // The Hello went out whole: nothing is left to finish.
            writer: tokio::sync::Mutex::new(ws),
            reader: tokio::sync::Mutex::new(rd),
            limits: *proto.limits(),
            pins: proto.pins().to_vec(),
            session: Mutex::new(proto),
            busy_poll: opts.busy_poll,
            fd,
            quic,
        };
        Ok(Self {
            inner,
            donor,
            addr,
            tables,
            row_sizes,
            lookup_timeout: opts.lookup_timeout,
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

    /// The local UDP address of a QUIC connection (`None` over TCP and TLS).
    pub fn quic_local_addr(&self) -> Option<SocketAddr> {
        let (endpoint, _) = self.inner.quic.as_ref()?;
        endpoint.local_addr().ok()
    }

    /// The tables the donor announced.
    pub fn tables(&self) -> &[TableInfo] {
        &self.tables
    }

    /// Bytes per row of pinned table `table` as the donor announced it
    /// (264 for V4.1's rows, and for a table not pinned).
    pub fn row_bytes(&self, table: u32) -> usize {
        match self.wire_row_bytes(table) {
            0 => ROW_BYTES,
            n => usize::from(n),
        }
    }

    fn wire_row_bytes(&self, table: u32) -> u16 {
        self.row_sizes
            .iter()
            .find(|&&(t, _)| t == table)
            .map_or(0, |&(_, size)| size)
    }

    /// Most rows one lookup may carry on this connection.
    pub fn max_rows(&self) -> u32 {
        self.inner.limits.max_rows
    }

    /// True once the donor said Goodbye: send nothing new here.
    pub fn is_draining(&self) -> bool {
        self.inner.session().is_draining()
    }

    /// Like [`Self::is_draining`], but first takes in what the donor sent
    /// while nobody was reading (once nothing was read for a millisecond;
    /// one `recv` on a polling connection, whose socket is outside the
    /// reactor, else no system call unless the socket is readable): a
    /// Goodbye that arrived between two lookups is seen before the next
    /// one is sent, so the router moves away without a failover.
    pub fn poll_draining(&self) -> bool {
        let inner = &self.inner;
        if !self.is_draining()
            && inner.idle()
            && let Ok(mut rd) = inner.reader.try_lock()
        {
            // A read error closes the connection; the next lookup sees it.
            let _ = inner.poll_idle(&mut rd);
        }
        let draining = self.is_draining();
        if draining {
            // Nothing in flight: close our side now, so the donor's drain
            // does not wait for us.
            inner.close_if_drained();
        }
        draining
    }

    /// True once the connection failed or closed.
    pub fn is_closed(&self) -> bool {
        self.inner.session().closed().is_some()
    }

    /// Send one frame built by `encode` and wait for the frame answering it.
    async fn request(
        &self,
        kind: Kind,
        encode: impl FnOnce(&mut Vec<u8>, u64) -> Result<(), ClientError>,
    ) -> Reply {
        match self
            .request_into(kind, encode, None, Instant::now())
            .await?
        {
            Answer::Frame(f) => Ok(f),
            Answer::Placed(_) => Err(ClientError::Protocol("rows placed unasked".into())),
        }
    }

    /// Begin a request on a connection that read nothing for a while or
    /// is draining: first take in what the donor sent meanwhile.
    fn begin_after_a_look(&self, kind: Kind) -> Result<u64, ClientError> {
        let inner = &self.inner;
        if inner.idle()
            && let Ok(mut rd) = inner.reader.try_lock()
        {
            // After a Goodbye (and our half-close) the donor closing its
            // side is the drain ending, not a failure.
            if let Err(e) = inner.poll_idle(&mut rd)
                && !self.is_draining()
            {
                return Err(e);
            }
        }
        if self.is_draining() {
            inner.close_if_drained();
            return Err(ClientError::Draining);
        }
        inner.session().begin(kind, Waiter::default())
    }

    /// [`Self::request`], the rows of a large Rows answer read straight
    /// into `direct`'s buffer when this request reads its own answer;
    /// begun at `now`.
    ///
    /// A lone request (the common case) takes one session lock to begin,
    /// one to see that nobody answered it meanwhile and one to take its
    /// answer, and waits on neither async lock: each is tried first.
    async fn request_into(
        &self,
        kind: Kind,
        encode: impl FnOnce(&mut Vec<u8>, u64) -> Result<(), ClientError>,
        direct: Option<Direct<'_>>,
        now: Instant,
    ) -> Result<Answer, ClientError> {
        let inner = &self.inner;
        // One look at the session when it read lately and is not draining
        // (back-to-back requests).
        let begun = {
            let mut s = inner.session();
            (!s.idle(now.into_std()) && !s.is_draining()).then(|| s.begin(kind, Waiter::default()))
        };
        let id = match begun {
            Some(id) => id?,
            None => self.begin_after_a_look(kind)?,
        };
        let mut guard = PendingGuard::new(inner, id);
        {
            let mut ws = match inner.writer.try_lock() {
                Ok(ws) => ws,
                Err(_) => inner.writer.lock().await,
            };
            // A request cancelled mid-write left its tail: finish it first.
            let mut sent = ws.finish().await;
            if sent.is_ok() {
                ws.out.clear();
                ws.written = 0;
                encode(&mut ws.out, id)?;
                if let Err(e) = ws.seal() {
                    inner.close(&e);
                    return Err(e);
                }
                sent = ws.finish().await;
            }
            if let Err(e) = sent {
                let err = ClientError::Disconnected(e.to_string());
                inner.close(&err);
                return Err(err);
            }
        }
        // Either another request reads our answer for us, or we take the
        // read side and read for everyone until our answer comes. Whoever
        // held the read side may have read our answer before letting go.
        if let Ok(mut rd) = inner.reader.try_lock() {
            let came = wire::take_reply(&mut inner.session(), id);
            return match came {
                Some(r) => r.map(Answer::Frame),
                None => inner.lead(&mut rd, &mut guard, direct).await,
            };
        }
        tokio::select! {
            biased;
            r = std::future::poll_fn(|cx| wire::poll_reply(&mut inner.session(), id, cx)) => r.map(Answer::Frame),
            mut rd = inner.reader.lock() => {
                let came = wire::take_reply(&mut inner.session(), id);
                match came {
                    Some(r) => r.map(Answer::Frame),
                    None => inner.lead(&mut rd, &mut guard, direct).await,
                }
            }
        }
    }

    /// An answer's verdict: a protocol violation (a well-formed answer of
    /// the wrong kind or shape) breaks the connection.
    fn checked<T>(&self, r: Result<T, ClientError>) -> Result<T, ClientError> {
        r.map_err(|e| {
            if matches!(e, ClientError::Protocol(_)) {
                self.inner.close(&e);
            }
            e
        })
    }

    /// Fetch rows of one or more pinned tables in one message, within the
    /// client's lookup timeout. `out` receives the rows back to back,
    /// sections in order, each table's rows at its row size (264 bytes for
    /// V4.1's; [`Self::row_bytes`]); its length must be exactly their sum.
    pub async fn lookup(
        &self,
        requests: &[Request<'_>],
        out: &mut [u8],
    ) -> Result<(), ClientError> {
        let now = Instant::now();
        self.lookup_from(requests, out, now, now + self.lookup_timeout)
            .await
    }

    /// `lookup` with an explicit deadline.
    pub async fn lookup_until(
        &self,
        requests: &[Request<'_>],
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<(), ClientError> {
        self.lookup_from(requests, out, Instant::now(), deadline)
            .await
    }

    /// `lookup_until`, begun at `now` (one clock read per lookup).
    async fn lookup_from(
        &self,
        requests: &[Request<'_>],
        out: &mut [u8],
        now: Instant,
        deadline: Instant,
    ) -> Result<(), ClientError> {
        deadline::within(deadline, self.lookup_inner(requests, out, now))
            .await
            .map_err(|()| ClientError::Timeout(deadline.saturating_duration_since(now)))?
    }

    async fn lookup_inner(
        &self,
        requests: &[Request<'_>],
        out: &mut [u8],
        now: Instant,
    ) -> Result<(), ClientError> {
        // Each request's row size in the wire's form (0: V4.1's 264).
        let mut sizes: smallvec::SmallVec<[u16; 2]> = smallvec::SmallVec::new();
        let mut want = 0usize;
        for r in requests {
            let size = self.wire_row_bytes(r.table);
            sizes.push(size);
            want += r.rows.len()
                * if size == 0 {
                    ROW_BYTES
                } else {
                    usize::from(size)
                };
        }
        if out.len() != want {
            let total: usize = requests.iter().map(|r| r.rows.len()).sum();
            return Err(ClientError::BadRequest(format!(
                "output buffer is {} bytes, {total} rows need {want}",
                out.len(),
            )));
        }
        // Inline: a lookup of one or two tables allocates nothing here.
        let mut sections: smallvec::SmallVec<[LookupSection<'_>; 2]> = smallvec::SmallVec::new();
        // From the pins and limits kept outside the session: no lock.
        client::sections(
            &self.inner.limits,
            &self.inner.pins,
            requests,
            &mut sections,
        )?;
        let direct = Direct {
            dest: &mut *out,
            sections: requests.len(),
        };
        let encode = |buf: &mut Vec<u8>, id| client::encode_lookup_frame(buf, id, &sections);
        let answer = self
            .request_into(Kind::Lookup, encode, Some(direct), now)
            .await?;
        self.checked(match answer {
            Answer::Frame(f) => client::rows(&self.inner.limits, &f, requests, &sizes, out),
            Answer::Placed(head) => client::placed(&head, requests, &sizes),
        })
    }

    /// Ask the donor where table `table`'s RDMA region is (PROTOCOL.md
    /// 3.10), by `deadline`. Only on a TLS or QUIC connection: the donor
    /// refuses it in the clear (`unauthorized`), and answers `unavailable`
    /// when it serves no RDMA.
    pub async fn region(
        &self,
        table: u32,
        deadline: Instant,
    ) -> Result<engram_protocol::Region, ClientError> {
        let budget = deadline.saturating_duration_since(Instant::now());
        let ask = self.request(Kind::Region, |buf, id| {
            client::encode_region_query(buf, id, table);
            Ok(())
        });
        let frame = tokio::time::timeout_at(deadline, ask)
            .await
            .map_err(|_| ClientError::Timeout(budget))??;
        self.checked(client::region(&self.inner.limits, &frame, table))
    }

    /// Round-trip a Ping within the lookup timeout; returns the time it took.
    pub async fn ping(&self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        let ping = self.request(Kind::Ping, |buf, id| {
            client::encode_ping_frame(buf, id);
            Ok(())
        });
        let frame = tokio::time::timeout(self.lookup_timeout, ping)
            .await
            .map_err(|_| ClientError::Timeout(self.lookup_timeout))??;
        self.checked(client::pong(&self.inner.limits, &frame))?;
        Ok(start.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rack_credential_goes_only_over_plain_tcp() {
        let mut opts = ClientOptions::new("n", Vec::new());
        opts.credential = Some(b"secret".to_vec());
        for (transport, sent) in [
            (Transport::Tcp, &b"secret"[..]),
            (Transport::Tls, &b""[..]),
            (Transport::Quic, &b""[..]),
            (Transport::Rdma, &b""[..]),
        ] {
            opts.transport = transport;
            assert_eq!(hello_credential(&opts), sent, "{transport}");
        }
    }
}
