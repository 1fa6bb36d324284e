//! A toy donor and the fuzz harnesses: a [`Service`] serving one synthetic
//! table from nothing but arithmetic, so the two sessions can be run
//! against each other (in tests, in the fuzz targets, in a corpus replay
//! that every `cargo test` runs) with no files and no sockets.

use crate::messages::{begin_rows, finish_rows};
use crate::session::client::{ClientConfig, ClientSession, Incoming, Kind, Request};
use crate::session::server::{Refusal, ServerSession, Service, Step};
use crate::synthetic::synthetic_row;
use crate::{
    ErrorCode, ErrorFrame, FrameHeader, HEADER_LEN, Hello, Limits, LookupRef, PROTOCOL_VERSION,
    ROW_BYTES, RowBytes, RowsSection, TableDigest, TableInfo, Welcome,
};

/// The toy table's id.
pub const TABLE: u32 = 7;
/// Its layer (also the synthetic rows' layer).
pub const LAYER: u32 = 2;
/// Its row count.
pub const ROWS: u64 = 1_000;
/// The synthetic rows' seed.
pub const SEED: u64 = 42;
/// The credential the toy donor wants.
pub const CREDENTIAL: &[u8] = b"toy-credential";

/// The toy table's version.
pub fn digest() -> TableDigest {
    TableDigest([7; 32])
}

/// A donor of one synthetic table, counting what it answered.
#[derive(Debug, Default)]
pub struct ToyDonor {
    /// Error frames the session answered, by code.
    pub errors: Vec<ErrorCode>,
    /// Lookups answered.
    pub lookups: u64,
    /// Pings answered.
    pub pings: u64,
}

impl Service for ToyDonor {
    fn hello(&mut self, id: u64, hello: &Hello<'_>, out: &mut Vec<u8>) -> Result<(), Refusal> {
        if hello.credential != CREDENTIAL {
            return Err(Refusal {
                code: ErrorCode::Unauthorized,
                detail: 0,
                message: "wrong or missing credential".into(),
            });
        }
        let tables = [TableInfo::v41(TABLE, LAYER, ROWS, digest())];
        let limits = Limits::default();
        Welcome {
            version: hello.version,
            donor: "toy",
            max_rows: limits.max_rows,
            max_payload: limits.max_payload,
            tables: &tables,
        }
        .encode(out, id)
        .map_err(|e| Refusal {
            code: ErrorCode::Internal,
            detail: 0,
            message: e.to_string(),
        })
    }

    fn lookup(&mut self, id: u64, lookup: LookupRef<'_>, out: &mut Vec<u8>) {
        self.lookups += 1;
        let sections: Vec<RowsSection> = lookup
            .sections()
            .map(|s| {
                let status = if s.table_id != TABLE {
                    Some(ErrorCode::UnknownTable)
                } else if s.digest_prefix != digest().prefix() {
                    Some(ErrorCode::VersionMismatch)
                } else if s.rows.iter().any(|r| r >= ROWS) {
                    Some(ErrorCode::RowOutOfRange)
                } else {
                    None
                };
                RowsSection {
                    table_id: s.table_id,
                    status,
                    row_count: if status.is_none() {
                        s.rows.len() as u32
                    } else {
                        0
                    },
                    row_bytes: 0,
                }
            })
            .collect();
        let Ok(start) = begin_rows(out, id, &sections) else {
            return;
        };
        let mut row: RowBytes = [0; ROW_BYTES];
        for (s, status) in lookup.sections().zip(&sections) {
            if status.status.is_none() {
                for r in s.rows.iter() {
                    synthetic_row(SEED, LAYER, r, &mut row);
                    out.extend_from_slice(&row);
                }
            }
        }
        if finish_rows(out, start).is_err() {
            out.truncate(start.offset());
        }
    }

    fn region(&mut self, id: u64, table: u32, out: &mut Vec<u8>) {
        ErrorFrame {
            code: ErrorCode::Unavailable,
            table_id: Some(table),
            detail: 0,
            message: "the toy donor serves no RDMA",
        }
        .encode(out, id);
    }

    fn answered_error(&mut self, code: ErrorCode) {
        self.errors.push(code);
    }

