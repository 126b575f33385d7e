"""The ``draft`` proposer (idleless.spec.draft) on tiny random Llamas built here, in float32.

With the draft model equal to the target model, the draft's greedy guesses must be exactly the
target's own greedy continuation; the independent reference is the target run alone through an
``EngineCore`` with plain decoding (no speculation). Records handed to the proposer are stand-ins
with the two fields a proposer reads (``rid``, ``all_ids``), so rejections are scripted by hand.
After every call the draft pool's one-owner invariant is checked (tests/kv_invariants.py).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from kv_invariants import check_ownership, tree_nodes

from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.request import Request, SamplingParams
from idleless.spec.draft import DraftModelProposer

VOCAB = 256
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V x 2 layers x 2 KV heads x head_dim 16 x float32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, another model with the same vocabulary, a model with another vocabulary)."""
    d = tmp_path_factory.mktemp("draft")
    return make_tiny_model(d), make_tiny_model(d, seed=1), make_tiny_model(d, seed=2, vocab_size=VOCAB + 64)


def core_config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS, **kw)


@pytest.fixture(scope="module")
def target_core(models) -> EngineCore:
    return EngineCore(core_config(models[0]))


def reference(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The target's greedy continuation (``n`` tokens) of each prompt, by plain decoding."""
    out = {}
    for i, p in enumerate(prompts):
        core.add_request(Request(f"ref{i}", p, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)))
        out[f"ref{i}"] = []
    while core.has_work():
        for o in core.step():
            out[o.rid] += o.new_token_ids
    return [out[f"ref{i}"] for i in range(len(prompts))]


def proposer(draft: str, page_size: int = 1, draft_kv: str = "1MiB", **kw) -> DraftModelProposer:
    cfg = core_config(draft, page_size=page_size, speculative_algorithm="draft", speculative_draft_model_path=draft,
                      speculative_draft_kv_cache_memory=draft_kv, **kw)
    target = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB), context_length=2048)
    return DraftModelProposer(cfg, target)


def rec(rid: str, ids: list[int]):
    return SimpleNamespace(rid=rid, all_ids=list(ids))


def check_draft_kv(p: DraftModelProposer) -> None:
    """Every draft page is free, in the draft tree, or owned by one request's draft state."""
    check_ownership(SimpleNamespace(pool=p.pool, cache=p.kv.cache, running=list(p.seqs.values()), waiting=[],
                                    kv_usage=p.kv_usage))


