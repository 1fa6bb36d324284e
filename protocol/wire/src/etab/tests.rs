//! Tests of `etab`.

use super::*;

fn meta(rows: u64) -> TableMeta {
    TableMeta {
        layer: 14,
        rows,
        digest: TableDigest([0xAB; 32]),
        hash_preset: Some("v41".into()),
        hash_base: Some(16_000_000),
        source: "test".into(),
        encoding: RowEncoding::V41,
        tensor_scale: None,
    }
}

fn parse(bytes: &[u8], file_len: u64) -> Result<(TableMeta, TableLayout), EtabError> {
    let read_at = |buf: &mut [u8], off: u64| {
        let src = bytes
            .get(off as usize..off as usize + buf.len())
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    };
    read_header(file_len, read_at).map_err(|e| match e {
        ReadHeaderError::Format(f) => f,
        ReadHeaderError::Io(e) => EtabError::Json(e.to_string()),
    })
}

#[test]
fn header_round_trips_and_is_aligned() {
    for rows in [1u64, 14, 15, 16, 1_000_000, 384_006_168] {
        let m = meta(rows);
        let h = encode_header(&m, false).expect("encodes");
        assert_eq!(h.len() % PAGE_BYTES as usize, 0);
        let file_len = h.len() as u64 + pages_for(rows) * PAGE_BYTES;
        let (m2, layout) = parse(&h, file_len).expect("parses");
        assert_eq!(m2, m);
        assert_eq!(layout.data_start, h.len() as u64);
        assert_eq!(layout.pages, rows.div_ceil(15));
        // The length does not depend on the digest.
        let other = TableMeta {
            digest: TableDigest([0; 32]),
            ..m
        };
        assert_eq!(
            encode_header(&other, false).expect("encodes").len(),
            h.len()
        );
    }
}

#[test]
fn page_sums_tensor_round_trips_and_is_checked() {
    let m = meta(100);
    let plain = encode_header(&m, false).expect("encodes");
    let with = encode_header(&m, true).expect("encodes");
    assert_eq!(plain.len(), with.len(), "the tensor fits in the padding");
    let pages = pages_for(100);
    let len = with.len() as u64 + pages * (PAGE_BYTES + SUM_BYTES);
    let (_, layout) = parse(&with, len).expect("parses");
    assert!(layout.page_sums);
    assert_eq!(
        layout.sums_start(),
        Some(with.len() as u64 + pages * PAGE_BYTES)
    );
    assert_eq!(layout.file_len(), len);
    let (_, old) = parse(&plain, len - pages * SUM_BYTES).expect("parses");
    assert!(!old.page_sums);
    assert_eq!(old.sums_start(), None);
    // A file whose sums are missing from its end is refused.
    assert!(matches!(
        parse(&with, len - 8),
        Err(EtabError::FileSize { .. })
    ));
    // Rewriting a header in place: same size, or refused when it does not fit.
    let at = encode_header_at(&m, true, plain.len() as u64).expect("fits");
    assert_eq!(at, with);
    assert!(encode_header_at(&m, true, 64).is_err());
    // The sums tensor is checked like the pages tensor; no third tensor.
    let json = String::from_utf8(with[8..].to_vec()).expect("utf8");
    for (from, to) in [
        ("\"dtype\":\"U64\"", "\"dtype\":\"U32\""),
        ("\"shape\":[7]", "\"shape\":[8]"),
        ("\"page_xxh3\"", "\"other_one\""),
    ] {
        assert!(json.contains(from), "{from} in {json}");
        let bad = json.replacen(from, to, 1);
        let bad = format!("{bad:<width$}", width = json.len());
        assert!(parse_header(bad.as_bytes(), len).is_err(), "{to} accepted");
    }
}

#[test]
fn page_checksum_is_xxh3_of_the_whole_page() {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    let zero = page_checksum(&page);
    assert_eq!(zero, twox_hash::XxHash3_64::oneshot(&page));
    page[4095] = 1;
    assert_ne!(page_checksum(&page), zero, "slack bytes count");
}

#[test]
fn row_offsets_never_straddle_pages() {
    let layout = TableLayout {
        data_start: 4096,
        rows: 31,
        pages: 3,
        page_sums: false,
        row_bytes: 264,
        rows_per_page: 15,
    };
    assert_eq!(layout.row_offset(0), Some(4096));
    assert_eq!(layout.row_offset(14), Some(4096 + 14 * 264));
    assert_eq!(layout.row_offset(15), Some(8192));
    assert_eq!(layout.row_offset(30), Some(12288));
    assert_eq!(layout.row_offset(31), None);
    assert_eq!(layout.row_page(16), Some((8192, 264)));
    for r in 0..31 {
        let off = layout.row_offset(r).expect("in range");
        assert_eq!(off / 4096, (off + 263) / 4096, "row {r}");
    }
}

#[test]
fn wrong_sizes_and_fields_are_refused() {
    let h = encode_header(&meta(100), false).expect("encodes");
    let good_len = h.len() as u64 + 7 * PAGE_BYTES;
    assert!(parse(&h, good_len).is_ok());
    assert_eq!(
        parse(&h, good_len - 1),
        Err(EtabError::FileSize {
            expected: good_len,
            actual: good_len - 1
        })
    );
    // Header length prefix: too large, misaligned.
    assert!(header_len((MAX_HEADER_BYTES + 4096 * 2 - 8).to_le_bytes()).is_err());
    assert!(header_len(100u64.to_le_bytes()).is_err());
    // Each field tampered with.
    let json = String::from_utf8(h[8..].to_vec()).expect("utf8");
    for (from, to) in [
        ("\"format\":\"engram-etab\"", "\"format\":\"other-thing\""),
        ("\"format_version\":\"1\"", "\"format_version\":\"9\""),
        ("e4m3_e8m0_32_row264", "e2m1_e8m0_32_row136"),
        ("\"rows\":\"100\"", "\"rows\":\"200\""),
        ("\"rows\":\"100\"", "\"rows\":\"abc\""),
        ("\"dtype\":\"U8\"", "\"dtype\":\"F8\""),
        ("\"layer\":\"14\"", "\"layer\":\"-1\""),
    ] {
        assert!(json.contains(from), "{from}");
        let bad = json.replacen(from, to, 1);
        let bad = format!("{bad:<width$}", width = json.len());
        assert_eq!(bad.len(), json.len());
        assert!(
            parse_header(bad.as_bytes(), good_len).is_err(),
            "{to} accepted"
        );
    }
    assert!(parse_header(b"{not json", 0).is_err());
}

