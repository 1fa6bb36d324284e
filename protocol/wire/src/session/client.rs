//! The node's side of a data-plane session, with no IO and no clock.
//!
//! A [`ClientSession`] holds what the protocol asks a client to keep
//! (PROTOCOL.md 3): the Hello it sends and the Welcome it checks against
//! the pinned table versions, the request ids it hands out, the requests in
//! flight (each with the driver's own per-request state `T`: a waker, a
//! reply), which answer goes to which request, the Goodbye after which
//! nothing new is sent, and the moment a drained session may close. The
//! driver (the node's async client) does the IO: it writes what the session
//! encodes and hands it every whole frame it reads. Time is passed in.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::messages::{
    LookupSection, ROWS_HEAD_LEN, ROWS_SECTION_LEN, RowsRef, encode_lookup, encode_ping,
};
use crate::{
    ErrorCode, Frame, FrameError, FrameHeader, FrameKind, HEADER_LEN, Hello, Limits, RegionQuery,
    TableDigest, TableInfo, decode,
};

/// Why a donor could not serve a request: the session's verdicts, and its
/// driver's own (a failed connect, a deadline). Typed, so a caller decides
/// from the kind whether another source may do better
/// ([`SessionError::retry_elsewhere`]), not from strings.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SessionError {
    /// The connection could not be made (by the driver: dialing, the TLS
    /// or QUIC handshake).
    #[error("connecting to {addr}: {message}")]
    Connect {
        /// The donor's address.
        addr: SocketAddr,
        /// Why the connection failed.
        message: String,
    },
    /// No answer in time (the driver's deadline).
    #[error("timed out after {0:?} waiting for the donor")]
    Timeout(Duration),
    /// The donor refused the handshake (busy, unauthorized, version, draining).
    #[error("donor refused the connection: {code}: {message}")]
    Refused {
        /// The donor's error code.
        code: ErrorCode,
        /// The donor's explanation.
        message: String,
    },
    /// The donor serves this table at another version than the one pinned.
    #[error("donor {donor} serves table {table} at digest {advertised}, not the pinned {pinned}")]
    DigestMismatch {
        /// The donor's name, as its Welcome gives it.
        donor: String,
        /// The table id.
        table: u32,
        /// The version the client pinned.
        pinned: TableDigest,
        /// The version the donor serves.
        advertised: TableDigest,
    },
    /// The donor does not serve a pinned table.
    #[error("donor {donor} does not serve table {table}")]
    TableMissing {
        /// The donor's name, as its Welcome gives it.
        donor: String,
        /// The pinned table id it does not serve.
        table: u32,
    },
    /// The caller asked for a table it did not pin (a caller bug).
    #[error("table {0} was not pinned when connecting")]
    NotPinned(u32),
    /// One section of an answer failed.
    #[error("donor answered table {table} with {code}")]
    Section {
        /// The table id of the failed section.
        table: u32,
        /// The donor's error code for it.
        code: ErrorCode,
    },
    /// The donor answered the request with a typed error.
    #[error("donor error {code}: {message}")]
    Donor {
        /// The donor's error code.
        code: ErrorCode,
        /// The donor's explanation.
        message: String,
    },
    /// The answer's checksum did not match: its rows were discarded.
    #[error("corrupt answer: {0}")]
    Corrupt(String),
    /// The donor broke the protocol; the session is closed.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The session is gone (the donor closed it, or the connection failed).
    #[error("connection lost: {0}")]
    Disconnected(String),
    /// The donor said Goodbye: it takes no new requests.
    #[error("donor is draining")]
    Draining,
    /// The request itself is wrong (a caller bug): buffer size, row count.
    #[error("bad request: {0}")]
    BadRequest(String),
}

