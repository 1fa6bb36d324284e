//! Socket <-> frames for one connection, on its own OS thread with blocking
//! IO. On the machines we measured, most of a round trip is the cost of
//! waking a sleeping thread; a blocking read is one wake-up, the fewest any
//! design gets, and the donor's cores are otherwise idle. Requests are
//! pipelined: every whole frame in the buffer is answered, the answers are
//! written together, then the socket is read again, so a client's in-flight
//! requests are bounded by the buffers and TCP's flow control.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_protocol::messages::keep_wide_units_warm;
use engram_protocol::{FrameHeader, HEADER_LEN};

use super::ended::Ended;
use super::handler::Handler;
use cluster_config::records::{MAX_RECORD, Opened, Progress, record_len};
use engram_sync::{Mutex, MutexGuard};

use super::pump::{INITIAL_BUF, Pump, ReadBuf, Step};
use super::{Conn, Shared, Slot, TlsSession};

/// Ciphertext read from the socket and not yet opened: whole records are
/// opened in place here, then their plaintext copied to the frame buffer.
#[derive(Debug)]
pub(super) struct TlsIn {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl TlsIn {
    pub(super) fn new() -> Self {
        Self {
            buf: vec![0; INITIAL_BUF.max(MAX_RECORD)],
            start: 0,
            end: 0,
        }
    }
}

fn tls_error(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

fn lock(session: &Mutex<TlsSession>) -> MutexGuard<'_, TlsSession> {
    session.lock()
}

/// Read more plaintext into `rb`: straight from the socket, or over TLS by
/// opening the next whole record in place and copying its plaintext (one
/// copy, no allocation). The session is locked only while a record is
/// opened, never during a blocking read, so a drain's Goodbye from
/// another thread is never held up by a silent peer. Ciphertext waits in
/// `tin` until the frame buffer has room: a pipelining client is bounded
/// by the same buffers and flow control as over plain TCP.
fn fill(
    stream: &mut TcpStream,
    conn: &Conn,
    rb: &mut ReadBuf,
    tin: &mut TlsIn,
    spin: Duration,
) -> io::Result<usize> {
    let Some(session) = &conn.tls else {
        spin_until_readable(stream, spin);
        let n = rb.read_from(stream)?;
        wake_wide_units(n);
        return Ok(n);
    };
    loop {
        let whole = record_len(&tin.buf[tin.start..tin.end]).map_err(tls_error)?;
        if let Some(len) = whole.filter(|&len| tin.end - tin.start >= len) {
            // Room for the record's plaintext, at most its length.
            if rb.buf.len() - rb.end < len {
                rb.reserve_frame(rb.end - rb.start + len);
            }
            let rec = &mut tin.buf[tin.start..tin.start + len];
            let opened = match &mut *lock(session) {
                TlsSession::Open { records, .. } => records.open(rec),
                _ => return Err(io::ErrorKind::NotConnected.into()),
            };
            tin.start += len;
            match opened.map_err(tls_error)? {
                Opened::Data(r) if !r.is_empty() => {
                    let n = r.len();
                    rb.buf[rb.end..rb.end + n].copy_from_slice(&rec[r]);
                    rb.end += n;
                    return Ok(n);
                }
                // An empty record, a key update (answered with our next
                // record), a ticket: nothing for the frames.
                Opened::Data(_) | Opened::Nothing => continue,
                // The peer's close_notify.
                Opened::Closed => return Ok(0),
            }
        }
        // The next record's bytes go after what is buffered: move that to
        // the front when the buffer has not the room for a whole record.
        if tin.buf.len() - tin.start < MAX_RECORD {
            tin.buf.copy_within(tin.start..tin.end, 0);
            (tin.start, tin.end) = (0, tin.end - tin.start);
        }
        spin_until_readable(stream, spin);
        let n = stream.read(&mut tin.buf[tin.end..])?;
        if n == 0 {
            return Ok(0);
        }
        wake_wide_units(n);
        tin.end += n;
    }
}

/// Bytes came in (a request, likely): wake the wide vector units now, so
/// that the answer's checksum, after the request is parsed and its rows
/// gathered, finds them awake and sums with them
/// ([`keep_wide_units_warm`]). They take under 0.5 us to wake here; a
/// thread that slept since the last request would otherwise sum on the
/// narrow ones: 345 ns instead of 220 for a 24-row answer, 635 instead of
/// 405 for 48 (docs/benchmarks.md, "The units woken when a request comes").
fn wake_wide_units(read: usize) {
    if read > 0 {
        keep_wide_units_warm();
    }
}

/// The busy-poll mode: check the socket without sleeping (`recv` with
/// `MSG_PEEK | MSG_DONTWAIT`) for up to `budget`, so the read that follows
/// finds its bytes without a wake-up. True when something is there to
/// read (bytes, the peer's close, an error, which the read then reports);
/// false when the budget ran out (the read then sleeps as usual).
pub(super) fn spin_until_readable(stream: &TcpStream, budget: Duration) -> bool {
    use std::os::fd::AsRawFd;
    if budget.is_zero() {
        return false;
    }
    let began = Instant::now();
    let mut probe = [0u8; 1];
    loop {
        // SAFETY: recv writes at most one byte into `probe`; MSG_PEEK
        // leaves it in the socket for the read that follows.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                probe.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return true;
        }
        match io::Error::last_os_error().kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => {}
            _ => return true,
        }
        if began.elapsed() >= budget {
            return false;
        }
        // Any other thread that can run gets the core meanwhile (the node's
        // loop, on a host of few cores): polling must not delay the very
        // request it waits for.
        std::thread::yield_now();
    }
}

