//! The 264-byte Engram row: 256 FP8 E4M3FN codes followed by 8 UE8M0 scales,
//! scale `j` covering values `32j..32j+31` (docs/ENGRAM.md section 4).
//!
//! Dequantization is exact in f32 (an E4M3 value has 4 significant bits and a
//! power-of-two scale only moves the exponent), except that the largest
//! values times the largest scales overflow to infinity exactly as f32
//! arithmetic does. The bf16 form is that f32 value rounded to nearest even.
//! NaN codes (`code & 0x7F == 0x7F`) and the NaN scale (`0xFF`) make a row
//! corrupt: they are reported, never turned into a value.

use thiserror::Error;

/// Bytes in one row.
pub const ROW_BYTES: usize = 264;
/// FP8 values in one row.
pub const ROW_VALUES: usize = 256;
/// UE8M0 scales in one row.
pub const ROW_SCALES: usize = 8;
/// Values covered by one scale.
pub const SCALE_BLOCK: usize = ROW_VALUES / ROW_SCALES;

/// One row's bytes.
pub type RowBytes = [u8; ROW_BYTES];

/// Why a row cannot be dequantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum RowError {
    /// A value byte is an E4M3FN NaN code.
    #[error("value {index} holds the E4M3 NaN code {code:#04x}")]
    NanCode {
        /// Index of the value byte within the row's values.
        index: usize,
        /// The NaN byte.
        code: u8,
    },
    /// A scale byte is the UE8M0 NaN (0xFF).
    #[error("scale {index} is the UE8M0 NaN 0xff")]
    NanScale {
        /// Index of the scale byte within the row's scales.
        index: usize,
    },
    /// A buffer is not a whole number of rows, or the output does not match.
    #[error("buffer of {len} bytes is not {rows} rows of {ROW_BYTES} bytes")]
    Length {
        /// Buffer length in bytes.
        len: usize,
        /// Rows the buffer was expected to hold.
        rows: usize,
    },
}

/// True when `code` is an E4M3FN NaN.
#[inline]
pub const fn is_nan_code(code: u8) -> bool {
    code & 0x7F == 0x7F
}

/// f32 bit pattern of an E4M3FN code (NaN codes give the canonical f32 NaN).
const fn e4m3_bits(code: u8) -> u32 {
    if is_nan_code(code) {
        return 0x7FC0_0000;
    }
    let sign = ((code >> 7) as u32) << 31;
    let exp = ((code >> 3) & 0x0F) as u32;
    let man = (code & 0x07) as u32;
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // Subnormal: man * 2^-9. Normalize the 3-bit mantissa.
        let mut m = man;
        let mut e: i32 = -9;
        while m < 8 {
            m <<= 1;
            e -= 1;
        }
        // Now value = m * 2^e with 8 <= m < 16, i.e. (m/8) * 2^(e+3).
        let f32_exp = (e + 3 + 127) as u32;
        return sign | (f32_exp << 23) | ((m & 0x07) << 20);
    }
    // Normal: (8 + man) * 2^(exp - 10) = 1.man * 2^(exp - 7).
    let f32_exp = exp + 120;
    sign | (f32_exp << 23) | (man << 20)
}

const fn build_e4m3_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_bits(i as u8);
        i += 1;
    }
    t
}

/// f32 bit patterns of all 256 E4M3FN codes.
static E4M3_F32_BITS: [u32; 256] = build_e4m3_table();

/// Scales for which every non-zero code times the scale is a normal f32 and
/// bf16 value: exponents 2^-9..2^8 shifted by `s - 127` stay in 1..=254, so
/// the product is exact (4 significant bits) and needs no rounding to bf16.
const FAST_SCALES: std::ops::RangeInclusive<u8> = 10..=246;

/// The value of an E4M3FN code, or `None` for NaN.
#[inline]
pub fn e4m3_to_f32(code: u8) -> Option<f32> {
    (!is_nan_code(code)).then(|| f32::from_bits(E4M3_F32_BITS[code as usize]))
}

