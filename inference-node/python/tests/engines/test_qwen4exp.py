"""Qwen4Exp's n-gram row ids: the engine's own code (vLLM's or SGLang's
`Qwen4ExpNGramEmbedding`, whichever this environment has) gives the ids
in integration-tests/data/qwen4exp-ids.json, which the rack's Rust
hashing is tested against (`cargo test -p rack-harness --test qwen4exp`):
so the engine's ids are the rack's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]


def test_the_engines_qwen4exp_hashing_gives_the_files_rows():
    pytest.importorskip("torch")
    have = []
    for name, module in (("vLLM", "vllm.models.qwen4_exp.nvidia.ngram_embedding"),
                         ("SGLang", "sglang.srt.models.qwen4_exp")):
        try:
            __import__(module)
            have.append(name)
        except ImportError:
            pass
    if not have:
        pytest.skip("neither vLLM's nor SGLang's Qwen4Exp code is importable here")
    r = subprocess.run(
        [sys.executable, str(REPO / "integration-tests/python/qwen4exp_reference.py"), "check",
         str(REPO / "integration-tests/data/qwen4exp-ids.json")],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 differ" in r.stdout, (have, r.stdout)
