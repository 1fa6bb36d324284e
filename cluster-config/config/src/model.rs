//! The optional `[model]` table: what the inference node needs to compute
//! Engram exactly as the model does (docs/ENGRAM.md sections 2, 3 and 5): the
//! hashing preset, where the token map comes from, the shapes, the fusion
//! weights and which backend fuses.
//!
//! This file holds the validated types; the table as written is
//! `raw::RawModel`, and the rules live in `validate/model.rs` beside the
//! other rules.

use std::fmt;
use std::path::PathBuf;

use engram_protocol::hashing::Preset;

/// Most raw token ids a tokenizer or token map may have.
pub const MAX_RAW_VOCAB: u32 = 1 << 24;
/// Largest hidden size accepted.
pub const MAX_HIDDEN: u32 = 65_536;
/// Most residual streams accepted.
pub const MAX_STREAMS: u32 = 64;
/// Largest fusion weight matrix accepted, in f32 bytes per layer.
pub const MAX_WKV_BYTES: u64 = 16 << 30;

/// Where the compressed vocabulary comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenMapSource {
    /// Built from the model's `tokenizer.json`.
    Tokenizer(PathBuf),
    /// A precomputed map file (one compressed id per raw id).
    Map(PathBuf),
    /// None: the node is given compressed ids.
    None,
}

/// Where the fusion weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightsSource {
    /// A checkpoint: a safetensors file, its directory, or its index JSON.
    Checkpoint(PathBuf),
    /// Generated from a seed (tests and demos).
    Seed(u64),
}

/// Which backend fuses rows into the hidden state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FusionBackend {
    /// The CPU path.
    #[default]
    Cpu,
    /// The GPU (CUDA) path; refuse to start without one.
    Gpu,
    /// The GPU where it works, else the CPU (logged loudly).
    GpuOrCpu,
}

impl FusionBackend {
    /// Parse `cpu`, `gpu` or `gpu-or-cpu`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cpu" => Some(Self::Cpu),
            "gpu" => Some(Self::Gpu),
            "gpu-or-cpu" => Some(Self::GpuOrCpu),
            _ => None,
        }
    }
}

impl fmt::Display for FusionBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
            Self::GpuOrCpu => "gpu-or-cpu",
        })
    }
}

/// Which model family a rack serves (`[model] family`): what its n-gram
/// tables' rows are and how the node hashes tokens to them
/// (docs/models.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// DeepSeek V4.1's Engram (`deepseek_v41`, the default): tables of
    /// 264-byte rows (`e4m3_ue8m0_32x256`), 24 rows a token per table.
    #[default]
    DeepseekV41,
    /// Qwen4Exp's PLE n-gram table (`qwen4exp`, Qwen3.8-Flash-Next): rows
    /// of FP8 with a table scale, BF16 or NVFP4, 16 a token.
    Qwen4Exp,
}

impl Family {
    /// Every family, in the order docs list them.
    pub const ALL: [Self; 2] = [Self::DeepseekV41, Self::Qwen4Exp];

    /// Its name in a config.
    pub fn name(self) -> &'static str {
        match self {
            Self::DeepseekV41 => "deepseek_v41",
            Self::Qwen4Exp => "qwen4exp",
        }
    }

    /// The family named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    /// Whether a table of rows in `encoding` can be this family's n-gram
    /// table.
    pub fn accepts(self, encoding: engram_protocol::encoding::RowEncoding) -> bool {
        use engram_protocol::encoding::RowEncoding;
        match self {
            Self::DeepseekV41 => encoding == RowEncoding::V41,
            Self::Qwen4Exp => !matches!(encoding, RowEncoding::E4m3Ue8m0 { .. }),
        }
    }

    /// Rows a token needs from each of its tables: V4.1's 24 (orders 2 to
    /// 4 x 8 heads), Qwen3.8-Flash-Next's 16 (orders 2 and 3 x 8 heads).
    pub fn rows_per_token(self) -> usize {
        match self {
            Self::DeepseekV41 => engram_protocol::hashing::COLUMNS,
            Self::Qwen4Exp => {
                (engram_protocol::qwen4exp::QWEN38_NGRAM_SIZE - 1)
                    * engram_protocol::qwen4exp::QWEN38_HEADS_PER_NGRAM
            }
        }
    }

    /// The encodings its tables may have, for messages.
    pub fn encodings(self) -> &'static str {
        match self {
            Self::DeepseekV41 => "e4m3_ue8m0_32x256",
            Self::Qwen4Exp => "fp8_per_tensorxN, bf16xN or nvfp4_e4m3_16xN",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The validated `[model]` table.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The model family (default `deepseek_v41`).
    pub family: Family,
    /// The end-of-sequence token id a Qwen4Exp n-gram window restarts at
    /// (`eos_token`; required under `qwen4exp`, refused otherwise).
    pub eos_token: Option<u32>,
    /// Hashing preset (default `v41`).
    pub hashing: Preset,
    /// Token map source.
    pub token_map: TokenMapSource,
    /// The compressed vocabulary size a token map must have (V4.1: 99,092;
    /// the default under `v41`); a map of another size is refused.
    pub compressed_vocab: Option<u32>,
    /// Raw id of the pad token (default 2); its compressed id pads hashing.
    pub pad_token: u32,
    /// Hidden size (default 5120).
    pub hidden: u32,
    /// Residual streams (default 4).
    pub streams: u32,
    /// Fusion weights.
    pub weights: Option<WeightsSource>,
    /// Fusion backend (default `cpu`).
    pub fusion: FusionBackend,
    /// The checkpoint's `config.json`, whose Engram and fusion parameters
    /// the node checks at start: `config` as given, else the one in the
    /// directory of the `weights` checkpoint (used where it exists).
    pub config_json: Option<ConfigJson>,
}

/// Where the checkpoint's `config.json` is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigJson {
    /// Named by `config`: it must exist.
    Named(PathBuf),
    /// Beside the `weights` checkpoint: checked where it exists.
    Beside(PathBuf),
}

impl ConfigJson {
    /// The file.
    pub fn path(&self) -> &std::path::Path {
        match self {
            Self::Named(p) | Self::Beside(p) => p,
        }
    }
}
