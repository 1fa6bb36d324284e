"""Qwen4Exp's n-gram row ids from the engines' own code: vLLM's
`Qwen4ExpNGramEmbedding` (its multipliers, its prime layout and its
`compute_ngram_ids`, CPU path) and, where SGLang is importable, SGLang's
(`_build_layer_multipliers`, `_build_head_vocab_and_offsets`,
`_hash_contexts`); and the bf16 values vLLM's Qwen4Exp table methods give
rows of each encoding (FP8 with a per-tensor scale, BF16, NVFP4). It
shares no code with the Rust side (`engram_protocol::qwen4exp`,
`engram_protocol::encoding`), whose tests read what this writes.

Usage:
  qwen4exp_reference.py write OUT_JSON   the cases, with vLLM's ids
  qwen4exp_reference.py check JSON       recompute with every engine here;
                                         exit 1 on any difference

The cases: Qwen3.8-Flash-Next's table (vocabulary 248,320, orders 2 and 3,
8 heads each, base 20,000,000, seed 1234) and a second PLE layer; random
sequences with EOS tokens inside (two in a row included), hashed whole, in
prefill chunks with the tokens before each chunk as context, and token by
token as decode does; a batch of requests of unequal lengths.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import torch
from torch import nn

VOCAB = 248_320
BASE = 20_000_000
NGRAM = 3
HEADS_PER_NGRAM = 8
SEED = 1234
DIVISIBLE_BY = 128
EOS = 248_044


def cfg(layer_index: int) -> dict:
    return {"vocab_size": VOCAB, "ngram_vocab_size_base": BASE, "ngram_size": NGRAM,
            "heads_per_ngram": HEADS_PER_NGRAM, "seed": SEED, "eos_token_id": EOS,
            "make_ngram_vocab_size_divisible_by": DIVISIBLE_BY, "layer_index": layer_index}


def cases() -> list[dict]:
    rng = np.random.default_rng(38)
    out = []
    for layer_index in (0, 1):
        for n in (1, 2, 7, 40):
            seq = rng.integers(0, VOCAB, n)
            if n > 5:
                seq[rng.integers(0, n, 2)] = EOS
            if n == 40:
                seq[10:12] = EOS  # two in a row
            seq = seq.tolist()
            out.append({"layer_index": layer_index, "batch": [{"context": [], "tokens": seq}]})
            cut = n // 2
            out.append({"layer_index": layer_index,
                        "batch": [{"context": seq[:cut], "tokens": seq[cut:]}]})
        # Decode: one token per request, unequal contexts, one of them EOS.
        batch = [{"context": rng.integers(0, VOCAB, k).tolist(), "tokens": [int(t)]}
                 for k, t in ((0, 7), (1, 99), (5, EOS), (9, 248_319))]
        batch.append({"context": [5, EOS], "tokens": [6]})
        out.append({"layer_index": layer_index, "batch": batch})
    return out


# --- vLLM ------------------------------------------------------------------

def have_vllm() -> bool:
    try:
        import vllm.models.qwen4_exp.nvidia.ngram_embedding  # noqa: F401
    except ImportError:
        return False
    return True


def vllm_ids(case: dict) -> list[list[int]] | None:
    if not have_vllm():
        return None
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as V

    layer = case["layer_index"]
    m = V.__new__(V)
    nn.Module.__init__(m)
    m.ngram_size, m.heads_per_ngram, m.eos_token_id = NGRAM, HEADS_PER_NGRAM, EOS
    m.register_buffer("layer_multipliers", torch.tensor(V._make_layer_multipliers(
        ngram_size=NGRAM, unigram_vocab_size=VOCAB, seed=SEED, ple_dense_layer_id=layer)))
    sizes, offsets, _ = V._make_vocab_layout(
        ngram_vocab_size_base=BASE, ngram_heads=(NGRAM - 1) * HEADS_PER_NGRAM,
        ple_dense_layer_id=layer)
    m.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes))
    m.register_buffer("ngram_heads_offsets", torch.tensor(offsets))
    ids, starts, ctx = [], [0], []
    for r in case["batch"]:
        ids += r["tokens"]
        starts.append(len(ids))
        # The tokens before the chunk, EOS before the sequence's start.
        ctx.append(([EOS] * (NGRAM - 1) + r["context"])[-(NGRAM - 1):])
    out = m.compute_ngram_ids(torch.tensor(ids), torch.tensor(starts), torch.tensor(ctx))
    return out.tolist()


def vllm_layout(layer: int) -> dict:
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as V

    sizes, offsets, total = V._make_vocab_layout(
        ngram_vocab_size_base=BASE, ngram_heads=(NGRAM - 1) * HEADS_PER_NGRAM,
        ple_dense_layer_id=layer)
    mult = V._make_layer_multipliers(ngram_size=NGRAM, unigram_vocab_size=VOCAB, seed=SEED,
                                     ple_dense_layer_id=layer)
    return {"multipliers": [int(x) for x in mult], "sizes": sizes, "offsets": offsets,
            "rows": total}


# --- SGLang ----------------------------------------------------------------

def sglang_ids(case: dict) -> list[list[int]] | None:
    try:
        import sglang.srt.models.qwen4_exp as S
    except ImportError:
        return None
    layer = case["layer_index"]
    m = S.Qwen4ExpNGramEmbedding.__new__(S.Qwen4ExpNGramEmbedding)
    nn.Module.__init__(m)
    m.config = types.SimpleNamespace(seed=SEED)
    m.unigram_vocab_size, m.ple_layer_index = VOCAB, layer
    m.ngram_size, m.heads_per_ngram, m.eos_token_id = NGRAM, HEADS_PER_NGRAM, EOS
    m.ngram_heads = (NGRAM - 1) * HEADS_PER_NGRAM
    m.ngram_vocab_size_base = BASE
    m.enable_ple_fusion = False
    m.register_buffer("layer_multipliers", m._build_layer_multipliers(NGRAM))
    sizes, offsets, _ = m._build_head_vocab_and_offsets()
    m.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes))
    m.register_buffer("ngram_heads_offsets", torch.tensor(offsets))
    # SGLang hashes each position from its window of the request's tokens
    # (the pool's window cache is not used here).
    S.get_req_to_token_pool = lambda: types.SimpleNamespace(ple_window_cache=None)
    rows = []
    for r in case["batch"]:
        seq = [EOS] * (NGRAM - 1) + r["context"] + r["tokens"]
        start = len(seq) - len(r["tokens"])
        for p in range(start, len(seq)):
            window = torch.tensor([seq[max(0, p - 2 * NGRAM):p + 1]], dtype=torch.long)
            rows.append(m._hash_contexts(window)[0].tolist())
    return rows


# --- rows --------------------------------------------------------------------

ROW_VALUES = 160


def row_cases() -> list[dict]:
    """Random rows of each encoding, NaN codes left out, with the table's
    scale: FP8 with one F32 scale, BF16, NVFP4 with E4M3 block scales and a
    global F32 scale."""
    rng = np.random.default_rng(160)
    out = []
    for k in range(6):
        fp8 = rng.integers(0, 256, ROW_VALUES).astype(np.uint8)
        fp8[(fp8 & 0x7F) == 0x7F] = 0x3F
        out.append({"encoding": f"fp8_per_tensorx{ROW_VALUES}",
                    "scale": float(np.float32(rng.uniform(1e-4, 4.0) * (-1) ** k)),
                    "row": fp8.tobytes().hex()})
        bf = rng.standard_normal(ROW_VALUES).astype(np.float32)
        bf16 = (bf.view(np.uint32) >> 16).astype(np.uint16)
        out.append({"encoding": f"bf16x{ROW_VALUES}", "scale": 1.0,
                    "row": bf16.astype("<u2").tobytes().hex()})
        packed = rng.integers(0, 256, ROW_VALUES // 2).astype(np.uint8)
        scales = rng.integers(0x20, 0x60, ROW_VALUES // 16).astype(np.uint8)
        out.append({"encoding": f"nvfp4_e4m3_16x{ROW_VALUES}",
                    "scale": float(np.float32(rng.uniform(1e-3, 2.0))),
                    "row": (packed.tobytes() + scales.tobytes()).hex()})
    return out


def vllm_row(case: dict) -> list[int]:
    """vLLM's bf16 values of one row (its FP8 method's `dequantize`, its
    NVFP4 lookup's `dequantize_to_dtype`), as bf16 bit patterns."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEFp8EmbeddingMethod

    raw = torch.frombuffer(bytearray(bytes.fromhex(case["row"])), dtype=torch.uint8)
    kind = case["encoding"].rsplit("x", 1)[0]
    if kind == "fp8_per_tensor":
        layer = types.SimpleNamespace(weight_scale=torch.tensor(case["scale"],
                                                                dtype=torch.float32))
        v = Qwen4ExpPLEFp8EmbeddingMethod().dequantize(
            layer, raw.view(torch.float8_e4m3fn)[None, :], torch.bfloat16)[0]
    elif kind == "bf16":
        v = raw.view(torch.bfloat16)
    else:
        n = ROW_VALUES // 2
        v = dequantize_to_dtype(raw[None, :n].clone(), raw[None, n:].clone(),
                                torch.tensor(case["scale"], dtype=torch.float32),
                                torch.bfloat16, swizzle=False)[0]
    return v.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "write":
        cs = cases()
        for c in cs:
            c["ids"] = vllm_ids(c)
        rows = row_cases()
        for r in rows:
            r["bf16"] = vllm_row(r)
        doc = {"engine": "vllm", "config": cfg(0),
               "layouts": {str(k): vllm_layout(k) for k in (0, 1)}, "cases": cs,
               "rows": rows}
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        print(f"{len(cs)} cases written to {path}")
        return 0
    doc = json.load(open(path))
    bad = 0
    for i, c in enumerate(doc["cases"]):
        for name, got in (("vLLM", vllm_ids(c)), ("SGLang", sglang_ids(c))):
            if got is None:
                continue
            if got != c["ids"]:
                bad += 1
                print(f"case {i}: {name}'s ids differ from the file's", file=sys.stderr)
    for i, r in enumerate(doc.get("rows", []) if have_vllm() else []):
        if vllm_row(r) != r["bf16"]:
            bad += 1
            print(f"row {i} ({r['encoding']}): vLLM's values differ from the file's",
                  file=sys.stderr)
    engines = ", ".join(n for n, ok in (("vLLM", have_vllm()), ("SGLang", sglang_ids(doc["cases"][0])
                                                                  is not None)) if ok)
    print(f"{len(doc['cases'])} cases ({engines}) and "
          f"{len(doc.get('rows', [])) if have_vllm() else 0} rows (vLLM) checked, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
