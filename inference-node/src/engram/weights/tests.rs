//! Loading fusion weights from checkpoints written here, in every accepted
//! encoding, single file and sharded.

use std::collections::HashMap;

use safetensors::tensor::TensorView;

use super::*;

struct T {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn write(path: &Path, tensors: &[T]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let v = TensorView::new(t.dtype, t.shape.clone(), &t.data).expect("view");
            (t.name.clone(), v)
        })
        .collect();
    let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).expect("serialize");
    std::fs::write(path, bytes).expect("write");
}

fn bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| f32_to_bf16_bits(*x).to_le_bytes())
        .collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16s(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

const SHAPE: FusionShape = FusionShape {
    hidden: 8,
    streams: 2,
};

/// FP8 codes for the wkv of SHAPE, a pattern that avoids NaN codes.
fn codes() -> Vec<u8> {
    (0..SHAPE.kv_len() * ENGRAM_DIM)
        .map(|i| (i * 37 % 251) as u8 & 0xF7)
        .collect()
}

/// Tensors for one layer: wkv in FP8 with `scale` tensors, q as F32, k as F16 (flat).
fn layer_tensors(layer: u32, scale: Option<(&str, Dtype, Vec<usize>, Vec<u8>)>) -> Vec<T> {
    let p = format!("layers.{layer}.engram");
    let n = SHAPE.state_len();
    let q: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 / 64.0).collect();
    let k: Vec<f32> = (0..n).map(|i| 0.5 - i as f32 / 128.0).collect();
    let mut out = vec![
        T {
            name: format!("{p}.q_weight"),
            dtype: Dtype::F32,
            shape: vec![SHAPE.streams, SHAPE.hidden],
            data: f32s(&q),
        },
        T {
            name: format!("{p}.k_weight"),
            dtype: Dtype::F16,
            shape: vec![n],
            data: f16s(&k),
        },
    ];
    let wkv_shape = vec![SHAPE.kv_len(), ENGRAM_DIM];
    match scale {
        Some((suffix, dt, shape, data)) => {
            out.push(T {
                name: format!("{p}.wkv.weight"),
                dtype: Dtype::F8_E4M3,
                shape: wkv_shape,
                data: codes(),
            });
            out.push(T {
                name: format!("{p}.wkv.{suffix}"),
                dtype: dt,
                shape,
                data,
            });
        }
        None => {
            let v: Vec<f32> = (0..SHAPE.kv_len() * ENGRAM_DIM)
                .map(|i| ((i % 97) as f32 - 48.0) / 256.0)
                .collect();
            out.push(T {
                name: format!("{p}.wkv.weight"),
                dtype: Dtype::BF16,
                shape: wkv_shape,
                data: bf16(&v),
            });
        }
    }
    out
}

#[test]
fn single_file_bf16_f32_f16() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    let mut t = layer_tensors(1, None);
    t.extend(layer_tensors(14, None));
    write(&path, &t);
    // The directory finds model.safetensors.
    let w = FusionWeights::from_checkpoint(dir.path(), SHAPE).expect("load");
    for lw in &w.layers {
        assert_eq!(lw.wkv.len(), SHAPE.kv_len() * ENGRAM_DIM);
        assert_eq!(lw.wkv[1], -47.0 / 256.0);
        let i = 5;
        let want = (1.0 + i as f32 / 64.0) * half::f16::from_f32(0.5 - i as f32 / 128.0).to_f32();
        assert_eq!(lw.w[i], want);
    }
    // A shape that disagrees with the config is refused, naming the tensor.
    let e = FusionWeights::from_checkpoint(&path, FusionShape::new(8, 3).unwrap())
        .expect_err("wrong shape")
        .to_string();
    assert!(e.contains("wkv.weight") && e.contains("shape"), "{e}");
}