impl SessionError {
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

/// Parse a whole frame; a checksum failure is `Corrupt`, anything else `Protocol`.
pub fn parse<'a>(
    frame: &'a [u8],
    limits: &Limits,
) -> Result<(FrameHeader, Frame<'a>), SessionError> {
    match decode(frame, limits) {
        Ok(Some(d)) => Ok((d.header, d.frame)),
        Ok(None) => Err(SessionError::Protocol("incomplete frame".into())),
        Err(e @ FrameError::Checksum { .. }) => Err(SessionError::Corrupt(e.to_string())),
        Err(e) => Err(SessionError::Protocol(e.to_string())),
    }
}

/// What a client says about itself and expects of a donor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// The name sent in Hello.
    pub node: String,
    /// The credential sent in Hello (empty for none; over TLS and QUIC the
    /// certificate is the proof and none is sent).
    pub credential: Vec<u8>,
    /// Tables and the digests they must have; a donor that differs is refused.
    pub pinned: Vec<(u32, TableDigest)>,
    /// Largest lookup this client sends (rows); answers are bounded by it.
    pub max_rows: u32,
    /// The protocol version it says in Hello: [`PROTOCOL_VERSION_V1`] for
    /// tables of V4.1's rows (what every donor answers), 2 to see tables
    /// of any encoding (PROTOCOL.md 3.3).
    pub version: u16,
}

/// One section of a lookup: rows of one pinned table.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Table id.
    pub table: u32,
    /// Row ids, answered in this order.
    pub rows: &'a [u64],
}

/// What a request asked, and so which answers fit it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A Lookup: answered by Rows or Error.
    Lookup,
    /// A Ping: answered by Pong or Error.
    Ping,
    /// A RegionQuery: answered by Region or Error.
    Region,
}

impl Kind {
    fn answered_by(self, kind: FrameKind) -> bool {
        matches!(
            (self, kind),
            (_, FrameKind::Error)
                | (Self::Lookup, FrameKind::Rows)
                | (Self::Ping, FrameKind::Pong)
                | (Self::Region, FrameKind::Region)
        )
    }
}

/// Where a session is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// The Hello is out; the Welcome is awaited.
    Hello,
    /// Requests flow.
    Ready,
    /// The donor said Goodbye: in-flight requests finish, nothing new goes out.
    Draining,
    /// Ended, for this reason.
    Closed(SessionError),
}

/// What a whole frame from the donor was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    /// The answer to in-flight request `id` (its state: [`ClientSession::slot`]).
    Answer(u64),
    /// The answer to a request no longer waited for (cancelled): dropped.
    Stale,
    /// The donor said Goodbye: the session drains.
    Goodbye,
}

/// One request in flight.
#[derive(Debug)]
struct InFlight<T> {
    id: u64,
    kind: Kind,
    answered: bool,
    slot: T,
}

/// A reading gap after which what the donor sent meanwhile (a Goodbye, the
/// end of the connection) may be waiting unread; back-to-back requests
/// skip the check, their readers see such frames anyway.
pub const IDLE_AFTER: Duration = Duration::from_millis(1);

/// The node's side of one session; `T` is the driver's state per request.
#[derive(Debug)]
pub struct ClientSession<T = ()> {
    config: ClientConfig,
    state: State,
    /// Bounds the donor's answers.
    limits: Limits,
    next_id: u64,
    in_flight: Vec<InFlight<T>>,
    donor: String,
    tables: Vec<TableInfo>,
    /// `(table, digest prefix)` of each pinned table, once welcomed.
    pins: Vec<(u32, u64)>,
    /// The donor said Goodbye (whatever ended the session since).
    goodbye: bool,
    last_read: Option<Instant>,
}

impl<T> ClientSession<T> {
    /// A session that has said nothing yet.
    pub fn new(config: ClientConfig) -> Self {
        Self {
            limits: Limits::for_rows(config.max_rows.max(1)),
            config,
            state: State::Hello,
            next_id: 1,
            in_flight: Vec::new(),
            donor: String::new(),
            tables: Vec::new(),
            pins: Vec::new(),
            goodbye: false,
            last_read: None,
        }
    }

