"""Weights by name (``ModelRunner.load_weights`` -> ``weights.load_weights``): an update re-processes every
linear method, so a runner loaded with weights W1 and then given W2 computes what a runner loaded with W2
computes, bit for bit, whatever the linear method (oneDNN- and AMX-packed copies where the CPU has them);
bad names and shapes are refused before anything is written.

Reference: a second runner built from W2's directory (its own fresh load); the batches are the same
(prefill rows past the AMX row limit, then decode rows under it) in the same slots.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from safetensors.torch import load_file
from test_model import MixedBatchDriver

from idleless.config import EngineConfig
from idleless.model import cpu_kernels
from idleless.model.linear import (PLAIN, InvariantLinearMethod, Linear, OneDnnLinearMethod, PlainLinearMethod,
                                   TiledLinearMethod)
from idleless.model import runner as runner_module
from idleless.model.runner import ModelRunner

SEQS = {"a": list(range(3, 100)), "b": list(range(40, 49)), "c": [7] * 5}


def _runner(path: str, dtype: str, eager: bool = False) -> ModelRunner:
    return ModelRunner(EngineConfig(model=path, dtype=dtype, kv_cache_memory="2MiB", num_threads=TEST_THREADS,
                                    disable_cpu_kernels=eager))


def _logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of a fixed batch sequence: 102 rows (oneDNN's size) then decode rows (AMX's size), slots
    taken in order from a fully free pool (so two runners use the same slots); the slots are freed after."""
    assert runner.pool.num_free_slots == runner.pool.num_slots
    drv = MixedBatchDriver(runner, SEQS, scatter=False)
    drv.step({"a": 90, "b": 8, "c": 4})
    drv.step({"a": 7, "b": 1, "c": 1})
    out = torch.stack([drv.logits[r][p] for r in SEQS for p in range(len(SEQS[r]))])
    runner.pool.free(torch.cat(list(drv.slots.values())))
    return out


def _checkpoint(path: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a model directory's safetensors, as stored (float32)."""
    return [kv for n in sorted(os.listdir(path)) if n.endswith(".safetensors")
            for kv in load_file(os.path.join(path, n)).items()]


CONFIGS = [
    pytest.param("float32", False, id="float32-kernels"),
    pytest.param("bfloat16", False, id="bfloat16-default"),  # oneDNN (+ AMX) packed where the CPU has them
    pytest.param("bfloat16", True, id="bfloat16-eager"),
]


class CopyLinearMethod(PlainLinearMethod):
    """A packed copy in its simplest form (a clone the products read), so the re-process path is tested
    on CPUs without oneDNN bfloat16 packing or AMX too."""

    def process_after_load(self, layer):
        layer.copy = layer.weight.detach().clone()
        return layer.copy.numel() * layer.copy.element_size()

    def apply(self, layer, x):
        return torch.nn.functional.linear(x, layer.copy, layer.bias)


@pytest.mark.parametrize("dtype,eager", CONFIGS + [pytest.param("float32", False, id="float32-copy-method")])
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)], ids=["llama-tied", "qwen2-bias"])
def test_weight_update_by_name_equals_a_fresh_load(tmp_path, monkeypatch, request, dtype, eager, arch, tie):
    """Runner A loaded with W1 has run batches (packed copies made, KV written); W2's checkpoint tensors
    (float32, cast on the way in) go in by name; A's logits are then B's (loaded with W2) bitwise. A stale
    packed copy (oneDNN, AMX, or a tied lm_head packed from the old embedding) would give W1's products."""
    if "copy-method" in request.node.callspec.id:
        monkeypatch.setattr(runner_module, "select_linear_method", lambda *args, **kw: CopyLinearMethod())
    w1 = make_tiny_model(tmp_path, arch=arch, tie=tie, seed=0)
    w2 = make_tiny_model(tmp_path, arch=arch, tie=tie, seed=1)
    a, b = _runner(w1, dtype, eager), _runner(w2, dtype, eager)
    assert type(a.linear_method) is type(b.linear_method)
    before = _logits(a)
    want = _logits(b)
    assert not torch.equal(before, want)  # the weights differ: the comparison below can fail
    a.load_weights(_checkpoint(w2))
    assert torch.equal(_logits(a), want)
    assert a.prepacked_bytes == b.prepacked_bytes


