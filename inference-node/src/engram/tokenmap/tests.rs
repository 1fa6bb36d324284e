//! The token map against a small tokenizer built here, whose expected
//! compressed ids were worked out by hand from docs/ENGRAM.md section 2.

use super::*;

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the
/// others for 256, 257, ... in byte order.
fn byte_level(bytes: &[u8]) -> String {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut table = [' '; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("valid char")
        };
    }
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// (token as stored in the vocabulary, expected compressed id, why).
fn vocab() -> Vec<(String, u32, &'static str)> {
    let bl = |s: &str| byte_level(s.as_bytes());
    vec![
        (
            "<｜begin▁of▁sentence｜>".into(),
            0,
            "special, NFKC turns ｜ into |",
        ),
        ("<｜end▁of▁sentence｜>".into(), 1, "special"),
        ("<｜▁pad▁｜>".into(), 2, "special: the pad"),
        (bl("Hello"), 3, "lowercased"),
        (bl(" Hello"), 3, "leading space stripped"),
        (bl("HELLO"), 3, "cased variant"),
        (bl("é"), 4, "accent dropped"),
        (bl("e"), 4, "same key"),
        (bl("É"), 4, "accent dropped, lowercased"),
        (
            byte_level(b"\xc3"),
            5,
            "partial UTF-8: key is the raw token",
        ),
        (byte_level(b"\xa9"), 6, "partial UTF-8: raw token is ©"),
        (
            bl("©"),
            6,
            "decodes to ©, the same key as the raw token above",
        ),
        (bl(" "), 7, "exactly one space stays a space"),
        (bl("   "), 7, "a run of spaces is one space"),
        (bl("\n"), 7, "newline collapses to a space"),
        (bl("\t\r\n "), 7, "mixed run"),
        (
            "\u{301}".into(),
            8,
            "a lone combining mark normalizes to empty: key is the text",
        ),
        (bl("\u{3000}"), 7, "ideographic space: NFKC gives a space"),
        (
            bl("\u{85}"),
            9,
            "NEL is stripped, not collapsed: empty, key is the text",
        ),
        (bl("ﬁ"), 10, "NFKC ligature"),
        (bl("fi"), 10, "same key"),
        (
            bl(" Hello  World\n"),
            11,
            "inner run collapsed, ends stripped",
        ),
        (
            bl("İ"),
            12,
            "dotted capital I: NFD, mark dropped, lowercased",
        ),
        (bl("i"), 12, "same key"),
        (bl("ΣΑΣ"), 13, "lowercased per character: no final sigma"),
        (bl("σας"), 14, "final sigma is its own letter"),
        (
            bl("\u{E000}"),
            7,
            "V4.1's sentinel turns U+E000 into a space",
        ),
        (bl("ab"), 15, "new"),
        (
            "HeLLo".into(),
            3,
            "an added (non-special) token keys like the vocabulary",
        ),
    ]
}

fn tokenizer_json() -> String {
    let v = vocab();
    let mut entries = serde_json::Map::new();
    // The last entry is an added, non-special token rather than a vocabulary one.
    let last = v.len() - 1;
    for (i, (tok, _, _)) in v.iter().enumerate().take(last) {
        entries.insert(tok.clone(), serde_json::json!(i));
    }
    let mut added: Vec<serde_json::Value> = (0..3)
        .map(|i| {
            serde_json::json!({"id": i, "content": v[i].0, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    added.push(
        serde_json::json!({"id": last, "content": v[last].0, "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": false}),
    );
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": entries, "merges": []}
    })
    .to_string()
}

fn built() -> (tempfile::TempDir, TokenMap) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, tokenizer_json()).expect("write");
    let map = TokenMap::from_tokenizer_file(&path).expect("token map");
    (dir, map)
}

#[test]
fn the_map_matches_the_hand_worked_keys() {
    let (_dir, map) = built();
    let v = vocab();
    assert_eq!(map.raw_len(), v.len());
    for (raw, (tok, want, why)) in v.iter().enumerate() {
        assert_eq!(
            map.get(raw as u32),
            Some(*want),
            "raw id {raw} {tok:?}: {why}"
        );
    }
    assert_eq!(map.compressed_len(), 16);
    assert_eq!(map.get(v.len() as u32), None);
}

#[test]
fn normalize_follows_the_section() {
    for (text, want) in [
        ("Hello", "hello"),
        (" ", " "),
        ("  ", " "),
        ("\t", " "),
        (" \u{3000}", " "),
        ("  a \n b  ", "a b"),
        ("\u{a0}x\u{a0}", "x"),
        ("Ａｂｃ", "abc"),
        ("Å", "a"),
        ("\u{301}", ""),
        ("\u{85}", ""),
        ("\u{2028}x", "x"),
        ("x\u{E000}", "x "),
        ("", ""),
    ] {
        let norm = KeyNormalizer::new().expect("normalizer");
        assert_eq!(norm.normalize(text).expect("normalize"), want, "{text:?}");
    }
}

#[test]
fn map_files_round_trip_and_are_checked() {
    let (dir, map) = built();
    let path = dir.path().join("map.txt");
    let mut bytes = Vec::new();
    map.write(&mut bytes).expect("write");
    std::fs::write(&path, &bytes).expect("write");
    assert_eq!(TokenMap::load(&path).expect("load"), map);
    // Without the final newline, and with CRLF, it reads the same.
    std::fs::write(&path, bytes.strip_suffix(b"\n").expect("newline")).expect("write");
    assert_eq!(TokenMap::load(&path).expect("load"), map);
    std::fs::write(&path, "0\r\n1\r\n0\r\n").expect("write");
    assert_eq!(TokenMap::load(&path).expect("load").compressed_len(), 2);

    for (text, line, msg) in [
        ("0\n1\n3\n", 3, "next new compressed id is 2"),
        ("1\n", 1, "next new compressed id is 0"),
        ("0\n\n1\n", 2, "not a compressed id"),
        ("0\n-1\n", 2, "not a compressed id"),
        ("0\nx\n", 2, "not a compressed id"),
        ("", 1, "not a compressed id"),
    ] {
        std::fs::write(&path, text).expect("write");
        match TokenMap::load(&path) {
            Err(TokenMapError::Map {
                line: l, reason, ..
            }) => {
                assert_eq!(l, line, "{text:?}");
                assert!(reason.contains(msg), "{text:?}: {reason}");
            }
            other => panic!("{text:?}: expected a map error, got {other:?}"),
        }
    }
    assert!(matches!(
        TokenMap::load(&dir.path().join("missing")),
        Err(TokenMapError::Io { .. })
    ));
}

#[test]
fn a_map_of_another_size_is_refused_naming_both_sizes() {
    let (_dir, map) = built();
    assert!(map.check_size(16).is_ok());
    let e = map.check_size(99_092).expect_err("refused").to_string();
    assert!(e.contains("16") && e.contains("99092"), "{e}");
}

#[test]
fn bad_tokenizer_files_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, "{not json").expect("write");
    assert!(matches!(
        TokenMap::from_tokenizer_file(&path),
        Err(TokenMapError::Tokenizer(_))
    ));
    assert!(matches!(
        TokenMap::from_tokenizer_file(&dir.path().join("missing.json")),
        Err(TokenMapError::Io { .. })
    ));
}