def rand_prompts(seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("page_size", [1, 4])
def test_guesses_equal_target_greedy_continuation(models, target_core, page_size):
    """Draft == target: one batch of five prompts, three rounds with different max_tokens per
    request; round r hands each request the prompt + m reference tokens and must get
    ref[m:m + k]. Round 1 accepts everything (catch-up: the last guess + the target's token);
    round 2 accepts nothing while the target's token equals the first guess (the scheduler cut
    the proposal: the draft KV already covers every target token and the last is recomputed)."""
    prompts = rand_prompts(0, [1, 7, 23, 40, 5])
    ref = reference(target_core, prompts, 16)
    p = proposer(models[0], page_size)
    ks = [[5, 3, 0, 1, 6], [2, 4, 4, 1, 3], [3, 1, 2, 6, 4]]
    ms = [[0] * 5, [k + 1 for k in ks[0]]]
    ms.append([m + 1 for m in ms[1]])
    for k, m in zip(ks, ms):
        recs = [rec(f"r{i}", prompts[i] + ref[i][:m[i]]) for i in range(5)]
        assert p.propose(recs, k) == [ref[i][m[i]:m[i] + k[i]] for i in range(5)]
        check_draft_kv(p)
    assert p.stats()["draft_tokens"] > 0 and p.stats()["draft_forward_s"] > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_rejection_truncates_stale_draft_kv(models, target_core, page_size):
    """After guesses g1..g5, the target accepts g1, g2 and adds its own X != g3: the draft's KV of
    g3, g4 is stale. The next guesses must be the target's greedy continuation of
    prompt + g1 g2 X (reference run on that prompt), and no stale token may ever reach the tree."""
    prompt = rand_prompts(1, [13])[0]
    p = proposer(models[0], page_size)
    g = p.propose([rec("a", prompt)], [5])[0]
    assert g == reference(target_core, [prompt], 5)[0]
    seq = prompt + g[:2] + [(g[2] + 1) % VOCAB]
    ref = reference(target_core, [seq], 8)[0]
    assert p.propose([rec("a", seq)], [4]) == [ref[:4]]
    check_draft_kv(p)
    final = seq + ref[:5]
    assert p.propose([rec("a", final)], [3]) == [ref[5:8]]  # all accepted after the rejection
    check_draft_kv(p)
    p.finish(rec("a", final + ref[8:9]))
    check_draft_kv(p)
    done = final + ref[8:9]
    for node in tree_nodes(p.kv.cache):  # every tree path is a prefix of the confirmed tokens
        start = node.start
        assert node.key == done[start:start + len(node.key)]


def test_chunked_catch_up(models, target_core):
    """chunked_prefill_size 4: a 10-token prompt is caught up 4 + 4 + 2 tokens over three calls,
    proposing nothing until its last token is computed; every draft token is computed once."""
    prompt = rand_prompts(2, [10])[0]
    ref = reference(target_core, [prompt], 3)[0]
    p = proposer(models[0], chunked_prefill_size=4)
    assert p.propose([rec("a", prompt)], [3]) == [[]]
    assert p.propose([rec("a", prompt)], [3]) == [[]]
    assert p.propose([rec("a", prompt)], [3]) == [ref]
    assert p.stats()["draft_tokens"] == 10 + 2
    check_draft_kv(p)


def test_bad_draft_configuration(models, tmp_path):
    target = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB), context_length=2048)
    with pytest.raises(ValueError, match="vocab_size"):
        DraftModelProposer(core_config(models[0], speculative_algorithm="draft",
                                       speculative_draft_model_path=models[2]), target)
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        DraftModelProposer(core_config(models[0], speculative_algorithm="draft",
                                       speculative_draft_model_path=str(tmp_path / "missing")), target)
    cfg = core_config(models[0])  # no draft path at all
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        DraftModelProposer(cfg, target)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_draft_pool_proposes_nothing_it_cannot_hold(models, target_core, page_size):
    """A 16-slot draft pool: a 30-token prompt never fits ([] every time); of two 8-token prompts
    wanting 4 guesses (8 + 3 slots each) only the first fits; once it finishes, the second gets its
    guesses (evicting the first's cached prompt). Accounting exact throughout."""
    long, a, b = rand_prompts(3, [30, 8, 8])
    ref = reference(target_core, [a, b], 4)
    p = proposer(models[0], page_size, draft_kv=str(16 * TINY_BYTES_PER_TOKEN))
    assert p.pool.num_slots == 16
    assert p.propose([rec("long", long), rec("a", a), rec("b", b)], [4, 4, 4]) == [[], ref[0], []]
    check_draft_kv(p)
    assert p.propose([rec("long", long)], [2]) == [[]]
    check_draft_kv(p)
    p.finish(rec("a", a + ref[0][:1]))
    check_draft_kv(p)
    assert p.propose([rec("b", b)], [4]) == [ref[1]]
    check_draft_kv(p)


@pytest.mark.parametrize("page_size", [1, 4])
def test_finish_releases_everything_and_prompts_are_shared(models, target_core, page_size):
    """Two requests sharing a 32-token prefix, proposed one after the other: the second computes
    only its own tail in the draft (the draft tree holds the first's prompt). After both finish
    (and an unknown rid), the draft pool is free + cached == total with nothing locked."""
    shared, ta, tb = rand_prompts(4, [32, 5, 6])
    a, b = shared + ta, shared + tb
    ref = reference(target_core, [a, b], 3)
    p = proposer(models[0], page_size)
    assert p.propose([rec("a", a)], [3]) == [ref[0]]
    before = p.stats()["draft_tokens"]
    assert before == len(a) + 2
    assert p.propose([rec("b", b)], [3]) == [ref[1]]
    assert p.stats()["draft_tokens"] - before == len(tb) + 2
    check_draft_kv(p)
    p.finish(rec("a", a + ref[0]))
    p.finish(rec("b", b + ref[1][:1]))
    p.finish(rec("never-proposed", a))
    assert not p.seqs
    check_draft_kv(p)
    kv = p.kv_usage()
    assert kv["in_use"] == 0 and kv["free"] + kv["cached"] == kv["total"] and kv["cached"] >= 32
    assert p.kv.cache.protected_size == 0


