//! The donor's side of a data-plane session, with no IO and no clock.
//!
//! The driver (a donor's connection thread or QUIC stream task) appends
//! what it reads to [`ServerSession::rb`], calls [`ServerSession::step`]
//! until it says [`Step::NeedInput`], and does what each step says: write
//! the answers, switch to the idle timeout, close. The session owns the
//! rules every donor keeps (PROTOCOL.md 3): Hello first and only once,
//! the handshake's one-frame limit, request id 0 reserved, a donor's frame
//! kinds refused from a client, an oversized Lookup refused and its
//! payload skipped with the connection kept, everything else fatal. What
//! the answers hold (the Welcome's tables, the rows) is the [`Service`]'s.

use crate::{
    ErrorCode, ErrorFrame, Frame, FrameError, FrameHeader, FrameKind, HEADER_LEN, Hello, Limits,
    LookupRef, PROTOCOL_VERSION, PROTOCOL_VERSION_V1, messages::encode_ping,
};

use super::ReadBuf;

/// Write out buffered answers once they pass this size, even mid-batch.
pub const FLUSH_AT: usize = 256 << 10;

/// What a donor serves: the answers the session cannot give by itself.
pub trait Service {
    /// A Hello of this protocol version, the connection's first frame:
    /// encode the Welcome answering request `id` into `out`, or refuse
    /// (wrong credential, say); the session then answers the refusal and
    /// closes.
    fn hello(&mut self, id: u64, hello: &Hello<'_>, out: &mut Vec<u8>) -> Result<(), Refusal>;
    /// Answer Lookup `id` into `out` (a Rows frame, or an Error frame).
    fn lookup(&mut self, id: u64, lookup: LookupRef<'_>, out: &mut Vec<u8>);
    /// Answer RegionQuery `id` for `table` into `out` (a Region frame, or
    /// an Error frame).
    fn region(&mut self, id: u64, table: u32, out: &mut Vec<u8>);
    /// An Error frame with `code` was answered by the session (to count it).
    fn answered_error(&mut self, code: ErrorCode);
    /// A Ping was answered.
    fn pinged(&mut self) {}
}

/// A [`Service`]'s refusal of a Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The error code answered.
    pub code: ErrorCode,
    /// The code's detail field.
    pub detail: u64,
    /// The explanation sent to the client.
    pub message: String,
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Every whole frame is answered: write what is buffered, then read more.
    NeedInput,
    /// What is buffered is large: write it, then step again.
    Flush,
    /// The client completed the handshake: switch to the idle timeout, then step again.
    Ready,
    /// Write what is buffered and close the session, for this reason.
    Close(Closed),
}

/// Why a session closed (the Error frame that says so is buffered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// The frame header was unreadable (bad magic or version, unknown kind).
    BadHeader,
    /// The same, and the bytes were a TLS ClientHello on a plaintext port.
    TlsOnPlaintext,
    /// A frame over the size allowed that is not a Lookup after the handshake.
    Oversized,
    /// A frame refused by its kind alone (not Hello first, a second Hello,
    /// a donor's kind, request id 0).
    RefusedKind,
    /// A frame whose payload did not parse.
    BadFrame,
    /// The Hello was refused (version, credential).
    Refused,
}

/// One session's state: the bytes read, the handshake, the limits.
#[derive(Debug)]
pub struct ServerSession {
    /// Bytes read and not yet consumed: the driver appends here.
    pub rb: ReadBuf,
    /// Bytes of a refused oversized Lookup still to discard.
    skip: usize,
    rules: Rules,
}

/// The handshake and its limits: what decides each frame's answer (apart
/// from the bytes, so a frame borrowed from them can be answered).
#[derive(Debug)]
struct Rules {
    limits: Limits,
    requests: Limits,
    ready: bool,
    plaintext: bool,
    last_error: Option<ErrorCode>,
    pinged: bool,
}

impl ServerSession {
    /// A session whose requests are bounded by `limits` (before the Hello,
    /// only a Hello fits); `plaintext` when the connection is not encrypted,
    /// so a TLS ClientHello arriving there is recognised.
    pub fn new(limits: Limits, plaintext: bool) -> Self {
        Self {
            rb: ReadBuf::default(),
            skip: 0,
            rules: Rules {
                limits: limits.before_hello(),
                requests: limits.for_requests(),
                ready: false,
                plaintext,
                last_error: None,
                pinged: false,
            },
        }
    }

