//! Frame codec properties: every frame round-trips, any split of a stream
//! decodes the same, arbitrary bytes never panic, and every bound holds.

use engram_protocol::frame::{DEFAULT_MAX_ROWS, DEFAULT_MAX_SECTIONS};
use engram_protocol::messages::{
    MAX_CREDENTIAL, MAX_MESSAGE, MAX_NAME, begin_rows, encode_lookup, encode_ping, finish_rows,
};
use engram_protocol::{
    ErrorCode, ErrorFrame, Frame, FrameError, FrameHeader, FrameKind, Goodbye, HEADER_LEN, Hello,
    Limits, LookupSection, ROW_BYTES, Region, RegionQuery, RowsSection, TableDigest, TableInfo,
    Welcome, decode,
};
use proptest::prelude::*;

/// An owned model of every frame, to compare decoded views against.
#[derive(Debug, Clone, PartialEq)]
enum Owned {
    Hello {
        version: u16,
        node: String,
        credential: Vec<u8>,
    },
    Welcome {
        version: u16,
        donor: String,
        max_rows: u32,
        max_payload: u32,
        tables: Vec<TableInfo>,
    },
    Lookup(Vec<(u32, u64, Vec<u64>)>),
    Rows(Vec<(u32, Option<ErrorCode>, Vec<u8>)>),
    Error {
        code: ErrorCode,
        table: Option<u32>,
        detail: u64,
        message: String,
    },
    Ping,
    Pong,
    Goodbye(u32),
    RegionQuery(u32),
    Region(Region),
}

fn encode(o: &Owned, id: u64, out: &mut Vec<u8>) {
    match o {
        Owned::Hello {
            version,
            node,
            credential,
        } => Hello {
            version: *version,
            node,
            credential,
        }
        .encode(out, id)
        .expect("encodes"),
        Owned::Welcome {
            version,
            donor,
            max_rows,
            max_payload,
            tables,
        } => Welcome {
            version: *version,
            donor,
            max_rows: *max_rows,
            max_payload: *max_payload,
            tables,
        }
        .encode(out, id)
        .expect("encodes"),
        Owned::Lookup(sections) => {
            let s: Vec<_> = sections
                .iter()
                .map(|(t, p, rows)| LookupSection {
                    table_id: *t,
                    digest_prefix: *p,
                    rows,
                })
                .collect();
            encode_lookup(out, id, &s).expect("encodes")
        }
        Owned::Rows(sections) => {
            let heads: Vec<_> = sections
                .iter()
                .map(|(t, status, data)| RowsSection {
                    table_id: *t,
                    status: *status,
                    row_count: (data.len() / ROW_BYTES) as u32,
                    row_bytes: 0,
                })
                .collect();
            let start = begin_rows(out, id, &heads).expect("begins");
            for (_, _, data) in sections {
                out.extend_from_slice(data);
            }
            finish_rows(out, start).expect("finishes");
        }
        Owned::Error {
            code,
            table,
            detail,
            message,
        } => ErrorFrame {
            code: *code,
            table_id: *table,
            detail: *detail,
            message,
        }
        .encode(out, id),
        Owned::Ping => encode_ping(out, id, false),
        Owned::Pong => encode_ping(out, id, true),
        Owned::Goodbye(g) => Goodbye { grace_ms: *g }.encode(out),
        Owned::RegionQuery(t) => RegionQuery { table_id: *t }.encode(out, id),
        Owned::Region(r) => r.encode(out, id),
    }
}

