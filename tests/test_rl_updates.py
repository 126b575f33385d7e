"""Weight updates of a running offline Engine (issue 16): tiny random model A serves, model B's weights are
pushed in (by tensor, from disk), and the engine must then answer exactly as a fresh engine built on B
(the independent reference: its own load of B's directory). Refused updates leave A's answers; the prefix
cache is emptied unless flush_cache=False; a request queued before the update finishes on the old weights.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from safetensors.torch import load_file

from idleless.engine.engine import Engine
from idleless.rl.updates import WeightUpdateError
from idleless.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 80, 9, 41, 120, 7, 66, 3, 12, 90], [200, 14, 15, 92, 65, 35], list(range(30, 62))]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def checkpoint(path: str) -> list[tuple[str, torch.Tensor]]:
    return [kv for n in sorted(os.listdir(path)) if n.endswith(".safetensors")
            for kv in load_file(os.path.join(path, n)).items()]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl-models")
    return make_tiny_model(d, seed=0), make_tiny_model(d, seed=1)


def make_engine(path: str, **kw) -> Engine:
    return Engine(model=path, tokenizer=kw.pop("tokenizer"), dtype="float32", kv_cache_memory="2MiB",
                  num_threads=TEST_THREADS, page_size=4, **kw)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return smollm2_dir


@pytest.fixture(scope="module")
def reference(models, tok):
    """Greedy answers of fresh engines on A and on B."""
    out = {}
    for name, path in zip("AB", models):
        eng = make_engine(path, tokenizer=tok)
        out[name] = [o.token_ids for o in eng.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert out["A"] != out["B"]  # the test can tell the two apart
    return out


def answers(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tensor_update_switches_to_b_and_flushes_the_cache(models, tok, reference):
    engine = make_engine(models[0], tokenizer=tok)
    assert answers(engine) == reference["A"]
    again = engine.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    assert again.cached_tokens > 0
    assert engine.get_weight_version() == "default"
    res = engine.update_weights_from_tensor(checkpoint(models[1]), weight_version="v1")
    assert res["success"] and res["flushed_cache"] and res["weight_version"] == "v1"
    assert engine.get_weight_version() == "v1"
    after = engine.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    assert after.cached_tokens == 0  # KV computed with A's weights is never reused
    assert after.token_ids == reference["B"][2]
    assert answers(engine) == reference["B"]
    # back to A from disk: every weight, and the version stays when none is named
    res = engine.update_weights_from_disk(models[0])
    assert res["weight_version"] == "v1" and res["num_tensors"] == len(checkpoint(models[0]))
    assert answers(engine) == reference["A"]


def test_partial_update_in_another_dtype_is_cast(models, tok):
    """A trainer may send a subset, in another float dtype: only those parameters change."""
    engine = make_engine(models[0], tokenizer=tok)
    b = dict(checkpoint(models[1]))
    half = [(n, t.to(torch.float64)) for n, t in b.items() if "layers.0." in n]
    engine.update_weights_from_tensor(half)
    p = dict(engine.core.runner.model.named_parameters())
    assert torch.equal(p["layers.0.self_attn.o_proj.weight"], b["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(p["layers.1.self_attn.o_proj.weight"],
                       dict(checkpoint(models[0]))["model.layers.1.self_attn.o_proj.weight"])


def test_bad_updates_are_refused_and_a_keeps_serving(models, tok, reference, tmp_path):
    engine = make_engine(models[0], tokenizer=tok)
    good = checkpoint(models[1])
    wrong_shape = [(n, t[:-1] if n.endswith("o_proj.weight") else t) for n, t in good]
    wrong_dtype = [(n, t.to(torch.int32) if n.endswith("norm.weight") else t) for n, t in good]
    unknown = good + [("model.layers.9.mlp.up_proj.weight", good[0][1])]
    twice = good + [good[-1]]
    for bad in (wrong_shape, wrong_dtype, unknown, twice, [("not.a.weight", good[0][1])]):
        with pytest.raises(WeightUpdateError):
            engine.update_weights_from_tensor(bad, weight_version="bad")
    # from disk: unreadable path, a checkpoint lacking a tensor, a model of another shape
    missing = shutil.copytree(models[1], tmp_path / "missing")
    sd = dict(checkpoint(str(missing)))
    del sd["model.layers.1.mlp.down_proj.weight"]
    for n in os.listdir(missing):
        if n.endswith(".safetensors"):
            os.remove(missing / n)
    from safetensors.torch import save_file
    save_file(sd, str(missing / "model.safetensors"))
    other = make_tiny_model(tmp_path, seed=1, num_hidden_layers=3)
    for path in (str(tmp_path / "nowhere"), str(missing), other):
        with pytest.raises(WeightUpdateError):
            engine.update_weights_from_disk(path, weight_version="bad")
    assert engine.get_weight_version() == "default"
    assert answers(engine) == reference["A"]


def test_flush_cache_false_keeps_the_cache(models, tok):
    engine = make_engine(models[0], tokenizer=tok)
    engine.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    res = engine.update_weights_from_tensor(checkpoint(models[1]), flush_cache=False)
    assert not res["flushed_cache"]
    assert engine.generate(PROMPTS[2], GREEDY, use_tqdm=False).cached_tokens > 0


def test_queued_requests_finish_on_old_weights_or_abort(models, tok, reference):
    """An update waits for the requests already in the engine (they finish on A's weights), or ends
    them with finish_reason abort when abort_all_requests is asked."""
    engine = make_engine(models[0], tokenizer=tok)
    states = engine._submit(PROMPTS[0], GREEDY, engine._sync_handler)
    engine.update_weights_from_tensor(checkpoint(models[1]))
    assert states[0].finished and states[0].result().token_ids == reference["A"][0]
    states = engine._submit(PROMPTS[0], GREEDY, engine._sync_handler)
    res = engine.update_weights_from_tensor(checkpoint(models[0]), abort_all_requests=True)
    assert res["num_aborted_requests"] == 1
    assert states[0].result().finish_reason == "abort"
    assert answers(engine) == reference["A"]


def test_update_reaches_an_int4_self_draft(models, tok, reference):
    """A self-draft (the target's own weights at int4) gets the pushed weights too: its quantised copies
    equal a fresh self-draft's on B, so it drafts B's guesses (the same acceptance counts as a fresh B
    engine's); the answers are B's, as any speculative output equals plain decoding's."""
    spec = dict(speculative_algorithm="draft", speculative_draft_weight_dtype="int4", speculative_num_draft_tokens=3,
                speculative_disable_adaptive=True, speculative_draft_kv_cache_memory="1MiB",
                skip_quantization_gate=True)  # the gate measures with the tokenizer's text, outside this vocab
    fresh = make_engine(models[1], tokenizer=tok, **spec)
    want = answers(fresh)
    engine = make_engine(models[0], tokenizer=tok, **spec)
    assert answers(engine) == reference["A"]
    before = engine.stats()["speculative"]
    engine.update_weights_from_tensor(checkpoint(models[1]), weight_version="v1")
    draft, fresh_draft = engine.core.proposer.inner, fresh.core.proposer.inner
    assert draft.kv.cache.total_size == 0  # the draft's KV of A's weights is gone too
    quant = [m.quant for m in draft.runner.model.modules() if hasattr(m, "quant")]
    fresh_quant = [m.quant for m in fresh_draft.runner.model.modules() if hasattr(m, "quant")]
    assert quant and len(quant) == len(fresh_quant)
    for q, f in zip(quant, fresh_quant):
        assert q.keys() == f.keys() and all(torch.equal(q[k], f[k]) for k in q)
    assert answers(engine) == want == reference["B"]
    s, f = engine.stats()["speculative"], fresh.stats()["speculative"]
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert s[key] - before[key] == f[key] > 0, key
