"""`idleless bench offline` end to end on a tiny random model: the JSON figures are present and
consistent (token accounting, speedups = ratios of the measured times). No timing asserts."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from conftest import make_tiny_model

from idleless.bench import offline
from idleless.cli import main as cli_main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory, smollm2_dir) -> str:
    """A tiny random Llama with SmolLM2's vocabulary size and tokenizer files (the Engine loads a
    tokenizer from the model directory)."""
    path = make_tiny_model(tmp_path_factory.mktemp("bench-model"), vocab_size=49152, tie=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(smollm2_dir, name)
        if os.path.exists(src):
            shutil.copy(src, path)
    return path


def _workload(tmp_path) -> str:
    """3 requests: two share a 40-token prefix (a cache hit for the second one admitted)."""
    prefix = [(7 * i + 11) % 49000 + 100 for i in range(40)]
    reqs = [
        {"id": "a", "prompt_token_ids": prefix + [501, 502, 503], "max_tokens": 6},
        {"id": "b", "prompt_token_ids": prefix + [601, 602], "max_tokens": 6},
        {"id": "c", "prompt_token_ids": [900 + i for i in range(25)], "max_tokens": 4},
    ]
    data = {"name": "tiny", "sampling": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}, "requests": reqs}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_offline_bench_end_to_end(tmp_path, tiny_bench_model, capsys):
    wl = _workload(tmp_path)
    out = tmp_path / "res" / "bench.json"
    rc = cli_main(["bench", "offline", "--workload", wl, "--model", tiny_bench_model, "--dtype", "float32",
                   "--kv-cache-memory", "16MiB", "--compare", "--hf-batch-size", "2", "--decode-batch1",
                   "--decode-tokens", "4", "--batch1-prompt-len", "8", "--batch1-reps", "1", "--seed", "3",
                   "--output", str(out), "--log-level", "warning"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "prompt_token_ids" in printed
    r = json.loads(out.read_text())
    assert r["complete"] is True

    w = r["workload"]
    assert w["num_requests"] == 3 and w["prompt_tokens"] == 43 + 42 + 25 and w["output_tokens"] == 16
    assert "prompt_token_ids" in w["note"]
    m = r["model"]
    assert m["dtype"] == "float32" and m["bytes_per_param"] == 4
    assert m["lm_head_params"] == 64 * 49152
    assert m["decode_weight_bytes"] == (m["non_embedding_params"] + m["lm_head_params"]) * 4

    for key in ("idleless", "idleless_radix_off", "hf_generate"):
        x = r[key]
        assert x["num_requests"] == 3
        assert x["prompt_tokens"] == w["prompt_tokens"]
        assert x["output_tokens"] == w["output_tokens"]
        assert x["wall_s"] > 0
        assert math.isclose(x["output_tokens_per_s"], x["output_tokens"] / x["wall_s"])
        assert math.isclose(x["total_tokens_per_s"], (x["prompt_tokens"] + x["output_tokens"]) / x["wall_s"])
        assert math.isclose(x["cache_hit_rate"], x["cached_prompt_tokens"] / x["prompt_tokens"])
        assert 0 <= x["mfu"]
    for key in ("idleless", "idleless_radix_off"):
        x = r[key]
        assert x["num_retractions"] == 0
        # every prompt token is either served by the cache or computed
        assert x["cached_prompt_tokens"] + x["computed_prompt_tokens"] == x["prompt_tokens"]
        assert x["stats_prompt_tokens"] == x["prompt_tokens"]
        assert x["stats_cached_tokens"] == x["cached_prompt_tokens"]
        assert 0 < x["forward_fraction"] <= 1 and 0 <= x["schedule_fraction"] <= 1
        assert math.isclose(x["forward_fraction"] + x["schedule_fraction"] + x["other_fraction"], 1.0)
        assert x["num_steps"] > 0
    assert r["idleless"]["radix_cache"] is True and r["idleless_radix_off"]["radix_cache"] is False
    assert r["idleless_radix_off"]["cached_prompt_tokens"] == 0
    # the second request of the shared-prefix pair hits the 40 shared tokens (never the whole prompt)
    assert 40 <= r["idleless"]["cached_prompt_tokens"] < w["prompt_tokens"]
    hf = r["hf_generate"]
    assert hf["cached_prompt_tokens"] == 0 and hf["computed_prompt_tokens"] == w["prompt_tokens"]
    assert hf["num_batches"] == 2 and hf["batch_size"] == 2

    assert math.isclose(r["speedup_vs_hf"], hf["wall_s"] / r["idleless"]["wall_s"])
    assert math.isclose(r["speedup_vs_radix_off"], r["idleless_radix_off"]["wall_s"] / r["idleless"]["wall_s"])
    for key in ("agreement_hf", "agreement_radix_off"):
        assert 0 <= r[key]["identical_fraction"] <= 1

    b = r["batch1"]
    for key in ("idleless", "hf_generate"):
        x = b[key]
        assert x["decode_tokens"] == 4 and x["decode_prompt_tokens"] == 8 and x["prefill_prompt_tokens"] == 43
        assert x["weight_bytes"] == m["decode_weight_bytes"]  # float32 weights: both read params x 4 bytes
        assert math.isclose(x["decode_bound_tokens_per_s"], 25e9 / m["decode_weight_bytes"])
        if x["decode_tokens_per_s"] is not None:
            assert math.isclose(x["decode_tokens_per_s"], 4 / x["decode_s"])
            assert math.isclose(x["mbu"], x["decode_tokens_per_s"] / x["decode_bound_tokens_per_s"])
    if b["idleless"]["decode_tokens_per_s"] and b["hf_generate"]["decode_tokens_per_s"]:
        assert math.isclose(b["decode_speedup_vs_hf"],
                            b["idleless"]["decode_tokens_per_s"] / b["hf_generate"]["decode_tokens_per_s"])


def test_workload_path_resolution(tmp_path, monkeypatch, capsys):
    # relative to the repo root from any directory, absolute, and a bare name
    monkeypatch.chdir(tmp_path)
    shared = offline.REPO_ROOT.parent / "shared" / "workloads" / "random.json"
    if shared.is_file():
        assert offline.resolve_workload_path("../shared/workloads/random.json") == shared.resolve()
        assert offline.resolve_workload_path(str(shared)) == shared.resolve()
        assert offline.resolve_workload_path("random") == shared.resolve()
    with pytest.raises(FileNotFoundError, match="not found"):
        offline.resolve_workload_path("no/such/workload.json")
    assert cli_main(["bench", "offline", "--workload", str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [{"id": "x", "prompt": "text only"}]}))
    with pytest.raises(offline.WorkloadError, match="prompt_token_ids"):
        offline.load_workload(str(bad))


def test_shuffle_is_seeded():
    items = [offline.WorkItem(str(i), [i + 1], 1) for i in range(20)]
    a, b, c = offline.shuffled(items, 0), offline.shuffled(items, 0), offline.shuffled(items, 1)
    assert [x.id for x in a] == [x.id for x in b] != [x.id for x in c]
    assert sorted(x.id for x in a) == sorted(x.id for x in items)


def test_decode_weight_bytes_count_quantised_storage(tmp_path):
    """A quantised model's decode step reads its stored blocks, not float weights: with int8 weights
    (per-channel symmetric: one int8 per weight + one float32 scale per output row) the cost counts
    sum(n x k) + 4 x sum(n) over the linears and the lm_head, plus the float32 norm weights
    (hand-computed from the shapes)."""
    import types

    from idleless.config import EngineConfig
    from idleless.model.runner import ModelRunner

    path = make_tiny_model(tmp_path, vocab_size=256, tie=True)
    runner = ModelRunner(EngineConfig(model=path, dtype="float32", weight_dtype="int8", kv_cache_memory="2MiB",
                                      skip_quantization_gate=True, num_threads=1))
    cost = offline.engine_cost(types.SimpleNamespace(core=types.SimpleNamespace(runner=runner)))
    hidden, inter, layers, vocab = 64, 128, 2, 256
    qkv = (4 + 2 * 2) * 16  # 4 query heads + 2 KV heads x2 (K and V), head_dim 16
    shapes = [(qkv, hidden), (hidden, 4 * 16), (2 * inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]
    norms = (2 * layers + 1) * hidden * 4  # two RMSNorm weights per layer + the final one, float32
    assert cost.decode_weight_bytes == sum(n * k for n, k in shapes) + 4 * sum(n for n, _ in shapes) + norms
    assert cost.param_bytes == (cost.non_embedding_params + cost.lm_head_params) * 4