    /// True once the client completed the handshake.
    pub fn is_ready(&self) -> bool {
        self.rules.ready
    }

    /// The code of the last Error frame answered (why a closed session closed).
    pub fn last_error(&self) -> Option<ErrorCode> {
        self.rules.last_error
    }

    /// Whether a Ping was answered since the last call (a node pings ahead
    /// of a lookup it knows is coming, so the driver polls for it).
    pub fn take_pinged(&mut self) -> bool {
        std::mem::take(&mut self.rules.pinged)
    }

    /// Answer whole frames in the buffer into `out` until something needs the driver.
    pub fn step<S: Service>(&mut self, svc: &mut S, out: &mut Vec<u8>) -> Step {
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
                    let tls = self.rules.plaintext && self.rb.data().starts_with(&[0x16, 0x03]);
                    self.rules.frame_error(svc, None, &e, out);
                    return Step::Close(if tls {
                        Closed::TlsOnPlaintext
                    } else {
                        Closed::BadHeader
                    });
                }
            };
            if header.payload_len > self.rules.limits.max_payload {
                if self.rules.oversized(svc, header, out) {
                    self.rb.consume(HEADER_LEN);
                    self.skip = header.payload_len as usize;
                    continue;
                }
                return Step::Close(Closed::Oversized);
            }
            if self.rb.data().len() < header.frame_len() {
                self.rb.reserve_frame(header.frame_len());
                return Step::NeedInput;
            }
            if self.rules.refuse_kind(svc, header, out) {
                return Step::Close(Closed::RefusedKind);
            }
            let payload = &self.rb.data()[HEADER_LEN..header.frame_len()];
            let next = match Frame::parse(header.kind, payload, &self.rules.limits) {
                Ok(frame) => {
                    let was_ready = self.rules.ready;
                    match self.rules.handle(svc, header, frame, out) {
                        Ok(()) if !was_ready && self.rules.ready => Some(Step::Ready),
                        Ok(()) => None,
                        Err(why) => Some(Step::Close(why)),
                    }
                }
                Err(e) => {
                    let keep = self.rules.frame_error(svc, Some(header), &e, out);
                    (!keep).then_some(Step::Close(Closed::BadFrame))
                }
            };
            self.rb.consume(header.frame_len());
            if let Some(step) = next {
                if step == Step::Ready {
                    self.rules.limits = self.rules.requests;
                }
                return step;
            }
            if out.len() >= FLUSH_AT {
                return Step::Flush;
            }
        }
    }
}

impl Rules {
    fn error<S: Service>(
        &mut self,
        svc: &mut S,
        out: &mut Vec<u8>,
        id: u64,
        code: ErrorCode,
        detail: u64,
        msg: &str,
    ) {
        svc.answered_error(code);
        self.last_error = Some(code);
        ErrorFrame {
            code,
            table_id: None,
            detail,
            message: msg,
        }
        .encode(out, id);
    }

    /// Answer a frame whose declared payload is over the limit; true when
    /// the connection stays (its payload is then skipped). After the
    /// handshake a Lookup that large is over the row or section cap
    /// whatever it holds: `request_too_large`, and the connection stays (as
    /// for a Lookup over the caps that fits the frame cap). Any other frame
    /// is `frame_too_large` and the connection closes.
    fn oversized<S: Service>(&mut self, svc: &mut S, h: FrameHeader, out: &mut Vec<u8>) -> bool {
        if self.ready && h.kind == FrameKind::Lookup && h.request_id != 0 {
            let max_rows = self.limits.max_rows;
            let msg = format!(
                "a Lookup of {} bytes is over the caps ({max_rows} rows, {} sections)",
                h.payload_len, self.limits.max_sections
            );
            let code = ErrorCode::RequestTooLarge;
            self.error(svc, out, h.request_id, code, u64::from(max_rows), &msg);
            return true;
        }
        let max = self.limits.max_payload;
        let e = FrameError::TooLarge {
            len: h.payload_len,
            max,
        };
        let msg = e.to_string();
        self.error(svc, out, h.request_id, e.code(), u64::from(max), &msg);
        false
    }

