//! The donor's answers within a session ([`Service`]): the Welcome with
//! its tables, a lookup's rows, a region grant. The protocol's rules (what
//! may come when, what closes) are the shared session's. No IO here:
//! answers are appended to the connection's write buffer, and the buffers
//! are reused, so a warm lookup allocates nothing.

use engram_protocol::encoding::RowEncoding;
use engram_protocol::messages::{begin_rows, finish_rows};
use engram_protocol::session::server::{Refusal, Service};
use engram_protocol::{
    ErrorCode, ErrorFrame, Hello, PROTOCOL_VERSION_V1, ROW_BYTES, RowsSection, TableInfo, Welcome,
};

use std::sync::Arc;

use super::{ServerConfig, Shared};

/// One connection's side of the donor: who the client is, and the
/// buffers its lookups reuse.
#[derive(Debug)]
pub struct Handler<'a> {
    shared: &'a Shared,
    config: Arc<ServerConfig>,
    peer_name: String,
    /// A TLS client's certificate identity: it replaces the credential.
    identity: Option<String>,
    /// The certificate chain that proved `identity`.
    chain: Option<super::Chain>,
    sections: Vec<RowsSection>,
    table_index: Vec<usize>,
    /// The protocol version the client said (1 until its Hello): a
    /// version-1 client sees and gets V4.1's tables only.
    version: u16,
}

impl<'a> Handler<'a> {
    /// A handler for a new connection under `config`.
    pub fn new(shared: &'a Shared, config: Arc<ServerConfig>) -> Self {
        Self {
            shared,
            config,
            peer_name: String::new(),
            identity: None,
            chain: None,
            sections: Vec::new(),
            table_index: Vec::new(),
            version: PROTOCOL_VERSION_V1,
        }
    }

    /// Whether this connection may see a table of `encoding`: a version-1
    /// client knows V4.1's rows only.
    fn sees(&self, encoding: RowEncoding) -> bool {
        self.version > PROTOCOL_VERSION_V1 || encoding == RowEncoding::V41
    }

    /// The client proved `identity` with its certificate `chain`: its
    /// Hello needs no credential, and it is known by that name.
    pub fn set_identity(&mut self, identity: String, chain: super::Chain) {
        self.identity = Some(identity);
        self.chain = Some(chain);
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
        ErrorFrame {
            code,
            table_id: table,
            detail,
            message: msg,
        }
        .encode(out, id);
    }

    /// Answer a RegionQuery: the table's RDMA region and a queue-pair
    /// token, only to a client that proved its identity with a certificate
    /// (TLS or QUIC): over plaintext the key and token would be in the
    /// clear. Every refusal keeps the connection.
    fn answer_region(&mut self, id: u64, table: u32, out: &mut Vec<u8>) {
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

    /// Admit a Hello (its version already checked by the session): the
    /// credential, unless a certificate proved the client; then the Welcome.
    fn admit(&mut self, id: u64, hello: &Hello<'_>, out: &mut Vec<u8>) -> Result<(), Refusal> {
        let cfg = Arc::clone(&self.config);
        if let Some(want) = &cfg.credential
            && self.identity.is_none()
            && !constant_time_eq(want, hello.credential)
        {
            return Err(Refusal {
                code: ErrorCode::Unauthorized,
                detail: 0,
                message: "wrong or missing credential".into(),
            });
        }
        self.peer_name = match &self.identity {
            Some(id) => id.clone(),
            None => hello.node.to_string(),
        };
        self.version = hello.version;
        let tables: Vec<TableInfo> = self
            .shared
            .tables()
            .iter()
            .filter(|t| self.sees(t.encoding))
            .map(|t| t.info())
            .collect();
        let welcome = Welcome {
            version: hello.version,
            donor: &cfg.name,
            max_rows: cfg.limits.max_rows,
            max_payload: cfg.limits.max_payload,
            tables: &tables,
        };
        welcome.encode(out, id).map_err(|e| Refusal {
            code: ErrorCode::Internal,
            detail: 0,
            message: format!("cannot encode Welcome: {e}"),
        })
    }

    fn answer_lookup(&mut self, id: u64, l: engram_protocol::LookupRef<'_>, out: &mut Vec<u8>) {
        let began = std::time::Instant::now();
        // One snapshot for the digest checks and the row copies: a swap
        // waits until this answer is encoded.
        let shared = self.shared;
        let tables = shared.tables();
        self.sections.clear();
        self.table_index.clear();
        let mut bytes = 0u64;
        for s in l.sections() {
            let found = tables
                .iter()
                .position(|t| t.id == s.table_id && self.sees(t.encoding));
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
            let (row_count, row_bytes) = match (status, found) {
                (None, Some(i)) => {
                    let size = tables[i].row_bytes();
                    bytes += s.rows.len() as u64 * size as u64;
                    // V4.1's rows say 0: their answers are as in version 1.
                    let wire = if size == ROW_BYTES { 0 } else { size as u16 };
                    (s.rows.len() as u32, wire)
                }
                _ => (0, 0),
            };
            self.sections.push(RowsSection {
                table_id: s.table_id,
                status,
                row_count,
                row_bytes,
            });
            self.table_index.push(found.unwrap_or(0));
        }
        // Rows of any size: an answer holds at most the bytes of
        // `max_rows` V4.1 rows (PROTOCOL.md 3.4), so `max_payload` holds.
        let cap = u64::from(self.config.limits.max_rows);
        if bytes > cap * ROW_BYTES as u64 {
            let msg = "the answer's rows exceed max_rows x 264 bytes";
            self.error(out, id, ErrorCode::RequestTooLarge, None, cap, msg);
            return;
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
                    row.extend_into(out);
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

impl Service for Handler<'_> {
    fn hello(&mut self, id: u64, hello: &Hello<'_>, out: &mut Vec<u8>) -> Result<(), Refusal> {
        self.admit(id, hello, out)
    }

    fn lookup(&mut self, id: u64, lookup: engram_protocol::LookupRef<'_>, out: &mut Vec<u8>) {
        self.answer_lookup(id, lookup, out);
    }

    fn region(&mut self, id: u64, table: u32, out: &mut Vec<u8>) {
        self.answer_region(id, table, out);
    }

    fn answered_error(&mut self, code: ErrorCode) {
        self.shared.stats.error(code);
    }

    fn pinged(&mut self) {
        self.shared
            .stats
            .pings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