/// The value of a UE8M0 scale, `2^(s - 127)`, or `None` for the NaN scale 0xFF.
#[inline]
pub fn ue8m0_to_f32(scale: u8) -> Option<f32> {
    match scale {
        0xFF => None,
        // 2^-127 is an f32 subnormal: only the mantissa's top bit is set.
        0 => Some(f32::from_bits(0x0040_0000)),
        s => Some(f32::from_bits(u32::from(s) << 23)),
    }
}

/// Round an f32 to bf16 bits, to nearest, ties to even. NaN stays NaN.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    // Cannot overflow: the largest finite pattern plus the bias stays below 2^32.
    ((bits + 0x7FFF + lsb) >> 16) as u16
}

/// The f32 value of bf16 bits.
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Check that a row holds no NaN code and no NaN scale.
pub fn check_row(row: &RowBytes) -> Result<(), RowError> {
    let (values, scales) = row.split_at(ROW_VALUES);
    // Branch-free scan first (vectorizes); locate the culprit only on failure.
    let bad_values = values
        .iter()
        .fold(0u8, |acc, &c| acc | u8::from(is_nan_code(c)));
    let bad_scales = scales.iter().fold(0u8, |acc, &s| acc | u8::from(s == 0xFF));
    if bad_values | bad_scales == 0 {
        return Ok(());
    }
    if let Some(index) = values.iter().position(|&c| is_nan_code(c)) {
        return Err(RowError::NanCode {
            index,
            code: values[index],
        });
    }
    let index = scales.iter().position(|&s| s == 0xFF).unwrap_or(0);
    Err(RowError::NanScale { index })
}

/// Check every row of a buffer of whole rows; returns the index of the first bad row.
pub fn check_rows(rows: &[u8]) -> Result<(), (usize, RowError)> {
    if !rows.len().is_multiple_of(ROW_BYTES) {
        return Err((
            0,
            RowError::Length {
                len: rows.len(),
                rows: rows.len() / ROW_BYTES,
            },
        ));
    }
    for (i, row) in rows.chunks_exact(ROW_BYTES).enumerate() {
        let row: &RowBytes = row.try_into().map_err(|_| {
            (
                i,
                RowError::Length {
                    len: row.len(),
                    rows: 1,
                },
            )
        })?;
        check_row(row).map_err(|e| (i, e))?;
    }
    Ok(())
}

/// Dequantize one row, converting each f32 value with `conv`.
#[inline]
fn dequantize_row<T>(
    row: &RowBytes,
    out: &mut [T; ROW_VALUES],
    conv: impl Fn(f32) -> T,
) -> Result<(), RowError> {
    check_row(row)?;
    let (values, scales) = row.split_at(ROW_VALUES);
    for (block, (&scale, out)) in scales
        .iter()
        .zip(out.chunks_exact_mut(SCALE_BLOCK))
        .enumerate()
    {
        let s = ue8m0_to_f32(scale).ok_or(RowError::NanScale { index: block })?;
        let codes = &values[block * SCALE_BLOCK..(block + 1) * SCALE_BLOCK];
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = conv(f32::from_bits(E4M3_F32_BITS[c as usize]) * s);
        }
    }
    Ok(())
}

/// Dequantize one row to f32.
pub fn dequantize_row_f32(row: &RowBytes, out: &mut [f32; ROW_VALUES]) -> Result<(), RowError> {
    dequantize_row(row, out, |v| v)
}

/// Dequantize one row to bf16 bits (f32 value rounded to nearest even).
pub fn dequantize_row_bf16(row: &RowBytes, out: &mut [u16; ROW_VALUES]) -> Result<(), RowError> {
    let (values, scales) = row.split_at(ROW_VALUES);
    if !scales.iter().all(|s| FAST_SCALES.contains(s)) {
        return dequantize_row(row, out, f32_to_bf16_bits);
    }
    check_row(row)?;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { bf16_blocks_avx2(values, scales, out) };
        return Ok(());
    }
    bf16_blocks(values, scales, out);
    Ok(())
}

