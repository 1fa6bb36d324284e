//! Frames in, answers out, for one client session whatever carries it
//! (a TCP or TLS connection's thread, a QUIC stream's task): the buffer of
//! bytes read, the handshake and request limits, a refused oversized
//! Lookup's bytes still to discard, and the handler. The driver reads into
//! `rb`, calls [`Pump::step`] until it needs input, and does what each
//! step says.

use std::io::{self, Read};
use std::net::SocketAddr;

use engram_protocol::{Frame, FrameHeader, HEADER_LEN, Limits};

use super::Shared;
use super::handler::{Action, Handler};

/// Initial read and write buffer size.
pub(super) const INITIAL_BUF: usize = 64 << 10;
/// Write out buffered answers once they pass this size, even mid-batch.
pub(super) const FLUSH_AT: usize = 256 << 10;

/// A read buffer with explicit start and end, zero-filled once when it grows
/// (not on every read) and bounded by the largest frame allowed.
#[derive(Debug)]
pub(super) struct ReadBuf {
    pub(super) buf: Vec<u8>,
    pub(super) start: usize,
    pub(super) end: usize,
}

impl ReadBuf {
    pub(super) fn new(size: usize) -> Self {
        Self {
            buf: vec![0; size],
            start: 0,
            end: 0,
        }
    }

    pub(super) fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    pub(super) fn consume(&mut self, n: usize) {
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
    pub(super) fn reserve_frame(&mut self, frame_len: usize) {
        if self.start + frame_len > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if frame_len > self.buf.len() {
            self.buf.resize(frame_len, 0);
        }
    }

    pub(super) fn read_from(&mut self, r: &mut impl Read) -> io::Result<usize> {
        if self.end == self.buf.len() {
            self.reserve_frame(self.end - self.start + HEADER_LEN);
        }
        let n = r.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Every whole frame is answered: write `out`, then read more.
    NeedInput,
    /// `out` is large: write it, then step again.
    Flush,
    /// The client completed the handshake: switch to the idle timeout, then step again.
    Ready,
    /// Write `out` and close the session.
    Close,
}

/// One session's frame processing.
#[derive(Debug)]
pub(super) struct Pump<'a> {
    pub(super) handler: Handler<'a>,
    pub(super) rb: ReadBuf,
    limits: Limits,
    requests: Limits,
    skip: usize,
    conn: u64,
    peer: SocketAddr,
    plaintext: bool,
}

impl<'a> Pump<'a> {
    /// A session under `limits` (before Hello only a Hello fits); `plaintext`
    /// when it is not encrypted (a TLS ClientHello there is recognised).
    pub(super) fn new(
        handler: Handler<'a>,
        rb: ReadBuf,
        limits: Limits,
        conn: u64,
        peer: SocketAddr,
        plaintext: bool,
    ) -> Self {
        Self {
            handler,
            rb,
            limits: limits.before_hello(),
            requests: limits.for_requests(),
            skip: 0,
            conn,
            peer,
            plaintext,
        }
    }

    /// Answer whole frames in the buffer into `out` until something needs the driver.
    pub(super) fn step(&mut self, shared: &Shared, out: &mut Vec<u8>) -> Step {
        let (conn, peer) = (self.conn, self.peer);
        loop {
            if self.skip > 0 {
                let n = self.skip.min(self.rb.data().len());
                self.rb.consume(n);
                self.skip -= n;
                if self.skip > 0 {
                    return Step::NeedInput;
                }
            }
            let header = match FrameHeader::peek_unbounded(self.rb.data()) {
                Ok(Some(h)) => h,
                Ok(None) => return Step::NeedInput,
                Err(e) => {
                    if self.plaintext && self.rb.data().starts_with(&[0x16, 0x03]) {
                        shared.stats.refusal("data", "tls_on_plaintext_port");
                        if let Some(suppressed) = super::CONN_WARN.allow() {
                            tracing::warn!(conn, %peer, suppressed, "a TLS client on a plaintext port: refused (it must dial tcp://)");
                        }
                    }
                    tracing::debug!(conn, %peer, error = %e, "bad frame header; closing");
                    self.handler.frame_error(None, &e, out);
                    return Step::Close;
                }
            };
            if header.payload_len > self.limits.max_payload {
                tracing::debug!(conn, %peer, kind = ?header.kind, len = header.payload_len, "oversized frame");
                match self.handler.oversized(header, self.limits.max_payload, out) {
                    Action::Skip(n) => {
                        self.rb.consume(HEADER_LEN);
                        self.skip = n;
                        continue;
                    }
                    _ => return Step::Close,
                }
            }
            if self.rb.data().len() < header.frame_len() {
                self.rb.reserve_frame(header.frame_len());
                return Step::NeedInput;
            }
            let payload = &self.rb.data()[HEADER_LEN..header.frame_len()];
            if let Some(action) = self.handler.refuse_kind(header, out) {
                tracing::debug!(conn, %peer, kind = ?header.kind, id = header.request_id, "frame refused by kind; closing");
                debug_assert_eq!(action, Action::Close);
                return Step::Close;
            }
            let action = match Frame::parse(header.kind, payload, &self.limits) {
                Ok(frame) => self.handler.handle(header, frame, out),
                Err(e) => {
                    tracing::debug!(conn, %peer, error = %e, "bad frame");
                    self.handler.frame_error(Some(header), &e, out)
                }
            };
            self.rb.consume(header.frame_len());
            match action {
                Action::Continue | Action::Skip(_) => {}
                Action::Ready => {
                    tracing::debug!(conn, %peer, node = self.handler.peer_name(), "client ready");
                    self.limits = self.requests;
                    return Step::Ready;
                }
                Action::Close => return Step::Close,
            }
            if out.len() >= FLUSH_AT {
                return Step::Flush;
            }
        }
    }
}
