//! The PLE fusion against vLLM's own kernels (`ple_gate`, `ple_conv`),
//! whose outputs `integration-tests/python/qwen4exp_fusion_reference.py`
//! wrote to `integration-tests/data/qwen4exp-fusion.json`.

use super::*;

fn case() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../integration-tests/data/qwen4exp-fusion.json"
    );
    serde_json::from_slice(&std::fs::read(path).expect("the reference file")).expect("json")
}

fn u16s(v: &serde_json::Value) -> Vec<u16> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("bits") as u16)
        .collect()
}

fn uint(v: &serde_json::Value) -> usize {
    v.as_u64().expect("number") as usize
}

/// Distance in bf16 steps between two values' bit patterns (same sign).
fn ulps(a: u16, b: u16) -> u32 {
    let key = |x: u16| {
        if x & 0x8000 != 0 {
            -i32::from(x & 0x7FFF)
        } else {
            i32::from(x)
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

/// (values bit-identical, most steps apart).
fn compare(ours: &[u16], theirs: &[u16]) -> (usize, u32) {
    assert_eq!(ours.len(), theirs.len());
    let same = ours.iter().zip(theirs).filter(|(a, b)| a == b).count();
    let worst = ours
        .iter()
        .zip(theirs)
        .map(|(&a, &b)| ulps(a, b))
        .max()
        .unwrap_or(0);
    (same, worst)
}

#[test]
fn the_fusion_matches_vllms_kernels_with_the_state_carried_across_calls() {
    let c = case();
    let (h, hc) = (uint(&c["H"]), uint(&c["HC"]));
    let layer = PleLayer::new(
        h,
        hc,
        uint(&c["kernel"]),
        uint(&c["dilation"]),
        c["eps"].as_f64().expect("eps") as f32,
        &u16s(&c["norm_key"]),
        &u16s(&c["norm_query"]),
        &u16s(&c["norm_conv"]),
        &u16s(&c["conv"]),
    )
    .expect("layer");
    // The reference ran under Triton's interpreter, whose bf16 casts
    // truncate (a GPU's round to nearest).
    let layer = PleLayer {
        rounding: Rounding::Truncate,
        ..layer
    };
    let ch = layer.channels();
    let (mut a, mut b) = (PleState::default(), PleState::default());
    let mut totals = [(0usize, 0usize, 0u32); 4];
    let mut proj = (0usize, 0usize, 0u32);
    for (i, call) in c["calls"].as_array().expect("calls").iter().enumerate() {
        let (key, value, hidden) = (
            u16s(&call["key"]),
            u16s(&call["value"]),
            u16s(&call["hidden"]),
        );
        // kv_proj: torch's matmul sums in its own order; ours in order.
        let (k2, v2) = layer
            .project(&u16s(&call["embeddings"]), &u16s(&c["kv_proj"]))
            .expect("project");
        for (ours, theirs) in [(&k2, &key), (&v2, &value)] {
            let (same, worst) = compare(ours, theirs);
            proj.0 += same;
            proj.1 += ours.len();
            proj.2 = proj.2.max(worst);
        }
        // Call 1: sequence A's decode step (token 0) beside sequence B's
        // prefill (tokens 1 to 3); the others are A's alone.
        let split = if i == 1 { 1 } else { key.len() / ch };
        let first = layer
            .forward(
                &mut a,
                &key[..split * ch],
                &value[..split * h],
                &hidden[..split * ch],
            )
            .expect("A");
        let mut got = first;
        if split * ch < key.len() {
            let rest = layer
                .forward(
                    &mut b,
                    &key[split * ch..],
                    &value[split * h..],
                    &hidden[split * ch..],
                )
                .expect("B");
            got.gated.extend(rest.gated);
            got.normed.extend(rest.normed);
            got.conv.extend(rest.conv);
            got.out.extend(rest.out);
        }
        let want = &c["vllm"][i];
        for (k, (ours, name)) in [
            (&got.gated, "gated"),
            (&got.normed, "normed"),
            (&got.conv, "conv"),
            (&got.out, "out"),
        ]
        .into_iter()
        .enumerate()
        {
            let (same, worst) = compare(ours, &u16s(&want[name]));
            totals[k].0 += same;
            totals[k].1 += ours.len();
            totals[k].2 = totals[k].2.max(worst);
        }
        assert_eq!(a.window, u16s(&want["state_a"]), "call {i}: A's state");
        if i > 0 {
            assert_eq!(b.window, u16s(&want["state_b"]), "call {i}: B's state");
        }
    }
    for ((same, n, worst), name) in totals.iter().zip(["gated", "normed", "conv", "out"]) {
        eprintln!(
            "{name}: {same} of {n} bit-identical to vLLM's kernels, at most {worst} bf16 steps apart"
        );
    }
    eprintln!(
        "kv_proj: {} of {} bit-identical to torch's linear, at most {} bf16 steps apart",
        proj.0, proj.1, proj.2
    );
    for (same, n, _) in totals {
        assert_eq!(same, n, "bit for bit");
    }
    assert!(proj.2 <= 1, "kv_proj within one bf16 step of torch's");
}

#[test]
fn bad_shapes_are_refused() {
    let w = |n| vec![0u16; n];
    assert!(PleLayer::new(0, 4, 4, 3, 1e-6, &w(0), &w(0), &w(0), &w(0)).is_err());
    assert!(PleLayer::new(8, 4, 4, 3, 0.0, &w(32), &w(32), &w(32), &w(128)).is_err());
    assert!(PleLayer::new(8, 4, 4, 3, 1e-6, &w(32), &w(32), &w(31), &w(128)).is_err());
    let l = PleLayer::new(8, 4, 4, 3, 1e-6, &w(32), &w(32), &w(32), &w(128)).expect("layer");
    let mut s = PleState::default();
    assert!(l.forward(&mut s, &w(32), &w(7), &w(32)).is_err());
    assert!(l.forward(&mut s, &w(64), &w(8), &w(32)).is_err());
    let mut bad = PleState { window: w(5) };
    assert!(l.forward(&mut bad, &w(32), &w(8), &w(32)).is_err());
    assert!(l.forward(&mut s, &w(32), &w(8), &w(32)).is_ok());
    assert_eq!(s.window.len(), 9 * 32);
}

#[test]
fn a_tokens_embedding_is_its_rows_dequantized_in_order() {
    use engram_protocol::encoding::RowEncoding;
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    // Two tokens of 16 rows of E4M3 1.0 (0x38), but the first value of each
    // token's first row: 2.0 (0x40) and 4.0 (0x48); the table scale 0.5.
    let mut rows = vec![0x38u8; 2 * 16 * 160];
    rows[0] = 0x40;
    rows[16 * 160] = 0x48;
    let e = PleLayer::embed(fp8, &rows, 0.5).expect("embed");
    assert_eq!(e.len(), 2 * 16 * 160);
    let f = |i: usize| bf16_bits_to_f32(e[i]);
    assert_eq!(
        (f(0), f(1), f(16 * 160), f(16 * 160 + 1)),
        (1.0, 0.5, 2.0, 0.5)
    );
    // Each row as the encoding dequantizes it alone.
    let mut one = vec![0u16; 160];
    fp8.dequantize_bf16(&rows[5 * 160..6 * 160], 0.5, &mut one)
        .expect("row");
    assert_eq!(&e[5 * 160..6 * 160], &one[..]);
    assert!(PleLayer::embed(fp8, &rows[..100], 0.5).is_err());
    let mut nan = rows.clone();
    nan[3] = 0x7F;
    assert!(PleLayer::embed(fp8, &nan, 0.5).is_err());
}

/// The prepared projection sums each output's products in the same order
/// as a row's in-order sum: the same bits, zeros and signs included.
#[test]
fn the_prepared_projection_gives_the_bits_of_each_rows_in_order_sum() {
    let (h, streams, d, n) = (4, 3, 40, 5);
    let c = h * streams;
    let ones = vec![f32_to_bf16_bits(0.0); c];
    let conv = vec![f32_to_bf16_bits(0.0); c * 4];
    let layer = PleLayer::new(h, streams, 4, 3, 1e-6, &ones, &ones, &ones, &conv).expect("layer");
    let mut g = engram_protocol::synthetic::SplitMix64::new(3);
    let mut draw = |k: usize| -> Vec<u16> {
        (0..k)
            .map(|i| {
                let u = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                // Some exact zeros of either sign among the values.
                match i % 17 {
                    0 => 0x8000,
                    1 => 0,
                    _ => f32_to_bf16_bits((u * 2.0 - 1.0) * 3.0),
                }
            })
            .collect()
    };
    let weight = draw((c + h) * d);
    let mut emb = draw(n * d);
    // A token of zero rows (a failed fetch's): every product a signed zero.
    emb[..d].fill(0x8000);
    let (key, value) = layer.project(&emb, &weight).expect("project");
    let mut want = Vec::new();
    for t in 0..n {
        for row in weight.chunks_exact(d) {
            let sum: f32 = row
                .iter()
                .zip(&emb[t * d..(t + 1) * d])
                .map(|(&w, &e)| bf16_bits_to_f32(w) * bf16_bits_to_f32(e))
                .sum();
            want.push(f32_to_bf16_bits(sum));
        }
    }
    let got: Vec<u16> = (0..n)
        .flat_map(|t| {
            key[t * c..(t + 1) * c]
                .iter()
                .chain(&value[t * h..(t + 1) * h])
                .copied()
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(got, want);
    assert!(
        got.contains(&0x8000) || got.contains(&0),
        "signed zeros were exercised"
    );
    let prepared = KvProj::new(&weight, c + h).expect("prepared");
    assert_eq!(
        layer.project_with(&emb, &prepared).expect("with"),
        (key, value)
    );
    assert!(KvProj::new(&weight, c + h + 1).is_err());
}