    /// Answer a frame that failed to parse (`header` is `None` when even
    /// the header was bad); true when the connection stays. Only a Lookup
    /// over the caps keeps it: its framing is intact and the client may
    /// split the request.
    fn frame_error<S: Service>(
        &mut self,
        svc: &mut S,
        header: Option<FrameHeader>,
        e: &FrameError,
        out: &mut Vec<u8>,
    ) -> bool {
        let detail = match e {
            FrameError::TooLarge { max, .. }
            | FrameError::TooManyRows { max, .. }
            | FrameError::TooManySections { max, .. } => u64::from(*max),
            _ => 0,
        };
        let id = header.map_or(0, |h| h.request_id);
        self.error(svc, out, id, e.code(), detail, &e.to_string());
        let lookup = header.is_some_and(|h| h.kind == FrameKind::Lookup);
        !e.is_fatal() && self.ready && lookup
    }

    /// Refuse a frame by its header alone, before its payload is parsed:
    /// anything but a Hello first, a donor's frame kind from a client, a
    /// second Hello, and a request with id 0 (reserved for unsolicited
    /// frames, so its answer could not be told from one). `malformed` with
    /// the frame's kind as detail; true when refused (the connection closes).
    fn refuse_kind<S: Service>(&mut self, svc: &mut S, h: FrameHeader, out: &mut Vec<u8>) -> bool {
        let msg = match h.kind {
            FrameKind::Hello if !self.ready => return false,
            _ if !self.ready => "the first frame on a connection must be Hello",
            FrameKind::Lookup | FrameKind::Ping | FrameKind::RegionQuery if h.request_id == 0 => {
                "request id 0 is reserved for unsolicited frames"
            }
            FrameKind::Lookup | FrameKind::Ping | FrameKind::Pong | FrameKind::RegionQuery => {
                return false;
            }
            FrameKind::Hello => "Hello again after the handshake",
            FrameKind::Welcome
            | FrameKind::Rows
            | FrameKind::Error
            | FrameKind::Goodbye
            | FrameKind::Region => "a donor's frame kind from a client",
        };
        let id = if matches!(
            h.kind,
            FrameKind::Lookup | FrameKind::Ping | FrameKind::RegionQuery
        ) {
            0
        } else {
            h.request_id
        };
        self.error(svc, out, id, ErrorCode::Malformed, h.kind as u64, msg);
        true
    }

    /// Answer one parsed frame (its kind already admitted by [`Self::refuse_kind`]).
    fn handle<S: Service>(
        &mut self,
        svc: &mut S,
        h: FrameHeader,
        frame: Frame<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), Closed> {
        let id = h.request_id;
        match frame {
            Frame::Hello(hello) if !self.ready => self.hello(svc, id, &hello, out),
            Frame::Lookup(l) if self.ready => {
                svc.lookup(id, l, out);
                Ok(())
            }
            Frame::Ping if self.ready => {
                encode_ping(out, id, true);
                self.pinged = true;
                svc.pinged();
                Ok(())
            }
            Frame::Pong if self.ready => Ok(()),
            Frame::RegionQuery(q) if self.ready => {
                svc.region(id, q.table_id, out);
                Ok(())
            }
            // Unreachable past refuse_kind; refused the same way if it were not.
            _ => {
                let msg = "unexpected frame kind from a client";
                self.error(svc, out, id, ErrorCode::Malformed, h.kind as u64, msg);
                Err(Closed::RefusedKind)
            }
        }
    }

    fn hello<S: Service>(
        &mut self,
        svc: &mut S,
        id: u64,
        hello: &Hello<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), Closed> {
        let refusal = if !(PROTOCOL_VERSION_V1..=PROTOCOL_VERSION).contains(&hello.version) {
            Refusal {
                code: ErrorCode::UnsupportedVersion,
                detail: u64::from(PROTOCOL_VERSION),
                message: format!(
                    "this donor speaks protocol versions {PROTOCOL_VERSION_V1} to {PROTOCOL_VERSION}, the client {}",
                    hello.version
                ),
            }
        } else {
            let mark = out.len();
            match svc.hello(id, hello, out) {
                Ok(()) => {
                    self.ready = true;
                    return Ok(());
                }
                Err(r) => {
                    out.truncate(mark);
                    r
                }
            }
        };
        self.error(svc, out, id, refusal.code, refusal.detail, &refusal.message);
        Err(Closed::Refused)
    }
}
