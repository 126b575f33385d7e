"""Prompt logprobs in the engine (issue 11, part 2): ``SamplingParams(prompt_logprobs=k,
prompt_logprobs_start=s)`` through plan -> execute -> commit.

* The plumbing, against a scripted model whose "logprob" of a token is a pure function of the tokens
  before it (hand-computable): every entry arrives once, in order, for any chunking, page size, cache
  hit, retraction (mid-prefill included) and batch, and the cache hit a request attaches stops before
  its first row still needed.
* The values, on a tiny random Llama: transformers' float64 log-softmax of the same sequence
  (allclose, tolerance stated); in the deterministic mode the logprob the engine reports when it
  generates a token greedily equals, bitwise, the prompt logprob of that token after the same prefix
  (float32 and bfloat16), and cache hits and chunked prefill change no bit.
* The offline Engine's ``CompletionOutput.prompt_logprobs`` (vLLM's list: first entry None) and bad
  values refused before anything runs.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_THREADS, make_tiny_model
from hf_ref import load_hf
from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.plan import StepPlan, StepResult
from idleless.engine.request import PromptLogprob, Request, RequestError, SamplingParams
from kv_invariants import check_ownership
from test_step_plan import ScriptedRunner, expected



# ============================================================================ scripted model


def score(prefix: list[int], tok: int) -> float:
    """The scripted model's logprob of ``tok`` after ``prefix``: a pure, hand-computable function."""
    return -((sum((i + 1) * t for i, t in enumerate(prefix)) * 31 + tok) % 997) / 7.0


def want_entries(prompt: list[int], start: int, k: int) -> list:
    """The entries a request must get: [None] for position 0 when start == 0, then one per position."""
    head = [None] if start == 0 else []
    return head + [(prompt[i], score(prompt[:i], prompt[i]), [(prompt[i], score(prompt[:i], prompt[i]))][:k])
                   for i in range(max(start, 1), len(prompt))]


class ScoringRunner(ScriptedRunner):
    """ScriptedRunner + prompt logprobs by ``score``. Each row's prefix is read back from the KV the
    plan says exists (cached or written), so a row computed over a wrong prefix gives a wrong entry.
    Records the (start, cached prefix) of every scored request it executes."""

    def execute(self, plan: StepPlan) -> StepResult:
        res = super().execute(plan)
        out = []
        for r in plan.requests:
            p = r.prompt_logprobs
            if p is None:
                out.append([])
                continue
            seq = [self.kv_tokens[s] for s in r.slot_table.tolist()]
            entries = []
            for j, t in enumerate(p.targets):
                prefix = seq[:r.start + p.first + j + 1]
                v = score(prefix, t)
                entries.append(PromptLogprob(t, v, 1, [(t, v)][:p.num_top]))
            out.append(entries)
        res.prompt_logprobs = out
        return res


def scripted_core(num_slots=4096, page_size=1, **kw) -> EngineCore:
    cfg = EngineConfig(kv_cache_memory="1MiB", page_size=page_size, **kw)
    return EngineCore(cfg, runner=ScoringRunner(num_slots, page_size))


def drive(core: EngineCore, reqs, max_steps: int = 5000) -> dict:
    """Run to completion; per rid: tokens, prompt_logprobs (the one output that carries them), and
    how many outputs carried them."""
    for r in reqs:
        core.add_request(r)
    res: dict = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            d = res.setdefault(o.rid, {"ids": [], "lps": [], "plp": None, "carried": 0, "cached": 0})
            d["ids"] += o.new_token_ids
            d["lps"] += o.new_logprobs or []
            d["cached"] = o.cached_tokens
            if o.prompt_logprobs is not None:
                d["plp"], d["carried"] = o.prompt_logprobs, d["carried"] + 1
            if o.finished:
                d["finish"] = o.finish_reason.value
        check_ownership(core.scheduler)
    assert not core.has_work()
    return res


def as_tuples(entries):
    return [None if e is None else (e.token_id, e.logprob, e.top) for e in entries]


PROMPT = [10 + (i * 7) % 40 for i in range(37)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [0, 5])
def test_scripted_entries_arrive_once_in_order_with_hits_and_chunks(page_size, chunk):
    """Requests sharing a prefix, one after another (each one's prefix cached by those before) and
    then all at once, with mixed starts and k; every one gets exactly its hand-computed entries, in
    one output, and its cached prefix stops before its first row (position start - 1)."""
    cases = [(0, 0), (1, 2), (9, 1), (20, 0), (36, 3), (37, 1), (50, 0)]  # (start, k)
    core = scripted_core(page_size=page_size, chunked_prefill_size=chunk)
    warm = drive(core, [Request("warm", PROMPT, SamplingParams(temperature=0, max_new_tokens=4))])
    assert warm["warm"]["ids"] == expected(PROMPT, 4)
    for rnd in ("alone", "batch"):
        reqs = [Request(f"{rnd}{i}", PROMPT + [3] * i, SamplingParams(temperature=0, max_new_tokens=3,
                                                                      prompt_logprobs=k, prompt_logprobs_start=s))
                for i, (s, k) in enumerate(cases)]
        res = {}
        if rnd == "alone":
            for r in reqs:
                res.update(drive(core, [r]))
        else:
            res = drive(core, reqs)
        for i, (s, k) in enumerate(cases):
            d, prompt = res[f"{rnd}{i}"], PROMPT + [3] * i
            assert d["carried"] == 1
            assert as_tuples(d["plp"]) == want_entries(prompt, s, k), (rnd, i)
            assert d["ids"] == expected(prompt, 3)
            if s < len(prompt) - 1:  # rows wanted: nothing from row s - 1 on may come from the cache
                assert d["cached"] <= max(s, 1) - 1, (rnd, i)
                if rnd == "alone":  # the warm-up cached PROMPT: the hit is the cap, page-aligned
                    assert d["cached"] == min(max(s, 1) - 1, len(PROMPT)) // page_size * page_size, i


