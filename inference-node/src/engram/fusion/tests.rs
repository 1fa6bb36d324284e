//! The CPU fusion against a straightforward f64 implementation of docs/ENGRAM.md
//! section 5, on random inputs and on edge cases.

use engram_protocol::row::dequantize_row_f32;
use engram_protocol::synthetic::synthetic_rows;

use super::*;

/// f64 reference: returns the new states of all positions.
fn reference(w: &FusionWeights, li: usize, rows: &[u8], live: &[bool], h: &[f32]) -> Vec<f64> {
    let (hd, s) = (w.shape.hidden, w.shape.streams);
    let lw = &w.layers[li];
    let mut out: Vec<f64> = h.iter().map(|&x| f64::from(x)).collect();
    for (p, &alive) in live.iter().enumerate() {
        if !alive {
            continue;
        }
        let mut e = vec![0f64; ENGRAM_DIM];
        for c in 0..COLUMNS {
            let off = (p * COLUMNS + c) * ROW_BYTES;
            let row: &RowBytes = rows[off..off + ROW_BYTES].try_into().unwrap();
            let mut f = [0f32; ROW_VALUES];
            dequantize_row_f32(row, &mut f).unwrap();
            for (i, v) in f.iter().enumerate() {
                e[c * ROW_VALUES + i] = half::bf16::from_f32(*v).to_f64();
            }
        }
        let kv: Vec<f64> = (0..(s + 1) * hd)
            .map(|r| {
                (0..ENGRAM_DIM)
                    .map(|j| f64::from(lw.wkv[r * ENGRAM_DIM + j]) * e[j])
                    .sum()
            })
            .collect();
        let value = &kv[s * hd..];
        for st in 0..s {
            let hs = &mut out[(p * s + st) * hd..(p * s + st + 1) * hd];
            let key = &kv[st * hd..(st + 1) * hd];
            let ws = &lw.w[st * hd..(st + 1) * hd];
            let n = hd as f64;
            let ms_h = hs.iter().map(|x| x * x).sum::<f64>() / n;
            let ms_k = key.iter().map(|x| x * x).sum::<f64>() / n;
            let sum: f64 = (0..hd).map(|d| hs[d] * f64::from(ws[d]) * key[d]).sum();
            let dot = sum / (ms_h + 1e-20).sqrt() / (ms_k + 1e-20).sqrt() / n.sqrt();
            let sign = if dot > 0.0 {
                1.0
            } else if dot < 0.0 {
                -1.0
            } else {
                0.0
            };
            let g = 1.0 / (1.0 + (-(sign * dot.abs().max(1e-6).sqrt())).exp());
            for d in 0..hd {
                hs[d] += g * value[d];
            }
        }
    }
    out
}

fn xorshift(s: &mut u64) -> f32 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn random_rows(seed: u64, positions: usize) -> Vec<u8> {
    let mut rows = vec![0u8; positions * POSITION_ROW_BYTES];
    synthetic_rows(seed, 1, seed * 1000, &mut rows);
    rows
}