@pytest.mark.parametrize("same_draft", [True, False])
def test_engine_greedy_equal_with_draft_speculation(models, target_core, same_draft):
    """EngineCore with speculative_algorithm='draft' (fixed draft length): greedy outputs equal
    plain decoding's token for token, max_new_tokens reached inside accepted runs. The draft is
    the target itself (everything accepted) or another random model (most guesses rejected)."""
    prompts = rand_prompts(5, [3, 17, 9, 30, 1, 12])
    lens = [7, 12, 1, 9, 15, 4]
    refs = [reference(target_core, [pr], n)[0] for pr, n in zip(prompts, lens)]
    draft = models[0] if same_draft else models[1]
    core = EngineCore(core_config(models[0], speculative_algorithm="draft", speculative_draft_model_path=draft,
                                  speculative_num_draft_tokens=4, speculative_disable_adaptive=True))
    out = {}
    for i, (pr, n) in enumerate(zip(prompts, lens)):
        core.add_request(Request(f"s{i}", pr, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)))
        out[f"s{i}"] = []
    while core.has_work():
        for o in core.step():
            out[o.rid] += o.new_token_ids
        check_ownership(core.scheduler)
        check_draft_kv(core.proposer.inner)
    assert [out[f"s{i}"] for i in range(len(prompts))] == refs
    st = core.stats()["speculative"]
    assert st["algorithm"] == "draft" and st["num_draft_tokens"] > 0
    if same_draft:
        assert st["num_accepted_tokens"] == st["num_draft_tokens"]
    assert not core.proposer.inner.seqs and core.proposer.inner.kv_usage()["in_use"] == 0


@pytest.fixture(scope="module")
def q4_target(tmp_path_factory):
    """A tiny random Llama whose linears hold whole Q4_1 blocks (every in_features a multiple of 32)."""
    return make_tiny_model(tmp_path_factory.mktemp("selfdraft"), seed=3)


def test_int4_self_draft_greedy_equal_to_plain_decoding(q4_target):
    """No draft model: ``--speculative-draft-weight-dtype int4`` drafts with the target itself on Q4_1
    blocks. Greedy outputs equal plain decoding's (the reference: the same target, no speculation),
    guesses are accepted, the draft runner holds int4 weights and its cost hint is its share of
    the bytes read."""
    plain = EngineCore(core_config(q4_target))
    prompts = rand_prompts(7, [5, 19, 2, 33])
    lens = [14, 9, 20, 11]
    refs = [reference(plain, [pr], n)[0] for pr, n in zip(prompts, lens)]
    core = EngineCore(core_config(q4_target, speculative_algorithm="draft", speculative_draft_weight_dtype="int4",
                                  speculative_num_draft_tokens=3, speculative_disable_adaptive=True))
    draft = core.proposer.inner
    assert draft.runner.weight_dtype == "int4" and core.runner.weight_dtype == "bf16"
    assert draft.runner.config.activation_dtype == "int8"  # an int4 draft runs W4A8, as llama.cpp runs Q4_1
    # the cost hint is the ratio of weight bytes a forward reads, by hand: per layer 36,864 linear
    # weights (qkv 128x64, o 64x64, gate_up 256x64, down 64x128) in Q4_1 blocks (20 bytes per 32),
    # the lm_head 256x64 in Q8_0 blocks (34 bytes per 32), embedding and norms float32 in both
    linears, head, rest = 2 * 36864, 256 * 64, 4 * (256 * 64 + 2 * 2 * 64 + 64)
    assert draft.cost_hint == pytest.approx((linears * 20 / 32 + head * 34 / 32 + rest) / (4 * (linears + head) + rest))
    out = {}
    for i, (pr, n) in enumerate(zip(prompts, lens)):
        core.add_request(Request(f"q{i}", pr, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)))
        out[f"q{i}"] = []
    while core.has_work():
        for o in core.step():
            out[o.rid] += o.new_token_ids
        check_ownership(core.scheduler)
        check_draft_kv(draft)
    assert [out[f"q{i}"] for i in range(len(prompts))] == refs
    st = core.stats()["speculative"]
    assert 0 < st["num_accepted_tokens"] <= st["num_draft_tokens"]