def test_scripted_retraction_mid_prefill_keeps_the_entries_already_in():
    """A tiny pool retracts requests while their prompts are half prefilled in chunks; re-admitted,
    each computes only the rows still missing (its cached prefix may cover the ones it has) and the
    entries still equal the hand-computed ones, once each."""
    prompts = [PROMPT + [i] * 30 for i in range(6)] + [PROMPT + [0] * 30]
    core = scripted_core(num_slots=150, max_running_requests=8, chunked_prefill_size=6)
    mid_prefill = []
    retract = core.scheduler._retract

    def spy(rec):
        if rec.prompt_logit_rows and len(rec.prompt_logprobs) > 1:
            mid_prefill.append(rec.rid)
        retract(rec)

    core.scheduler._retract = spy
    res = drive(core, [Request(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=20, prompt_logprobs=1))
                       for i, p in enumerate(prompts)])
    assert mid_prefill, "the tiny pool should retract a request in the middle of its prefill"
    for i, p in enumerate(prompts):
        d = res[f"r{i}"]
        assert d["carried"] == 1 and as_tuples(d["plp"]) == want_entries(p, 0, 1), i
        assert d["ids"] == expected(p, 20)


def test_scripted_prefill_only_and_one_token_prompts():
    core = scripted_core(chunked_prefill_size=4)
    res = drive(core, [Request("score", PROMPT, SamplingParams(max_new_tokens=0, prompt_logprobs=2)),
                       Request("one", [7], SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=0)),
                       Request("off", PROMPT, SamplingParams(max_new_tokens=2, temperature=0))])
    assert res["score"]["ids"] == [] and res["score"]["finish"] == "length"
    assert as_tuples(res["score"]["plp"]) == want_entries(PROMPT, 0, 2)
    assert res["one"]["plp"] == [None] and res["one"]["ids"] == expected([7], 2)
    assert res["off"]["plp"] is None and res["off"]["carried"] == 0


@pytest.mark.parametrize("bad", [dict(prompt_logprobs=21), dict(prompt_logprobs=-1), dict(prompt_logprobs=True),
                                 dict(prompt_logprobs=1.5), dict(prompt_logprobs=1, prompt_logprobs_start=-2)])
def test_bad_prompt_logprobs_are_refused_and_the_engine_runs_on(bad):
    core = scripted_core()
    with pytest.raises(RequestError) as e:
        core.add_request(Request("bad", PROMPT, SamplingParams(max_new_tokens=2, **bad)))
    assert e.value.param in ("prompt_logprobs", "prompt_logprobs_start")
    assert not core.has_work()
    res = drive(core, [Request("ok", PROMPT, SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=20))])
    assert as_tuples(res["ok"]["plp"]) == want_entries(PROMPT, 0, 20)


# ============================================================================ tiny Llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-plp"), arch="llama")


