"""The accuracy gate at start-up (issue 14, item 4; ``idleless.quant.gate``) on a tiny random Llama
(tests/conftest.py; no tokenizer, so the built-in text is its first UTF-8 bytes modulo the vocabulary).

Its KL and top-1 agreement are checked against a brute-force float64 computation (``math`` over every
vocabulary entry) of the same two sets of logits; a scale multiplied by 50 (weights or KV, patched in
the quantiser: the test hook) makes start-up fail naming the KL and the limit; int8 weights pass."""

import gc
import math
import weakref

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import TEST_THREADS, make_tiny_model
from idleless.config import EngineConfig
from idleless.model.runner import ModelRunner
from idleless.quant import formats, gate, methods
from idleless.quant.accuracy import BYTE_TOKENS, TEXT, next_token_logits, text_token_ids
from idleless.telemetry.metrics import ServerMetrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gate"), seed=3)


def _config(path, w="auto", a="bf16", kv="auto", **kw):
    kw.setdefault("kv_cache_memory", "2MiB")
    return EngineConfig(model=path, dtype="float32", num_threads=TEST_THREADS, weight_dtype=w, activation_dtype=a,
                        kv_cache_dtype=kv, **kw)


def _brute_force(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(logits)) and top-1 agreement, one position and one vocabulary
    entry at a time in Python floats (float64), log-sum-exp with the row maximum."""
    kls, agree = [], 0
    for q_row, p_row in zip(logits.tolist(), ref.tolist()):
        def log_softmax(row):
            m = max(row)
            lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
            return [x - lse for x in row]
        lq, lp = log_softmax(q_row), log_softmax(p_row)
        kls.append(math.fsum(math.exp(b) * (b - a) for a, b in zip(lq, lp)))
        agree += q_row.index(max(q_row)) == p_row.index(max(p_row))
    return math.fsum(kls) / len(kls), agree / len(kls)


def test_int8_weights_pass_and_kl_equals_float64_brute_force(tiny):
    runner = ModelRunner(_config(tiny, "int8"))
    p = runner.precision
    assert p["gate"] == "passed" and p["weight_dtype"] == "int8" and p["activation_dtype"] == "bf16"
    assert 0 < p["kl"] < p["max_kl"] == 0.1 and p["gate_seconds"] > 0
    # int8 codes + a float32 scale per output channel of 64 or 128 inputs
    assert 1.0 < p["bytes_per_weight"] < 1.1
    assert p["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers * K,V * KV heads * head_dim * float32
    ids = text_token_ids(tiny, 256)
    assert p["gate_tokens"] == len(ids) == BYTE_TOKENS and ids == [b % 256 for b in TEXT.encode()[:BYTE_TOKENS]]
    ref = gate.reference_runner(runner, len(ids))
    ref_logits = next_token_logits(ref, ids)
    logits = next_token_logits(runner, ids)
    kl, top1 = _brute_force(logits, ref_logits)
    assert p["kl"] == pytest.approx(kl, rel=1e-9, abs=1e-15)
    assert p["top1"] == top1


def test_a_kv_pool_smaller_than_the_text_gates_over_what_it_holds(tiny):
    """A quantised runner whose KV pool holds fewer tokens than the gate's text used to fail at start-up
    (the pool's None slots taken as a tensor): the gate measures the tokens the pool holds, here 96
    slots in pages of 16 of the text's BYTE_TOKENS; next_token_logits refuses more with a clear error."""
    per_token = 2 * 2 * 2 * 16 * 4  # float32 K and V, 2 layers, 2 KV heads, head_dim 16
    runner = ModelRunner(_config(tiny, "int8", kv_cache_memory=str(100 * per_token), page_size=16))
    assert runner.pool.num_slots == 96 < BYTE_TOKENS
    p = runner.precision
    assert p["gate"] == "passed" and p["gate_tokens"] == 96 and 0 < p["kl"] < p["max_kl"]
    ids = text_token_ids(tiny, 256)
    with pytest.raises(MemoryError, match="free slots"):
        next_token_logits(runner, ids)
    assert runner.pool.num_free_slots == 96  # nothing taken
    # under 64 tokens the first positions alone would decide the verdict: refused, naming the pool
    with pytest.raises(MemoryError, match="holds 48 tokens; the accuracy gate needs 64"):
        ModelRunner(_config(tiny, "int8", kv_cache_memory=str(50 * per_token), page_size=16))


def test_broken_weight_scale_is_refused_at_startup(tiny, monkeypatch):
    real = formats.quantize_rows

    def broken(x, dtype):  # the test hook: every int8 weight row's scale 50x too large
        q, s = real(x, dtype)
        return q, s * 50

    monkeypatch.setattr(methods, "quantize_rows", broken)
    with pytest.raises(gate.QuantizationGateError) as e:
        ModelRunner(_config(tiny, "int8"))
    msg = str(e.value)
    assert "mean KL divergence" in msg and "--max-quantization-kl 0.1" in msg and "--weight-dtype int8" in msg
    kl = float(msg.split("mean KL divergence ")[1].split()[0])
    assert kl > 0.1
    # --allow-accuracy-loss starts it, reporting the loss
    runner = ModelRunner(_config(tiny, "int8", allow_accuracy_loss=True))
    assert runner.precision["gate"] == "allowed" and runner.precision["kl"] == pytest.approx(kl, rel=1e-2)


def test_broken_kv_scale_is_refused_at_startup(tiny, monkeypatch):
    from idleless.quant import kv as kv_mod
    real = formats.quantize_rows
    monkeypatch.setattr(kv_mod, "quantize_rows", lambda x, dtype: (lambda q, s: (q, s * 50))(*real(x, dtype)))
    # without the C kernels, whose KV write quantises in C: every KV row goes through QuantizedKV.write
    with pytest.raises(gate.QuantizationGateError, match=r"--kv-cache-dtype int8.*exceeds --max-quantization-kl"):
        ModelRunner(_config(tiny, kv="int8", disable_cpu_kernels=True))


def test_kv_int8_passes_and_a_tighter_limit_refuses(tiny):
    p = ModelRunner(_config(tiny, kv="int8")).precision
    assert p["gate"] == "passed" and p["kv_cache_dtype"] == "int8" and p["bytes_per_weight"] == 4.0
    with pytest.raises(gate.QuantizationGateError):
        ModelRunner(_config(tiny, kv="int8", max_quantization_kl=p["kl"] / 2))


def test_no_gate_for_the_reference_precision_or_when_skipped(tiny, monkeypatch):
    def no_reference(*a, **k):
        raise AssertionError("the gate built a reference model")

    monkeypatch.setattr(gate, "reference_runner", no_reference)
    assert ModelRunner(_config(tiny)).precision["gate"] == "not_needed"
    assert ModelRunner(_config(tiny, "bf16", kv="auto")).precision["gate"] == "not_needed"
    p = ModelRunner(_config(tiny, "int4", kv="fp8_e5m2", skip_quantization_gate=True)).precision
    assert p["gate"] == "skipped" and p["kl"] is None
    # Q4_1 blocks of 32: 16 bytes of codes + a float16 step and minimum per block = 20 / 32 bytes a weight
    # (the tiny model's untied lm_head is Q8_0: 34 / 32)
    assert 0.6 < p["bytes_per_weight"] < 1.0
    with pytest.raises(ValueError, match="max_quantization_kl"):
        ModelRunner(_config(tiny, "int8", max_quantization_kl=0.0))


def test_reference_is_dropped_after_the_gate(tiny, monkeypatch):
    refs = []
    real = gate.reference_runner

    def tracked(runner, n):
        ref = real(runner, n)
        refs.append(weakref.ref(ref))
        return ref

    monkeypatch.setattr(gate, "reference_runner", tracked)
    ModelRunner(_config(tiny, "fp8"))
    gc.collect()
    assert len(refs) == 1 and refs[0]() is None


def test_native_gguf_format_is_its_own_reference(smollm2_dir):
    # the converted directory remembers its GGUF, whose layer linears are all Q4_1
    assert gate.native_weight_dtype_of(smollm2_dir) == "int4"
    assert gate.native_weight_dtype_of(None) == "int4"


def test_precision_gauges():
    m = ServerMetrics("tiny")
    m.set_precision({"weight_dtype": "int8", "activation_dtype": "bf16", "kv_cache_dtype": "fp8_e4m3",
                     "bytes_per_weight": 1.0061, "kv_bytes_per_token": 12345, "kl": 0.0052, "top1": 0.93})
    samples = {s.name: s for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    labels = {"model_name": "tiny", "weight_dtype": "int8", "activation_dtype": "bf16", "kv_cache_dtype": "fp8_e4m3"}
    for name, value in (("idleless:quantization_kl", 0.0052), ("idleless:quantization_top1_agreement", 0.93),
                        ("idleless:kv_cache_bytes_per_token", 12345), ("idleless:weight_bytes_per_weight", 1.0061)):
        assert samples[name].labels == labels and samples[name].value == value
    plain = ServerMetrics("tiny")
    plain.set_precision({"weight_dtype": "bf16", "activation_dtype": "bf16", "kv_cache_dtype": "auto",
                         "bytes_per_weight": 4.0, "kv_bytes_per_token": 100, "kl": None, "top1": None})
    assert "quantization_kl" not in plain.render().decode()


def test_server_info_and_metrics_show_the_gate(tiny, smollm2_dir):
    """Through the engine-core process: its CoreReady carries the runner's precision report to
    /server_info and /metrics (the tiny model borrows SmolLM2's tokenizer for the frontend)."""
    import asyncio

    import httpx

    from idleless.server.app import ServerSettings, build_app
    from idleless.server.engine_client import EngineClient

    async def run():
        client = await EngineClient.start(_config(tiny, "int8", tokenizer=smollm2_dir), startup_timeout=600)
        try:
            app = build_app(client, ServerSettings(model_names=["tiny"]))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                info = (await http.get("/server_info")).json()["precision"]
                metrics = (await http.get("/metrics")).text
        finally:
            await client.shutdown()
        return info, metrics

    info, metrics = asyncio.run(run())
    assert info["gate"] == "passed" and info["weight_dtype"] == "int8" and 0 < info["kl"] < 0.1
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples["idleless:quantization_kl"] == info["kl"]
    assert samples["idleless:quantization_top1_agreement"] == info["top1"]
