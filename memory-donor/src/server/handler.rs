//! Frame -> action: the donor's answer to each frame of one connection.
//! No IO here: answers are appended to the connection's write buffer, and
//! the buffers are reused, so a warm lookup allocates nothing.

use engram_protocol::messages::{begin_rows, encode_ping, finish_rows};
use engram_protocol::{
    ErrorCode, ErrorFrame, Frame, FrameError, FrameHeader, FrameKind, Hello, PROTOCOL_VERSION,
    RowsSection, TableInfo, Welcome,
};

use std::sync::Arc;

use super::{ServerConfig, Shared};

/// What the connection does after a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Keep reading.
    Continue,
    /// Discard the next this-many bytes unread (an oversized Lookup's
    /// payload, already refused), then keep reading.
    Skip(usize),
    /// The handshake completed: switch to the idle timeout.
    Ready,
    /// Flush what is buffered and close.
    Close,
}

/// Per-connection protocol state.
#[derive(Debug)]
pub struct Handler<'a> {
    shared: &'a Shared,
    config: Arc<ServerConfig>,
    ready: bool,
    peer_name: String,
    /// A TLS client's certificate identity: it replaces the credential.
    identity: Option<String>,
    /// The certificate chain that proved `identity`.
    chain: Option<super::Chain>,
    sections: Vec<RowsSection>,
    table_index: Vec<usize>,
    /// The code of the last error answered (why a closed session closed).
    last_error: std::cell::Cell<Option<ErrorCode>>,
    /// A Ping was answered since [`Self::take_pinged`] last looked.
    pinged: bool,
}

impl<'a> Handler<'a> {
    /// A handler for a new connection under `config`.
    pub fn new(shared: &'a Shared, config: Arc<ServerConfig>) -> Self {
        Self {
            shared,
            config,
            ready: false,
            peer_name: String::new(),
            identity: None,
            chain: None,
            sections: Vec::new(),
            table_index: Vec::new(),
            last_error: std::cell::Cell::new(None),
            pinged: false,
        }
    }

    /// Whether a Ping was answered since the last call: a node pings
    /// ahead of a lookup it knows is coming (a warm-up), so the
    /// connection thread polls for it instead of sleeping
    /// ([`super::AFTER_PING_POLL`]).
    pub fn take_pinged(&mut self) -> bool {
        std::mem::take(&mut self.pinged)
    }

    /// The code of the last error answered, if any.
    pub fn last_error(&self) -> Option<ErrorCode> {
        self.last_error.get()
    }

    /// The client proved `identity` with its certificate `chain`: its
    /// Hello needs no credential, and it is known by that name.
    pub fn set_identity(&mut self, identity: String, chain: super::Chain) {
        self.identity = Some(identity);
        self.chain = Some(chain);
    }

    /// True once the client completed the handshake.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The client's name once it said Hello.
    pub fn peer_name(&self) -> &str {
        &self.peer_name
    }

    fn error(
        &self,
        out: &mut Vec<u8>,
        id: u64,
        code: ErrorCode,
        table: Option<u32>,
        detail: u64,
        msg: &str,
    ) {
        self.shared.stats.error(code);
        self.last_error.set(Some(code));
        ErrorFrame {
            code,
            table_id: table,
            detail,
            message: msg,
        }
        .encode(out, id);
    }

    /// Answer a frame whose declared payload is larger than `max`. After
    /// the handshake a Lookup that large is over the row or section cap
    /// whatever it holds: it is refused as `request_too_large` and its
    /// payload skipped, so the connection stays (as for a Lookup over the
    /// caps that fits the frame cap). Any other frame is `frame_too_large`
    /// and the connection closes.
    pub fn oversized(&mut self, h: FrameHeader, max: u32, out: &mut Vec<u8>) -> Action {
        if self.ready && h.kind == FrameKind::Lookup && h.request_id != 0 {
            let max_rows = self.config.limits.max_rows;
            let msg = format!(
                "a Lookup of {} bytes is over the caps ({max_rows} rows, {} sections)",
                h.payload_len, self.config.limits.max_sections
            );
            self.error(
                out,
                h.request_id,
                ErrorCode::RequestTooLarge,
                None,
                u64::from(max_rows),
                &msg,
            );
            return Action::Skip(h.payload_len as usize);
        }
        let e = FrameError::TooLarge {
            len: h.payload_len,
            max,
        };
        self.error(
            out,
            h.request_id,
            e.code(),
            None,
            u64::from(max),
            &e.to_string(),
        );
        Action::Close
    }

