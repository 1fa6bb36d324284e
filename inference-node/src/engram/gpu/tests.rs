//! GPU tests: where no GPU (or no driver) is present they check that the
//! backend refuses with a clear error and report themselves skipped.

use std::sync::Arc;

use engram_protocol::synthetic::synthetic_rows;

use super::*;
use crate::engram::fusion::CpuFusion;

/// The GPU backend, or `None` (after checking the refusal) where there is none.
fn gpu(weights: &FusionWeights) -> Option<GpuFusion> {
    match GpuFusion::new(weights, 0) {
        Ok(g) => Some(g),
        Err(FusionError::Gpu(msg)) => {
            assert!(!msg.is_empty());
            eprintln!("skipped: no usable GPU here ({msg})");
            None
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn without_a_driver_creation_is_an_error_not_a_panic() {
    let w = FusionWeights::from_seed(0, FusionShape::new(8, 1).unwrap());
    match probe() {
        Err(FusionError::Gpu(msg)) => {
            assert!(msg.contains("cannot be loaded"), "{msg}");
            let e = GpuFusion::new(&w, 0).expect_err("no driver");
            assert_eq!(e.to_string(), format!("gpu: {msg}"));
        }
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(()) => eprintln!("skipped: the CUDA libraries are present here"),
    }
}

fn agreement(hidden: usize, streams: usize, positions: usize) {
    let shape = FusionShape::new(hidden, streams).unwrap();
    let w = Arc::new(FusionWeights::from_seed(9, shape));
    let Some(mut g) = gpu(&w) else { return };
    let mut rows = vec![0u8; positions * POSITION_ROW_BYTES];
    synthetic_rows(4, 14, 1000, &mut rows);
    let live: Vec<bool> = (0..positions).map(|p| p % 5 != 2).collect();
    let mut h: Vec<f32> = (0..positions * shape.state_len())
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 300.0)
        .collect();
    let mut want = h.clone();
    CpuFusion::new(Arc::clone(&w))
        .fuse(14, &rows, &live, &mut want)
        .unwrap();
    g.fuse(14, &rows, &live, &mut h).unwrap();
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (a, b)) in h.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * scale + 1e-4 * b.abs(),
            "value {i}: gpu {a}, cpu {b}"
        );
    }
}

#[test]
fn gpu_matches_cpu_small_shapes() {
    agreement(64, 4, 7);
    agreement(40, 1, 3);
}

#[test]
fn gpu_matches_cpu_across_chunks() {
    agreement(128, 2, CHUNK + 9);
}

#[test]
fn gpu_names_corrupt_rows_and_skips_dead_ones() {
    let shape = FusionShape::new(16, 2).unwrap();
    let w = FusionWeights::from_seed(1, shape);
    let Some(mut g) = gpu(&w) else { return };
    let mut rows = vec![0u8; 3 * POSITION_ROW_BYTES];
    synthetic_rows(1, 1, 0, &mut rows);
    rows[POSITION_ROW_BYTES..2 * POSITION_ROW_BYTES].fill(0xFF);
    let mut h = vec![1f32; 3 * shape.state_len()];
    g.fuse(1, &rows, &[true, false, true], &mut h).unwrap();
    match g.fuse(1, &rows, &[true, true, true], &mut h) {
        Err(FusionError::Row {
            position: 1,
            column: 0,
            ..
        }) => {}
        other => panic!("expected a row error, got {other:?}"),
    }
}
