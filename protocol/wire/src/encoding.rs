//! Row encodings of n-gram memory tables (docs/models.md): what a row's
//! bytes are and how an engine turns them into bf16 values, bit for bit
//! as the engines' own code does.
//!
//! - `E4m3Ue8m0`: V4.1's Engram rows, values as E4M3 then one UE8M0 scale
//!   per 32 values (256 + 8 = 264 bytes; [`crate::row`] serves them).
//! - `Fp8PerTensor`: Qwen4Exp's FP8 rows, E4M3 values and one F32 scale for
//!   the whole table; vLLM multiplies in bf16: `bf16(v) · bf16(scale)`,
//!   rounded to bf16.
//! - `Bf16`: values as they are, little-endian.
//! - `Nvfp4`: Qwen4Exp's NVFP4 rows, E2M1 values two to a byte (the low
//!   nibble first), then one E4M3 scale per 16 values; a per-tensor F32
//!   scale (`weight_scale_2`) too. Each value is `e2m1 · (f32(scale) ·
//!   global)`, in f32, rounded to bf16 (vLLM's `dequantize_to_dtype`).

use thiserror::Error;

use crate::row::{e4m3_to_f32, f32_to_bf16_bits, is_nan_code, ue8m0_to_f32};

/// Most values a row may have.
pub const MAX_VALUES: u32 = 4096;

/// E2M1 magnitudes by their three low bits.
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// How a table's rows are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowEncoding {
    /// E4M3 values, one UE8M0 scale per 32 (V4.1: 256 values, 264 bytes).
    E4m3Ue8m0 {
        /// Values per row (a multiple of 32).
        values: u32,
    },
    /// E4M3 values, one F32 scale for the whole table.
    Fp8PerTensor {
        /// Values per row.
        values: u32,
    },
    /// BF16 values.
    Bf16 {
        /// Values per row.
        values: u32,
    },
    /// E2M1 values two to a byte, one E4M3 scale per 16, and one F32 scale
    /// for the whole table.
    Nvfp4 {
        /// Values per row (a multiple of 16).
        values: u32,
    },
}

/// Why an encoding or a row is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EncodingError {
    /// A name this build does not know, or values that do not fit it.
    #[error(
        "{0:?} is not a row encoding (e4m3_ue8m0_32, fp8_per_tensor, bf16 or nvfp4_e4m3_16, then x VALUES: e.g. nvfp4_e4m3_16x160)"
    )]
    Name(String),
    /// Values per row the encoding cannot have.
    #[error("{values} values per row: {why}")]
    Values {
        /// The values asked for.
        values: u32,
        /// The bound.
        why: &'static str,
    },
    /// A row of the wrong length, or an output of the wrong length.
    #[error(
        "a row of {got} bytes or an output of {out} values: this encoding has {want} bytes and {values} values"
    )]
    Length {
        /// The row's bytes.
        got: usize,
        /// The output's values.
        out: usize,
        /// The encoding's row bytes.
        want: usize,
        /// The encoding's values.
        values: usize,
    },
    /// A NaN code or scale in the row.
    #[error("byte {at} of the row is a NaN code")]
    Nan {
        /// Its offset in the row.
        at: usize,
    },
}

impl RowEncoding {
    /// V4.1's Engram rows.
    pub const V41: Self = Self::E4m3Ue8m0 { values: 256 };

    /// Checked: values within bounds and a whole number of scale blocks.
    pub fn new(self) -> Result<Self, EncodingError> {
        let (values, block) = match self {
            Self::E4m3Ue8m0 { values } => (values, 32),
            Self::Nvfp4 { values } => (values, 16),
            Self::Fp8PerTensor { values } | Self::Bf16 { values } => (values, 1),
        };
        if values == 0 || values > MAX_VALUES {
            return Err(EncodingError::Values {
                values,
                why: "1 to 4096",
            });
        }
        if !values.is_multiple_of(block) {
            return Err(EncodingError::Values {
                values,
                why: if block == 32 {
                    "a multiple of 32 (one scale each)"
                } else {
                    "a multiple of 16 (one scale each)"
                },
            });
        }
        Ok(self)
    }