    /// Encode the Hello (request id 0), the session's first frame.
    pub fn hello(&self, out: &mut Vec<u8>) -> Result<(), SessionError> {
        Hello {
            version: self.config.version,
            node: &self.config.node,
            credential: &self.config.credential,
        }
        .encode(out, 0)
        .map_err(|e| SessionError::BadRequest(e.to_string()))
    }

    /// The limits the donor's frames must keep.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Take the frame answering the Hello: a Welcome whose tables include
    /// every pinned one at its pinned version readies the session; anything
    /// else closes it, with why.
    pub fn welcome(&mut self, frame: &[u8]) -> Result<(), SessionError> {
        let r = self.check_welcome(frame);
        if let Err(e) = &r {
            self.state = State::Closed(e.clone());
        }
        r
    }

    fn check_welcome(&mut self, frame: &[u8]) -> Result<(), SessionError> {
        if self.state != State::Hello {
            return Err(SessionError::Protocol("a second Welcome".into()));
        }
        let (donor, tables, max_rows) = match parse(frame, &self.limits)?.1 {
            Frame::Welcome(w) if w.version == self.config.version => (
                w.donor.to_string(),
                w.tables().collect::<Vec<_>>(),
                w.max_rows,
            ),
            Frame::Welcome(w) => {
                return Err(SessionError::Protocol(format!(
                    "donor speaks protocol version {}, this client {}",
                    w.version, self.config.version
                )));
            }
            Frame::Error(e) => {
                return Err(SessionError::Refused {
                    code: e.code,
                    message: e.message.to_string(),
                });
            }
            Frame::Goodbye(_) => {
                self.goodbye = true;
                return Err(SessionError::Draining);
            }
            _ => return Err(SessionError::Protocol("expected Welcome".into())),
        };
        let mut pins = Vec::with_capacity(self.config.pinned.len());
        for &(table, digest) in &self.config.pinned {
            let t = tables.iter().find(|t| t.table_id == table).ok_or_else(|| {
                SessionError::TableMissing {
                    donor: donor.clone(),
                    table,
                }
            })?;
            if t.digest != digest {
                return Err(SessionError::DigestMismatch {
                    donor,
                    table,
                    pinned: digest,
                    advertised: t.digest,
                });
            }
            pins.push((table, digest.prefix()));
        }
        // Requests are bounded by the smaller of the two row caps.
        self.limits = Limits::for_rows(max_rows.min(self.config.max_rows).max(1));
        (self.donor, self.tables, self.pins) = (donor, tables, pins);
        self.state = State::Ready;
        Ok(())
    }

    /// The donor's name (from Welcome).
    pub fn donor(&self) -> &str {
        &self.donor
    }

    /// The tables the donor announced.
    pub fn tables(&self) -> &[TableInfo] {
        &self.tables
    }

    /// True once the donor said Goodbye (even if the session ended since:
    /// the donor closing its side after a Goodbye is the drain ending).
    pub fn is_draining(&self) -> bool {
        self.goodbye
    }

    /// Why the session ended, once it has.
    pub fn closed(&self) -> Option<&SessionError> {
        match &self.state {
            State::Closed(e) => Some(e),
            _ => None,
        }
    }

    /// End the session for `why` (kept if it already ended); every
    /// in-flight request's slot is handed to `fail`, which tells its owner.
    pub fn close(&mut self, why: SessionError, mut fail: impl FnMut(&mut T, &SessionError)) {
        if !matches!(self.state, State::Closed(_)) {
            self.state = State::Closed(why);
        }
        let State::Closed(why) = &self.state else {
            return;
        };
        for f in &mut self.in_flight {
            fail(&mut f.slot, why);
        }
    }