def test_self_draft_configuration_errors(q4_target):
    """Start-up errors: an unknown draft weight dtype (config), no draft path and no draft weight
    dtype, and a self-draft at the precision the target already runs at."""
    with pytest.raises(ValueError, match="speculative_draft_weight_dtype must be one of int4, int8, fp8"):
        core_config(q4_target, speculative_algorithm="draft", speculative_draft_weight_dtype="int3")
    with pytest.raises(ValueError, match="speculative_draft_weight_dtype"):
        core_config(q4_target, speculative_algorithm="draft")
    target = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB), context_length=2048,
                             weight_dtype="int4")
    cfg = core_config(q4_target, speculative_algorithm="draft", speculative_draft_weight_dtype="int4")
    with pytest.raises(ValueError, match="already runs with int4 weights.*Q4_1.*--weight-dtype bf16"):
        DraftModelProposer(cfg, target)
    with pytest.raises(ValueError, match="already runs with int8 weights"):
        DraftModelProposer(replace(cfg, speculative_draft_weight_dtype="int8"),
                           SimpleNamespace(**{**vars(target), "weight_dtype": "int8"}))


def test_self_draft_copies_the_targets_kv_instead_of_catching_up(q4_target):
    """A self-draft's catch-up is a copy: after the first verify step of a 33-token prompt the draft
    pool holds, at the request's draft slots, bitwise the K/V the target computed at its slots for
    every prompt token, the draft model computed only its guesses' tokens (one row per guess
    depth), and it reports no catch-up tokens to the cost model."""
    core = EngineCore(core_config(q4_target, speculative_algorithm="draft", speculative_draft_weight_dtype="int4",
                                  speculative_num_draft_tokens=3, speculative_disable_adaptive=True))
    draft = core.proposer.inner
    assert draft.target_pool is core.runner.pool
    prompt = rand_prompts(11, [33])[0]
    core.add_request(Request("c", prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)))
    core.step()  # prefill: the target's K/V of the prompt
    rec = core.scheduler.running[0]
    assert draft.catchup_tokens([rec]) == [0]
    core.step()  # the first propose (3 draft forwards of one token) and its verify
    seq = draft.seqs["c"]
    assert draft.num_tokens == 3 and draft.last_catchup_tokens == 0
    n = len(prompt)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(getattr(draft.pool, name)[:, seq.slots[:n]], getattr(core.runner.pool, name)[:, rec.slots[:n]])
    while core.has_work():
        core.step()
        check_draft_kv(draft)
    assert not draft.seqs and draft.kv_usage()["in_use"] == 0


def test_a_separate_draft_reports_its_prompt_as_catch_up(models, target_core):
    """A draft model of its own computes a new prompt itself: ``catchup_tokens`` counts it before
    the first propose, that propose reports the catch-up forward's tokens, and afterwards (one
    guess accepted, then the target's token) the request needs no catch-up."""
    p = proposer(models[0])
    assert p.target_pool is None
    prompt = rand_prompts(12, [20])[0]
    ref = reference(target_core, [prompt], 6)[0]
    assert p.catchup_tokens([rec("a", prompt)]) == [20]
    assert p.propose([rec("a", prompt)], [3]) == [ref[:3]]
    assert p.last_catchup_tokens == 20 and p.last_catchup_s > 0
    after = prompt + ref[:2]  # one guess accepted, then the target's own token
    assert p.catchup_tokens([rec("a", after)]) == [0]
    assert p.propose([rec("a", after)], [2]) == [ref[2:4]]
    assert p.last_catchup_tokens == 0
    check_draft_kv(p)