#[test]
fn zero_rows_and_bad_preset_are_refused() {
    assert!(encode_header(&meta(0), false).is_err());
    assert!(
        encode_header(
            &TableMeta {
                hash_preset: Some("a b".into()),
                ..meta(1)
            },
            false
        )
        .is_err()
    );
    assert!(
        encode_header(
            &TableMeta {
                source: "x".repeat(MAX_TEXT + 1),
                ..meta(1)
            },
            false
        )
        .is_err()
    );
}

#[test]
fn the_safetensors_crate_opens_it() {
    let rows = 40u64;
    let h = encode_header(&meta(rows), true).expect("encodes");
    let mut file = h.clone();
    file.resize(
        h.len() + (pages_for(rows) * (PAGE_BYTES + SUM_BYTES)) as usize,
        0,
    );
    let st = safetensors::SafeTensors::deserialize(&file).expect("safetensors parses it");
    let t = st.tensor(TENSOR_NAME).expect("pages tensor");
    assert_eq!(t.shape(), &[3, 4096]);
    assert_eq!(t.dtype(), safetensors::Dtype::U8);
    let sums = st.tensor(SUMS_TENSOR_NAME).expect("page_xxh3 tensor");
    assert_eq!(sums.shape(), &[3]);
    assert_eq!(sums.dtype(), safetensors::Dtype::U64);
    let (_, md) = safetensors::SafeTensors::read_metadata(&file).expect("metadata");
    let md = md.metadata().clone().expect("has __metadata__");
    assert_eq!(md.get("rows").map(String::as_str), Some("40"));
}

#[test]
fn tables_of_every_encoding_round_trip_with_pages_of_their_own_rows() {
    let rows = 1000u64;
    for (e, scale) in [
        (RowEncoding::V41, None),
        (RowEncoding::Fp8PerTensor { values: 160 }, Some(0.0123f32)),
        (RowEncoding::Bf16 { values: 160 }, None),
        (RowEncoding::Nvfp4 { values: 160 }, Some(2.5f32)),
    ] {
        let m = TableMeta {
            encoding: e,
            tensor_scale: scale.map(f32::to_bits),
            ..meta(rows)
        };
        let h = encode_header(&m, true).expect("encodes");
        let per_page = 4096 / e.row_bytes() as u64;
        let pages = rows.div_ceil(per_page);
        let (m2, layout) = parse(&h, h.len() as u64 + pages * (4096 + 8)).expect("parses");
        assert_eq!(m2, m, "{}", e.name());
        assert_eq!((layout.rows_per_page, layout.pages), (per_page, pages));
        assert_eq!(layout.row_bytes, e.row_bytes() as u64);
        let last = layout.row_offset(rows - 1).expect("in range");
        assert!(last + layout.row_bytes <= layout.data_start + pages * 4096);
        // Every row within its page.
        for r in [0, per_page - 1, per_page, rows - 1] {
            let (page, at) = layout.row_page(r).expect("in range");
            assert!(at as u64 + layout.row_bytes <= 4096, "{}", e.name());
            assert_eq!(page + at as u64, layout.row_offset(r).expect("in range"));
        }
        // V4.1's rows keep the name every earlier file has.
        let json = std::str::from_utf8(&h[8..]).expect("utf8");
        assert_eq!(
            json.contains("\"e4m3_e8m0_32_row264\""),
            e == RowEncoding::V41
        );
    }
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    for (e, scale, key) in [
        (fp8, None, "tensor_scale"),
        (fp8, Some(-1.0f32), "tensor_scale"),
        (fp8, Some(f32::NAN), "tensor_scale"),
        (RowEncoding::Bf16 { values: 160 }, Some(1.0), "tensor_scale"),
        (RowEncoding::Bf16 { values: 4096 }, None, "encoding"),
        (RowEncoding::Nvfp4 { values: 24 }, Some(1.0), "encoding"),
    ] {
        let m = TableMeta {
            encoding: e,
            tensor_scale: scale.map(f32::to_bits),
            ..meta(10)
        };
        match encode_header(&m, false) {
            Err(EtabError::Metadata { key: k, .. }) => assert_eq!(k, key, "{e:?} {scale:?}"),
            other => panic!("{e:?} {scale:?}: {other:?}"),
        }
    }
    // A header whose page geometry does not follow its rows is refused.
    let m = TableMeta {
        encoding: fp8,
        tensor_scale: Some(1f32.to_bits()),
        ..meta(10)
    };
    let h = encode_header(&m, false).expect("encodes");
    let text = std::str::from_utf8(&h[8..]).expect("utf8");
    let json = text.replace("\"rows_per_page\":\"25\"", "\"rows_per_page\":\"26\"");
    assert_ne!(json, text);
    let bad = [&h[..8], json.as_bytes()].concat();
    assert!(matches!(
        parse(&bad, h.len() as u64 + 4096),
        Err(EtabError::Metadata {
            key: "rows_per_page",
            ..
        })
    ));
}