fn to_owned(f: &Frame<'_>) -> Owned {
    match f {
        Frame::Hello(h) => Owned::Hello {
            version: h.version,
            node: h.node.to_string(),
            credential: h.credential.to_vec(),
        },
        Frame::Welcome(w) => Owned::Welcome {
            version: w.version,
            donor: w.donor.to_string(),
            max_rows: w.max_rows,
            max_payload: w.max_payload,
            tables: w.tables().collect(),
        },
        Frame::Lookup(l) => Owned::Lookup(
            l.sections()
                .map(|s| (s.table_id, s.digest_prefix, s.rows.iter().collect()))
                .collect(),
        ),
        Frame::Rows(r) => Owned::Rows(
            r.sections()
                .map(|(s, d)| (s.table_id, s.status, d.to_vec()))
                .collect(),
        ),
        Frame::Error(e) => Owned::Error {
            code: e.code,
            table: e.table_id,
            detail: e.detail,
            message: e.message.to_string(),
        },
        Frame::Ping => Owned::Ping,
        Frame::Pong => Owned::Pong,
        Frame::Goodbye(g) => Owned::Goodbye(g.grace_ms),
        Frame::RegionQuery(q) => Owned::RegionQuery(q.table_id),
        Frame::Region(r) => Owned::Region(*r),
    }
}

fn is_request_id_echoed(o: &Owned) -> bool {
    !matches!(o, Owned::Goodbye(_))
}

fn code() -> impl Strategy<Value = ErrorCode> {
    (1u16..=u16::MAX).prop_map(|c| ErrorCode::from_u16(c).expect("non-zero"))
}

fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!(".{{0,{}}}", max / 4)).expect("regex")
}