/// Every value within bf16 tolerance of the reference, relative to the
/// magnitudes involved at that position.
fn assert_close(got: &[f32], want: &[f64], scale: f64, what: &str) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = 2f64.powi(-8) * (w.abs() + scale);
        assert!(
            (f64::from(g) - w).abs() <= tol,
            "{what}: value {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}

fn run(shape: FusionShape, seed: u64, rows: &[u8], live: &[bool], h: &mut [f32]) -> Vec<f64> {
    let w = Arc::new(FusionWeights::from_seed(seed, shape));
    let want = reference(&w, 1, rows, live, h);
    let mut cpu = CpuFusion::new(Arc::clone(&w));
    cpu.fuse(14, rows, live, h).expect("fuse");
    want
}

#[test]
fn random_inputs_match_the_f64_reference() {
    for (hidden, streams, positions) in [(64, 4, 9), (40, 1, 5), (8, 3, 1), (128, 2, 4)] {
        let shape = FusionShape::new(hidden, streams).unwrap();
        let rows = random_rows(hidden as u64, positions);
        let mut s = 99 + hidden as u64;
        let live: Vec<bool> = (0..positions).map(|p| p % 3 != 1).collect();
        let mut h: Vec<f32> = (0..positions * shape.state_len())
            .map(|_| 3.0 * xorshift(&mut s))
            .collect();
        let before = h.clone();
        let want = run(shape, 5, &rows, &live, &mut h);
        let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert_close(&h, &want, 1e-3 * scale, &format!("H={hidden} S={streams}"));
        for p in (0..positions).filter(|p| !live[*p]) {
            let r = p * shape.state_len()..(p + 1) * shape.state_len();
            assert_eq!(h[r.clone()], before[r], "DEAD position {p} is untouched");
        }
        assert_ne!(h, before);
    }
}

#[test]
fn a_zero_state_gets_gate_one_half() {
    let shape = FusionShape::new(32, 2).unwrap();
    let rows = random_rows(3, 2);
    let mut h = vec![0f32; 2 * shape.state_len()];
    let w = Arc::new(FusionWeights::from_seed(1, shape));
    let mut cpu = CpuFusion::new(Arc::clone(&w));
    cpu.fuse(1, &rows, &[true, true], &mut h).unwrap();
    // dot = 0, sign(0) = 0: every stream becomes value / 2.
    let want = reference(&w, 0, &rows, &[true, true], &vec![0f32; h.len()]);
    assert_close(&h, &want, 1e-6, "zero state");
    let mut e = vec![0f32; ENGRAM_DIM];
    dequantize_position(&rows[..POSITION_ROW_BYTES], 0, &mut e).unwrap();
    let v0: f64 = (0..ENGRAM_DIM)
        .map(|j| f64::from(w.layers[0].wkv[2 * 32 * ENGRAM_DIM + j]) * f64::from(e[j]))
        .sum();
    assert!((f64::from(h[0]) - 0.5 * v0).abs() <= 1e-5 * v0.abs().max(1e-3));
    assert_eq!(h[0], h[32], "both streams get the same half value");
}

#[test]
fn huge_rows_and_states_stay_finite_and_match() {
    let shape = FusionShape::new(48, 4).unwrap();
    let mut rows = random_rows(11, 3);
    // Scales of 2^90 and more: values near 1e29, whose squares overflow f32.
    for row in rows.chunks_exact_mut(ROW_BYTES) {
        for s in &mut row[ROW_VALUES..] {
            *s = 127 + 90 + (*s % 8);
        }
    }
    let mut s = 7;
    let mut h: Vec<f32> = (0..3 * shape.state_len())
        .map(|_| 1e30 * xorshift(&mut s))
        .collect();
    let want = run(shape, 2, &rows, &[true, true, true], &mut h);
    assert!(h.iter().all(|x| x.is_finite()));
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    assert_close(&h, &want, 1e-3 * scale, "huge");
    // Tiny states: the norm still normalizes.
    let mut h: Vec<f32> = (0..3 * shape.state_len())
        .map(|_| 1e-30 * xorshift(&mut s))
        .collect();
    let rows = random_rows(12, 3);
    let want = run(shape, 2, &rows, &[true, true, true], &mut h);
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    assert_close(&h, &want, 1e-3 * scale, "tiny");
}

#[test]
fn all_dead_positions_leave_the_state_alone_and_read_no_rows() {
    let shape = FusionShape::new(16, 4).unwrap();
    // Rows full of NaN codes: never read for DEAD positions.
    let rows = vec![0xFFu8; 5 * POSITION_ROW_BYTES];
    let mut h: Vec<f32> = (0..5 * shape.state_len()).map(|i| i as f32).collect();
    let before = h.clone();
    let mut cpu = CpuFusion::new(Arc::new(FusionWeights::from_seed(0, shape)));
    cpu.fuse(1, &rows, &[false; 5], &mut h).unwrap();
    assert_eq!(h, before);
    // A live position with a corrupt row names it.
    let mut live = [false; 5];
    live[3] = true;
    match cpu.fuse(1, &rows, &live, &mut h) {
        Err(FusionError::Row {
            position: 3,
            column: 0,
            ..
        }) => {}
        other => panic!("expected a row error, got {other:?}"),
    }
}

#[test]
fn bad_calls_are_errors() {
    let shape = FusionShape::new(16, 2).unwrap();
    let mut cpu = CpuFusion::new(Arc::new(FusionWeights::from_seed(0, shape)));
    let rows = random_rows(1, 2);
    let mut h = vec![0f32; 2 * shape.state_len()];
    assert!(matches!(
        cpu.fuse(2, &rows, &[true; 2], &mut h),
        Err(FusionError::Layer(2))
    ));
    assert!(matches!(
        cpu.fuse(1, &rows[1..], &[true; 2], &mut h),
        Err(FusionError::Length { .. })
    ));
    assert!(matches!(
        cpu.fuse(1, &rows, &[true; 3], &mut h),
        Err(FusionError::Length { .. })
    ));
    assert!(matches!(
        cpu.fuse(1, &rows, &[true; 2], &mut h[1..]),
        Err(FusionError::Length { .. })
    ));
    assert!(cpu.fuse(1, &[], &[], &mut []).is_ok());
}

#[test]
fn gate_edges() {
    assert_eq!(gate(0.0, 1.0, 1.0, 4), 0.5);
    assert_eq!(gate(-0.0, 0.0, 0.0, 4), 0.5);
    assert!(gate(f64::NAN, 1.0, 1.0, 4).is_nan());
    // |dot| below 1e-6 is lifted to 1e-6 before the square root.
    let tiny = gate(1e-30, 1.0, 1.0, 1);
    assert!((tiny - 1.0 / (1.0 + (-1e-3f64).exp())).abs() < 1e-12);
    assert!(gate(-1e9, 1.0, 1.0, 1) < 1e-10);
}