#[test]
fn fp8_with_block_scales_through_an_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = SHAPE.kv_len();
    // Layer 1: DeepSeek-style F32 scale_inv over 128 x 128 blocks.
    let sc1: Vec<f32> = (0..kv.div_ceil(128) * ENGRAM_DIM.div_ceil(128))
        .map(|j| 0.5 + j as f32)
        .collect();
    let s1 = (
        "weight_scale_inv",
        Dtype::F32,
        vec![kv.div_ceil(128), ENGRAM_DIM.div_ceil(128)],
        f32s(&sc1),
    );
    // Layer 14: UE8M0 scales over 1 x 32 blocks, as the Engram tables use.
    let sc14: Vec<u8> = (0..kv * ENGRAM_DIM / 32)
        .map(|j| 120 + (j % 9) as u8)
        .collect();
    let s14 = (
        "scale",
        Dtype::F8_E8M0,
        vec![kv, ENGRAM_DIM / 32],
        sc14.clone(),
    );
    write(
        &dir.path().join("a.safetensors"),
        &layer_tensors(1, Some(s1)),
    );
    write(
        &dir.path().join("b.safetensors"),
        &layer_tensors(14, Some(s14)),
    );
    let mut map = serde_json::Map::new();
    for (shard, layer) in [("a.safetensors", 1), ("b.safetensors", 14)] {
        for t in layer_tensors(
            layer,
            Some(("weight_scale_inv", Dtype::F32, vec![], vec![])),
        ) {
            map.insert(t.name, shard.into());
        }
        let scale = if layer == 1 {
            "weight_scale_inv"
        } else {
            "scale"
        };
        map.insert(format!("layers.{layer}.engram.wkv.{scale}"), shard.into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    let idx = dir.path().join("model.safetensors.index.json");
    std::fs::write(&idx, index.to_string()).expect("write");
    let w = FusionWeights::from_checkpoint(dir.path(), SHAPE).expect("load");
    let c = codes();
    for (r, c_) in [(0usize, 0usize), (3, 200), (23, 6143)] {
        let code = c[r * ENGRAM_DIM + c_];
        let v = e4m3_to_f32(code).unwrap();
        assert_eq!(
            w.layers[0].wkv[r * ENGRAM_DIM + c_],
            v * sc1[c_ / 128],
            "({r}, {c_})"
        );
        let s = ue8m0_to_f32(sc14[r * (ENGRAM_DIM / 32) + c_ / 32]).unwrap();
        assert_eq!(w.layers[1].wkv[r * ENGRAM_DIM + c_], v * s, "({r}, {c_})");
    }

    // FP8 without any scale tensor is refused.
    let lone = dir.path().join("lone.safetensors");
    let mut t = layer_tensors(1, None);
    t.retain(|t| !t.name.ends_with("wkv.weight"));
    t.push(T {
        name: "layers.1.engram.wkv.weight".into(),
        dtype: Dtype::F8_E4M3,
        shape: vec![kv, ENGRAM_DIM],
        data: c,
    });
    t.extend(layer_tensors(14, None));
    write(&lone, &t);
    let e = FusionWeights::from_checkpoint(&lone, SHAPE)
        .expect_err("no scales")
        .to_string();
    assert!(e.contains("none of"), "{e}");
}

#[test]
fn bad_checkpoints_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert!(
        FusionWeights::from_checkpoint(dir.path(), SHAPE).is_err(),
        "empty directory"
    );
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"\xff\xff\xff\xff\xff\xff\xff\xffjunk").expect("write");
    let e = FusionWeights::from_checkpoint(&junk, SHAPE)
        .expect_err("junk")
        .to_string();
    assert!(e.contains("not safetensors"), "{e}");
    let idx = dir.path().join("x.json");
    std::fs::write(
        &idx,
        r#"{"weight_map": {"layers.1.engram.wkv.weight": "../evil"}}"#,
    )
    .expect("write");
    let e = FusionWeights::from_checkpoint(&idx, SHAPE)
        .expect_err("escape")
        .to_string();
    assert!(e.contains("leaves the checkpoint"), "{e}");
    // A missing tensor and a wrong dtype are named.
    let path = dir.path().join("m.safetensors");
    let mut t = layer_tensors(1, None);
    t.retain(|t| !t.name.ends_with("k_weight"));
    write(&path, &t);
    let e = FusionWeights::from_checkpoint(&path, SHAPE)
        .expect_err("missing")
        .to_string();
    assert!(e.contains("k_weight"), "{e}");
    let mut t = layer_tensors(1, None);
    t[0].dtype = Dtype::I32;
    t[0].data.resize(SHAPE.state_len() * 4, 0);
    write(&path, &t);
    let e = FusionWeights::from_checkpoint(&path, SHAPE)
        .expect_err("dtype")
        .to_string();
    assert!(e.contains("I32"), "{e}");
    // Non-finite weights are refused.
    let mut t = layer_tensors(1, None);
    t[0].data[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    t.extend(layer_tensors(14, None));
    write(&path, &t);
    let e = FusionWeights::from_checkpoint(&path, SHAPE)
        .expect_err("inf")
        .to_string();
    assert!(e.contains("not finite"), "{e}");
}

