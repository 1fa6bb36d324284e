//! Engram math on the CPU, per unit of work: hashing (positions per second
//! on one core), dequantizing one 24-row batch to bf16, and fusing one
//! position at V4.1 shapes (hidden 5120, 4 streams).
//!
//! Run: `cargo bench -p engram-bench --bench engram` (about two minutes here).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use engram_protocol::hashing::{COLUMNS, HashParams, SequenceHasher};
use engram_protocol::row::dequantize_rows_bf16;
use engram_protocol::synthetic::synthetic_rows;
use engram_protocol::{ROW_BYTES, ROW_VALUES};
use inference_node::engram::fusion::{CpuFusion, Fusion, POSITION_ROW_BYTES};
use inference_node::engram::{FusionShape, FusionWeights};

fn hashing(c: &mut Criterion) {
    let params = HashParams::v41();
    let n = 4096u64;
    // A pseudo-random sequence of compressed ids with a DEAD token now and then.
    let ids: Vec<i64> = (0..n)
        .map(|i| {
            let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 47;
            if x % 97 == 0 { -1 } else { (x % 99_092) as i64 }
        })
        .collect();
    let mut g = c.benchmark_group("hashing");
    g.throughput(Throughput::Elements(n));
    g.bench_function("v41 positions (2 layers x 24 rows)", |b| {
        let mut rows = [[0u64; COLUMNS]; 2];
        b.iter(|| {
            let mut h = SequenceHasher::new(&params, 2).expect("pad");
            let mut acc = 0u64;
            for &id in &ids {
                if h.push(id, &mut rows).expect("id") {
                    acc ^= rows[0][23] ^ rows[1][0];
                }
            }
            black_box(acc)
        });
    });
    g.finish();
}

fn dequant(c: &mut Criterion) {
    let mut rows = vec![0u8; COLUMNS * ROW_BYTES];
    synthetic_rows(1, 1, 12_345, &mut rows);
    let mut out = vec![0u16; COLUMNS * ROW_VALUES];
    c.bench_function("dequantize 24 rows to bf16", |b| {
        b.iter(|| {
            dequantize_rows_bf16(black_box(&rows), &mut out).expect("valid rows");
            black_box(out[5])
        });
    });
}

fn fusion(c: &mut Criterion) {
    let shape = FusionShape::new(5120, 4).expect("shape");
    let weights = Arc::new(FusionWeights::from_seed(1, shape));
    let mut cpu = CpuFusion::new(weights);
    let mut g = c.benchmark_group("cpu fusion, hidden 5120, 4 streams");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    for positions in [1usize, 4] {
        let mut rows = vec![0u8; positions * POSITION_ROW_BYTES];
        synthetic_rows(2, 1, 0, &mut rows);
        let live = vec![true; positions];
        let mut h = vec![0.25f32; positions * shape.state_len()];
        g.throughput(Throughput::Elements(positions as u64));
        g.bench_function(format!("{positions} position(s) per call"), |b| {
            b.iter(|| {
                cpu.fuse(1, &rows, &live, &mut h).expect("fuse");
                black_box(h[0])
            });
        });
    }
    g.finish();
}

criterion_group!(
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = hashing, dequant, fusion
);
criterion_main!(benches);
