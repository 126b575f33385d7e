"""Speculative decoding end to end on a tiny random Llama: lossless, exact at the stops, KV exact.

The proposer here is an oracle that knows each request's answer without speculation (the reference,
run first on its own engine) and guesses it with deliberate mistakes, so every verify mixes accepted
and rejected guesses. With deterministic numerics (bfloat16, batch-invariant kernels) and
position-keyed sampling, the output with speculation must equal the reference bitwise: greedy and
seeded requests, token ids and logprobs, whatever the batch, chunking or pool size; stop tokens and
max_new_tokens inside an accepted run end the request exactly there; rejected guesses never enter
the radix tree and the KV pool's accounting stays exact.
"""

from __future__ import annotations

import pytest
import torch

from idleless.cache.kv_pool import KVPool
from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.request import FinishReason, Request, SamplingParams
from idleless.spec.adaptive import AdaptiveProposer
from idleless.spec.proposer import Proposer

from conftest import TEST_THREADS, make_tiny_model
from kv_invariants import check_ownership, tree_nodes

VOCAB = 256
TINY_BYTES = KVPool.bytes_per_token(2, 2, 16, torch.bfloat16)


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("spec"), max_position_embeddings=1024)


def _core(model, slots=4096, **kw) -> EngineCore:
    cfg = dict(model=model, dtype="bfloat16", kv_cache_memory=str(slots * TINY_BYTES), num_threads=TEST_THREADS,
               enable_deterministic_inference=True)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


class Oracle(Proposer):
    """Guesses each request's reference answer, wrong wherever (position + seed) % period == 0."""

    name = "oracle"

    def __init__(self, answers: dict[str, list[int]], period: int = 4):
        self.answers = answers
        self.period = period
        self.finished: list[str] = []

    def propose(self, requests, max_tokens):
        out = []
        for r, k in zip(requests, max_tokens):
            ans = self.answers.get(r.rid, [])
            pos = len(r.output_ids)
            guess = list(ans[pos:pos + k])
            out.append([(t + 1) % VOCAB if (pos + j + len(r.rid)) % self.period == 0 else t
                        for j, t in enumerate(guess)])
        return out

    def finish(self, request):
        self.finished.append(request.rid)


def _install(core: EngineCore, proposer: Proposer) -> None:
    core.proposer = core.scheduler.proposer = proposer


def _drive(core: EngineCore, reqs: list[Request]) -> dict:
    for r in reqs:
        core.add_request(r)
    out = {r.rid: {"ids": [], "lps": [], "finish": None} for r in reqs}
    steps = 0
    while core.has_work():
        steps += 1
        assert steps < 5000
        for o in core.step():
            out[o.rid]["ids"].extend(o.new_token_ids)
            out[o.rid]["lps"].extend(o.new_logprobs or [])
            if o.finished:
                out[o.rid]["finish"] = o.finish_reason
        check_ownership(core.scheduler)
    return out


def _requests():
    """Greedy and seeded-sampled requests of mixed prompt and answer lengths, two sharing a prefix."""
    shared = _ids(90, 1)
    specs = [("g0", _ids(40, 2), 0.0, None, 30), ("g1", shared + _ids(10, 3), 0.0, None, 25),
             ("s0", shared + _ids(30, 4), 0.9, 11, 28), ("s1", _ids(200, 5), 1.0, 12, 20),
             ("g2", _ids(7, 6), 0.0, None, 33), ("s2", _ids(60, 7), 0.7, 13, 26)]
    return [Request(rid, ids, SamplingParams(temperature=t, seed=seed, max_new_tokens=n, ignore_eos=True,
                                             logprobs=True))
            for rid, ids, t, seed, n in specs]


@pytest.fixture(scope="module")
def reference(spec_model):
    out = _drive(_core(spec_model), _requests())
    assert all(len(v["ids"]) == r.params.max_new_tokens for r, v in zip(_requests(), out.values()))
    return out