    /// Start a request of `kind`: its id, with `slot` kept for it until
    /// [`Self::finish`]. Refused once the donor said Goodbye or the session
    /// ended.
    pub fn begin(&mut self, kind: Kind, slot: T) -> Result<u64, SessionError> {
        match &self.state {
            State::Ready => {}
            State::Hello => return Err(SessionError::BadRequest("no Welcome yet".into())),
            State::Draining => return Err(SessionError::Draining),
            State::Closed(e) => return Err(e.clone()),
        }
        let id = self.next_id;
        self.next_id += 1;
        self.in_flight.push(InFlight {
            id,
            kind,
            answered: false,
            slot,
        });
        Ok(id)
    }

    /// The state kept for in-flight request `id`.
    pub fn slot(&mut self, id: u64) -> Option<&mut T> {
        self.in_flight
            .iter_mut()
            .find(|f| f.id == id)
            .map(|f| &mut f.slot)
    }

    /// Request `id` is done (answered, failed, or cancelled): a late answer
    /// to it is dropped. True when that leaves a drained session with
    /// nothing in flight: the driver then closes its side, and the session
    /// is closed as drained.
    pub fn finish(&mut self, id: u64) -> bool {
        if let Some(i) = self.in_flight.iter().position(|f| f.id == id) {
            self.in_flight.swap_remove(i);
        }
        self.close_if_drained()
    }