    /// Values per row.
    pub fn values(self) -> usize {
        match self {
            Self::E4m3Ue8m0 { values }
            | Self::Fp8PerTensor { values }
            | Self::Bf16 { values }
            | Self::Nvfp4 { values } => values as usize,
        }
    }

    /// Bytes per row.
    pub fn row_bytes(self) -> usize {
        let v = self.values();
        match self {
            Self::E4m3Ue8m0 { .. } => v + v / 32,
            Self::Fp8PerTensor { .. } => v,
            Self::Bf16 { .. } => 2 * v,
            Self::Nvfp4 { .. } => v / 2 + v / 16,
        }
    }

    /// Whether rows need the table's F32 scale.
    pub fn has_tensor_scale(self) -> bool {
        matches!(self, Self::Fp8PerTensor { .. } | Self::Nvfp4 { .. })
    }

    /// Its name, as a table file records it: `KIND x VALUES`.
    pub fn name(self) -> String {
        let kind = match self {
            Self::E4m3Ue8m0 { .. } => "e4m3_ue8m0_32",
            Self::Fp8PerTensor { .. } => "fp8_per_tensor",
            Self::Bf16 { .. } => "bf16",
            Self::Nvfp4 { .. } => "nvfp4_e4m3_16",
        };
        format!("{kind}x{}", self.values())
    }

    /// The encoding a name gives ([`Self::name`]'s form).
    pub fn parse(name: &str) -> Result<Self, EncodingError> {
        let bad = || EncodingError::Name(name.to_string());
        let (kind, values) = name.rsplit_once('x').ok_or_else(bad)?;
        let values: u32 = values.parse().map_err(|_| bad())?;
        let e = match kind {
            "e4m3_ue8m0_32" => Self::E4m3Ue8m0 { values },
            "fp8_per_tensor" => Self::Fp8PerTensor { values },
            "bf16" => Self::Bf16 { values },
            "nvfp4_e4m3_16" => Self::Nvfp4 { values },
            _ => return Err(bad()),
        };
        e.new()
    }

    /// Its code on the wire (a version-2 Welcome's table entry,
    /// PROTOCOL.md section 3.3): the kind, then the values per row.
    pub fn wire_code(self) -> (u16, u16) {
        let kind = match self {
            Self::E4m3Ue8m0 { .. } => 1,
            Self::Fp8PerTensor { .. } => 2,
            Self::Bf16 { .. } => 3,
            Self::Nvfp4 { .. } => 4,
        };
        // At most MAX_VALUES (4096): checked where an encoding is made.
        (kind, self.values() as u16)
    }

    /// The encoding a wire code names, checked ([`Self::new`]); `None`
    /// for a kind this build does not know or values it cannot have.
    pub fn from_wire(kind: u16, values: u16) -> Option<Self> {
        let values = u32::from(values);
        let e = match kind {
            1 => Self::E4m3Ue8m0 { values },
            2 => Self::Fp8PerTensor { values },
            3 => Self::Bf16 { values },
            4 => Self::Nvfp4 { values },
            _ => return None,
        };
        e.new().ok()
    }

    /// Check a buffer of whole rows of this encoding: every E4M3 byte
    /// (values or block scales) is a number and every UE8M0 scale is not
    /// the NaN 0xff (BF16 rows are taken as they are). The first bad row's
    /// index is the error's.
    pub fn check_rows(self, rows: &[u8]) -> Result<(), (usize, EncodingError)> {
        let size = self.row_bytes();
        if !rows.len().is_multiple_of(size) {
            return Err((
                rows.len() / size,
                EncodingError::Length {
                    got: rows.len() % size,
                    out: self.values(),
                    want: size,
                    values: self.values(),
                },
            ));
        }
        let v = self.values();
        let bad = |row: &[u8]| -> Option<usize> {
            match self {
                Self::E4m3Ue8m0 { .. } => row[..v]
                    .iter()
                    .position(|&c| is_nan_code(c))
                    .or_else(|| row[v..].iter().position(|&s| s == 0xFF).map(|i| v + i)),
                Self::Fp8PerTensor { .. } => row.iter().position(|&c| is_nan_code(c)),
                Self::Bf16 { .. } => None,
                Self::Nvfp4 { .. } => row[v / 2..]
                    .iter()
                    .position(|&c| is_nan_code(c))
                    .map(|i| v / 2 + i),
            }
        };
        for (i, row) in rows.chunks_exact(size).enumerate() {
            if let Some(at) = bad(row) {
                return Err((i, EncodingError::Nan { at }));
            }
        }
        Ok(())
    }