/// Write buffered answers under the connection's write lock (a drain's
/// Goodbye may be written from another thread); over TLS, seal them into
/// `sealed` first under the same lock, so records go out in order.
fn flush(conn: &Conn, out: &mut Vec<u8>, sealed: &mut Vec<u8>) -> io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let _guard = conn.write_lock.lock();
    let Some(session) = &conn.tls else {
        let r = (&conn.stream).write_all(out);
        out.clear();
        return r;
    };
    sealed.clear();
    let r = match &mut *lock(session) {
        TlsSession::Open { records, .. } => records.seal(out, sealed).map_err(tls_error),
        _ => Err(io::ErrorKind::NotConnected.into()),
    };
    out.clear();
    r?;
    (&conn.stream).write_all(sealed)
}

/// Run the TLS handshake to completion by `deadline` (an absolute bound: a
/// peer trickling bytes cannot stretch it). Ciphertext that came after it
/// is left in `tin`; application data that came with it, in `early`.
fn handshake(
    stream: &mut TcpStream,
    conn: &Conn,
    deadline: Instant,
    tin: &mut TlsIn,
    early: &mut Vec<u8>,
) -> io::Result<()> {
    let Some(session) = &conn.tls else {
        return Ok(());
    };
    // The session is held throughout (a Goodbye meanwhile just closes).
    let mut s = lock(session);
    let TlsSession::Handshaking(mut hs) = std::mem::replace(&mut *s, TlsSession::Failed) else {
        return Err(io::ErrorKind::NotConnected.into());
    };
    let mut incoming = Vec::with_capacity(16 << 10);
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        let r = hs.advance(&mut incoming, &mut out, early);
        // On an error, `out` holds the alert that tells the peer why.
        let sent = stream.write_all(&out);
        out.clear();
        match r {
            Err(e) => return Err(tls_error(e)),
            Ok(Progress::Done) => {
                sent?;
                break;
            }
            Ok(Progress::NeedInput) => sent?,
        }
        let rest = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(io::ErrorKind::TimedOut)?;
        stream.set_read_timeout(Some(rest))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        incoming.extend_from_slice(&chunk[..n]);
    }
    let chain = hs
        .peer_certificates()
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let records = hs.into_records().map_err(tls_error)?;
    // At most the handshake's bound: the buffer takes it.
    if incoming.len() > tin.buf.len() {
        tin.buf.resize(incoming.len(), 0);
    }
    tin.buf[..incoming.len()].copy_from_slice(&incoming);
    (tin.start, tin.end) = (0, incoming.len());
    *s = TlsSession::Open {
        records: Box::new(records),
        chain,
    };
    Ok(())
}

/// A TLS alert record: fatal (2), protocol_version (70).
pub const TLS_ALERT_PROTOCOL_VERSION: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46];