#[test]
fn seeded_weights_are_deterministic_and_bf16_valued() {
    let a = FusionWeights::from_seed(3, SHAPE);
    assert_eq!(a, FusionWeights::from_seed(3, SHAPE));
    assert_ne!(a, FusionWeights::from_seed(4, SHAPE));
    assert_ne!(a.layers[0], a.layers[1]);
    for v in &a.layers[0].wkv {
        assert_eq!(bf16_bits_to_f32(f32_to_bf16_bits(*v)), *v);
        assert!(v.abs() <= 1.0 / (ENGRAM_DIM as f32).sqrt());
    }
    assert!(a.layers[0].w.iter().all(|w| (0.5..1.6).contains(w)));
    assert!(FusionShape::new(0, 4).is_err());
    assert!(FusionShape::new(65_536, 64).is_err());
}

/// A Qwen4Exp PLE layer's tensors under `prefix`, as a checkpoint holds
/// `w` (2 streams of 8, an embedding of 32 values, kernel 4): the
/// projection split into key and value, the norms in F32, the convolution
/// `[C, 1, kernel]`.
fn ple_tensors(prefix: &str, w: &PleWeights) -> Vec<T> {
    let (c, h, d, k) = (16, 8, 32, 4);
    let raw = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|b| b.to_le_bytes()).collect() };
    let f32_of = |v: &[u16]| -> Vec<u8> {
        let f: Vec<f32> = v.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        f32s(&f)
    };
    let t = |name: &str, dtype, shape: Vec<usize>, data| T {
        name: format!("{prefix}.{name}"),
        dtype,
        shape,
        data,
    };
    vec![
        t(
            "key_proj.weight",
            Dtype::BF16,
            vec![c, d],
            raw(&w.kv_proj[..c * d]),
        ),
        t(
            "value_proj.weight",
            Dtype::BF16,
            vec![h, d],
            raw(&w.kv_proj[c * d..]),
        ),
        t("norm_key.weight", Dtype::F32, vec![c], f32_of(&w.norm_key)),
        t(
            "norm_query.weight",
            Dtype::BF16,
            vec![c],
            raw(&w.norm_query),
        ),
        t("norm_conv.weight", Dtype::BF16, vec![c], raw(&w.norm_conv)),
        t("conv1d.weight", Dtype::BF16, vec![c, 1, k], raw(&w.conv)),
    ]
}

#[test]
fn a_ple_layer_loads_from_a_qwen4exp_checkpoint_as_vllm_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let want = PleWeights::from_seed(9, (8, 2), 32, 4).expect("seeded");
    assert_eq!(want.kv_proj.len(), (16 + 8) * 32);
    // The multimodal model's names (PLE layer 3: decoder layer 2), and
    // the text model's.
    for prefix in ["model.language_model.layers.2.ple", "model.layers.2.ple"] {
        let path = dir.path().join("m.safetensors");
        write(&path, &ple_tensors(prefix, &want));
        let got = PleWeights::from_checkpoint(&path, 3, (8, 2), 32, 4).expect("loads");
        assert_eq!(got, want, "{prefix}");
        // Another layer's tensors are not this one's.
        let e = PleWeights::from_checkpoint(&path, 1, (8, 2), 32, 4).expect_err("layer 1");
        assert!(e.to_string().contains("no PLE layer 1"), "{e}");
    }
    // Another shape than [model] says, a tensor missing: named.
    let path = dir.path().join("m.safetensors");
    let e = PleWeights::from_checkpoint(&path, 3, (8, 2), 48, 4).expect_err("dim");
    assert!(
        e.to_string()
            .contains("key_proj.weight` has shape [16, 32]"),
        "{e}"
    );
    let mut cut = ple_tensors("model.layers.2.ple", &want);
    cut.retain(|t| !t.name.ends_with("conv1d.weight"));
    write(&path, &cut);
    let e = PleWeights::from_checkpoint(&path, 3, (8, 2), 32, 4).expect_err("conv");
    assert!(e.to_string().contains("conv1d.weight"), "{e}");
    // Bounds before any read.
    let e = PleWeights::from_checkpoint(&path, 3, (8, 2), 32, 40).expect_err("kernel");
    assert!(e.to_string().contains("kernel of 40"), "{e}");
}