    fn pinged(&mut self) {
        self.pings += 1;
    }
}

/// A client config that the toy donor welcomes.
pub fn client_config() -> ClientConfig {
    ClientConfig {
        node: "toy-node".into(),
        credential: CREDENTIAL.to_vec(),
        pinned: vec![(TABLE, digest())],
        max_rows: 4_096,
        version: PROTOCOL_VERSION,
    }
}

/// Feed `bytes` to a fresh donor session in chunks whose sizes come from
/// the bytes themselves, answering as a donor would; checks what must
/// hold whatever the bytes: no panic, answers bounded by what came in,
/// and nothing after a close.
pub fn fuzz_server(bytes: &[u8]) {
    let mut session = ServerSession::new(Limits::default(), true);
    let mut svc = ToyDonor::default();
    let mut out = Vec::new();
    let (chunks, data) = split_seed(bytes);
    let mut at = 0usize;
    for size in chunks.into_iter().chain(std::iter::repeat(usize::MAX)) {
        let end = at.saturating_add(size).min(data.len());
        session.rb.push(&data[at..end]);
        at = end;
        loop {
            match session.step(&mut svc, &mut out) {
                Step::NeedInput => break,
                Step::Flush | Step::Ready => out.clear(),
                Step::Close(_) => {
                    assert!(session.last_error().is_some(), "closed without saying why");
                    return;
                }
            }
        }
        out.clear();
        if at == data.len() {
            return;
        }
    }
}

/// Hand `bytes` to a client session as donor frames, first as the answer
/// to its Hello, then split into frames as its driver would; requests are
/// begun and finished between frames as the bytes say. Checks that the
/// session never hands an answer to a request not in flight, and that a
/// closed session stays closed.
pub fn fuzz_client(bytes: &[u8]) {
    let mut c: ClientSession<u32> = ClientSession::new(client_config());
    let mut hello = Vec::new();
    if c.hello(&mut hello).is_err() {
        return;
    }
    let (ops, data) = split_seed(bytes);
    let mut frames = Frames::new(data, *c.limits());
    let Some(first) = frames.split() else { return };
    if c.welcome(first).is_err() {
        assert!(c.closed().is_some());
        return;
    }
    let mut ops = ops.into_iter();
    let mut begun: Vec<u64> = Vec::new();
    while let Some(frame) = frames.split() {
        // Between frames: begin or finish requests as the seed says.
        match ops.next().unwrap_or(0) % 4 {
            0 => {}
            1 | 2 => {
                let kind = if begun.len().is_multiple_of(2) {
                    Kind::Lookup
                } else {
                    Kind::Ping
                };
                if let Ok(id) = c.begin(kind, 0) {
                    begun.push(id);
                }
            }
            _ => {
                if let Some(id) = begun.pop() {
                    c.finish(id);
                }
            }
        }
        match c.receive(frame) {
            Ok(Incoming::Answer(id)) => {
                assert!(begun.contains(&id), "answer handed to {id}, not in flight");
                let requests = [Request {
                    table: TABLE,
                    rows: &[0],
                }];
                let mut rows = [0u8; ROW_BYTES];
                let _ = crate::session::client::rows(c.limits(), frame, &requests, &[], &mut rows);
                let _ = crate::session::client::pong(c.limits(), frame);
            }
            Ok(Incoming::Stale | Incoming::Goodbye) => {}
            Err(_) => {
                assert!(c.closed().is_some(), "an error left the session open");
                assert!(c.begin(Kind::Ping, 0).is_err());
                return;
            }
        }
    }
}

/// Decode `bytes` as a stream of frames under the default limits: checks
/// the decoder never panics and never claims more than it was given.
pub fn fuzz_frames(bytes: &[u8]) {
    let limits = Limits::default();
    let mut rest = bytes;
    while let Ok(Some(d)) = crate::decode(rest, &limits) {
        assert!(d.header.frame_len() <= rest.len());
        assert!(d.header.frame_len() >= HEADER_LEN);
        rest = &rest[d.header.frame_len()..];
    }
}

