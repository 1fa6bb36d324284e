//! Deterministic synthetic rows: each row's bytes are a pure function of
//! `(seed, layer, row id)`, so any test or tool can check any served row
//! without the table file. Every row decodes (no NaN code, no NaN scale) and
//! its scales stay in `2^-7..=2^0`, so values look like a real table's.

use crate::row::{ROW_BYTES, ROW_VALUES, RowBytes, is_nan_code};

/// splitmix64 finalizer: a bijective 64-bit mix.
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A small, fast, seedable generator (splitmix64). Not for cryptography.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose sequence is a pure function of `seed`.
    pub const fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// A value uniform in `0..bound` (bound > 0), by multiply-shift.
    #[inline]
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }
}

/// Fill `out` with the synthetic row `(seed, layer, row)`.
pub fn synthetic_row(seed: u64, layer: u32, row: u64, out: &mut RowBytes) {
    let key = mix64(seed ^ mix64(u64::from(layer) ^ 0x656E_6772_616D_0000)) ^ row;
    let mut rng = SplitMix64::new(mix64(key));
    for chunk in out.chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let (values, scales) = out.split_at_mut(ROW_VALUES);
    for c in values.iter_mut() {
        // Flip the lowest mantissa bit of the two NaN codes: 0x7F -> 0x7E (448).
        *c ^= u8::from(is_nan_code(*c));
    }
    for s in scales.iter_mut() {
        *s = 120 + (*s & 7);
    }
}

/// Fill a buffer of whole rows with the synthetic rows `first_row..`.
pub fn synthetic_rows(seed: u64, layer: u32, first_row: u64, out: &mut [u8]) {
    for (i, chunk) in out.chunks_exact_mut(ROW_BYTES).enumerate() {
        if let Ok(row) = <&mut RowBytes>::try_from(chunk) {
            synthetic_row(seed, layer, first_row + i as u64, row);
        }
    }
}

/// True when `bytes` are exactly the synthetic row `(seed, layer, row)`.
pub fn is_synthetic_row(seed: u64, layer: u32, row: u64, bytes: &[u8]) -> bool {
    let mut want = [0u8; ROW_BYTES];
    synthetic_row(seed, layer, row, &mut want);
    bytes == want
}

/// The first of `ids` whose row in `bytes` (rows back to back, in the
/// order of `ids`) is not the synthetic row, if any.
pub fn first_mismatch(seed: u64, layer: u32, ids: &[u64], bytes: &[u8]) -> Option<u64> {
    if bytes.len() != ids.len() * ROW_BYTES {
        return ids.first().copied().or(Some(0));
    }
    ids.iter()
        .zip(bytes.chunks_exact(ROW_BYTES))
        .find(|(r, b)| !is_synthetic_row(seed, layer, **r, b))
        .map(|(r, _)| *r)
}

/// Fill `out` (exactly one row of `encoding`) with the synthetic row
/// `(seed, layer, row)` of that encoding. V4.1's rows are
/// [`synthetic_row`]'s. Every row decodes: FP8 codes are never NaN (the
/// NaN codes' lowest bit flipped, as V4.1's); BF16 values have magnitudes
/// in `2^-7 .. 2^1`; NVFP4's nibbles are any, its E4M3 block scales in
/// `0.5 .. 1`. Returns false (and leaves `out`) when `out` is not one row.
pub fn synthetic_encoded_row(
    encoding: crate::encoding::RowEncoding,
    seed: u64,
    layer: u32,
    row: u64,
    out: &mut [u8],
) -> bool {
    use crate::encoding::RowEncoding;
    if out.len() != encoding.row_bytes() {
        return false;
    }
    if encoding == RowEncoding::V41 {
        return <&mut RowBytes>::try_from(out).is_ok_and(|r| {
            synthetic_row(seed, layer, row, r);
            true
        });
    }
    let (kind, _) = encoding.wire_code();
    let key = mix64(seed ^ mix64(u64::from(layer) ^ 0x656E_6772_616D_0000 ^ u64::from(kind) << 48));
    let mut rng = SplitMix64::new(mix64(key ^ row));
    for chunk in out.chunks_mut(8) {
        let x = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&x[..chunk.len()]);
    }
    let v = encoding.values();
    match encoding {
        RowEncoding::E4m3Ue8m0 { .. } => {
            for c in out[..v].iter_mut() {
                *c ^= u8::from(is_nan_code(*c));
            }
            for s in out[v..].iter_mut() {
                *s = 120 + (*s & 7);
            }
        }
        RowEncoding::Fp8PerTensor { .. } => {
            for c in out.iter_mut() {
                *c ^= u8::from(is_nan_code(*c));
            }
        }
        RowEncoding::Bf16 { .. } => {
            for b in out.chunks_exact_mut(2) {
                let r = u16::from_le_bytes([b[0], b[1]]);
                // Sign, a biased exponent of 120 to 127, 7 mantissa bits.
                let x = (r & 0x8000) | ((120 + ((r >> 7) & 7)) << 7) | (r & 0x7F);
                b.copy_from_slice(&x.to_le_bytes());
            }
        }
        RowEncoding::Nvfp4 { .. } => {
            for s in out[v / 2..].iter_mut() {
                // E4M3 exponent 6: 0.5 .. 0.9375.
                *s = 0x30 | (*s & 7);
            }
        }
    }
    true
}

