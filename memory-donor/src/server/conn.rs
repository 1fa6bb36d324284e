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

use engram_protocol::{Frame, FrameHeader, HEADER_LEN};

use super::handler::{Action, Handler};
use super::{Conn, Shared};

/// Initial read and write buffer size.
const INITIAL_BUF: usize = 64 << 10;
/// Write out buffered answers once they pass this size, even mid-batch.
const FLUSH_AT: usize = 256 << 10;

/// A read buffer with explicit start and end, zero-filled once when it grows
/// (not on every read) and bounded by the largest frame allowed.
#[derive(Debug)]
struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl ReadBuf {
    fn new(size: usize) -> Self {
        Self {
            buf: vec![0; size],
            start: 0,
            end: 0,
        }
    }

    fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // Give back what one large request needed.
            if self.buf.len() > 4 * INITIAL_BUF {
                self.buf.truncate(INITIAL_BUF);
                self.buf.shrink_to_fit();
            }
        }
    }

    /// Make room for a frame of `frame_len` bytes (already bounded by the
    /// codec's maximum) to be fully buffered.
    fn reserve_frame(&mut self, frame_len: usize) {
        if self.start + frame_len > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if frame_len > self.buf.len() {
            self.buf.resize(frame_len, 0);
        }
    }

    fn read_from(&mut self, r: &mut impl Read) -> io::Result<usize> {
        if self.end == self.buf.len() {
            self.reserve_frame(self.end - self.start + HEADER_LEN);
        }
        let n = r.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

/// Write buffered answers under the connection's write lock (a drain's
/// Goodbye may be written from another thread).
fn flush(conn: &Conn, out: &mut Vec<u8>) -> io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let _guard = conn.write_lock.lock().unwrap_or_else(|p| p.into_inner());
    let r = (&conn.stream).write_all(out);
    out.clear();
    r
}

/// Write the last answers (an error frame, usually), then half-close and
/// discard what the peer still sends for a moment: closing with unread data
/// would reset the connection and lose the error before the peer reads it.
/// All of it within 200 ms and 64 KiB, however the peer trickles.
fn close_gracefully(conn: &Conn, stream: &TcpStream, out: &mut Vec<u8>) -> io::Result<()> {
    flush(conn, out)?;
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

/// Read timeout: zero means none.
fn set_timeout(stream: &TcpStream, t: Duration) -> io::Result<()> {
    stream.set_read_timeout(if t.is_zero() { None } else { Some(t) })
}

/// Serve one connection until the peer closes, a timeout passes, a fatal
/// frame arrives, or the drain force-closes it.
pub(super) fn serve(mut stream: TcpStream, conn: Arc<Conn>, shared: Arc<Shared>) -> io::Result<()> {
    let cfg = shared.config();
    stream.set_nodelay(true)?;
    stream.set_write_timeout(if cfg.write_timeout.is_zero() {
        None
    } else {
        Some(cfg.write_timeout)
    })?;
    // Before the handshake only a Hello fits, and the Hello must arrive by an
    // absolute deadline (a read timeout alone restarts with every byte).
    let hello_deadline = (!cfg.hello_timeout.is_zero()).then(|| Instant::now() + cfg.hello_timeout);
    let (before_hello, requests) = (cfg.limits.before_hello(), cfg.limits.for_requests());
    let mut limits = before_hello;
    let mut rb = ReadBuf::new(INITIAL_BUF);
    let mut out = Vec::with_capacity(INITIAL_BUF);
    let mut handler = Handler::new(&shared, Arc::clone(&cfg));
    // Bytes of a refused oversized Lookup still to discard as they arrive.
    let mut skip = 0usize;
    loop {
        loop {
            if skip > 0 {
                let n = skip.min(rb.data().len());
                rb.consume(n);
                skip -= n;
                if skip > 0 {
                    break;
                }
            }
            let header = match FrameHeader::peek_unbounded(rb.data()) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(conn = conn.id, peer = %conn.peer, error = %e, "bad frame header; closing");
                    handler.frame_error(None, &e, &mut out);
                    return close_gracefully(&conn, &stream, &mut out);
                }
            };
            if header.payload_len > limits.max_payload {
                tracing::debug!(conn = conn.id, peer = %conn.peer, kind = ?header.kind, len = header.payload_len, "oversized frame");
                match handler.oversized(header, limits.max_payload, &mut out) {
                    Action::Skip(n) => {
                        rb.consume(HEADER_LEN);
                        skip = n;
                        continue;
                    }
                    _ => return close_gracefully(&conn, &stream, &mut out),
                }
            }
            if rb.data().len() < header.frame_len() {
                rb.reserve_frame(header.frame_len());
                break;
            }
            let payload = &rb.data()[HEADER_LEN..header.frame_len()];
            if let Some(action) = handler.refuse_kind(header, &mut out) {
                tracing::debug!(conn = conn.id, peer = %conn.peer, kind = ?header.kind, id = header.request_id, "frame refused by kind; closing");
                debug_assert_eq!(action, Action::Close);
                return close_gracefully(&conn, &stream, &mut out);
            }
            let action = match Frame::parse(header.kind, payload, &limits) {
                Ok(frame) => handler.handle(header, frame, &mut out),
                Err(e) => {
                    tracing::debug!(conn = conn.id, peer = %conn.peer, error = %e, "bad frame");
                    handler.frame_error(Some(header), &e, &mut out)
                }
            };
            rb.consume(header.frame_len());
            match action {
                Action::Continue | Action::Skip(_) => {}
                Action::Ready => {
                    tracing::debug!(conn = conn.id, peer = %conn.peer, node = handler.peer_name(), "client ready");
                    limits = requests;
                    set_timeout(&stream, cfg.idle_timeout)?;
                }
                Action::Close => return close_gracefully(&conn, &stream, &mut out),
            }
            if out.len() >= FLUSH_AT {
                flush(&conn, &mut out)?;
            }
        }
        flush(&conn, &mut out)?;
        if !handler.is_ready()
            && let Some(deadline) = hello_deadline
        {
            match deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
            {
                Some(rest) => stream.set_read_timeout(Some(rest))?,
                None => return Err(io::ErrorKind::TimedOut.into()),
            }
        }
        match rb.read_from(&mut stream) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