/// A plaintext engram client on a TLS port: its first bytes are a Hello
/// frame's header, not a TLS record. Peeked, not consumed.
fn plaintext_hello(stream: &TcpStream) -> bool {
    let mut head = [0u8; HEADER_LEN];
    match stream.peek(&mut head) {
        Ok(n) if n >= 8 => matches!(
            FrameHeader::peek_unbounded(&[&head[..n], &[0u8; HEADER_LEN][n..]].concat()),
            Ok(Some(h)) if h.kind == engram_protocol::FrameKind::Hello
        ),
        _ => false,
    }
}

/// Write the last answers (an error frame, usually), then half-close and
/// discard what the peer still sends for a moment: closing with unread data
/// would reset the connection and lose the error before the peer reads it.
/// All of it within 200 ms and 64 KiB, however the peer trickles.
fn close_gracefully(conn: &Conn, stream: &TcpStream, out: &mut Vec<u8>) -> io::Result<()> {
    let mut sealed = Vec::new();
    flush(conn, out, &mut sealed)?;
    if let Some(session) = &conn.tls {
        let _guard = conn.write_lock.lock();
        sealed.clear();
        if let TlsSession::Open { records, .. } = &mut *lock(session) {
            records.seal_close_notify(&mut sealed).map_err(tls_error)?;
        }
        (&conn.stream).write_all(&sealed)?;
    }
    linger_close(stream)
}

/// Half-close `stream` and discard what the peer still sends, for at most
/// 200 ms and 64 KiB: what was written reaches the peer before the close.
fn linger_close(stream: &TcpStream) -> io::Result<()> {
    stream.shutdown(std::net::Shutdown::Write)?;
    let deadline = Instant::now() + Duration::from_millis(200);
    let mut sink = [0u8; 4096];
    let mut left: usize = 64 << 10;
    while left > 0 {
        let Some(rest) = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
        else {
            break;
        };
        stream.set_read_timeout(Some(rest))?;
        match (&*stream).read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
    Ok(())
}

/// An authenticated client the donor has no served slot for: `busy`
/// inside its session (over TLS, an encrypted record, then close_notify),
/// counted as refused.
fn refuse_busy(stream: &TcpStream, conn: &Conn, shared: &Shared) {
    let max = shared.max_connections();
    shared
        .stats
        .refused
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::debug!(conn = conn.id, peer = %conn.peer, "connection refused: at the bound");
    let msg = format!("donor is at its bound of {max} connections");
    let mut out = Vec::new();
    engram_protocol::ErrorFrame {
        code: engram_protocol::ErrorCode::Busy,
        table_id: None,
        detail: max as u64,
        message: &msg,
    }
    .encode(&mut out, 0);
    let _ = close_gracefully(conn, stream, &mut out);
}

/// Read timeout: zero means none.
fn set_timeout(stream: &TcpStream, t: Duration) -> io::Result<()> {
    stream.set_read_timeout(if t.is_zero() { None } else { Some(t) })
}

/// The TLS handshake and the client's identity: `Ok(Some((name, chain)))`
/// for an allowed client, `Ok(None)` when the connection was refused and closed
/// here (logged and counted), `Err` for a failed handshake.
fn admit(
    stream: &mut TcpStream,
    conn: &Conn,
    shared: &Shared,
    deadline: Instant,
    tin: &mut TlsIn,
    early: &mut Vec<u8>,
) -> io::Result<Option<(String, super::Chain)>> {
    let stats = &shared.stats;
    // The peek waits for the first bytes: within the deadline too.
    let rest = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .unwrap_or(Duration::from_millis(1));
    stream.set_read_timeout(Some(rest))?;
    if plaintext_hello(stream) {
        stats.refusal("data", "plaintext_on_tls_port");
        if let Some(suppressed) = super::CONN_WARN.allow() {
            tracing::warn!(conn = conn.id, peer = %conn.peer, suppressed, "a plaintext client on a TLS port: refused (it must dial tls://)");
        }
        // A TLS port answers in TLS only: a fatal protocol_version alert,
        // which a client that spoke plaintext reads as a refusal.
        let _ = (&*stream).write_all(&TLS_ALERT_PROTOCOL_VERSION);
        let _ = linger_close(stream);
        return Ok(None);
    }
    if let Err(e) = handshake(stream, conn, deadline, tin, early) {
        let reason = match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "handshake_timeout",
            _ => "handshake_failed",
        };
        stats.refusal("data", reason);
        if let Some(suppressed) = super::CONN_WARN.allow() {
            tracing::warn!(conn = conn.id, peer = %conn.peer, error = %e, suppressed, "TLS handshake failed");
        }
        return Err(e);
    }
    let Some(session) = &conn.tls else {
        return Ok(None);
    };
    let (identity, chain) = {
        let chain: super::Chain = match &*lock(session) {
            TlsSession::Open { chain, .. } => chain[..].into(),
            _ => return Ok(None),
        };
        (cluster_config::tls::peer_identity(Some(&chain[..])), chain)
    };
    let allowed = identity
        .as_deref()
        .is_some_and(|i| shared.tls().is_some_and(|t| t.data_allowed(i)));
    let who = identity.clone().unwrap_or_else(|| "(no name)".into());
    if !allowed {
        stats.refusal("data", "client_not_allowed");
        if let Some(suppressed) = super::CONN_WARN.allow() {
            tracing::warn!(conn = conn.id, peer = %conn.peer, identity = %who, suppressed, "TLS client not allowed on this donor: refused");
        }
        let mut out = Vec::new();
        let msg = format!(
            "{who} is not allowed on donor {} (the donor's `clients` in the rack config)",
            shared.config().name
        );
        engram_protocol::ErrorFrame {
            code: engram_protocol::ErrorCode::Unauthorized,
            table_id: None,
            detail: 0,
            message: &msg,
        }
        .encode(&mut out, 0);
        let _ = close_gracefully(conn, stream, &mut out);
        return Ok(None);
    }
    Ok(identity.map(|i| (i, chain)))
}