/// [`synthetic_encoded_row`] for rows `first_row..` back to back in `out`.
pub fn synthetic_encoded_rows(
    encoding: crate::encoding::RowEncoding,
    seed: u64,
    layer: u32,
    first_row: u64,
    out: &mut [u8],
) {
    for (i, chunk) in out.chunks_exact_mut(encoding.row_bytes()).enumerate() {
        synthetic_encoded_row(encoding, seed, layer, first_row + i as u64, chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::row::check_row;

    /// Every encoding's synthetic rows decode, differ row to row, and
    /// V4.1's are the V4.1 generator's.
    #[test]
    fn encoded_rows_decode_and_v41_is_unchanged() {
        use crate::encoding::RowEncoding;
        for e in [
            RowEncoding::V41,
            RowEncoding::Fp8PerTensor { values: 160 },
            RowEncoding::Bf16 { values: 160 },
            RowEncoding::Nvfp4 { values: 160 },
        ] {
            let mut rows = vec![0u8; 500 * e.row_bytes()];
            synthetic_encoded_rows(e, 3, 2, 1_000, &mut rows);
            assert_eq!(e.check_rows(&rows), Ok(()), "{}", e.name());
            let mut out = vec![0u16; e.values()];
            for r in rows.chunks_exact(e.row_bytes()) {
                e.dequantize_bf16(r, 1.0, &mut out).expect("decodes");
                let finite = out
                    .iter()
                    .all(|&b| crate::row::bf16_bits_to_f32(b).is_finite());
                assert!(finite, "{}", e.name());
            }
            assert_ne!(
                rows[..e.row_bytes()],
                rows[e.row_bytes()..2 * e.row_bytes()]
            );
            let mut one = vec![0u8; e.row_bytes()];
            assert!(synthetic_encoded_row(e, 3, 2, 1_007, &mut one));
            assert_eq!(one, rows[7 * e.row_bytes()..8 * e.row_bytes()]);
            assert!(!synthetic_encoded_row(e, 3, 2, 0, &mut one[1..]));
        }
        let mut a = vec![0u8; ROW_BYTES];
        synthetic_encoded_row(RowEncoding::V41, 9, 1, 5, &mut a);
        assert!(is_synthetic_row(9, 1, 5, &a));
    }

    #[test]
    fn rows_are_deterministic_and_distinct() {
        let mut a = [0u8; ROW_BYTES];
        let mut b = [0u8; ROW_BYTES];
        synthetic_row(7, 1, 42, &mut a);
        synthetic_row(7, 1, 42, &mut b);
        assert_eq!(a, b);
        synthetic_row(7, 1, 43, &mut b);
        assert_ne!(a, b);
        synthetic_row(7, 14, 42, &mut b);
        assert_ne!(a, b);
        synthetic_row(8, 1, 42, &mut b);
        assert_ne!(a, b);
        assert!(is_synthetic_row(7, 1, 42, &a));
        assert!(!is_synthetic_row(7, 1, 41, &a));
        let both = [a, b].concat();
        assert_eq!(first_mismatch(7, 1, &[42, 42], &both), Some(42));
        assert_eq!(first_mismatch(7, 1, &[42], &a), None);
        assert_eq!(
            first_mismatch(7, 1, &[42, 43], &a),
            Some(42),
            "a length mismatch is a mismatch"
        );
    }

    #[test]
    fn every_row_decodes() {
        let mut row = [0u8; ROW_BYTES];
        for r in 0..50_000u64 {
            synthetic_row(3, 14, r * 7919, &mut row);
            assert_eq!(check_row(&row), Ok(()), "row {r}");
        }
    }

    #[test]
    fn batch_equals_single_rows() {
        let mut batch = vec![0u8; 5 * ROW_BYTES];
        synthetic_rows(1, 1, 100, &mut batch);
        for (i, chunk) in batch.chunks_exact(ROW_BYTES).enumerate() {
            assert!(is_synthetic_row(1, 1, 100 + i as u64, chunk));
        }
    }

    #[test]
    fn below_stays_in_range() {
        let mut rng = SplitMix64::new(5);
        for bound in [1u64, 2, 3, 1000, u64::MAX] {
            for _ in 0..1000 {
                assert!(rng.below(bound) < bound);
            }
        }
    }
}