    /// One row's values as bf16 bits, as the engines compute them;
    /// `tensor_scale` is the table's F32 scale (ignored by encodings
    /// without one). V4.1's zero scale byte is 2^-127 here (SGLang's
    /// rule; [`crate::row`] has both).
    pub fn dequantize_bf16(
        self,
        row: &[u8],
        tensor_scale: f32,
        out: &mut [u16],
    ) -> Result<(), EncodingError> {
        let v = self.values();
        if row.len() != self.row_bytes() || out.len() != v {
            return Err(EncodingError::Length {
                got: row.len(),
                out: out.len(),
                want: self.row_bytes(),
                values: v,
            });
        }
        let e4m3 = |at: usize| e4m3_to_f32(row[at]).ok_or(EncodingError::Nan { at });
        match self {
            Self::E4m3Ue8m0 { .. } => {
                for (i, o) in out.iter_mut().enumerate() {
                    let at = v + i / 32;
                    let s = ue8m0_to_f32(row[at]).ok_or(EncodingError::Nan { at })?;
                    *o = f32_to_bf16_bits(e4m3(i)? * s);
                }
            }
            Self::Fp8PerTensor { .. } => {
                let s = round_bf16(tensor_scale);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = f32_to_bf16_bits(e4m3(i)? * s);
                }
            }
            Self::Bf16 { .. } => {
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]);
                }
            }
            Self::Nvfp4 { .. } => {
                for (i, o) in out.iter_mut().enumerate() {
                    let at = v / 2 + i / 16;
                    if is_nan_code(row[at]) {
                        return Err(EncodingError::Nan { at });
                    }
                    let scale = e4m3(at)? * tensor_scale;
                    let nibble = (row[i / 2] >> (4 * (i % 2))) & 0x0F;
                    let m = E2M1[usize::from(nibble & 7)];
                    let x = if nibble & 8 != 0 { -m } else { m };
                    *o = f32_to_bf16_bits(x * scale);
                }
            }
        }
        Ok(())
    }
}