    /// Answer a frame that failed to parse (`header` is `None` when even the
    /// header was bad). Only a Lookup over the caps keeps the connection:
    /// its framing is intact and the client may split the request.
    pub fn frame_error(
        &mut self,
        header: Option<FrameHeader>,
        e: &FrameError,
        out: &mut Vec<u8>,
    ) -> Action {
        let detail = match e {
            FrameError::TooLarge { max, .. } => u64::from(*max),
            FrameError::TooManyRows { max, .. } => u64::from(*max),
            FrameError::TooManySections { max, .. } => u64::from(*max),
            _ => 0,
        };
        let id = header.map_or(0, |h| h.request_id);
        self.error(out, id, e.code(), None, detail, &e.to_string());
        let lookup = header.is_some_and(|h| h.kind == FrameKind::Lookup);
        if e.is_fatal() || !self.ready || !lookup {
            Action::Close
        } else {
            Action::Continue
        }
    }

    /// Refuse a frame by its header alone, before its payload is parsed:
    /// anything but a Hello first, a donor's frame kind from a client, a
    /// second Hello, and a request with id 0 (reserved for unsolicited
    /// frames, so its answer could not be told from one). `malformed` with
    /// the frame's kind as detail, and the connection closes.
    pub fn refuse_kind(&mut self, h: FrameHeader, out: &mut Vec<u8>) -> Option<Action> {
        let msg = match h.kind {
            FrameKind::Hello if !self.ready => return None,
            _ if !self.ready => "the first frame on a connection must be Hello",
            FrameKind::Lookup | FrameKind::Ping | FrameKind::RegionQuery if h.request_id == 0 => {
                "request id 0 is reserved for unsolicited frames"
            }
            FrameKind::Lookup | FrameKind::Ping | FrameKind::Pong | FrameKind::RegionQuery => {
                return None;
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
        self.error(out, id, ErrorCode::Malformed, None, h.kind as u64, msg);
        Some(Action::Close)
    }

    /// Answer one parsed frame.
    pub fn handle(&mut self, h: FrameHeader, frame: Frame<'_>, out: &mut Vec<u8>) -> Action {
        match frame {
            Frame::Hello(hello) if !self.ready => self.hello(h.request_id, hello, out),
            Frame::Lookup(l) if self.ready => {
                self.lookup(h.request_id, l, out);
                Action::Continue
            }
            Frame::Ping if self.ready => {
                encode_ping(out, h.request_id, true);
                self.pinged = true;
                self.shared
                    .stats
                    .pings
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Action::Continue
            }
            Frame::Pong if self.ready => Action::Continue,
            Frame::RegionQuery(q) if self.ready => {
                self.region(h.request_id, q.table_id, out);
                Action::Continue
            }
            _ => {
                let msg = if self.ready {
                    "unexpected frame kind from a client"
                } else {
                    "the first frame on a connection must be Hello"
                };
                self.error(
                    out,
                    h.request_id,
                    ErrorCode::Malformed,
                    None,
                    h.kind as u64,
                    msg,
                );
                Action::Close
            }
        }
    }

    /// Answer a RegionQuery: the table's RDMA region and a queue-pair
    /// token, only to a client that proved its identity with a certificate
    /// (TLS or QUIC): over plaintext the key and token would be in the
    /// clear. Every refusal keeps the connection.
    fn region(&mut self, id: u64, table: u32, out: &mut Vec<u8>) {
        let (Some(identity), Some(chain)) = (&self.identity, &self.chain) else {
            self.shared.stats.refusal("data", "region_plaintext");
            self.error(
                out,
                id,
                ErrorCode::Unauthorized,
                Some(table),
                0,
                "RDMA regions are handed out over TLS or QUIC only",
            );
            return;
        };
        let Some(book) = self.shared.rdma() else {
            self.error(
                out,
                id,
                ErrorCode::Unavailable,
                Some(table),
                0,
                "this donor serves no RDMA (no device, or built without it)",
            );
            return;
        };
        match book.grant(table, identity) {
            Some(region) => {
                self.shared.rdma_granted(identity, chain);
                tracing::debug!(
                    peer = %self.peer_name,
                    table,
                    generation = region.generation,
                    "rdma: region granted"
                );
                region.encode(out, id);
            }
            None if self.shared.tables().iter().any(|t| t.id == table) => self.error(
                out,
                id,
                ErrorCode::Unavailable,
                Some(table),
                0,
                "the table is not registered for RDMA",
            ),
            None => self.error(
                out,
                id,
                ErrorCode::UnknownTable,
                Some(table),
                0,
                "this donor does not serve the table",
            ),
        }
    }

    fn hello(&mut self, id: u64, hello: Hello<'_>, out: &mut Vec<u8>) -> Action {
        let cfg = Arc::clone(&self.config);
        if hello.version != PROTOCOL_VERSION {
            let msg = format!(
                "this donor speaks protocol version {PROTOCOL_VERSION}, the client {}",
                hello.version
            );
            self.error(
                out,
                id,
                ErrorCode::UnsupportedVersion,
                None,
                u64::from(PROTOCOL_VERSION),
                &msg,
            );
            return Action::Close;
        }
        if let Some(want) = &cfg.credential
            && self.identity.is_none()
            && !constant_time_eq(want, hello.credential)
        {
            self.error(
                out,
                id,
                ErrorCode::Unauthorized,
                None,
                0,
                "wrong or missing credential",
            );
            return Action::Close;
        }
        self.peer_name = match &self.identity {
            Some(id) => id.clone(),
            None => hello.node.to_string(),
        };
        let tables: Vec<TableInfo> = self
            .shared
            .tables()
            .iter()
            .map(|t| TableInfo {
                table_id: t.id,
                layer: t.layer,
                rows: t.rows,
                digest: t.digest,
            })
            .collect();
        let welcome = Welcome {
            version: PROTOCOL_VERSION,
            donor: &cfg.name,
            max_rows: cfg.limits.max_rows,
            max_payload: cfg.limits.max_payload,
            tables: &tables,
        };
        if welcome.encode(out, id).is_err() {
            self.error(
                out,
                id,
                ErrorCode::Internal,
                None,
                0,
                "cannot encode Welcome",
            );
            return Action::Close;
        }
        self.ready = true;
        Action::Ready
    }

    fn lookup(&mut self, id: u64, l: engram_protocol::LookupRef<'_>, out: &mut Vec<u8>) {
        let began = std::time::Instant::now();
        // One snapshot for the digest checks and the row copies: a swap
        // waits until this answer is encoded.
        let shared = self.shared;
        let tables = shared.tables();
        self.sections.clear();
        self.table_index.clear();
        for s in l.sections() {
            let found = tables.iter().position(|t| t.id == s.table_id);
            let status = match found {
                None => Some(ErrorCode::UnknownTable),
                Some(i) if tables[i].digest_prefix != s.digest_prefix => {
                    Some(ErrorCode::VersionMismatch)
                }
                Some(i) if !check_and_prefetch(&tables[i], s.rows) => {
                    Some(ErrorCode::RowOutOfRange)
                }
                Some(_) => None,
            };
            if let Some(code) = status {
                self.shared.stats.error(code);
            }
            let row_count = if status.is_none() {
                s.rows.len() as u32
            } else {
                0
            };
            self.sections.push(RowsSection {
                table_id: s.table_id,
                status,
                row_count,
            });
            self.table_index.push(found.unwrap_or(0));
        }
        let Ok(start) = begin_rows(out, id, &self.sections) else {
            self.error(out, id, ErrorCode::Internal, None, 0, "cannot encode Rows");
            return;
        };
        let mut served = 0u64;
        for ((s, status), &ti) in l.sections().zip(&self.sections).zip(&self.table_index) {
            if status.status.is_some() {
                continue;
            }
            let table = &tables[ti];
            // The rows past the first PREFETCH_AHEAD are prefetched that
            // far ahead of their copy (a long lookup's early prefetches
            // would otherwise be evicted before they are used).
            let mut ahead = s.rows.iter().skip(PREFETCH_AHEAD);
            for r in s.rows.iter() {
                if let Some(a) = ahead.next() {
                    table.prefetch(a);
                }
                // In range: checked above.
                if let Some(row) = table.row(r) {
                    out.extend_from_slice(row);
                }
            }
            served += s.rows.len() as u64;
        }
        if finish_rows(out, start).is_err() {
            // Cannot happen (rows were range-checked); never send a frame whose length lies.
            out.truncate(start.offset());
            self.error(out, id, ErrorCode::Internal, None, 0, "row count mismatch");
            return;
        }
        let bytes = (out.len() - start.offset()) as u64;
        self.shared.stats.lookup(served, bytes, began.elapsed());
    }
}

/// Rows a lookup starts loading into cache before it copies the first,
/// and then ahead of each copy: all of a decode step's (24 or 48), a
/// window of a long lookup's. (16,384 random rows gathered: 4.0 ms with
/// every row prefetched first, 3.2 ms with this window, `engram-bench
/// floor`'s bulk series.)
const PREFETCH_AHEAD: usize = 64;

/// Range-check every row and start loading the first [`PREFETCH_AHEAD`]
/// valid ones into cache, in one pass; false when a row is out of range.
fn check_and_prefetch(
    table: &engram_store::resident::ResidentTable,
    rows: engram_protocol::messages::RowIds<'_>,
) -> bool {
    let mut ok = true;
    for (i, r) in rows.iter().enumerate() {
        ok &= r < table.rows;
        if i < PREFETCH_AHEAD {
            table.prefetch(r);
        }
    }
    ok
}

/// Equal in time that does not depend on where the bytes differ (the
/// length is not secret: it is bounded and on the wire anyway).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}
