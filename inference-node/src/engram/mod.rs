//! Engram math on the inference node (docs/ENGRAM.md sections 2 to 5): the token
//! map, row addressing (from `engram_protocol::hashing`), dequantized rows
//! and their fusion into the hidden state.
//!
//! Layers: `addresses` (what `inference-node addresses` prints), `tokenmap` (raw -> compressed ids), `weights` (the fusion
//! weights, from a checkpoint or a seed), `fusion` (the CPU path), `gpu`
//! (the CUDA path, behind the `cuda` feature), `backend` (which of the two
//! the config asks for).

pub mod addresses;
pub mod backend;
pub mod fusion;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod ple;
pub mod tokenmap;
pub mod weights;

pub use backend::backend;
pub use fusion::{CpuFusion, Fusion, FusionError};
pub use tokenmap::{TokenMap, TokenMapError};
pub use weights::{FusionShape, FusionWeights, WeightsError};
