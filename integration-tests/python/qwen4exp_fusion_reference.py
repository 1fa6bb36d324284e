"""Qwen4Exp's PLE fusion from vLLM's own kernels: `ple_gate` (grouped
RMSNorms, the signed-sqrt gate, the gated value and its norm) and
`ple_conv` (the depthwise causal convolution, kernel 4 and dilation 3,
with each sequence's state carried from one call to the next, and SiLU),
run under Triton's interpreter on CPU, then the two residual additions as
vLLM's sequence-parallel path makes them (`gated.add_(conv)`,
`gated.add_(hidden)`: torch's bf16 adds). The fused kernel's own residual
store is not used: under the interpreter it writes an f32 into bf16
memory without converting it. The interpreter's bf16 casts truncate (a
GPU rounds to nearest). It shares no code with the Rust side
(`inference_node::engram::ple`), whose tests read what this writes.

Usage:
  qwen4exp_fusion_reference.py write OUT_JSON   the cases, with vLLM's outputs
  qwen4exp_fusion_reference.py check JSON       recompute; exit 1 on a difference

The case: 4 residual streams of 8 (32 channels), an n-gram embedding of
48 values projected by `kv_proj` (torch's `linear`); sequence A prefilled with
5 tokens, then 2 decode steps that carry its state; sequence B prefilled
with 3 tokens beside A's first decode step, from no state. Every tensor is
bf16, given as its bit patterns.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402

H, HC, K, DIL = 8, 4, 4, 3
D = 48  # the n-gram embedding: heads x head_dim (16 x 160 in Qwen3.8-Flash-Next)
C = H * HC
STATE = (K - 1) * DIL
EPS = 1e-6


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).reshape(-1).tolist()


def from_bits(v: list[int], shape) -> torch.Tensor:
    a = np.array(v, dtype=np.uint16).view(np.int16)
    return torch.from_numpy(a.copy()).view(torch.bfloat16).reshape(shape)


def inputs() -> dict:
    g = torch.Generator().manual_seed(41)
    r = lambda *s, k=1.0: (torch.randn(*s, generator=g) * k).to(torch.bfloat16)  # noqa: E731
    calls = []
    # kv_proj: the token's n-gram embedding (D values) to a key per stream
    # and one value, torch's bf16 `linear` on CPU.
    kv_proj = r(C + H, D, k=0.2)
    # (sequence lengths per call: A's 5-token prefill; A's decode beside B's
    # 3-token prefill; A's decode alone)
    for n in (5, 4, 1):
        emb = r(n, D)
        kv = torch.nn.functional.linear(emb, kv_proj)
        key, value = kv.split([C, H], dim=-1)
        calls.append({"embeddings": bits(emb), "key": bits(key), "value": bits(value),
                      "hidden": bits(r(n, C))})
    return {"H": H, "HC": HC, "D": D, "kernel": K, "dilation": DIL, "eps": EPS,
            "kv_proj": bits(kv_proj),
            "norm_key": bits(r(C, k=0.1)), "norm_query": bits(r(C, k=0.1)),
            "norm_conv": bits(r(C, k=0.1)), "conv": bits(r(C, K, k=0.5)), "calls": calls}


def run(case: dict) -> list[dict]:
    from vllm.models.qwen4_exp.common.ops.ple import ple_conv, ple_gate

    nk = from_bits(case["norm_key"], (C,))
    nq = from_bits(case["norm_query"], (C,))
    nc = from_bits(case["norm_conv"], (C,))
    w = from_bits(case["conv"], (C, K))
    state = torch.zeros(3, C, STATE, dtype=torch.bfloat16)  # slots: 1 = A, 2 = B
    out = []
    for i, call in enumerate(case["calls"]):
        n = len(call["value"]) // H
        key = from_bits(call["key"], (n, C))
        value = from_bits(call["value"], (n, H))
        hidden = from_bits(call["hidden"], (n, C))
        gated, normed = ple_gate(key, value, hidden, nk, nq, nc, EPS)
        residual = torch.zeros_like(gated)  # the convolution's output
        if i == 0:  # A's prefill, from no state
            ple_conv(normed, residual, state, w, torch.tensor([1]), None, mode="prefill",
                     dilation=DIL, query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                     has_initial_states=torch.tensor([False]))
        elif i == 1:  # A decodes (row 0), B prefills rows 1..4 from no state
            ple_conv(normed[:1], residual[:1], state, w, torch.tensor([1]), None,
                     mode="decode", dilation=DIL, has_initial_states=torch.tensor([True]))
            ple_conv(normed[1:], residual[1:], state, w, torch.tensor([2]), None,
                     mode="prefill", dilation=DIL,
                     query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                     has_initial_states=torch.tensor([False]))
        else:  # A decodes again
            ple_conv(normed, residual, state, w, torch.tensor([1]), None, mode="decode",
                     dilation=DIL, has_initial_states=torch.tensor([True]))
        total = gated.clone()
        total.add_(residual)
        total.add_(hidden)
        out.append({"gated": bits(gated), "normed": bits(normed), "conv": bits(residual),
                    "out": bits(total),
                    "state_a": bits(state[1].t()), "state_b": bits(state[2].t())})
    return out


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "write":
        case = inputs()
        case["vllm"] = run(case)
        with open(path, "w") as f:
            json.dump(case, f, separators=(",", ":"))
        return 0
    with open(path) as f:
        case = json.load(f)
    got = run(case)
    bad = [i for i, (a, b) in enumerate(zip(got, case["vllm"])) if a != b]
    print(f"{len(got) - len(bad)} of {len(got)} calls identical to the file")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
