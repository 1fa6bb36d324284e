//! What the token loop reads: text tokenized with the model's
//! `tokenizer.json` (teacher forcing: the text's own tokens are the ones
//! "generated"), a file of raw token ids, or, for the demo, a built-in text
//! with a built-in word-level tokenizer. Real text matters: its repeated
//! n-grams are what the tables see in production.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use thiserror::Error;
use tokenizers::Tokenizer;

use crate::engram::tokenmap::{TokenMap, TokenMapError};

/// Largest input file read.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;
/// Most tokens one run holds.
pub const MAX_TOKENS: usize = 8 << 20;

/// The built-in text (about 3 KB of prose with the repeated phrases of real text).
pub const BUILTIN_TEXT: &str = include_str!("builtin.txt");

/// Raw ids of the built-in tokenizer's special tokens.
const SPECIALS: [&str; 3] = ["[UNK]", "[BOS]", "[PAD]"];

/// Why the input cannot be read.
#[derive(Debug, Error)]
pub enum InputError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The input file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is larger than accepted.
    #[error("{path}: {size} bytes is over the {MAX_INPUT_BYTES} accepted")]
    TooLarge {
        /// The input file.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
    },
    /// A token-id file holds something that is not an id.
    #[error("{path}: token {index}: {text:?} is not a token id")]
    BadId {
        /// The token-id file.
        path: PathBuf,
        /// Index of the token in the file, from 0.
        index: usize,
        /// The token's text (its first 40 characters).
        text: String,
    },
    /// No tokens.
    #[error("the input has no tokens")]
    Empty,
    /// More tokens than accepted.
    #[error("the input has more than {MAX_TOKENS} tokens")]
    TooMany,
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The token map failed.
    #[error(transparent)]
    Map(#[from] TokenMapError),
    /// A raw id the map does not know.
    #[error("token {index}: raw id {id} is outside the token map ({len} raw ids)")]
    UnknownId {
        /// Index of the token in the input, from 0.
        index: usize,
        /// The raw id.
        id: u32,
        /// Raw ids the token map holds.
        len: usize,
    },
}

/// Tokens ready for the loop: raw ids (they seed the stand-in hidden
/// state) and compressed ids (they are hashed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    /// Raw token ids.
    pub raw: Vec<u32>,
    /// Compressed ids (`-1`: DEAD).
    pub compressed: Vec<i64>,
    /// Compressed id of the pad token.
    pub pad: i64,
    /// Where the tokens came from, for the summary.
    pub origin: String,
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, InputError> {
    let io = |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    if size > MAX_INPUT_BYTES {
        return Err(InputError::TooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    let mut buf = Vec::with_capacity(size as usize);
    f.take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(io)?;
    if buf.len() as u64 > MAX_INPUT_BYTES {
        return Err(InputError::TooLarge {
            path: path.to_path_buf(),
            size: buf.len() as u64,
        });
    }
    Ok(buf)
}

/// Read a text file (UTF-8; invalid bytes are replaced).
pub fn read_text(path: &Path) -> Result<String, InputError> {
    Ok(String::from_utf8_lossy(&read_bounded(path)?).into_owned())
}

/// Read raw token ids separated by whitespace or commas.
pub fn read_ids(path: &Path) -> Result<Vec<u32>, InputError> {
    let text = String::from_utf8_lossy(&read_bounded(path)?).into_owned();
    let mut ids = Vec::new();
    for (index, t) in text
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .enumerate()
    {
        if ids.len() == MAX_TOKENS {
            return Err(InputError::TooMany);
        }
        ids.push(t.parse().map_err(|_| InputError::BadId {
            path: path.to_path_buf(),
            index,
            text: t.chars().take(40).collect(),
        })?);
    }
    if ids.is_empty() {
        return Err(InputError::Empty);
    }
    Ok(ids)
}

/// A word-level tokenizer over the words of `text` (split as the
/// `Whitespace` pre-tokenizer splits: runs of word characters, runs of
/// punctuation), numbered in order of first appearance after `[UNK]`,
/// `[BOS]` and `[PAD]` (raw id 2, V4.1's pad id).
pub fn word_tokenizer(text: &str) -> Result<Tokenizer, InputError> {
    let mut vocab = BTreeMap::new();
    for (i, s) in SPECIALS.iter().enumerate() {
        vocab.insert((*s).to_string(), i as u32);
    }
    let mut next = SPECIALS.len() as u32;
    for w in words(text) {
        vocab.entry(w.to_string()).or_insert_with(|| {
            next += 1;
            next - 1
        });
    }
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    json.to_string()
        .parse::<Tokenizer>()
        .map_err(|e| InputError::Tokenizer(e.to_string()))
}

/// The `Whitespace` pre-tokenizer's split: `\w+|[^\w\s]+`.
fn words(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        rest = rest.trim_start();
        let first = rest.chars().next()?;
        let word = first.is_alphanumeric() || first == '_';
        let end = rest
            .char_indices()
            .find(|&(_, c)| c.is_whitespace() || (c.is_alphanumeric() || c == '_') != word)
            .map_or(rest.len(), |(i, _)| i);
        let (w, r) = rest.split_at(end);
        rest = r;
        Some(w)
    })
}

