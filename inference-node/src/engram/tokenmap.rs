//! The compressed vocabulary (docs/ENGRAM.md section 2): raw token id ->
//! compressed id, built from the model's `tokenizer.json` exactly as V4.1
//! builds it, or loaded from a precomputed map file.
//!
//! Map file format: UTF-8 text, one decimal compressed id per line, line `i`
//! (0-based) for raw id `i`; a final newline is optional. The ids must be the
//! dense first-appearance numbering (raw id 0 maps to 0, and every id is at
//! most one more than the largest before it). `inference-node token-map`
//! writes one from a tokenizer.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use thiserror::Error;
use tokenizers::normalizers::replace::{Replace, ReplacePattern};
use tokenizers::normalizers::strip::{Strip, StripAccents};
use tokenizers::normalizers::unicode::{NFD, NFKC};
use tokenizers::normalizers::utils::{Lowercase, Sequence};
use tokenizers::{NormalizedString, Normalizer, NormalizerWrapper, Tokenizer};

/// Most raw ids a tokenizer or map may have.
pub const MAX_RAW_VOCAB: usize = cluster_config::model::MAX_RAW_VOCAB as usize;
/// Largest tokenizer.json read.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Largest map file read (8 bytes per line is ample for 7-digit ids).
pub const MAX_MAP_BYTES: u64 = MAX_RAW_VOCAB as u64 * 9;

/// Why a token map cannot be built or loaded.
#[derive(Debug, Error)]
pub enum TokenMapError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The tokenizer could not be loaded or could not decode an id.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A map file is malformed.
    #[error("{path}: line {line}: {reason}")]
    Map {
        /// The map file.
        path: String,
        /// The line at fault, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The vocabulary is empty or larger than accepted.
    #[error("a vocabulary of {0} raw ids is not accepted (1..={MAX_RAW_VOCAB})")]
    VocabSize(usize),
    /// The map's compressed size is not the one the model was trained with.
    #[error(
        "the token map has {actual} compressed ids but the model expects {expected}: \
         a different map would change every hash"
    )]
    CompressedSize {
        /// Compressed ids the model was trained with.
        expected: u32,
        /// Compressed ids the map has.
        actual: u32,
    },
}

/// Raw id -> compressed id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMap {
    map: Vec<u32>,
    compressed: u32,
}

/// V4.1's key normalizer, built from the tokenizers library's own
/// normalizers exactly as the engines build it (vLLM's
/// `build_compressed_token_map`): NFKC, NFD, strip accents, lowercase,
/// every run of `[ \t\r\n]` to one space, then strip leading and trailing
/// whitespace, except that a string that is exactly one space stays one
/// (protected from `Strip` by the private-use sentinel U+E000, which then
/// turns back into a space wherever it is, as in V4.1).
#[derive(Debug)]
pub struct KeyNormalizer(Sequence);

impl KeyNormalizer {
    /// The normalizer; an error only if the tokenizers library refuses
    /// one of its fixed patterns.
    pub fn new() -> Result<Self, TokenMapError> {
        let sentinel = "\u{E000}";
        let re = |p: &str| ReplacePattern::Regex(p.to_string());
        let replace = |p: ReplacePattern, with: &str| {
            Replace::new(p, with)
                .map(NormalizerWrapper::from)
                .map_err(|e| TokenMapError::Tokenizer(format!("the key normalizer: {e}")))
        };
        Ok(Self(Sequence::new(vec![
            NFKC.into(),
            NFD.into(),
            StripAccents.into(),
            Lowercase.into(),
            replace(re("[ \t\r\n]+"), " ")?,
            replace(re("^ $"), sentinel)?,
            Strip::new(true, true).into(),
            replace(ReplacePattern::String(sentinel.to_string()), " ")?,
        ])))
    }

    /// `text` normalized.
    pub fn normalize(&self, text: &str) -> Result<String, TokenMapError> {
        let mut n = NormalizedString::from(text);
        self.0
            .normalize(&mut n)
            .map_err(|e| TokenMapError::Tokenizer(format!("normalizing {text:?}: {e}")))?;
        Ok(n.get().to_string())
    }
}

/// The key of one decoded token (step 2 of the section): the raw token string
/// for partial UTF-8, else the normalized text, else the text itself.
fn key(
    norm: &KeyNormalizer,
    text: String,
    raw_token: impl FnOnce() -> Option<String>,
) -> Result<String, TokenMapError> {
    if text.contains('\u{FFFD}') {
        return Ok(raw_token().unwrap_or(text));
    }
    let normalized = norm.normalize(&text)?;
    Ok(if normalized.is_empty() {
        text
    } else {
        normalized
    })
}

