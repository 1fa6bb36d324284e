"""engine_serve_check's parts that need no GPU: the config cut to a few
blocks, the rack it starts (both donors, the host's client for each
node), and the ring waits read from /metrics."""

from __future__ import annotations

import json
import urllib.request

import numpy as np

import engine_serve_check as sc
from conftest import Donor, Engines, free_port


def v41_like(n=43, mtp=1):
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": {
            "num_hidden_layers": n, "num_nextn_predict_layers": mtp,
            "compress_ratios": list(range(n + mtp)), "layer_kinds": [f"k{i}" for i in range(n)],
            "num_hash_layers": 3, "n_routed_experts": 256, "num_experts_per_tok": 6,
            "engram_layer_ids": [1, 14], "engram_num_embeddings": [1, 2],
            "engram_vocab_size": 16_000_000, "hidden_size": 4096,
        },
    }


def test_the_config_is_cut_to_its_first_blocks_with_the_racks_tables(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(v41_like()))
    (src / "tokenizer.json").write_text("{}")
    out = sc.small_model(src, tmp_path / "m", 16, 8, 1000, (24_101, 24_203))
    t = json.loads((out / "config.json").read_text())["text_config"]
    assert t["num_hidden_layers"] == 16
    assert t["compress_ratios"] == list(range(16)) + [43], "MTP's entry kept after the cut"
    assert t["layer_kinds"] == [f"k{i}" for i in range(16)]
    assert (t["n_routed_experts"], t["num_experts_per_tok"], t["num_hash_layers"]) == (8, 6, 3)
    assert (t["engram_vocab_size"], t["engram_num_embeddings"]) == (1000, [24_101, 24_203])
    assert t["hidden_size"] == 4096 and (out / "tokenizer.json").is_file()
    for bad in (14, 44):
        try:
            sc.small_model(src, tmp_path / "x", bad, 0, 1000, (1, 2))
        except SystemExit as e:
            assert "--layers" in str(e)
        else:
            raise AssertionError(f"{bad} layers accepted")


def test_the_rack_starts_and_each_nodes_client_serves_metrics(tmp_path):
    cfg, tables = sc.make_rack(tmp_path, 1000, 11)
    donors = [Donor(cfg, "d"), Donor(cfg, "h")]
    try:
        for node in ("hl", "remote"):
            port = free_port()
            eng = Engines(cfg, node, tmp_path / f"{node}.sock", f"127.0.0.1:{port}")
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=5).read().decode()
                assert text.startswith("# HELP engram_node_"), text[:200]
                # No ring has waited yet: no series.
                assert sc.ring_waits(f"http://127.0.0.1:{port}/metrics") == {}
            finally:
                eng.stop()
        values, scales = sc.table_rows(tables[14][0], tables[14][2])
        from conftest import read_rows

        want = read_rows(tables[14][0], np.array([0, 14, 15, tables[14][2] - 1]))
        got = np.concatenate([values, scales], axis=1)[[0, 14, 15, -1]]
        assert (got == want).all()
    finally:
        for d in donors:
            d.stop()


def test_ring_wait_quantiles_from_the_histogram():
    text = "\n".join([
        "# TYPE engram_node_ring_gpu_wait_seconds histogram",
        'engram_node_ring_gpu_wait_seconds_bucket{layer="1",le="0.000001024"} 0',
        'engram_node_ring_gpu_wait_seconds_bucket{layer="1",le="0.00001"} 90',
        'engram_node_ring_gpu_wait_seconds_bucket{layer="1",le="0.0001"} 99',
        'engram_node_ring_gpu_wait_seconds_bucket{layer="1",le="+Inf"} 100',
        'engram_node_ring_gpu_wait_seconds_bucket{layer="14",le="0.00001"} 4',
        'engram_node_ring_gpu_wait_seconds_bucket{layer="14",le="+Inf"} 4',
        'engram_node_ring_gpu_wait_seconds_count{layer="1"} 100',
    ])
    w = sc.parse_ring_waits(text)
    assert sorted(w) == ["1", "14"]
    assert sc.quantile(None, w["1"], 0.5) == 10.0
    assert sc.quantile(None, w["1"], 0.99) == 100.0
    before = w["1"].copy()
    before[:, 1] = [0, 90, 90, 90]  # only the waits since: 9 at <= 100 us, 1 beyond
    assert sc.quantile(before, w["1"], 0.5) == 100.0
    assert sc.quantile(None, w["14"], 0.99) == 10.0