    /// After a Goodbye, once nothing is in flight: true the first time
    /// (the driver closes its side, so the donor's drain does not wait).
    pub fn close_if_drained(&mut self) -> bool {
        if self.state == State::Draining && self.in_flight.is_empty() {
            self.state = State::Closed(SessionError::Draining);
            return true;
        }
        false
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// A frame was read at `now`.
    pub fn read_at(&mut self, now: Instant) {
        self.last_read = Some(now);
    }

    /// True when nothing was read for [`IDLE_AFTER`] before `now` (or ever).
    pub fn idle(&self, now: Instant) -> bool {
        self.last_read
            .is_none_or(|t| now.saturating_duration_since(t) >= IDLE_AFTER)
    }

    /// Take a whole frame read from the donor (at least its header: the
    /// payload is read only for an unsolicited Error). An answer goes to
    /// the request it answers; a Goodbye starts the drain. Anything the
    /// protocol does not allow closes the session, and is the error.
    pub fn receive(&mut self, frame: &[u8]) -> Result<Incoming, SessionError> {
        let r = self.route(frame);
        if let Err(e) = &r {
            self.close(e.clone(), |_, _| {});
        }
        r
    }

    fn route(&mut self, frame: &[u8]) -> Result<Incoming, SessionError> {
        if let State::Closed(e) = &self.state {
            return Err(e.clone());
        }
        let h = match FrameHeader::peek(frame, &self.limits) {
            Ok(Some(h)) => h,
            Ok(None) => return Err(SessionError::Protocol("incomplete frame header".into())),
            Err(e) => return Err(SessionError::Protocol(e.to_string())),
        };
        match h.kind {
            FrameKind::Rows | FrameKind::Error | FrameKind::Pong | FrameKind::Region
                if h.request_id != 0 =>
            {
                if h.request_id >= self.next_id {
                    return Err(SessionError::Protocol(format!(
                        "an answer to request {}, never sent",
                        h.request_id
                    )));
                }
                let Some(f) = self.in_flight.iter_mut().find(|f| f.id == h.request_id) else {
                    return Ok(Incoming::Stale);
                };
                if f.answered {
                    return Err(SessionError::Protocol(format!(
                        "a second answer to request {}",
                        h.request_id
                    )));
                }
                if !f.kind.answered_by(h.kind) {
                    return Err(SessionError::Protocol(format!(
                        "a {:?} frame answering a {:?}",
                        h.kind, f.kind
                    )));
                }
                f.answered = true;
                Ok(Incoming::Answer(h.request_id))
            }
            FrameKind::Goodbye => {
                self.goodbye = true;
                if self.state == State::Ready {
                    self.state = State::Draining;
                }
                Ok(Incoming::Goodbye)
            }
            FrameKind::Error => {
                // An unsolicited error (request id 0) ends the session.
                let msg = match parse(frame, &self.limits) {
                    Ok((_, Frame::Error(e))) => format!("{}: {}", e.code, e.message),
                    _ => "unreadable error frame".into(),
                };
                Err(SessionError::Disconnected(format!(
                    "donor closed the connection: {msg}"
                )))
            }
            k => Err(SessionError::Protocol(format!(
                "unexpected {k:?} frame from the donor"
            ))),
        }
    }

    /// The sections of a lookup of `requests` (each table pinned), into
    /// `into`; refused over the connection's caps ([`sections`]).
    pub fn sections<'r>(
        &self,
        requests: &[Request<'r>],
        into: &mut impl Extend<LookupSection<'r>>,
    ) -> Result<(), SessionError> {
        sections(&self.limits, &self.pins, requests, into)
    }

    /// `(table, digest prefix)` of each pinned table, once welcomed; with
    /// [`Self::limits`], all [`sections`] needs (neither changes after the
    /// Welcome, so a driver may keep copies and build requests without
    /// the session).
    pub fn pins(&self) -> &[(u32, u64)] {
        &self.pins
    }
}

/// The sections of a lookup of `requests` into `into`, each table's
/// digest prefix taken from `pins` (`(table, prefix)`, as
/// [`ClientSession::pins`]); refused over `limits`' caps or for a table
/// not pinned.
pub fn sections<'r>(
    limits: &Limits,
    pins: &[(u32, u64)],
    requests: &[Request<'r>],
    into: &mut impl Extend<LookupSection<'r>>,
) -> Result<(), SessionError> {
    let total: usize = requests.iter().map(|r| r.rows.len()).sum();
    if total > limits.max_rows as usize || requests.len() > limits.max_sections as usize {
        return Err(SessionError::BadRequest(format!(
            "{total} rows in {} sections exceed this connection's caps of {} rows and {} sections",
            requests.len(),
            limits.max_rows,
            limits.max_sections
        )));
    }
    for r in requests {
        let prefix = pins
            .iter()
            .find(|p| p.0 == r.table)
            .ok_or(SessionError::NotPinned(r.table))?
            .1;
        into.extend([LookupSection {
            table_id: r.table,
            digest_prefix: prefix,
            rows: r.rows,
        }]);
    }
    Ok(())
}

/// The rows of a whole answer to a Lookup of `requests`, checked
/// against them, copied into `out` back to back. `sizes[k]` is the row
/// size request `k`'s table was announced with, in the wire's form (0 for
/// V4.1's 264: [`wire_row_bytes`]); an empty `sizes` expects 264 bytes
/// everywhere.
pub fn rows(
    limits: &Limits,
    frame: &[u8],
    requests: &[Request<'_>],
    sizes: &[u16],
    out: &mut [u8],
) -> Result<(), SessionError> {
    let rows: RowsRef<'_> = match parse(frame, limits)?.1 {
        Frame::Rows(rows) => rows,
        Frame::Error(e) => {
            return Err(SessionError::Donor {
                code: e.code,
                message: e.message.to_string(),
            });
        }
        _ => return Err(violation("Lookup")),
    };
    if rows.section_count() as usize != requests.len() {
        return Err(violation("Lookup (section count)"));
    }
    let mut at = 0;
    for (k, ((s, data), req)) in rows.sections().zip(requests).enumerate() {
        if s.table_id != req.table {
            return Err(violation("Lookup (section order)"));
        }
        let want = sizes.get(k).copied().unwrap_or(0);
        if s.status.is_none() && s.row_bytes != want {
            return Err(violation("Lookup (row size)"));
        }
        if let Some(code) = s.status {
            return Err(SessionError::Section {
                table: s.table_id,
                code,
            });
        }
        if data.len() != req.rows.len() * s.row_size() || at + data.len() > out.len() {
            return Err(violation("Lookup (row count)"));
        }
        out[at..at + data.len()].copy_from_slice(data);
        at += data.len();
    }
    Ok(())
}

/// The head of a Rows answer (header, checksum, counts, sections) whose
/// rows were read elsewhere (and checksummed there): its sections must
/// be the request's, in order, each served with its row count.
pub fn placed(head: &[u8], requests: &[Request<'_>], sizes: &[u16]) -> Result<(), SessionError> {
    let u32_at = |i: usize| {
        head.get(i..i + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_le_bytes)
    };
    let base = HEADER_LEN + 8;
    if u32_at(base) != Some(requests.len() as u32) || u32_at(base + 4) != Some(0) {
        return Err(violation("Lookup (section count)"));
    }
    for (k, req) in requests.iter().enumerate() {
        let e = base + 8 + ROWS_SECTION_LEN * k;
        let (Some(table), Some(status), Some(rows)) = (u32_at(e), u32_at(e + 4), u32_at(e + 8))
        else {
            return Err(violation("Lookup (sections)"));
        };
        if table != req.table {
            return Err(violation("Lookup (section order)"));
        }
        // Status (low half) is 0 when served and the row size (high half)
        // the table's; a failed section has no rows, so its answer is
        // never read this way.
        let want = u32::from(sizes.get(k).copied().unwrap_or(0)) << 16;
        if status != want || rows as usize != req.rows.len() {
            return Err(violation("Lookup (row count)"));
        }
    }
    Ok(())
}

/// The answer to a Ping: Ok for a Pong.
pub fn pong(limits: &Limits, frame: &[u8]) -> Result<(), SessionError> {
    match parse(frame, limits)?.1 {
        Frame::Pong => Ok(()),
        Frame::Error(e) => Err(SessionError::Donor {
            code: e.code,
            message: e.message.to_string(),
        }),
        _ => Err(violation("Ping")),
    }
}

/// The answer to a RegionQuery for `table`.
pub fn region(limits: &Limits, frame: &[u8], table: u32) -> Result<crate::Region, SessionError> {
    match parse(frame, limits)?.1 {
        Frame::Region(r) if r.table_id == table => Ok(r),
        Frame::Error(e) => Err(SessionError::Donor {
            code: e.code,
            message: e.message.to_string(),
        }),
        _ => Err(violation("RegionQuery")),
    }
}

/// A table's row size in a Rows section's form: 0 for V4.1's 264 bytes.
pub fn wire_row_bytes(t: &TableInfo) -> u16 {
    match t.row_bytes() {
        crate::ROW_BYTES => 0,
        // At most 4096 bytes (PROTOCOL.md 2).
        n => n as u16,
    }
}

/// The payload length of a Rows answer serving all `sections` with
/// `row_bytes` of rows.
pub fn rows_payload_len(sections: usize, row_bytes: usize) -> usize {
    ROWS_HEAD_LEN + ROWS_SECTION_LEN * sections + row_bytes
}

/// Encode Lookup `id` of `sections`.
pub fn encode_lookup_frame(
    out: &mut Vec<u8>,
    id: u64,
    sections: &[LookupSection<'_>],
) -> Result<(), SessionError> {
    encode_lookup(out, id, sections).map_err(|e| SessionError::BadRequest(e.to_string()))
}

/// Encode Ping `id`.
pub fn encode_ping_frame(out: &mut Vec<u8>, id: u64) {
    encode_ping(out, id, false);
}

/// Encode RegionQuery `id` for `table`.
pub fn encode_region_query(out: &mut Vec<u8>, id: u64, table: u32) {
    RegionQuery { table_id: table }.encode(out, id);
}

/// A well-formed answer of the wrong kind or shape.
fn violation(what: &str) -> SessionError {
    SessionError::Protocol(format!("unexpected answer to {what}"))
}