def tiny_core(path: str, **kw) -> EngineCore:
    """An engine in the deterministic mode (batch-, chunk- and cache-invariant kernels, issue 11 part
    1): a logits row is the same bits in a prefill of any length and in a decode, so the comparisons
    below are exact."""
    cfg = dict(model=path, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS,
               enable_deterministic_inference=True)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def rand_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logprobs_equal_transformers_float64(tiny_dir):
    """Several requests in one batch (mixed starts, k, lengths), the engine in float32 vs transformers'
    float64 log-softmax of the same sequences: logprobs within 1e-5 absolute (float32 rounding through
    2 layers: observed ~1e-6), ranks and top-k ids equal (the model's weights are well conditioned:
    no near-ties)."""
    hf = load_hf(tiny_dir).double()
    core = tiny_core(tiny_dir, chunked_prefill_size=16)
    cases = [(rand_ids(1, 40), 0, 3), (rand_ids(2, 23), 5, 0), (rand_ids(3, 61), 60, 20), (rand_ids(4, 1), 0, 2),
             (rand_ids(5, 30), 0, 1)]
    res = drive(core, [Request(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=k,
                                                           prompt_logprobs_start=s))
                       for i, (p, s, k) in enumerate(cases)])
    for i, (p, s, k) in enumerate(cases):
        got = res[f"r{i}"]["plp"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
        assert len(got) == len(p) - max(s, 1) + (s == 0)
        if s == 0:
            assert got[0] is None
        for e, pos in zip(got[int(s == 0):], range(max(s, 1), len(p))):
            row = ref[pos - 1]
            assert e.token_id == p[pos]
            assert abs(e.logprob - float(row[p[pos]])) < 1e-5, (i, pos)
            assert e.rank == 1 + int((row > row[p[pos]]).sum())
            top = row.topk(k) if k else None
            assert [t for t, _ in e.top] == (top.indices.tolist() if k else [])
            if k:
                assert max(abs(a - b) for (_, a), b in zip(e.top, top.values.tolist())) < 1e-5


@pytest.mark.parametrize("dtype,eager", [("float32", False), ("bfloat16", False), ("bfloat16", True)],
                         ids=["float32", "bfloat16", "bfloat16-eager"])
def test_prompt_logprobs_equal_the_generated_tokens_logprobs(tiny_dir, dtype, eager):
    """Generate greedily with logprobs, then score prompt + continuation: the prompt logprob of each
    generated token equals, bitwise, the logprob the engine reported when it generated it (the
    deterministic mode: a position's logits row does not depend on how it was computed), in float32
    and bfloat16, with the C kernels and without."""
    core = tiny_core(tiny_dir, dtype=dtype, disable_cpu_kernels=eager)
    prompt = rand_ids(7, 29)
    gen = drive(core, [Request("gen", prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True,
                                                              logprobs=True))])["gen"]
    core.flush_cache()
    for start in (0, len(prompt)):
        scored = drive(core, [Request(f"s{start}", prompt + gen["ids"],
                                      SamplingParams(max_new_tokens=0, prompt_logprobs=0,
                                                     prompt_logprobs_start=start))])[f"s{start}"]
        entries = scored["plp"][-len(gen["ids"]):]
        assert [e.token_id for e in entries] == gen["ids"]
        assert all(e.rank == 1 for e in entries)  # greedy tokens are the most likely
        assert [e.logprob for e in entries] == gen["lps"], f"start {start}"


def test_cache_hits_and_chunked_prefill_change_nothing(tiny_dir):
    """The same scoring request alone on a fresh engine, again (a cache hit up to its cap), after
    another request cached a longer sequence, and with chunked prefill of 7 tokens on pages of 4."""
    prompt = rand_ids(11, 45)
    params = [SamplingParams(temperature=0, max_new_tokens=3, prompt_logprobs=2, prompt_logprobs_start=s)
              for s in (0, 1, 20, 44)]

    def score_all(core, tag):
        return {s.prompt_logprobs_start: drive(core, [Request(f"{tag}{i}", prompt, s)])[f"{tag}{i}"]
                for i, s in enumerate(params)}

    core = tiny_core(tiny_dir)
    ref = score_all(core, "fresh")  # the first warms the cache for the others
    again = score_all(core, "again")
    drive(core, [Request("longer", prompt + [5] * 9, SamplingParams(temperature=0, max_new_tokens=4))])
    after = score_all(core, "after")
    for s, d in again.items():
        assert d["cached"] == max(s, 1) - 1  # page size 1: the hit is exactly the cap
    chunked = score_all(tiny_core(tiny_dir, chunked_prefill_size=7, page_size=4), "chunked")
    for s in ref:
        for name, other in (("again", again), ("after", after), ("chunked", chunked)):
            assert other[s]["ids"] == ref[s]["ids"], (name, s)
            assert other[s]["plp"] == ref[s]["plp"], f"{name} start {s}"
    kv = core.scheduler.kv_usage()
    assert kv["in_use"] == 0 and kv["free"] + kv["cached"] == kv["total"]


# ============================================================================ offline Engine


def test_offline_engine_returns_vllm_shaped_prompt_logprobs(smollm2_engine):
    """``Engine.generate`` with prompt_logprobs: one entry per prompt token, the first None, each the
    prompt token with its rank and top k; max_new_tokens 0 scores without generating."""
    e = smollm2_engine
    text = "The capital of France is Paris."
    out = e.generate(text, SamplingParams(max_new_tokens=0, prompt_logprobs=2), use_tqdm=False)
    ids = out.prompt_token_ids
    assert out.token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for tok, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        assert entry.token_id == tok and entry.logprob <= 0 and entry.rank >= 1 and len(entry.top) == 2
        assert entry.top[0][1] >= entry.top[1][1] >= entry.logprob or entry.rank <= 2
    # " Paris" after "The capital of France is" is the model's favourite
    paris = out.prompt_logprobs[ids.index(e.tokenizer.encode(" Paris")[-1])]
    assert paris.rank == 1
    gen = e.generate(text, SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=0), use_tqdm=False)
    assert [x.token_id for x in gen.prompt_logprobs[1:]] == ids[1:] and len(gen.token_ids) == 2
    with pytest.raises(RequestError):
        e.generate(text, SamplingParams(prompt_logprobs=25), use_tqdm=False)
