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

use engram_protocol::{FrameHeader, HEADER_LEN};

use super::ended::Ended;
use super::handler::Handler;
use super::pump::{INITIAL_BUF, Pump, ReadBuf, Step};
use super::{Conn, Shared, Slot};

/// Ciphertext read from the socket and not yet given to rustls.
#[derive(Debug)]
struct TlsIn {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl TlsIn {
    fn new() -> Self {
        Self {
            buf: vec![0; INITIAL_BUF],
            start: 0,
            end: 0,
        }
    }
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Read more plaintext into `rb`: straight from the socket, or through the
/// connection's TLS session. The session is locked only while bytes move
/// through it, never during a blocking read, so a drain's Goodbye from
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
        return rb.read_from(stream);
    };
    loop {
        if rb.end == rb.buf.len() {
            rb.reserve_frame(rb.end - rb.start + HEADER_LEN);
        }
        {
            let mut s = session.lock().unwrap_or_else(|p| p.into_inner());
            match s.reader().read(&mut rb.buf[rb.end..]) {
                // The peer's close_notify.
                Ok(0) => return Ok(0),
                Ok(n) => {
                    rb.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if tin.start < tin.end {
                let mut pending = &tin.buf[tin.start..tin.end];
                let n = s.read_tls(&mut pending)?;
                tin.start += n;
                if let Err(e) = s.process_new_packets() {
                    // Tell the peer why (an alert) before closing.
                    let _ = s.write_tls(&mut &*stream);
                    return Err(tls_error(e));
                }
                continue;
            }
        }
        spin_until_readable(stream, spin);
        let n = stream.read(&mut tin.buf)?;
        if n == 0 {
            return Ok(0);
        }
        (tin.start, tin.end) = (0, n);
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
/// Goodbye may be written from another thread); over TLS, encrypt them
/// first, in the same critical section, so records go out in order.
fn flush(conn: &Conn, out: &mut Vec<u8>) -> io::Result<()> {
    let Some(session) = &conn.tls else {
        if out.is_empty() {
            return Ok(());
        }
        let _guard = conn.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        let r = (&conn.stream).write_all(out);
        out.clear();
        return r;
    };
    let _guard = conn.write_lock.lock().unwrap_or_else(|p| p.into_inner());
    let mut s = session.lock().unwrap_or_else(|p| p.into_inner());
    let r = cluster_config::tls::seal_and_send(&mut s, out, &mut &conn.stream);
    out.clear();
    r
}

/// Run the TLS handshake to completion by `deadline` (an absolute bound: a
/// peer trickling bytes cannot stretch it).
fn handshake(stream: &mut TcpStream, conn: &Conn, deadline: Instant) -> io::Result<()> {
    let Some(session) = &conn.tls else {
        return Ok(());
    };
    let mut s = session.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        while s.wants_write() {
            s.write_tls(stream)?;
        }
        if !s.is_handshaking() {
            return Ok(());
        }
        let rest = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(io::ErrorKind::TimedOut)?;
        stream.set_read_timeout(Some(rest))?;
        if s.read_tls(stream)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if let Err(e) = s.process_new_packets() {
            let _ = s.write_tls(stream);
            return Err(tls_error(e));
        }
    }
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
    flush(conn, out)?;
    if let Some(session) = &conn.tls {
        session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send_close_notify();
        flush(conn, out)?;
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
    if let Err(e) = handshake(stream, conn, deadline) {
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
        let s = session.lock().unwrap_or_else(|p| p.into_inner());
        let chain: super::Chain = s
            .peer_certificates()
            .map(|c| c.iter().map(|x| x.clone().into_owned()).collect())
            .unwrap_or_default();
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
    if conn.tls.is_some() {
        let deadline = hello_deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(10));
        match admit(&mut stream, &conn, &shared, deadline) {
            Ok(Some((identity, chain))) => handler.set_identity(identity, chain),
            Ok(None) | Err(_) => return,
        }
        // Authenticated: a served slot now, or a refusal inside the session.
        if !slot.promote(&shared) {
            refuse_busy(&stream, &conn, &shared);
            return;
        }
    }
    let mut pump = Pump::new(
        handler,
        ReadBuf::new(INITIAL_BUF),
        cfg.limits,
        conn.id,
        conn.peer,
        conn.tls.is_none(),
    );
    if let Err(ended) = session(
        &mut stream,
        &conn,
        &shared,
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
    pump: &mut Pump<'_>,
    hello_deadline: Option<Instant>,
    slot: &mut Slot,
) -> Result<(), Ended> {
    let cfg = shared.config();
    let mut tin = TlsIn::new();
    let mut out = Vec::with_capacity(INITIAL_BUF);
    let writing = |e: io::Error| Ended::writing(&e);
    let socket = |e: io::Error| Ended::new("socket_error", e.to_string());
    loop {
        loop {
            let step = pump.step(shared, &mut out);
            // A plain TCP client has authenticated once its Hello is
            // accepted: it needs a served slot before its Welcome goes out.
            if pump.handler.is_ready()
                && matches!(slot, Slot::PreAuth { .. })
                && !slot.promote(shared)
            {
                out.clear();
                refuse_busy(stream, conn, shared);
                return Ok(());
            }
            match step {
                Step::NeedInput => break,
                Step::Flush => flush(conn, &mut out).map_err(writing)?,
                Step::Ready => set_timeout(stream, cfg.idle_timeout).map_err(socket)?,
                Step::Close => {
                    // The error frame is the peer's to read; that the
                    // close itself failed changes nothing.
                    let _ = close_gracefully(conn, stream, &mut out);
                    return Err(Ended::closed_on(pump.handler.last_error()));
                }
            }
        }
        flush(conn, &mut out).map_err(writing)?;
        if !pump.handler.is_ready()
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
        let spin = if pump.handler.take_pinged() {
            cfg.busy_poll.max(super::AFTER_PING_POLL)
        } else {
            cfg.busy_poll
        };
        match fill(stream, conn, &mut pump.rb, &mut tin, spin) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Ended::reading(&e, pump.handler.is_ready())),
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
}