def test_fp8_kv_self_draft_reads_the_targets_scales(q4_target, monkeypatch):
    """With an fp8 KV cache the int4 self-draft copies the target's fp8 bytes, so its pool must hold the
    target's static per-head scales: the draft does not calibrate its own (one calibration, the
    target's), its scales equal the target's bitwise, it shares the target's KV (copies, no catch-up),
    the copied rows read back as the target's values, and greedy outputs equal plain decoding over the
    same fp8 cache."""
    from idleless.quant import kv_scales

    fp8 = {"kv_cache_dtype": "fp8_e4m3", "skip_quantization_gate": True}
    plain = EngineCore(core_config(q4_target, **fp8))
    prompts = rand_prompts(13, [33, 6, 21])
    lens = [12, 15, 9]
    refs = [reference(plain, [pr], n)[0] for pr, n in zip(prompts, lens)]
    calls = []
    calibrate = kv_scales.calibrate
    monkeypatch.setattr(kv_scales, "calibrate", lambda *a, **k: calls.append(1) or calibrate(*a, **k))
    core = EngineCore(core_config(q4_target, speculative_algorithm="draft", speculative_draft_weight_dtype="int4",
                                  speculative_num_draft_tokens=3, speculative_disable_adaptive=True, **fp8))
    draft, target = core.proposer.inner, core.runner.pool
    assert len(calls) == 1  # the target's calibration; the draft read its scales
    assert draft.pool.k_scale is None and draft.runner.weight_dtype == "int4"
    assert torch.equal(draft.pool.k_head_scale, target.k_head_scale)
    assert torch.equal(draft.pool.v_head_scale, target.v_head_scale)
    assert torch.equal(target.k_head_scale, plain.runner.pool.k_head_scale)  # the reference's cache too
    assert draft.target_pool is target
    out = {}
    for i, (pr, n) in enumerate(zip(prompts, lens)):
        core.add_request(Request(f"f{i}", pr, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)))
        out[f"f{i}"] = []

    def step():
        for o in core.step():
            out[o.rid] += o.new_token_ids

    step()  # prefill: the target's fp8 K/V of the prompts
    recs = {r.rid: r for r in core.scheduler.running}
    step()  # the first propose copies them into the draft pool
    for rid, r in recs.items():
        seq, n = draft.seqs[rid], len(r.prompt_ids)
        for layer in range(target.k_cache.shape[0]):
            for mine, theirs in zip(draft.pool.layer_kv(layer), target.layer_kv(layer)):
                assert torch.equal(mine.index_select(0, seq.slots[:n]), theirs.index_select(0, r.slots[:n]))
    while core.has_work():
        step()
        check_ownership(core.scheduler)
        check_draft_kv(draft)
    assert [out[f"f{i}"] for i in range(len(prompts))] == refs
    st = core.stats()["speculative"]
    assert 0 < st["num_accepted_tokens"] <= st["num_draft_tokens"]


def test_self_draft_shares_no_kv_with_a_target_of_other_static_scales(q4_target):
    """``_same_layout`` compares static scales too: pools of one shape whose fp8 scales differ in one
    value are not shared (the self-draft would catch up instead of copying mis-scaled bytes)."""
    from idleless.cache.kv_pool import KVPool
    from idleless.spec.draft import _same_layout

    k, v = torch.full((2, 2), 0.01), torch.full((2, 2), 0.02)
    a = KVPool(2, 2, 16, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(k, v))
    assert _same_layout(a, KVPool(2, 2, 16, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(k.clone(), v)))
    v2 = v.clone()
    v2[1, 0] *= 2
    assert not _same_layout(a, KVPool(2, 2, 16, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(k, v2)))
    assert not _same_layout(a, KVPool(2, 2, 16, 8, torch.float32, cache_dtype="int8"))
    assert _same_layout(KVPool(2, 2, 16, 8, torch.float32, cache_dtype="int8"),
                        KVPool(2, 2, 16, 8, torch.float32, cache_dtype="int8"))


def test_adaptive_self_draft_starts_with_measured_draft_steps(q4_target):
    """With the adaptive controller the engine times draft steps of 1-64 requests on the draft runner
    at start-up (idleless.spec.prime): the draft's prior is set, its pool is all free again and its
    tree empty, so the first request's draft state starts clean (check_draft_kv after every step)."""
    from idleless.spec.prime import DRAFT_GRID
    core = EngineCore(core_config(q4_target, speculative_algorithm="draft", speculative_draft_weight_dtype="int4",
                                  speculative_num_draft_tokens=3))
    draft = core.proposer.inner
    assert [x for x, _ in core.proposer.draft_step_cost._prior] == [float(x) for x in DRAFT_GRID]
    assert core.proposer.step_cost.primed
    assert draft.pool.num_free_slots == draft.pool.num_slots and draft.kv.cache.total_size == 0
    core.add_request(Request("p", rand_prompts(12, [21])[0],
                             SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)))
    while core.has_work():
        core.step()
        check_draft_kv(draft)
    assert draft.kv_usage()["in_use"] == 0
