//! The fusion backend the config asks for: the CPU path (`fusion`) or
//! the CUDA path (`gpu`, behind the `cuda` feature), above both.

use std::sync::Arc;

use cluster_config::model::FusionBackend;

use super::fusion::{CpuFusion, Fusion, FusionError};
use super::weights::FusionWeights;

/// The backend the config asks for: `cpu`; `gpu` (an error when no GPU
/// backend can start); `gpu-or-cpu` (the CPU, with a warning naming why,
/// when the GPU backend cannot start).
pub fn backend(
    choice: FusionBackend,
    weights: Arc<FusionWeights>,
) -> Result<Box<dyn Fusion>, FusionError> {
    match choice {
        FusionBackend::Cpu => Ok(Box::new(CpuFusion::new(weights))),
        FusionBackend::Gpu => gpu_backend(&weights),
        FusionBackend::GpuOrCpu => match gpu_backend(&weights) {
            Ok(b) => Ok(b),
            Err(e) => {
                tracing::warn!("GPU fusion is unavailable ({e}); fusing on the CPU");
                Ok(Box::new(CpuFusion::new(weights)))
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn gpu_backend(weights: &FusionWeights) -> Result<Box<dyn Fusion>, FusionError> {
    Ok(Box::new(super::gpu::GpuFusion::new(weights, 0)?))
}

#[cfg(not(feature = "cuda"))]
fn gpu_backend(_: &FusionWeights) -> Result<Box<dyn Fusion>, FusionError> {
    Err(FusionError::Gpu(
        "this build has no GPU support (build with --features cuda)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engram::weights::FusionShape;

    #[test]
    fn the_backend_choice_follows_the_config() {
        let w = Arc::new(FusionWeights::from_seed(0, FusionShape::new(8, 1).unwrap()));
        let cpu = backend(FusionBackend::Cpu, Arc::clone(&w)).unwrap();
        assert_eq!(cpu.name(), "cpu");
        // Without a GPU (or without the feature) `gpu` refuses and `gpu-or-cpu` falls back.
        if let Err(e) = backend(FusionBackend::Gpu, Arc::clone(&w)) {
            assert!(matches!(e, FusionError::Gpu(_)), "{e}");
            let b = backend(FusionBackend::GpuOrCpu, w).unwrap();
            assert_eq!(b.name(), "cpu");
        } else {
            eprintln!("a GPU backend started: the refusal path is not exercised here");
        }
    }
}