def test_the_linear_method_follows_the_config(tmp_path):
    """Chosen once at load from dtype, flags and CPU: float32 gives bi_linear for small batches over plain
    F.linear (with the C kernels; plain without), disable_weight_prepack plain F.linear; bfloat16 gives
    oneDNN packing where the CPU supports it with deterministic inference off, the batch-invariant method
    by default (F.linear on row tiles with disable_weight_prepack)."""
    from idleless.model.linear import SmallBatchLinearMethod, can_prepack

    path = make_tiny_model(tmp_path)
    f32 = _runner(path, "float32")
    if f32.kernels is not None:
        assert isinstance(f32.linear_method, SmallBatchLinearMethod) and f32.linear_method.base is PLAIN
        params = sum(m.weight.numel() for m in f32.model.modules() if isinstance(m, Linear))
        assert f32.prepacked_bytes >= 4 * params  # the packed copies (panels padded to 16 columns)
    else:
        assert isinstance(f32.linear_method, PlainLinearMethod) and f32.prepacked_bytes == 0
    bf16_cfg = dict(model=path, dtype="bfloat16", kv_cache_memory="2MiB", num_threads=TEST_THREADS)
    plain = ModelRunner(EngineConfig(**bf16_cfg, disable_weight_prepack=True, enable_deterministic_inference=False))
    assert isinstance(plain.linear_method, PlainLinearMethod)
    bf16 = ModelRunner(EngineConfig(**bf16_cfg, enable_deterministic_inference=False))
    assert isinstance(bf16.linear_method, OneDnnLinearMethod) == can_prepack(torch.bfloat16)
    assert all(m.method is bf16.linear_method for m in bf16.model.modules() if isinstance(m, Linear))
    # bfloat16's default: the batch-invariant method (the kernels' bi_linear; no packed copy when asked)
    det = _runner(path, "bfloat16")
    assert det.deterministic
    assert isinstance(det.linear_method, InvariantLinearMethod if det.kernels is not None else TiledLinearMethod)
    tiled = ModelRunner(EngineConfig(**bf16_cfg, disable_weight_prepack=True))
    assert isinstance(tiled.linear_method, TiledLinearMethod) and tiled.prepacked_bytes == 0


def _state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bad_weights_raise_and_change_nothing(tmp_path, dtype):
    """Each bad list starts with valid W2 tensors (a loader writing as it goes would have changed them);
    the ValueError names the bad tensor and afterwards every parameter and the logits are W1's."""
    w1 = make_tiny_model(tmp_path, arch="qwen2", seed=0)
    w2 = dict(_checkpoint(make_tiny_model(tmp_path, arch="qwen2", seed=1)))
    runner = _runner(w1, dtype)
    params, logits = _state(runner), _logits(runner)
    good = [(n, w2[n]) for n in ("model.norm.weight", "model.embed_tokens.weight",
                                 "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")]
    q = "model.layers.1.self_attn.k_proj.weight"
    bad = {
        "model.layers.0.mlp.gate_proj.bias": torch.zeros(128),  # no such parameter
        "model.layers.7.input_layernorm.weight": torch.ones(64),  # a layer the model does not have
        "transformer.h.0.attn.weight": torch.ones(64),  # not an HF Llama-family name
        q: w2[q][:-1],  # one row short
        "model.layers.0.self_attn.v_proj.bias": w2["model.layers.0.self_attn.v_proj.bias"][None],  # [1, n]
        "model.layers.1.post_attention_layernorm.weight": torch.ones(64, dtype=torch.int64),  # not floating
        "model.norm.weight": w2["model.norm.weight"],  # given twice (first in `good`)
    }
    for name, tensor in bad.items():
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            runner.load_weights(good + [(name, tensor)])
        after = _state(runner)
        assert all(torch.equal(after[n], p) for n, p in params.items()), name
    with pytest.raises(ValueError, match="missing"):
        runner.load_weights(good, require_all=True)
    assert all(torch.equal(_state(runner)[n], p) for n, p in params.items())
    assert torch.equal(_logits(runner), logits)


def test_partial_update_writes_only_its_shards(tmp_path):
    """A partial update (k_proj alone, as a trainer might send): the fused q/k/v weight takes W2's k rows
    and keeps its q and v rows; nothing else changes."""
    w1 = make_tiny_model(tmp_path, seed=0)
    w2 = dict(_checkpoint(make_tiny_model(tmp_path, seed=1)))
    runner = _runner(w1, "float32")
    params = _state(runner)
    name = "model.layers.1.self_attn.k_proj.weight"
    runner.load_weights([(name, w2[name])])
    after = _state(runner)
    qkv = "layers.1.self_attn.qkv_proj.weight"
    q_rows, kv_rows = 4 * 16, 2 * 16
    assert torch.equal(after[qkv][q_rows:q_rows + kv_rows], w2[name])
    assert torch.equal(after[qkv][:q_rows], params[qkv][:q_rows])
    assert torch.equal(after[qkv][q_rows + kv_rows:], params[qkv][q_rows + kv_rows:])
    assert all(torch.equal(after[n], p) for n, p in params.items() if n != qkv)


@pytest.mark.skipif(cpu_kernels.load(torch.float32) is None, reason="no C compiler for the CPU kernels")
def test_kernel_ops_and_eager_ops_are_chosen_once(tmp_path):
    """Norms, MLPs and attention layers hold the runner's ops object (fused kernels or eager), chosen at
    start-up; no module keeps a kernels switch of its own."""
    from idleless.model.ops import CpuKernelOps, EagerOps

    path = make_tiny_model(tmp_path)
    for eager, kind in ((False, CpuKernelOps), (True, EagerOps)):
        runner = _runner(path, "float32", eager)
        assert isinstance(runner.ops, kind)
        holders = [m for m in runner.model.modules() if hasattr(m, "ops")]
        assert len(holders) == 1 + 2 * 4 + 1  # the model; per layer two norms, attention, MLP; the final norm
        assert all(m.ops is runner.ops for m in holders)
        assert not any(hasattr(m, "kernels") for m in runner.model.modules())