/// Serve one connection until the peer closes, a timeout passes, a fatal
/// frame arrives, or the drain force-closes it. An end on an error is
/// counted and logged by its reason ([`Ended`]); a refused TLS client was
/// counted and logged as a refusal already.
pub(super) fn serve(mut stream: TcpStream, conn: Arc<Conn>, shared: Arc<Shared>, mut slot: Slot) {
    let cfg = shared.config();
    let write_timeout = (!cfg.write_timeout.is_zero()).then_some(cfg.write_timeout);
    let setup = stream
        .set_nodelay(true)
        .and_then(|()| stream.set_write_timeout(write_timeout));
    if let Err(e) = setup {
        Ended::new("socket_error", e.to_string()).report(&shared, conn.id, conn.peer, "");
        return;
    }
    // Before the handshake only a Hello fits, and the Hello must arrive by an
    // absolute deadline (a read timeout alone restarts with every byte).
    // Over TLS the same deadline covers the TLS handshake too.
    // The deadline shrinks as strangers fill the pre-auth budget.
    let hello_deadline = (!cfg.hello_timeout.is_zero())
        .then(|| Instant::now() + shared.preauth.deadline(cfg.hello_timeout));
    let mut handler = Handler::new(&shared, Arc::clone(&cfg));
    let mut tin = TlsIn::new();
    let mut early = Vec::new();
    if conn.tls.is_some() {
        let deadline = hello_deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(10));
        match admit(&mut stream, &conn, &shared, deadline, &mut tin, &mut early) {
            Ok(Some((identity, chain))) => handler.set_identity(identity, chain),
            Ok(None) | Err(_) => return,
        }
        // Authenticated: a served slot now, or a refusal inside the session.
        if !slot.promote(&shared) {
            refuse_busy(&stream, &conn, &shared);
            return;
        }
    }
    let mut pump = Pump::new(handler, cfg.limits, conn.id, conn.peer, conn.tls.is_none());
    // Application data that came with the handshake's last flight.
    pump.session.rb.push(&early);
    if let Err(ended) = session(
        &mut stream,
        &conn,
        &shared,
        &mut tin,
        &mut pump,
        hello_deadline,
        &mut slot,
    ) {
        ended.report(&shared, conn.id, conn.peer, pump.handler.peer_name());
    }
}