impl TokenMap {
    /// Build the map from a loaded tokenizer: every raw id in
    /// `0..vocab_size(with added tokens)`, decoded alone with special tokens
    /// kept, keyed and numbered by first appearance.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Self, TokenMapError> {
        let n = tok.get_vocab_size(true);
        if n == 0 || n > MAX_RAW_VOCAB {
            return Err(TokenMapError::VocabSize(n));
        }
        let norm = KeyNormalizer::new()?;
        let mut ids: HashMap<String, u32> = HashMap::with_capacity(n);
        let mut map = Vec::with_capacity(n);
        for t in 0..n as u32 {
            let text = tok
                .decode(&[t], false)
                .map_err(|e| TokenMapError::Tokenizer(format!("decoding id {t}: {e}")))?;
            let k = key(&norm, text, || tok.id_to_token(t))?;
            let next = ids.len() as u32;
            map.push(*ids.entry(k).or_insert(next));
        }
        let compressed = ids.len() as u32;
        Ok(Self { map, compressed })
    }

    /// Build the map from a `tokenizer.json` file.
    pub fn from_tokenizer_file(path: &Path) -> Result<Self, TokenMapError> {
        Self::from_tokenizer(&load_tokenizer(path)?)
    }

    /// A map from its ids, checked to be the dense first-appearance numbering.
    pub fn from_ids(map: Vec<u32>) -> Result<Self, (usize, String)> {
        if map.is_empty() || map.len() > MAX_RAW_VOCAB {
            return Err((
                0,
                format!("{} raw ids is not 1..={MAX_RAW_VOCAB}", map.len()),
            ));
        }
        let mut next = 0u32;
        for (i, &id) in map.iter().enumerate() {
            if id == next {
                next += 1;
            } else if id > next {
                return Err((
                    i,
                    format!(
                        "raw id {i} maps to {id}, but the next new compressed id is {next} \
                         (ids are numbered by first appearance)"
                    ),
                ));
            }
        }
        Ok(Self {
            map,
            compressed: next,
        })
    }

    /// Load a precomputed map file (format in the module docs).
    pub fn load(path: &Path) -> Result<Self, TokenMapError> {
        let name = path.display().to_string();
        let io = |source| TokenMapError::Io {
            path: name.clone(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        let bad = |line: usize, reason: String| TokenMapError::Map {
            path: name.clone(),
            line,
            reason,
        };
        if len > MAX_MAP_BYTES {
            return Err(bad(
                0,
                format!("{len} bytes is more than the {MAX_MAP_BYTES} accepted"),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let body = text.strip_suffix('\n').unwrap_or(&text);
        let mut ids = Vec::new();
        for (i, line) in body.split('\n').enumerate() {
            let line = line.strip_suffix('\r').unwrap_or(line);
            let id = line
                .parse::<u32>()
                .map_err(|_| bad(i + 1, format!("{line:?} is not a compressed id")))?;
            ids.push(id);
        }
        Self::from_ids(ids).map_err(|(i, reason)| bad(i + 1, reason))
    }

    /// Write the map in the file format [`TokenMap::load`] reads.
    pub fn write(&self, mut out: impl Write) -> std::io::Result<()> {
        for id in &self.map {
            writeln!(out, "{id}")?;
        }
        out.flush()
    }

    /// Refuse a map whose compressed size is not `expected`.
    pub fn check_size(&self, expected: u32) -> Result<(), TokenMapError> {
        if self.compressed == expected {
            Ok(())
        } else {
            Err(TokenMapError::CompressedSize {
                expected,
                actual: self.compressed,
            })
        }
    }

    /// The compressed id of a raw id, or `None` when it is out of range.
    #[inline]
    pub fn get(&self, raw: u32) -> Option<u32> {
        self.map.get(raw as usize).copied()
    }

    /// Raw ids covered.
    pub fn raw_len(&self) -> usize {
        self.map.len()
    }

    /// Distinct compressed ids.
    pub fn compressed_len(&self) -> u32 {
        self.compressed
    }
}

/// Load a `tokenizer.json` (at most `MAX_TOKENIZER_BYTES`).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, TokenMapError> {
    let len = std::fs::metadata(path)
        .map_err(|source| TokenMapError::Io {
            path: path.display().to_string(),
            source,
        })?
        .len();
    if len > MAX_TOKENIZER_BYTES {
        return Err(TokenMapError::Tokenizer(format!(
            "{} is {len} bytes, more than the {MAX_TOKENIZER_BYTES} accepted",
            path.display()
        )));
    }
    let tok = Tokenizer::from_file(path)
        .map_err(|e| TokenMapError::Tokenizer(format!("{}: {e}", path.display())))?;
    Ok(tok)
}

#[cfg(test)]
mod tests;