fn owned() -> impl Strategy<Value = Owned> {
    let table = (any::<u32>(), any::<u32>(), any::<u64>(), any::<[u8; 32]>()).prop_map(
        |(table_id, layer, rows, d)| TableInfo::v41(table_id, layer, rows, TableDigest(d)),
    );
    let rows_section = prop_oneof![
        (any::<u32>(), 1usize..6).prop_flat_map(|(t, n)| {
            proptest::collection::vec(any::<u8>(), n * ROW_BYTES).prop_map(move |d| (t, None, d))
        }),
        (any::<u32>(), code()).prop_map(|(t, c)| (t, Some(c), Vec::new())),
    ];
    prop_oneof![
        (
            any::<u16>(),
            text(MAX_NAME),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(version, node, credential)| Owned::Hello {
                version,
                node,
                credential
            }),
        (
            any::<u16>(),
            text(MAX_NAME),
            any::<u32>(),
            any::<u32>(),
            proptest::collection::vec(table, 0..6)
        )
            .prop_map(
                |(version, donor, max_rows, max_payload, tables)| Owned::Welcome {
                    version,
                    donor,
                    max_rows,
                    max_payload,
                    tables,
                }
            ),
        proptest::collection::vec(
            (
                any::<u32>(),
                any::<u64>(),
                proptest::collection::vec(any::<u64>(), 1..50)
            ),
            1..5
        )
        .prop_map(Owned::Lookup),
        proptest::collection::vec(rows_section, 1..4).prop_map(Owned::Rows),
        (
            code(),
            proptest::option::of(0u32..u32::MAX),
            any::<u64>(),
            text(MAX_MESSAGE)
        )
            .prop_map(|(code, table, detail, message)| Owned::Error {
                code,
                table,
                detail,
                message
            }),
        Just(Owned::Ping),
        Just(Owned::Pong),
        any::<u32>().prop_map(Owned::Goodbye),
        any::<u32>().prop_map(Owned::RegionQuery),
        (
            (any::<u32>(), any::<u64>(), any::<[u8; 32]>(), any::<u64>()),
            (any::<u64>(), any::<u32>(), any::<u32>(), any::<u64>()),
            any::<[u8; 16]>()
        )
            .prop_map(
                |(
                    (table_id, rows, d, generation),
                    (rows_addr, rows_rkey, checks_rkey, checks_addr),
                    token,
                )| {
                    Owned::Region(Region {
                        table_id,
                        rows,
                        digest: TableDigest(d),
                        generation,
                        rows_addr,
                        rows_rkey,
                        checks_rkey,
                        checks_addr,
                        token,
                    })
                }
            ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn every_frame_round_trips(o in owned(), id in any::<u64>()) {
        let mut buf = Vec::new();
        encode(&o, id, &mut buf);
        let limits = Limits::default();
        let d = decode(&buf, &limits).expect("valid").expect("complete");
        prop_assert_eq!(d.len, buf.len());
        if is_request_id_echoed(&o) {
            prop_assert_eq!(d.header.request_id, id);
        }
        prop_assert_eq!(to_owned(&d.frame), o);
        // Every strict prefix is "incomplete", never an error or a frame.
        for cut in [0, 1, HEADER_LEN - 1, HEADER_LEN, buf.len() - 1] {
            if cut < buf.len() {
                prop_assert_eq!(decode(&buf[..cut], &limits), Ok(None));
            }
        }
    }

    #[test]
    fn a_stream_decodes_the_same_under_any_split(
        frames in proptest::collection::vec(owned(), 1..8),
        splits in proptest::collection::vec(1usize..400, 1..40),
    ) {
        let mut stream = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            encode(f, i as u64, &mut stream);
        }
        // Feed the stream in arbitrary chunks, as reads from a socket would.
        let limits = Limits::default();
        let mut buf: Vec<u8> = Vec::new();
        let mut got = Vec::new();
        let mut pos = 0;
        let mut split = splits.iter().cycle();
        while pos < stream.len() {
            let n = (*split.next().expect("cycle")).min(stream.len() - pos);
            buf.extend_from_slice(&stream[pos..pos + n]);
            pos += n;
            while let Some(d) = decode(&buf, &limits).expect("valid stream") {
                got.push(to_owned(&d.frame));
                buf.drain(..d.len);
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, frames);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let limits = Limits::for_caps(64, 4);
        let mut rest = &bytes[..];
        while let Ok(Some(d)) = decode(rest, &limits) {
            rest = &rest[d.len..];
        }
    }

    #[test]
    fn arbitrary_payloads_behind_a_valid_header_never_panic(
        kind in 1u8..=8,
        payload in proptest::collection::vec(any::<u8>(), 0..1024),
    ) {
        let mut buf = Vec::new();
        FrameHeader::write(&mut buf, FrameKind::from_u8(kind).expect("known"), 1, payload.len() as u32);
        buf.extend_from_slice(&payload);
        let _ = decode(&buf, &Limits::default());
    }

    #[test]
    fn flipped_bytes_never_panic_and_corrupt_rows_are_caught(
        o in owned(),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let mut buf = Vec::new();
        encode(&o, 7, &mut buf);
        let i = at.index(buf.len());
        buf[i] ^= 1 << bit;
        let result = decode(&buf, &Limits::default());
        if let Owned::Rows(sections) = &o {
            let data_start = buf.len() - sections.iter().map(|s| s.2.len()).sum::<usize>();
            if i >= data_start {
                let is_checksum_error = matches!(result, Err(FrameError::Checksum { .. }));
                prop_assert!(is_checksum_error, "flipped row byte {} not caught: {:?}", i, result);
            }
        }
    }
}

#[test]
fn oversized_payload_is_refused_from_the_header_alone() {
    let limits = Limits::for_caps(24, 2);
    let mut buf = Vec::new();
    FrameHeader::write(&mut buf, FrameKind::Lookup, 1, limits.max_payload + 1);
    assert_eq!(
        decode(&buf, &limits),
        Err(FrameError::TooLarge {
            len: limits.max_payload + 1,
            max: limits.max_payload
        })
    );
    FrameHeader::write(&mut buf[..0].to_vec(), FrameKind::Lookup, 1, u32::MAX);
    let mut huge = Vec::new();
    FrameHeader::write(&mut huge, FrameKind::Rows, 1, u32::MAX);
    assert!(matches!(
        decode(&huge, &limits),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn header_bits_and_kinds_are_checked() {
    let limits = Limits::default();
    let mut buf = Vec::new();
    encode_ping(&mut buf, 3, false);
    let mut bad = buf.clone();
    bad[4] = 0;
    assert_eq!(decode(&bad, &limits), Err(FrameError::UnknownKind(0)));
    bad[4] = 11;
    assert_eq!(decode(&bad, &limits), Err(FrameError::UnknownKind(11)));
    for i in 5..8 {
        let mut bad = buf.clone();
        bad[i] = 1;
        assert_eq!(decode(&bad, &limits), Err(FrameError::BadHeader));
    }
    let mut bad = buf.clone();
    bad[0] = 1;
    bad.push(0);
    assert!(matches!(
        decode(&bad, &limits),
        Err(FrameError::Malformed {
            kind: FrameKind::Ping,
            ..
        })
    ));
}

#[test]
fn region_frames_have_fixed_sizes_and_reserved_zeros() {
    let limits = Limits::default();
    let mut q = Vec::new();
    RegionQuery { table_id: 7 }.encode(&mut q, 5);
    assert_eq!(q.len(), HEADER_LEN + 8);
    assert_eq!(q[4], 9, "kind 9");
    let mut bad = q.clone();
    bad[HEADER_LEN + 4] = 1;
    assert!(matches!(
        decode(&bad, &limits),
        Err(FrameError::Malformed { .. })
    ));
    let r = Region {
        table_id: 7,
        rows: 1000,
        digest: TableDigest([9; 32]),
        generation: 3,
        rows_addr: 0x7f00_0000_0000,
        rows_rkey: 0x1234,
        checks_rkey: 0x5678,
        checks_addr: 0x7f10_0000_0000,
        token: [0xAB; 16],
    };
    let mut a = Vec::new();
    r.encode(&mut a, 5);
    assert_eq!(a.len(), HEADER_LEN + 96);
    assert_eq!(a[4], 10, "kind 10");
    // The layout PROTOCOL.md 3.10 gives.
    assert_eq!(&a[HEADER_LEN..HEADER_LEN + 4], &7u32.to_le_bytes());
    assert_eq!(&a[HEADER_LEN + 8..HEADER_LEN + 16], &1000u64.to_le_bytes());
    assert_eq!(&a[HEADER_LEN + 48..HEADER_LEN + 56], &3u64.to_le_bytes());
    assert_eq!(
        &a[HEADER_LEN + 64..HEADER_LEN + 68],
        &0x1234u32.to_le_bytes()
    );
    assert_eq!(
        &a[HEADER_LEN + 72..HEADER_LEN + 80],
        &0x7f10_0000_0000u64.to_le_bytes()
    );
    assert_eq!(&a[HEADER_LEN + 80..], &[0xAB; 16]);
    let mut short = a.clone();
    short.truncate(a.len() - 1);
    short[0] = 95;
    assert!(matches!(
        decode(&short, &limits),
        Err(FrameError::Malformed { .. })
    ));
}

#[test]
fn row_and_section_caps_are_enforced_without_closing() {
    let limits = Limits::for_caps(48, 2);
    let rows: Vec<u64> = (0..49).collect();
    let mut buf = Vec::new();
    encode_lookup(
        &mut buf,
        1,
        &[LookupSection {
            table_id: 1,
            digest_prefix: 0,
            rows: &rows,
        }],
    )
    .expect("encodes");
    let err = decode(&buf, &limits).expect_err("too many rows");
    assert_eq!(err, FrameError::TooManyRows { rows: 49, max: 48 });
    assert!(!err.is_fatal());
    assert_eq!(err.code(), ErrorCode::RequestTooLarge);

    let s = LookupSection {
        table_id: 1,
        digest_prefix: 0,
        rows: &rows[..1],
    };
    buf.clear();
    encode_lookup(&mut buf, 1, &[s, s, s]).expect("encodes");
    let err = decode(&buf, &limits).expect_err("too many sections");
    assert_eq!(
        err,
        FrameError::TooManySections {
            sections: 3,
            max: 2
        }
    );
    assert!(!err.is_fatal());

    // Exactly at the caps is fine.
    buf.clear();
    let s = LookupSection {
        table_id: 1,
        digest_prefix: 0,
        rows: &rows[..24],
    };
    encode_lookup(&mut buf, 1, &[s, s]).expect("encodes");
    assert!(decode(&buf, &limits).expect("valid").is_some());
}

#[test]
fn structural_lies_are_malformed() {
    let limits = Limits::default();
    let rows = [1u64, 2, 3];
    let mut buf = Vec::new();
    encode_lookup(
        &mut buf,
        1,
        &[LookupSection {
            table_id: 1,
            digest_prefix: 9,
            rows: &rows,
        }],
    )
    .expect("encodes");
    // A section that claims more rows than the payload holds.
    let mut bad = buf.clone();
    bad[HEADER_LEN + 8 + 4] = 4;
    assert!(matches!(
        decode(&bad, &limits),
        Err(FrameError::Malformed { .. })
    ));
    // A section count of zero, and a non-zero reserved field.
    let mut bad = buf.clone();
    bad[HEADER_LEN] = 0;
    assert!(matches!(
        decode(&bad, &limits),
        Err(FrameError::Malformed { .. })
    ));
    let mut bad = buf.clone();
    bad[HEADER_LEN + 4] = 1;
    assert!(matches!(
        decode(&bad, &limits),
        Err(FrameError::Malformed { .. })
    ));

    // Name, credential and message bounds in Hello and Error.
    let long = "x".repeat(MAX_NAME + 1);
    assert!(
        Hello {
            version: 1,
            node: &long,
            credential: b""
        }
        .encode(&mut Vec::new(), 0)
        .is_err()
    );
    let cred = vec![0u8; MAX_CREDENTIAL + 1];
    assert!(
        Hello {
            version: 1,
            node: "n",
            credential: &cred
        }
        .encode(&mut Vec::new(), 0)
        .is_err()
    );
    let mut e = Vec::new();
    let msg = "é".repeat(MAX_MESSAGE);
    ErrorFrame {
        code: ErrorCode::Busy,
        table_id: None,
        detail: 0,
        message: &msg,
    }
    .encode(&mut e, 4);
    match decode(&e, &limits).expect("valid").expect("complete").frame {
        Frame::Error(f) => {
            assert!(f.message.len() <= MAX_MESSAGE && f.message.chars().all(|c| c == 'é'))
        }
        other => panic!("{other:?}"),
    }

    // Rows whose failed section claims rows, or whose data length lies.
    let mut r = Vec::new();
    let start = begin_rows(
        &mut r,
        1,
        &[RowsSection {
            table_id: 1,
            status: None,
            row_count: 1,
            row_bytes: 0,
        }],
    )
    .expect("ok");
    r.extend_from_slice(&[0u8; ROW_BYTES]);
    finish_rows(&mut r, start).expect("finishes");
    assert!(decode(&r, &limits).expect("valid").is_some());
    let mut bad = r.clone();
    bad[HEADER_LEN + 16 + 4] = 2; // status = version mismatch, yet 1 row
    assert!(matches!(
        decode(&bad, &limits),
        Err(FrameError::Malformed { .. })
    ));
    assert!(
        begin_rows(
            &mut Vec::new(),
            1,
            &[RowsSection {
                table_id: 1,
                status: Some(ErrorCode::Busy),
                row_count: 1,
                row_bytes: 0,
            }]
        )
        .is_err()
    );
    let mut short = Vec::new();
    let start = begin_rows(
        &mut short,
        1,
        &[RowsSection {
            table_id: 1,
            status: None,
            row_count: 2,
            row_bytes: 0,
        }],
    )
    .expect("ok");
    short.extend_from_slice(&[0u8; ROW_BYTES]);
    assert!(finish_rows(&mut short, start).is_err());
}

#[test]
fn default_limits_fit_the_default_caps() {
    let l = Limits::default();
    assert_eq!(l.max_rows, DEFAULT_MAX_ROWS);
    assert_eq!(l.max_sections, DEFAULT_MAX_SECTIONS);
    assert!(l.max_payload as usize >= 16 + 12 * 64 + ROW_BYTES * DEFAULT_MAX_ROWS as usize);
    // A full-size answer decodes under the default limits.
    let mut r = Vec::new();
    let n = DEFAULT_MAX_ROWS;
    let start = begin_rows(
        &mut r,
        1,
        &[RowsSection {
            table_id: 1,
            status: None,
            row_count: n,
            row_bytes: 0,
        }],
    )
    .expect("ok");
    r.resize(r.len() + n as usize * ROW_BYTES, 0x38);
    finish_rows(&mut r, start).expect("finishes");
    assert!(decode(&r, &l).expect("valid").is_some());
}

#[test]
fn request_and_handshake_limits_shrink_the_payload_cap() {
    let l = Limits::default();
    let r = l.for_requests();
    assert_eq!(
        r.max_payload as usize,
        8 + 16 * 64 + 8 * DEFAULT_MAX_ROWS as usize
    );
    assert_eq!((r.max_rows, r.max_sections), (l.max_rows, l.max_sections));
    // A full Lookup still fits; a Rows answer of the same size does not.
    let rows: Vec<u64> = (0..u64::from(DEFAULT_MAX_ROWS) / 64).collect();
    let sections: Vec<LookupSection<'_>> = (0..64)
        .map(|t| LookupSection {
            table_id: t,
            digest_prefix: 0,
            rows: &rows,
        })
        .collect();
    let mut buf = Vec::new();
    encode_lookup(&mut buf, 1, &sections).expect("encodes");
    assert!(decode(&buf, &r).expect("fits").is_some());
    let h = l.before_hello();
    let mut hello = Vec::new();
    let name = "n".repeat(MAX_NAME);
    let cred = vec![1u8; MAX_CREDENTIAL];
    Hello {
        version: 1,
        node: &name,
        credential: &cred,
    }
    .encode(&mut hello, 0)
    .expect("encodes");
    assert!(
        decode(&hello, &h)
            .expect("the largest Hello fits")
            .is_some()
    );
    assert!(matches!(decode(&buf, &h), Err(FrameError::TooLarge { .. })));
}

#[test]
fn the_checksum_of_parts_is_the_checksum_of_their_concatenation() {
    use engram_protocol::messages::{payload_checksum, payload_checksum_of_parts};
    let bytes: Vec<u8> = (0..70_000u32).map(|i| (i * 31 % 251) as u8).collect();
    for cut in [0, 1, 16, 1000, 65_536, 70_000] {
        let (a, b) = bytes.split_at(cut);
        assert_eq!(payload_checksum_of_parts(&[a, b]), payload_checksum(&bytes));
    }
}

/// Short payloads are summed one way, long ones another
/// (`WIDE_SUM_FROM`): both are XXH3-64 with seed 0, on either side of the
/// switch and at every length class of xxh3 (up to 16, 128, 240 bytes,
/// then stripes).
#[test]
fn the_checksum_is_xxh3_64_on_both_sides_of_the_switch() {
    use engram_protocol::messages::{
        WIDE_SUM_FROM, keep_wide_units_warm, payload_checksum, payload_checksum_of_parts,
    };
    assert_eq!(payload_checksum(b""), 0x2D06_8005_38D3_94C2);
    keep_wide_units_warm();
    assert_eq!(payload_checksum(b""), 0x2D06_8005_38D3_94C2);
    let bytes: Vec<u8> = (0..WIDE_SUM_FROM as u32 * 2)
        .map(|i| (i * 131 % 251) as u8)
        .collect();
    for len in [
        1,
        16,
        17,
        128,
        129,
        240,
        241,
        1024,
        6356,
        12_704,
        WIDE_SUM_FROM - 1,
        WIDE_SUM_FROM,
        WIDE_SUM_FROM + 1,
        bytes.len(),
    ] {
        let b = &bytes[..len];
        // The streaming sum always takes the wide way.
        let wide = payload_checksum_of_parts(&[b]);
        assert_eq!(payload_checksum(b), wide, "{len}");
        // After a polling reader's turns, short payloads take it too.
        keep_wide_units_warm();
        assert_eq!(payload_checksum(b), wide, "{len}, warm");
        assert_eq!(payload_checksum(b), wide, "{len}, after the warm one");
    }
}