/// Read frames, answer them and write the answers, until the session ends:
/// `Ok` when the peer closed, else why it ended.
fn session(
    stream: &mut TcpStream,
    conn: &Conn,
    shared: &Shared,
    tin: &mut TlsIn,
    pump: &mut Pump<'_>,
    hello_deadline: Option<Instant>,
    slot: &mut Slot,
) -> Result<(), Ended> {
    let cfg = shared.config();
    let mut out = Vec::with_capacity(INITIAL_BUF);
    let mut sealed = Vec::with_capacity(if conn.tls.is_some() { INITIAL_BUF } else { 0 });
    let writing = |e: io::Error| Ended::writing(&e);
    let socket = |e: io::Error| Ended::new("socket_error", e.to_string());
    loop {
        loop {
            let step = pump.step(shared, &mut out);
            // A plain TCP client has authenticated once its Hello is
            // accepted: it needs a served slot before its Welcome goes out.
            if pump.session.is_ready()
                && matches!(slot, Slot::PreAuth { .. })
                && !slot.promote(shared)
            {
                out.clear();
                refuse_busy(stream, conn, shared);
                return Ok(());
            }
            match step {
                Step::NeedInput => break,
                Step::Flush => flush(conn, &mut out, &mut sealed).map_err(writing)?,
                Step::Ready => set_timeout(stream, cfg.idle_timeout).map_err(socket)?,
                Step::Close => {
                    // The error frame is the peer's to read; that the
                    // close itself failed changes nothing.
                    let _ = close_gracefully(conn, stream, &mut out);
                    return Err(Ended::closed_on(pump.session.last_error()));
                }
            }
        }
        flush(conn, &mut out, &mut sealed).map_err(writing)?;
        if !pump.session.is_ready()
            && let Some(deadline) = hello_deadline
        {
            match deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
            {
                Some(rest) => stream.set_read_timeout(Some(rest)).map_err(socket)?,
                None => return Err(Ended::new("hello_timeout", "no Hello in time")),
            }
        }
        let spin = if pump.session.take_pinged() {
            cfg.busy_poll.max(super::AFTER_PING_POLL)
        } else {
            cfg.busy_poll
        };
        match fill(stream, conn, &mut pump.session.rb, tin, spin) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Ended::reading(&e, pump.session.is_ready())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn spinning_finds_bytes_the_close_and_gives_up_at_its_budget() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        // Off: no spin at all.
        assert!(!spin_until_readable(&s, Duration::ZERO));
        // Nothing sent: gives up after its budget, without consuming anything.
        let began = Instant::now();
        assert!(!spin_until_readable(&s, Duration::from_millis(5)));
        assert!(began.elapsed() >= Duration::from_millis(5));
        // Bytes sent from another thread while it spins: found, still unread.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            c.write_all(b"x").expect("write");
            c
        });
        assert!(spin_until_readable(&s, Duration::from_secs(10)));
        let mut b = [0u8; 1];
        (&s).read_exact(&mut b).expect("read");
        assert_eq!(&b, b"x");
        // The peer's close counts as readable (the read returns 0).
        drop(writer.join().expect("writer"));
        assert!(spin_until_readable(&s, Duration::from_secs(10)));
        assert_eq!((&s).read(&mut b).expect("eof"), 0);
    }

    /// A read that brings bytes wakes the wide units for the answer's sum;
    /// the peer's close does not.
    #[test]
    fn bytes_read_wake_the_wide_units_for_the_answers_sum() {
        use engram_protocol::messages::{payload_checksum, wide_units_marked};
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (mut s, peer) = l.accept().expect("accept");
        let conn = Conn {
            id: 1,
            peer,
            stream: s.try_clone().expect("clone"),
            write_lock: Mutex::new(()),
            tls: None,
        };
        let (mut rb, mut tin) = (ReadBuf::new(INITIAL_BUF), TlsIn::new());
        let _ = payload_checksum(b"takes any mark left by another test on this thread");
        assert!(!wide_units_marked());
        c.write_all(b"hello").expect("write");
        let n = fill(&mut s, &conn, &mut rb, &mut tin, Duration::ZERO).expect("read");
        assert_eq!(n, 5);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            wide_units_marked(),
            std::arch::is_x86_feature_detected!("avx2")
        );
        // The sum takes the mark.
        let _ = payload_checksum(rb.data());
        assert!(!wide_units_marked());
        drop(c);
        let n = fill(&mut s, &conn, &mut rb, &mut tin, Duration::ZERO).expect("eof");
        assert_eq!(n, 0);
        assert!(!wide_units_marked());
    }
}
