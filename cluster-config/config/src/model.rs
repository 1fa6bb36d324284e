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

/// The validated `[model]` table.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
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