@pytest.mark.parametrize("chunk,slots,draft", [(2048, 4096, 5), (16, 4096, 3), (2048, 400, 6)])
def test_speculation_changes_no_token_and_no_logprob(spec_model, reference, chunk, slots, draft):
    core = _core(spec_model, slots=slots, chunked_prefill_size=chunk)
    oracle = Oracle({rid: v["ids"] for rid, v in reference.items()})
    ctl = AdaptiveProposer(oracle, draft, adaptive=False)
    _install(core, ctl)
    out = _drive(core, _requests())
    for rid, ref in reference.items():
        assert out[rid]["ids"] == ref["ids"], rid
        assert out[rid]["lps"] == ref["lps"], rid
    st = ctl.stats()
    assert st["num_accepted_tokens"] > 0 and st["num_accepted_tokens"] < st["num_draft_tokens"]  # both kinds
    assert sorted(oracle.finished) == sorted(reference)
    # every sequence in the radix tree is a prefix of a real request's prompt + answer: no rejected guess
    truth = [r.prompt_ids + reference[r.rid]["ids"] for r in _requests()]
    for node in tree_nodes(core.scheduler.cache):
        path, n = [], node
        while n is not None and n.parent is not None:
            path[:0] = list(n.key)
            n = n.parent
        assert any(t[:len(path)] == path for t in truth)
    kv = core.scheduler.kv_usage()
    assert kv["in_use"] == 0 and kv["free"] + kv["cached"] == kv["total"]
    if slots < 1000:
        assert core.stats()["num_retractions"] > 0  # the tiny pool retracted requests mid-speculation


def test_a_stop_token_or_the_length_limit_inside_an_accepted_run_ends_the_request_there(spec_model, reference):
    ref = reference["g0"]["ids"]
    i = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    prompt = _requests()[0].prompt_ids
    reqs = [Request("stop", prompt, SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[ref[i]])),
            Request("len", prompt, SamplingParams(temperature=0.0, max_new_tokens=i - 1, ignore_eos=True))]
    core = _core(spec_model)
    # a perfect oracle guessing 8 at a time: the stop token and the limit fall inside accepted runs
    _install(core, AdaptiveProposer(Oracle({"stop": ref, "len": ref}, period=10**9), 8, adaptive=False))
    out = _drive(core, reqs)
    assert out["stop"]["ids"] == ref[:i + 1] and out["stop"]["finish"] == FinishReason.STOP
    assert out["len"]["ids"] == ref[:i - 1] and out["len"]["finish"] == FinishReason.LENGTH
    assert core.stats()["generation_tokens"] == 2 * i  # nothing after the stop is counted


def test_verify_and_draft_time_have_their_own_buckets(spec_model, reference):
    core = _core(spec_model)
    _install(core, AdaptiveProposer(Oracle({r: v["ids"] for r, v in reference.items()}), 4, adaptive=False))
    _drive(core, _requests()[:2])
    t = core.stats()["time"]
    assert t["verify"] > 0 and t["draft"] > 0
    assert t["busy_fraction"] > 0
    spec = core.stats()["speculative"]
    assert spec["algorithm"] == "oracle" and spec["num_drafts"] > 0


def test_bad_speculative_configuration_is_refused_at_start_up(spec_model):
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="draft_model_path"):
        EngineConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="does not exist"):  # before any model is loaded
        EngineConfig(speculative_algorithm="draft", speculative_draft_model_path="/nonexistent/draft")
    with pytest.raises(ValueError, match="context length"):
        _core(spec_model, speculative_algorithm="ngram", speculative_num_draft_tokens=4096)


def test_speculative_flags_without_an_algorithm_are_named_in_a_warning(caplog):
    with caplog.at_level("WARNING", logger="idleless"):
        EngineConfig(speculative_num_draft_tokens=3, speculative_ngram_max_match_window_size=4)
    (rec,) = [r for r in caplog.records if "speculative" in r.getMessage()]
    assert "--speculative-num-draft-tokens" in rec.getMessage() and "stays off" in rec.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="idleless"):
        EngineConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
        EngineConfig()
    assert not [r for r in caplog.records if "speculative" in r.getMessage()]