/// The first byte says how many of the next bytes are chunk sizes (or
/// operations); the rest is the data.
fn split_seed(bytes: &[u8]) -> (Vec<usize>, &[u8]) {
    let Some((&n, rest)) = bytes.split_first() else {
        return (Vec::new(), bytes);
    };
    let n = usize::from(n % 16).min(rest.len());
    let (sizes, data) = rest.split_at(n);
    (sizes.iter().map(|&s| usize::from(s) + 1).collect(), data)
}

/// Whole frames split off a byte stream as the node's driver does: by the
/// header's declared length, under the session's limits; stops at the
/// first header the limits refuse, or at a partial frame.
struct Frames<'a> {
    data: &'a [u8],
    limits: Limits,
}

impl<'a> Frames<'a> {
    fn new(data: &'a [u8], limits: Limits) -> Self {
        Self { data, limits }
    }

    fn split(&mut self) -> Option<&'a [u8]> {
        let h = FrameHeader::peek(self.data, &self.limits).ok()??;
        let frame = self.data.get(..h.frame_len())?;
        self.data = &self.data[h.frame_len()..];
        Some(frame)
    }
}

/// The seed corpus of the fuzz targets, `(target, name, bytes)`: real
/// sessions between a client and the toy donor. The files under
/// `protocol/wire/fuzz/corpus` are these bytes (a test checks it, and
/// writes them with `ENGRAM_WRITE_CORPUS=1`).
pub fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    use crate::messages::{LookupSection, encode_ping};
    use crate::session::client::{encode_lookup_frame, encode_region_query};
    let mut hello = Vec::new();
    let client: ClientSession = ClientSession::new(client_config());
    let _ = client.hello(&mut hello);
    let lookup = |id: u64, rows: &[u64], out: &mut Vec<u8>| {
        let s = [LookupSection {
            table_id: TABLE,
            digest_prefix: digest().prefix(),
            rows,
        }];
        let _ = encode_lookup_frame(out, id, &s);
    };
    let mut requests = Vec::new();
    lookup(1, &[0, 1, 2], &mut requests);
    encode_ping(&mut requests, 2, false);
    lookup(3, &[999; 24], &mut requests);
    encode_region_query(&mut requests, 4, TABLE);
    let mut oversized = Vec::new();
    lookup(1, &[1; 20_000], &mut oversized);
    lookup(2, &[5], &mut oversized);
    // What the toy donor answers to each.
    let answer = |bytes: &[u8]| {
        let mut s = ServerSession::new(Limits::default(), true);
        let mut svc = ToyDonor::default();
        let mut out = Vec::new();
        s.rb.push(bytes);
        while !matches!(s.step(&mut svc, &mut out), Step::NeedInput | Step::Close(_)) {}
        out
    };
    let session = [&hello[..], &requests].concat();
    let welcome_and_answers = answer(&session);
    let mut bye = Vec::new();
    crate::Goodbye { grace_ms: 100 }.encode(&mut bye);
    let welcome = answer(&hello);
    let mut bad_cred = Vec::new();
    let _ = Hello {
        version: PROTOCOL_VERSION,
        node: "n",
        credential: b"wrong",
    }
    .encode(&mut bad_cred, 0);
    let mut first_ping = Vec::new();
    encode_ping(&mut first_ping, 1, false);
    let with = |head: &[u8], body: &[u8]| [head, body].concat();
    vec![
        ("frames", "requests", session.clone()),
        ("frames", "answers", welcome_and_answers.clone()),
        ("server", "session", with(&[0], &session)),
        ("server", "chunked", with(&[4, 0, 5, 30, 200], &session)),
        (
            "server",
            "oversized",
            with(&[0], &[&hello[..], &oversized].concat()),
        ),
        ("server", "refused", with(&[0], &bad_cred)),
        ("server", "not-hello-first", with(&[0], &first_ping)),
        (
            "client",
            "answers",
            with(&[4, 1, 1, 1, 1], &welcome_and_answers),
        ),
        (
            "client",
            "drain",
            with(
                &[2, 1, 0],
                &[
                    &welcome[..],
                    &bye,
                    &answer(&[&hello[..], &requests].concat())[welcome.len()..],
                ]
                .concat(),
            ),
        ),
        ("client", "refused", with(&[0], &answer(&bad_cred))),
    ]
}
