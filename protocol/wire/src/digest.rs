//! A table's version: BLAKE3 over its logical rows in row order, independent
//! of how the rows are laid out in a file or in memory.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

use crate::row::ROW_BYTES;

/// The 32-byte BLAKE3 digest of a table's rows; the table's version.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableDigest(pub [u8; 32]);

/// A digest string that is not 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("a table digest is 64 hex digits (BLAKE3), got {0:?}")]
pub struct DigestParseError(pub String);

impl TableDigest {
    /// The 64-bit prefix carried in every lookup: the first 8 digest bytes, little-endian.
    pub fn prefix(&self) -> u64 {
        let mut p = [0u8; 8];
        p.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(p)
    }

    /// Lower-case hex, 64 digits.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
            s.push(char::from_digit(u32::from(b & 15), 16).unwrap_or('0'));
        }
        s
    }

    /// The digest of a buffer holding whole rows in row order.
    pub fn of_rows(rows: &[u8]) -> Self {
        let mut d = DigestBuilder::new();
        d.update(rows);
        d.finish()
    }
}

impl FromStr for TableDigest {
    type Err = DigestParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let t = t.strip_prefix("blake3:").unwrap_or(t);
        if t.len() != 64 || !t.is_ascii() {
            return Err(DigestParseError(s.to_string()));
        }
        let mut out = [0u8; 32];
        for (i, pair) in t.as_bytes().chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16);
            let lo = (pair[1] as char).to_digit(16);
            match (hi, lo) {
                (Some(h), Some(l)) => out[i] = (h * 16 + l) as u8,
                _ => return Err(DigestParseError(s.to_string())),
            }
        }
        Ok(Self(out))
    }
}

impl fmt::Display for TableDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for TableDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableDigest({})", self.to_hex())
    }
}

/// Incremental digest over rows fed in row order (any chunking).
#[derive(Debug, Clone, Default)]
pub struct DigestBuilder {
    hasher: blake3::Hasher,
    bytes: u64,
}

impl DigestBuilder {
    /// An empty digest.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed the next rows. Large slices hash fastest (BLAKE3 uses SIMD across chunks).
    pub fn update(&mut self, rows: &[u8]) {
        self.hasher.update(rows);
        self.bytes += rows.len() as u64;
    }

    /// Rows fed so far (whole rows only count once complete).
    pub fn rows(&self) -> u64 {
        self.bytes / ROW_BYTES as u64
    }

    /// The finished digest.
    pub fn finish(self) -> TableDigest {
        TableDigest(*self.hasher.finalize().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        let d = TableDigest::of_rows(&[1u8; ROW_BYTES * 3]);
        let hex = d.to_hex();
        assert_eq!(hex.len(), 64);
        assert_eq!(hex.parse::<TableDigest>(), Ok(d));
        assert_eq!(format!("blake3:{hex}").parse::<TableDigest>(), Ok(d));
        assert_eq!(hex.to_uppercase().parse::<TableDigest>(), Ok(d));
        assert!(hex[1..].parse::<TableDigest>().is_err());
        assert!(format!("{}g", &hex[1..]).parse::<TableDigest>().is_err());
        assert!("é".repeat(32).parse::<TableDigest>().is_err());
    }

    #[test]
    fn digest_is_independent_of_chunking() {
        let data: Vec<u8> = (0..ROW_BYTES * 100).map(|i| (i * 31 % 251) as u8).collect();
        let whole = TableDigest::of_rows(&data);
        let mut b = DigestBuilder::new();
        for chunk in data.chunks(777) {
            b.update(chunk);
        }
        assert_eq!(b.rows(), 100);
        assert_eq!(b.finish(), whole);
        assert_eq!(whole.0, *blake3::hash(&data).as_bytes());
    }

    #[test]
    fn prefix_is_first_eight_bytes_le() {
        let mut d = TableDigest([0; 32]);
        d.0[0] = 0x01;
        d.0[7] = 0x80;
        assert_eq!(d.prefix(), 0x8000_0000_0000_0001);
    }
}