/// Tokenize `text` and compress its ids with the map built from the same
/// tokenizer (`pad_raw`: the raw pad id).
pub fn tokenize(
    tok: &Tokenizer,
    map: &TokenMap,
    text: &str,
    pad_raw: u32,
    origin: String,
) -> Result<Tokens, InputError> {
    let enc = tok
        .encode(text, false)
        .map_err(|e| InputError::Tokenizer(e.to_string()))?;
    compress(map, enc.get_ids().to_vec(), pad_raw, origin)
}

/// Compress raw ids with `map`.
pub fn compress(
    map: &TokenMap,
    raw: Vec<u32>,
    pad_raw: u32,
    origin: String,
) -> Result<Tokens, InputError> {
    if raw.is_empty() {
        return Err(InputError::Empty);
    }
    if raw.len() > MAX_TOKENS {
        return Err(InputError::TooMany);
    }
    let compressed = raw
        .iter()
        .enumerate()
        .map(|(index, &id)| {
            map.get(id).map(i64::from).ok_or(InputError::UnknownId {
                index,
                id,
                len: map.raw_len(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let pad = map.get(pad_raw).map_or(0, i64::from);
    Ok(Tokens {
        raw,
        compressed,
        pad,
        origin,
    })
}

/// The built-in text with the built-in tokenizer.
pub fn builtin() -> Result<Tokens, InputError> {
    let tok = word_tokenizer(BUILTIN_TEXT)?;
    let map = TokenMap::from_tokenizer(&tok)?;
    tokenize(&tok, &map, BUILTIN_TEXT, 2, "the built-in text".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_text_repeats_ngrams_and_case_shares_ids() {
        let t = builtin().expect("built-in");
        assert!(t.raw.len() > 500, "{} tokens", t.raw.len());
        assert_eq!(t.raw.len(), t.compressed.len());
        // "The" and "the" are two raw ids and one compressed id.
        let tok = word_tokenizer(BUILTIN_TEXT).expect("tokenizer");
        let up = tok.token_to_id("The").expect("The");
        let low = tok.token_to_id("the").expect("the");
        assert_ne!(up, low);
        let map = TokenMap::from_tokenizer(&tok).expect("map");
        assert_eq!(map.get(up), map.get(low));
        // Real text repeats trigrams.
        let mut seen = std::collections::HashSet::new();
        let repeats = t
            .compressed
            .windows(3)
            .filter(|w| !seen.insert(w.to_vec()))
            .count();
        assert!(repeats > 100, "{repeats} repeated trigrams");
        assert_eq!(t.pad, i64::from(map.get(2).expect("pad")));
    }

    #[test]
    fn words_split_like_the_whitespace_pretokenizer() {
        let w: Vec<&str> = words("  Hello, world!! it's 2 x_y ").collect();
        assert_eq!(w, ["Hello", ",", "world", "!!", "it", "'", "s", "2", "x_y"]);
        assert_eq!(words("").count(), 0);
        // Every word of the built-in text is in the vocabulary: no [UNK].
        let t = builtin().expect("built-in");
        assert!(!t.raw.contains(&0));
    }

    #[test]
    fn id_files_are_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("ids.txt");
        std::fs::write(&p, "5, 17\n3 9").expect("write");
        assert_eq!(read_ids(&p).expect("ids"), [5, 17, 3, 9]);
        std::fs::write(&p, "5 x7").expect("write");
        let e = read_ids(&p).expect_err("bad id").to_string();
        assert!(e.contains("token 1") && e.contains("x7"), "{e}");
        std::fs::write(&p, " \n").expect("write");
        assert!(matches!(read_ids(&p), Err(InputError::Empty)));
        let map = TokenMap::from_ids(vec![0, 1, 1, 2]).expect("map");
        let e = compress(&map, vec![1, 9], 2, String::new()).expect_err("unknown");
        assert!(e.to_string().contains("raw id 9"), "{e}");
        assert!(read_ids(&dir.path().join("missing")).is_err());
    }
}