/// `x` rounded to bf16 and back.
fn round_bf16(x: f32) -> f32 {
    crate::row::bf16_bits_to_f32(f32_to_bf16_bits(x))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::row::{ROW_BYTES, dequantize_row_bf16};
    use crate::synthetic::SplitMix64;

    #[test]
    fn each_encoding_has_its_row_size_and_name() {
        let q = |e: RowEncoding| (e.row_bytes(), e.name());
        assert_eq!(q(RowEncoding::V41), (ROW_BYTES, "e4m3_ue8m0_32x256".into()));
        assert_eq!(q(RowEncoding::Fp8PerTensor { values: 160 }).0, 160);
        assert_eq!(q(RowEncoding::Bf16 { values: 160 }).0, 320);
        assert_eq!(q(RowEncoding::Nvfp4 { values: 160 }).0, 90);
        for e in [
            RowEncoding::V41,
            RowEncoding::Fp8PerTensor { values: 160 },
            RowEncoding::Bf16 { values: 160 },
            RowEncoding::Nvfp4 { values: 160 },
        ] {
            assert_eq!(RowEncoding::parse(&e.name()), Ok(e));
        }
        for bad in [
            "bf16",
            "bf16x0",
            "bf16x4097",
            "nvfp4_e4m3_16x24",
            "e4m3_ue8m0_32x48",
            "int8x16",
            "bf16x-1",
            "",
        ] {
            assert!(RowEncoding::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn v41_rows_dequantize_as_the_row_module_does() {
        let mut rng = SplitMix64::new(3);
        let mut row = [0u8; ROW_BYTES];
        for _ in 0..200 {
            for b in &mut row[..256] {
                *b = (rng.next_u64() as u8) & 0x7E; // no NaN codes
            }
            for b in &mut row[256..] {
                *b = 100 + (rng.next_u64() % 40) as u8;
            }
            let mut want = [0u16; 256];
            dequantize_row_bf16(&row, &mut want).expect("row");
            let mut got = [0u16; 256];
            RowEncoding::V41
                .dequantize_bf16(&row, 0.0, &mut got)
                .expect("row");
            assert_eq!(got, want);
        }
    }

    #[test]
    fn rows_are_checked_by_their_own_encoding() {
        let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
        let mut rows = vec![0x38u8; 3 * 160];
        assert_eq!(fp8.check_rows(&rows), Ok(()));
        rows[160 + 7] = 0x7F;
        assert_eq!(
            fp8.check_rows(&rows),
            Err((1, EncodingError::Nan { at: 7 }))
        );
        assert!(fp8.check_rows(&rows[..100]).is_err(), "not whole rows");
        // NVFP4: nibbles are never NaN; a scale byte is.
        let nv = RowEncoding::Nvfp4 { values: 160 };
        let mut rows = vec![0xFFu8; 90];
        rows[80..].fill(0x38);
        assert_eq!(nv.check_rows(&rows), Ok(()));
        rows[85] = 0xFF;
        assert_eq!(
            nv.check_rows(&rows),
            Err((0, EncodingError::Nan { at: 85 }))
        );
        // V4.1: a scale byte of 0xff.
        let mut rows = vec![0u8; 2 * 264];
        assert_eq!(RowEncoding::V41.check_rows(&rows), Ok(()));
        rows[264 + 260] = 0xFF;
        assert_eq!(
            RowEncoding::V41.check_rows(&rows),
            Err((1, EncodingError::Nan { at: 260 }))
        );
        assert_eq!(
            RowEncoding::Bf16 { values: 160 }.check_rows(&[0xFF; 640]),
            Ok(())
        );
    }

    #[test]
    fn nvfp4_and_fp8_follow_the_engines_arithmetic() {
        // NVFP4: byte 0x9A = low nibble 0xA (-1.0), high 0x9 (-0.5); block
        // scale E4M3 0x38 = 1.0, global 3.0.
        let e = RowEncoding::Nvfp4 { values: 16 };
        let mut row = vec![0u8; e.row_bytes()];
        row[0] = 0x9A;
        row[1] = 0x07; // 6.0, then 0.0
        row[8] = 0x38;
        let mut out = vec![0u16; 16];
        e.dequantize_bf16(&row, 3.0, &mut out).expect("row");
        let f: Vec<f32> = out
            .iter()
            .map(|&b| crate::row::bf16_bits_to_f32(b))
            .collect();
        assert_eq!(&f[..4], &[-3.0, -1.5, 18.0, 0.0]);
        // FP8 per tensor: the scale is rounded to bf16 before the product.
        let e = RowEncoding::Fp8PerTensor { values: 1 };
        let mut one = [0u16; 1];
        e.dequantize_bf16(&[0x38], 1.0 + 1.0 / 512.0, &mut one)
            .expect("row");
        assert_eq!(crate::row::bf16_bits_to_f32(one[0]), 1.0);
        // NaN codes and wrong lengths are refused.
        assert!(matches!(
            e.dequantize_bf16(&[0x7F], 1.0, &mut one),
            Err(EncodingError::Nan { at: 0 })
        ));
        assert!(matches!(
            e.dequantize_bf16(&[0, 0], 1.0, &mut one),
            Err(EncodingError::Length { .. })
        ));
    }
}
