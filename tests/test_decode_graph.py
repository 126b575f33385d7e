"""The decode graph (idleless/model/decode_graph.py) against the module path it replaces: for small batches
of every shape the runner sends it (decode rows of several requests, a shared prefix attended as a
cascade segment, a multi-token tail as in a speculative verify, a short extend), its hidden states are
bitwise those of ``LlamaForCausalLM.hidden_states`` (which the model tests check against transformers),
for each linear method and KV format it meets; and the runner uses it exactly where it applies."""

import pytest
import torch

from conftest import TEST_THREADS, make_tiny_model
from idleless.config import EngineConfig
from idleless.model.decode_graph import MAX_ROWS, DecodeGraph
from idleless.model.runner import ForwardBatch, ModelRunner

CONFIGS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "deterministic": {"enable_deterministic_inference": True},
    "int4": {"weight_dtype": "int4"},
    "int4-deterministic": {"weight_dtype": "int4", "enable_deterministic_inference": True},
    "w4a8": {"weight_dtype": "int4", "activation_dtype": "int8"},
    "int8": {"weight_dtype": "int8"},
    "w8a8": {"weight_dtype": "int8", "activation_dtype": "int8"},
    "fp8": {"weight_dtype": "fp8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graph"), seed=11)


def _runner(path, **kw) -> ModelRunner:
    cfg = dict(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS,
               skip_quantization_gate=True)
    cfg.update(kw)
    return ModelRunner(EngineConfig(**cfg))


def _batches(pool):
    """(name, ForwardBatch) pairs: the prefixes written by a first extend (longer than the graph's
    rows), then the small batches."""
    g = torch.Generator().manual_seed(4)
    ids = lambda n: torch.randint(3, 256, (n,), generator=g)
    p2, n = 48, MAX_ROWS  # request 2's prompt; the extend's tokens
    shared = pool.alloc(0, 0, 24)  # a 24-token prefix held by requests 0 and 1 (a cascade segment)
    own = [pool.alloc(0, 0, 8), pool.alloc(0, 0, 8), pool.alloc(0, 0, p2 + 2 + n + 5)]
    tables = [torch.cat([shared, own[0]]), torch.cat([shared, own[1]]), own[2]]
    prefill = ForwardBatch(ids(24 + p2), torch.cat([torch.arange(24), torch.arange(p2)]),
                           torch.cat([shared, own[2][:p2]]), [24, p2], [0, 0], [shared, own[2][:p2]],
                           torch.tensor([23, 24 + p2 - 1]))
    out = [("prefill", prefill)]
    # one decode row each: request 0 at 24, 1 at 24, 2 at p2 (0 and 1 share their 24-token prefix)
    out.append(("decode x3", ForwardBatch(ids(3), torch.tensor([24, 24, p2]),
                                          torch.stack([tables[0][24], tables[1][24], tables[2][p2]]),
                                          [1, 1, 1], [24, 24, p2],
                                          [tables[0][:25], tables[1][:25], tables[2][:p2 + 1]], torch.arange(3))))
    # a 4-token tail (a verify) beside a decode row, sampling every row of the tail
    out.append(("verify", ForwardBatch(ids(5), torch.tensor([25, 26, 27, 28, p2 + 1]),
                                       torch.cat([tables[0][25:29], tables[2][p2 + 1:p2 + 2]]), [4, 1], [25, p2 + 1],
                                       [tables[0][:29], tables[2][:p2 + 2]], torch.arange(5))))
    # exactly MAX_ROWS tokens: a short extend of request 2
    out.append(("extend", ForwardBatch(ids(n), torch.arange(p2 + 2, p2 + 2 + n), tables[2][p2 + 2:p2 + 2 + n], [n],
                                       [p2 + 2], [tables[2][:p2 + 2 + n]], torch.tensor([0, n - 1]))))
    # without shared segments, the fused decode kernel alone (the graph calls it by address): one decode
    # row, a 3-token tail, and decode rows of two requests that share nothing
    e = p2 + 2 + n
    out.append(("decode alone", ForwardBatch(ids(1), torch.tensor([e]), tables[2][e:e + 1], [1], [e],
                                             [tables[2][:e + 1]], torch.tensor([0]))))
    out.append(("tail alone", ForwardBatch(ids(3), torch.arange(e + 1, e + 4), tables[2][e + 1:e + 4], [3], [e + 1],
                                           [tables[2][:e + 4]], torch.arange(3))))
    out.append(("decode x2", ForwardBatch(ids(2), torch.tensor([29, e + 4]),
                                          torch.stack([tables[0][29], tables[2][e + 4]]), [1, 1], [29, e + 4],
                                          [tables[0][:30], tables[2][:e + 5]], torch.arange(2))))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_hidden_states_are_the_module_path_bitwise(model_path, name):
    runner = _runner(model_path, **CONFIGS[name])
    graph = runner.decode_graph
    assert graph is not None
    for what, b in _batches(runner.pool):
        meta = runner.backend.prepare(b.extend_lens, b.prefix_lens, b.slot_tables)
        got = None
        if what != "prefill":  # (the prefill writes the prefixes; it is past the graph's rows)
            assert graph.can_run(b.num_tokens)
            # the graph first: K/V it failed to write would be read as the pool's zeros (the module path
            # then writes them itself before reading them)
            got = graph.hidden_states(b.input_ids, b.positions, meta, b.out_cache_loc, b.sample_rows)
        want = runner.model.hidden_states(b.input_ids, b.positions, runner.backend, meta, b.out_cache_loc,
                                          b.sample_rows)
        if got is None:
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), f"{name}: {what}"


def test_runner_routes_small_batches_to_the_graph(model_path, monkeypatch):
    runner = _runner(model_path)
    batches = _batches(runner.pool)
    calls = []
    real = runner.model.hidden_states
    monkeypatch.setattr(runner.model, "hidden_states", lambda *a, **k: calls.append(a[0].numel()) or real(*a, **k))
    for _, b in batches:
        runner.forward(b)
    assert calls == [72]  # only the 72-token prefill went through the modules
    assert not runner.decode_graph.can_run(MAX_ROWS + 1) and not runner.decode_graph.can_run(0)


def test_graph_off_by_flag_and_under_a_layer_hook(model_path):
    assert _runner(model_path, disable_decode_graph=True).decode_graph is None
    runner = _runner(model_path)
    handle = runner.model.layers[1].register_forward_hook(lambda *a: None)
    assert not runner.decode_graph.can_run(1)  # a hook on a decoder layer needs the module path
    handle.remove()
    assert runner.decode_graph.can_run(1)


def test_no_graph_without_the_fused_glue(model_path):
    runner = _runner(model_path, disable_cpu_kernels=True)
    assert runner.decode_graph is None and DecodeGraph.build(runner.model, runner.backend) is None