# --------------------------------------------------------------------------------------------------
# the output distribution: a scripted target with known distributions, drafts from another one
# --------------------------------------------------------------------------------------------------
V_SMALL = 5
TARGET_P = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2],
                         [0.7, 0.1, 0.1, 0.05, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1]], dtype=torch.float64)
DRAFT_Q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3], dtype=torch.float64)  # far from every row of TARGET_P


class DistributionRunner:
    """Target model: the next token after ``t`` is drawn from TARGET_P[t] by the real sampler (one
    row per sampled position, the request's seed, temperature 1)."""

    def __init__(self, num_slots=1 << 14):
        import types
        self.pool = KVPool(1, 1, 4, num_slots, torch.float32, "cpu", 1)
        self.model_config = types.SimpleNamespace(vocab_size=V_SMALL, eos_token_ids=[])
        self.context_length = 64

    def execute(self, plan):
        from dataclasses import replace

        from idleless.engine.plan import StepResult
        from idleless.model.sampler import sample
        logits, rows = [], []
        for r in plan.requests:
            for j in range(r.num_sampled):
                logits.append(TARGET_P[r.token_ids[r.num_known - 1 + j]].log().float())
                rows.append(replace(r.sampling, output_ids=list(r.sampling.output_ids) + r.proposed[:j]))
        ids = sample(torch.stack(logits), rows, set()).next_ids if rows else []
        out, i = [], 0
        for r in plan.requests:
            out.append(ids[i:i + r.num_sampled])
            i += r.num_sampled
        return StepResult(out, [[None] * len(x) for x in out], [[None] * len(x) for x in out])


class RandomDraft(Proposer):
    """Guesses drawn i.i.d. from DRAFT_Q (its own generator: independent of the target's draws)."""

    name = "random"

    def __init__(self):
        self.g = torch.Generator().manual_seed(1234)

    def propose(self, requests, max_tokens):
        return [torch.multinomial(DRAFT_Q, k, replacement=True, generator=self.g).tolist() if k else []
                for k in max_tokens]


def test_output_distribution_is_the_targets_whatever_the_drafts():
    """3,000 seeded requests of 3 tokens after the prompt [0], with drafts from DRAFT_Q (acceptance
    well below 1): the joint of the first two tokens matches TARGET_P[0][a] * TARGET_P[a][b] by a
    chi-square test (p > 0.001), and every request equals its run without speculation (position-keyed draws)."""
    def run_all(spec: bool):
        core = EngineCore(EngineConfig(kv_cache_memory="1MiB", max_running_requests=256),
                          runner=DistributionRunner())
        if spec:
            _install(core, AdaptiveProposer(RandomDraft(), 3, adaptive=False))
        reqs = [Request(f"r{i}", [0], SamplingParams(temperature=1.0, seed=i, max_new_tokens=3))
                for i in range(3000)]
        return _drive(core, reqs), core

    on, core = run_all(True)
    st = core.stats()["speculative"]
    assert 0.1 < st["acceptance_rate"] < 0.6 and st["num_drafts"] > 1000
    off, _ = run_all(False)
    assert all(on[r]["ids"] == off[r]["ids"] for r in on)
    counts = torch.zeros(V_SMALL * V_SMALL)
    for v in on.values():
        counts[v["ids"][0] * V_SMALL + v["ids"][1]] += 1
    expected = (TARGET_P[0].unsqueeze(1) * TARGET_P).flatten() * 3000
    keep = expected > 5  # the chi-square approximation needs enough expected counts per cell
    obs, exp = counts[keep].double(), expected[keep]
    exp = exp * obs.sum() / exp.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    # the 0.999 quantile of chi-square(df), Wilson-Hilferty: df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, z = 3.09
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
    assert stat < critical, (stat, critical)