/// The bf16 values of a row whose scales are all in `FAST_SCALES`.
#[inline(always)]
fn bf16_blocks(values: &[u8], scales: &[u8], out: &mut [u16; ROW_VALUES]) {
    for ((&scale, out), codes) in scales
        .iter()
        .zip(out.chunks_exact_mut(SCALE_BLOCK))
        .zip(values.chunks_exact(SCALE_BLOCK))
    {
        // Branch-free f32 arithmetic (it vectorizes, a table lookup does
        // not): the product is exact in this scale range, so its top 16 bits
        // are the bf16 value with no rounding to do.
        let s = f32::from_bits(u32::from(scale) << 23);
        for (o, &c) in out.iter_mut().zip(codes) {
            let c = u32::from(c);
            let (e, m) = ((c >> 3) & 0x0F, c & 0x07);
            let normal = f32::from_bits(((e + 120) << 23) | (m << 20));
            let subnormal = m as f32 * (1.0 / 512.0);
            let mag = if e == 0 { subnormal } else { normal };
            *o = ((mag * s).to_bits() >> 16) as u16 | ((c & 0x80) << 8) as u16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn bf16_blocks_avx2(values: &[u8], scales: &[u8], out: &mut [u16; ROW_VALUES]) {
    bf16_blocks(values, scales, out);
}

/// Dequantize a buffer of whole rows to bf16 bits, 256 values per row.
pub fn dequantize_rows_bf16(rows: &[u8], out: &mut [u16]) -> Result<(), (usize, RowError)> {
    let n = rows.len() / ROW_BYTES;
    if !rows.len().is_multiple_of(ROW_BYTES) || out.len() != n * ROW_VALUES {
        return Err((
            0,
            RowError::Length {
                len: rows.len(),
                rows: n,
            },
        ));
    }
    for (i, (row, out)) in rows
        .chunks_exact(ROW_BYTES)
        .zip(out.chunks_exact_mut(ROW_VALUES))
        .enumerate()
    {
        let (Ok(row), Ok(out)) = (
            <&RowBytes>::try_from(row),
            <&mut [u16; ROW_VALUES]>::try_from(out),
        ) else {
            return Err((
                i,
                RowError::Length {
                    len: row.len(),
                    rows: 1,
                },
            ));
        };
        dequantize_row_bf16(row, out).map_err(|e| (i, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3FN decoded from the definition, in f64, without bit tricks.
    fn reference_e4m3(code: u8) -> Option<f64> {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((code >> 3) & 0x0F);
        let m = f64::from(code & 0x07);
        if e == 15 && m == 7.0 {
            return None;
        }
        let mag = if e == 0 {
            m * 2f64.powi(-9)
        } else {
            (8.0 + m) * 2f64.powi(e - 10)
        };
        Some(sign * mag)
    }

    #[test]
    fn all_256_codes_match_the_definition() {
        let mut nan = 0;
        for code in 0..=255u8 {
            match (reference_e4m3(code), e4m3_to_f32(code)) {
                (None, None) => nan += 1,
                (Some(r), Some(v)) => {
                    assert_eq!(f64::from(v), r, "code {code:#04x}");
                    assert_eq!(
                        v.is_sign_negative(),
                        code & 0x80 != 0,
                        "sign of {code:#04x}"
                    );
                }
                (r, v) => panic!("code {code:#04x}: reference {r:?}, decoded {v:?}"),
            }
        }
        assert_eq!(nan, 2, "exactly 0x7f and 0xff are NaN");
        assert_eq!(e4m3_to_f32(0x7E), Some(448.0));
        assert_eq!(e4m3_to_f32(0x01), Some(2f32.powi(-9)));
    }

    #[test]
    fn all_256_scales_match_the_definition() {
        for s in 0..=255u8 {
            let got = ue8m0_to_f32(s);
            if s == 0xFF {
                assert_eq!(got, None);
            } else {
                let want = 2f64.powi(i32::from(s) - 127);
                assert_eq!(got.map(f64::from), Some(want), "scale {s}");
            }
        }
    }

    #[test]
    fn every_code_times_every_scale_matches_f64_in_f32_and_bf16() {
        for code in 0..=255u8 {
            let Some(v) = reference_e4m3(code) else {
                continue;
            };
            for s in 0..=254u8 {
                let exact = v * 2f64.powi(i32::from(s) - 127);
                let mut row = [0u8; ROW_BYTES];
                row[0] = code;
                row[ROW_VALUES..].fill(s);
                let mut f = [0f32; ROW_VALUES];
                dequantize_row_f32(&row, &mut f).expect("valid row");
                // `as f32` rounds to nearest even and overflows to infinity.
                let want = exact as f32;
                assert_eq!(f[0].to_bits(), want.to_bits(), "code {code:#04x} scale {s}");
                let mut b = [0u16; ROW_VALUES];
                dequantize_row_bf16(&row, &mut b).expect("valid row");
                let want_bf16 = half::bf16::from_f64(exact);
                assert_eq!(
                    b[0],
                    want_bf16.to_bits(),
                    "bf16 of code {code:#04x} scale {s}"
                );
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn bf16_fast_path_equals_rounding_the_f32_values(
            codes in proptest::collection::vec(0u8..=0xFE, ROW_VALUES),
            scales in proptest::collection::vec(0u8..=0xFE, ROW_SCALES),
        ) {
            let mut row = [0u8; ROW_BYTES];
            for (i, c) in codes.iter().enumerate() {
                row[i] = if is_nan_code(*c) { 0 } else { *c };
            }
            row[ROW_VALUES..].copy_from_slice(&scales);
            let mut fast = [0u16; ROW_VALUES];
            let mut slow = [0u16; ROW_VALUES];
            dequantize_row_bf16(&row, &mut fast).unwrap();
            dequantize_row(&row, &mut slow, f32_to_bf16_bits).unwrap();
            proptest::prop_assert_eq!(fast, slow);
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 neighbours: ties go to even (1.0).
        assert_eq!(f32_to_bf16_bits(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1 + 3 * 2^-8 is halfway too: ties go to even (1 + 2^-6).
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7F80);
        assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::NAN)).is_nan());
        for x in [0.1f32, -3.7, 1e-30, 6.5e4, 3.0e38] {
            assert_eq!(
                f32_to_bf16_bits(x),
                half::bf16::from_f32(x).to_bits(),
                "{x}"
            );
        }
    }

    #[test]
    fn scales_apply_per_block_of_32() {
        let mut row = [0x38u8; ROW_BYTES]; // 0x38 = 1.0
        for j in 0..ROW_SCALES {
            row[ROW_VALUES + j] = 127 + j as u8;
        }
        let mut f = [0f32; ROW_VALUES];
        dequantize_row_f32(&row, &mut f).expect("valid row");
        for (i, v) in f.iter().enumerate() {
            assert_eq!(*v, 2f32.powi((i / SCALE_BLOCK) as i32), "value {i}");
        }
    }

    #[test]
    fn nan_codes_and_scales_are_errors() {
        let mut row = [0u8; ROW_BYTES];
        row[ROW_VALUES..].fill(127);
        assert_eq!(check_row(&row), Ok(()));
        row[17] = 0xFF;
        assert_eq!(
            check_row(&row),
            Err(RowError::NanCode {
                index: 17,
                code: 0xFF
            })
        );
        let mut f = [0f32; ROW_VALUES];
        assert!(dequantize_row_f32(&row, &mut f).is_err());
        row[17] = 0;
        row[ROW_VALUES + 5] = 0xFF;
        assert_eq!(check_row(&row), Err(RowError::NanScale { index: 5 }));
        let mut b = [0u16; ROW_VALUES];
        assert_eq!(
            dequantize_row_bf16(&row, &mut b),
            Err(RowError::NanScale { index: 5 })
        );
    }

    #[test]
    fn batch_reports_the_bad_row_and_bad_lengths() {
        let mut rows = vec![0u8; 3 * ROW_BYTES];
        for r in rows.chunks_exact_mut(ROW_BYTES) {
            r[ROW_VALUES..].fill(127);
        }
        let mut out = vec![0u16; 3 * ROW_VALUES];
        assert_eq!(dequantize_rows_bf16(&rows, &mut out), Ok(()));
        rows[2 * ROW_BYTES + 3] = 0x7F;
        assert_eq!(
            dequantize_rows_bf16(&rows, &mut out).map_err(|e| e.0),
            Err(2)
        );
        assert_eq!(check_rows(&rows).map_err(|e| e.0), Err(2));
        assert!(dequantize_rows_bf16(&rows[1..], &mut out).is_err());
        assert!(dequantize_rows_bf16(&rows, &mut out[1..]).is_err());
    }
}
