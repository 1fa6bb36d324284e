//! PROTOCOL.md's worked example is what the code puts on the wire, byte for
//! byte: if either changes, this test says so.

use engram_protocol::messages::{
    LookupSection, RowsSection, begin_rows, encode_lookup, finish_rows,
};
use engram_protocol::synthetic::synthetic_rows;
use engram_protocol::{
    Hello, Limits, PROTOCOL_VERSION, ROW_BYTES, TableDigest, TableInfo, Welcome,
};

/// The hexdump in the code block that follows the paragraph starting with `**title**`.
fn dump(doc: &str, title: &str) -> Vec<u8> {
    let start = doc
        .find(&format!("**{title}**"))
        .unwrap_or_else(|| panic!("{title} not in PROTOCOL.md"));
    let rest = &doc[start..];
    let open = rest.find("```\n").expect("code block") + 4;
    let close = rest[open..].find("```").expect("block end") + open;
    rest[open..close]
        .lines()
        .flat_map(|l| {
            l.split_whitespace()
                .skip(1)
                .map(|h| u8::from_str_radix(h, 16).expect("hex byte"))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_worked_example_matches_the_encoders() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../PROTOCOL.md"))
        .expect("PROTOCOL.md");
    let mut table = vec![0u8; 100 * ROW_BYTES];
    synthetic_rows(1, 1, 0, &mut table);
    let digest = TableDigest::of_rows(&table);
    assert!(
        doc.contains(&digest.to_hex()),
        "the example's digest is the 100-row seed-1 table's"
    );

    let mut hello = Vec::new();
    Hello {
        version: PROTOCOL_VERSION,
        node: "py-client",
        credential: b"",
    }
    .encode(&mut hello, 0)
    .expect("hello");
    assert_eq!(dump(&doc, "Hello"), hello);

    let mut welcome = Vec::new();
    let limits = Limits::default();
    let tables = [TableInfo {
        table_id: 1,
        layer: 1,
        rows: 100,
        digest,
    }];
    Welcome {
        version: 1,
        donor: "donor-a",
        max_rows: limits.max_rows,
        max_payload: limits.max_payload,
        tables: &tables,
    }
    .encode(&mut welcome, 0)
    .expect("welcome");
    assert_eq!(dump(&doc, "Welcome"), welcome);

    let mut lookup = Vec::new();
    encode_lookup(
        &mut lookup,
        7,
        &[LookupSection {
            table_id: 1,
            digest_prefix: digest.prefix(),
            rows: &[5, 17],
        }],
    )
    .expect("lookup");
    assert_eq!(dump(&doc, "Lookup"), lookup);

    let mut rows = Vec::new();
    let start = begin_rows(
        &mut rows,
        7,
        &[RowsSection {
            table_id: 1,
            status: None,
            row_count: 2,
        }],
    )
    .expect("rows");
    for r in [5usize, 17] {
        rows.extend_from_slice(&table[r * ROW_BYTES..(r + 1) * ROW_BYTES]);
    }
    finish_rows(&mut rows, start).expect("finish");
    assert_eq!(dump(&doc, "Rows"), rows);
}

#[test]
fn the_checksum_test_vector_holds() {
    assert_eq!(
        engram_protocol::messages::payload_checksum(b"engram"),
        10819433604875713650
    );
}
