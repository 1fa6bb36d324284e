//! PROTOCOL.md's worked example is what the code puts on the wire, byte for
//! byte: if either changes, this test says so.

use engram_protocol::messages::{
    LookupSection, RowsSection, begin_rows, encode_lookup, finish_rows,
};
use engram_protocol::synthetic::synthetic_rows;
use engram_protocol::{
    Hello, Limits, PROTOCOL_VERSION_V1, ROW_BYTES, TableDigest, TableInfo, Welcome,
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
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../PROTOCOL.md"))
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
        version: PROTOCOL_VERSION_V1,
        node: "py-client",
        credential: b"",
    }
    .encode(&mut hello, 0)
    .expect("hello");
    assert_eq!(dump(&doc, "Hello"), hello);

    let mut welcome = Vec::new();
    let limits = Limits::default();
    let tables = [TableInfo::v41(1, 1, 100, digest)];
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
            row_bytes: 0,
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

/// Every error code in the table of section 3.6 is the codec's, by number
/// and name, and the codec has no code the table leaves out.
#[test]
fn the_error_code_table_is_the_codecs() {
    use engram_protocol::ErrorCode;
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../PROTOCOL.md"))
        .expect("PROTOCOL.md");
    let start = doc.find("| code | name |").expect("the error code table");
    let rows: Vec<(u16, String)> = doc[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let code = cells[1].parse().expect("a code number");
            (code, cells[2].trim_matches('`').to_string())
        })
        .collect();
    let mut want = Vec::new();
    for n in 1..=u16::MAX {
        match ErrorCode::from_u16(n) {
            Some(ErrorCode::Other(_)) | None => break,
            Some(c) => want.push((n, c.name().to_string())),
        }
    }
    assert_eq!(rows, want);
}

/// The `.etab` header shown in section 2 is what the writer puts in a file.
#[test]
fn the_table_header_example_is_the_writers() {
    use engram_protocol::encoding::RowEncoding;
    use engram_protocol::etab::{TableMeta, encode_header};
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../PROTOCOL.md"))
        .expect("PROTOCOL.md");
    let mut table = vec![0u8; 100 * ROW_BYTES];
    synthetic_rows(1, 1, 0, &mut table);
    let meta = TableMeta {
        layer: 1,
        rows: 100,
        digest: TableDigest::of_rows(&table),
        hash_preset: None,
        hash_base: None,
        source: "synthetic seed=1 layer=1".into(),
        encoding: RowEncoding::V41,
        tensor_scale: None,
    };
    let header = encode_header(&meta, true).expect("header");
    let json = std::str::from_utf8(&header[8..]).expect("utf8").trim_end();
    // The document breaks the one-line JSON into lines for reading.
    let start = doc.find("{\"__metadata__\"").expect("the header example");
    let shown: String = doc[start..]
        .lines()
        .take_while(|l| !l.trim_start().starts_with("```"))
        .map(|l| l.split("      (then").next().unwrap_or(l).trim())
        .collect();
    assert_eq!(shown, json);
    assert_eq!(header.len(), 4096);
    assert_eq!(&header[..8], &0x0ff8u64.to_le_bytes());
}
