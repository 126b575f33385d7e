"""Engine core end to end: scheduler + radix cache + KV pool + model + sampler + text layer.

Two kinds of models:
* tiny random Llamas (``make_tiny_model``) driven at the ``EngineCore`` level with token ids: radix
  cache hits hand-computed from the token ids, cache on vs off, eviction under a tiny pool,
  retraction, aborts and bad requests mid-run, seeds. After every step the exact slot ownership is
  checked (every KV page is free, in the radix tree, or owned by exactly one running request).
* the bundled SmolLM2-135M-Instruct through the ONE session ``Engine`` (``smollm2_engine``, float32):
  greedy output against transformers' (see hf_ref.check_greedy), batched == alone, radix on vs
  off, seeds, stop strings, UTF-8 streaming, and bad requests while a stream is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from dataclasses import dataclass

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from hf_ref import check_greedy, hf_logits, load_hf

from idleless.cache.radix_cache import NoPrefixCache
from kv_invariants import check_ownership, tree_nodes
from idleless.config import EngineConfig, available_memory_bytes, parse_memory
from idleless.engine.core import EngineCore
from idleless.engine.engine import Engine
from idleless.engine.request import Request, RequestError, SamplingParams

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V x 2 layers x 2 KV heads x head_dim 16 x float32
SMALL_POOL = str(600 * TINY_BYTES_PER_TOKEN)  # ~600 tokens: forces eviction and retraction


# ============================================================================ helpers


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assert_idle_and_flush(sched) -> None:
    """Nothing runs: free + cached == total; after a cache flush the whole pool is free."""
    assert not sched.running and not sched.waiting
    check_ownership(sched)
    kv = sched.kv_usage()
    assert kv["in_use"] == 0 and kv["free"] + kv["cached"] == kv["total"]
    assert sched.flush_cache()
    kv = sched.kv_usage()
    assert kv["free"] == kv["total"] and kv["cached"] == 0


@dataclass
class Result:
    tokens: list[int]
    finish: str | None = None
    cached: int = 0
    matched_stop: object = None


def run_core(core: EngineCore, reqs: list[Request], per_step: int | None = None, on_step=None,
             arrivals: list[int] | None = None, max_steps: int = 5000) -> dict[str, Result]:
    """Submit ``reqs`` (all at once, ``per_step`` per step, or request i at step ``arrivals[i]``) and
    step until idle, checking slot ownership after every step. ``on_step(step, core, results)`` runs
    before each step (it may abort or add requests)."""
    res: dict[str, Result] = {}
    if arrivals is None:
        per = len(reqs) if per_step is None else per_step
        arrivals = [i // per for i in range(len(reqs))]
    queue = sorted(zip(arrivals, range(len(reqs))))
    step = 0
    while queue or core.has_work():
        while queue and queue[0][0] <= step:
            r = reqs[queue.pop(0)[1]]
            core.add_request(r)
            res[r.rid] = Result([])
        if on_step is not None:
            on_step(step, core, res)
        for o in core.step():
            res.setdefault(o.rid, Result([]))
            res[o.rid].tokens += o.new_token_ids
            res[o.rid].cached = o.cached_tokens
            if o.finished:
                res[o.rid].finish = o.finish_reason.value if hasattr(o.finish_reason, "value") else o.finish_reason
                res[o.rid].matched_stop = o.matched_stop
        check_ownership(core.scheduler)
        step += 1
        assert step < max_steps, "engine made no progress"
    return res


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kw)


def rand_ids(g: torch.Generator, n: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ============================================================================ tiny models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama")


def tiny_core(path: str, **kw) -> EngineCore:
    cfg = dict(model=path, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_tokens_equal_hand_computed_prefix_lengths(tiny_dir, page_size):
    """Requests sent one after another: each one's cached tokens == the longest common prefix of
    its prompt with any earlier request's sequence as the tree holds it (prompt + output minus the
    last token, which never had KV, cut to whole pages), capped at prompt_len - 1 (one token must be
    computed to sample from), cut to whole pages."""
    core = tiny_core(tiny_dir, page_size=page_size)
    g = torch.Generator().manual_seed(11)
    base = rand_ids(g, 60)
    seqs: list[list[int]] = []  # full sequences of finished requests
    specs = [
        lambda: base[:30],
        lambda: base[:45],  # extends request 0's prompt
        lambda: seqs[0][:35] + rand_ids(g, 10),  # runs into request 0's *output*
        lambda: base[:45],  # the same prompt again: all but the last token cached
        lambda: base[:10],  # a prefix of earlier prompts
        lambda: [7],
        lambda: rand_ids(g, 20),
        lambda: seqs[2] + rand_ids(g, 3),  # the whole of request 2, its last token included
        lambda: seqs[2][:-1],  # exactly the tree's copy of request 2
    ]
    ps = page_size
    for i, spec in enumerate(specs):
        prompt = spec()
        held = [s[: (len(s) - 1) // ps * ps] for s in seqs]  # what the tree holds of each
        best = max((lcp(prompt, h) for h in held), default=0)
        expected = min(best, len(prompt) - 1) // ps * ps
        out = run_core(core, [Request(f"r{i}", prompt, greedy(8))])[f"r{i}"]
        assert out.cached == expected, (i, out.cached, expected)
        assert len(out.tokens) == 8
        seqs.append(prompt + out.tokens)
    st = core.scheduler.stats
    assert st.cached_tokens > 0 and st.prompt_tokens == sum(len(s) - 8 for s in seqs)
    assert_idle_and_flush(core.scheduler)


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_on_off_same_outputs_on_shared_prefix_batch(tiny_dir, page_size):
    g = torch.Generator().manual_seed(2)
    shared = rand_ids(g, 40)
    firsts = [3 + i for i in range(8)]  # distinct first suffix tokens: pairwise LCP is exactly 40
    prompts = [shared + [firsts[i]] + rand_ids(g, 3 * i) for i in range(8)]
    outs = {}
    for radix in (True, False):
        core = tiny_core(tiny_dir, page_size=page_size, disable_radix_cache=not radix)
        res = run_core(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)])
        outs[radix] = res
        assert_idle_and_flush(core.scheduler)
    assert [outs[True][f"r{i}"].tokens for i in range(8)] == [outs[False][f"r{i}"].tokens for i in range(8)]
    # on: the first request computes the shared 40 tokens, the rest wait one step and hit them
    assert [outs[True][f"r{i}"].cached for i in range(8)] == [0] + [40] * 7
    assert all(outs[False][f"r{i}"].cached == 0 for i in range(8))


@pytest.mark.parametrize("page_size", [1, 4])
def test_batch_of_16_mixed_lengths_equals_alone_tiny(tiny_dir, page_size):
    g = torch.Generator().manual_seed(4)
    lens = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 7, 40, 16, 100, 4, 64]
    prompts = [rand_ids(g, n) for n in lens]
    params = [greedy(3 + i % 7) for i in range(16)]
    kw = dict(page_size=page_size, chunked_prefill_size=32, max_prefill_tokens=96)
    core = tiny_core(tiny_dir, **kw)
    batch = run_core(core, [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    assert_idle_and_flush(core.scheduler)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = run_core(tiny_core(tiny_dir, **kw), [Request("x", p, sp)])["x"]
        assert batch[f"r{i}"].tokens == alone.tokens and len(alone.tokens) == sp.max_new_tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_eviction_under_a_tiny_pool(tiny_dir, page_size):
    """~600 slots, 10 requests of ~120 tokens arriving two per step: the tree must give back slots."""
    g = torch.Generator().manual_seed(5)
    prompts = [rand_ids(g, 80 + 7 * i) for i in range(10)]
    reqs = lambda: [Request(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)]  # noqa: E731
    big = run_core(tiny_core(tiny_dir, page_size=page_size), reqs(), per_step=2)
    core = tiny_core(tiny_dir, page_size=page_size, kv_cache_memory=SMALL_POOL)
    assert core.scheduler.pool.num_slots == 600
    small = run_core(core, reqs(), per_step=2)
    assert core.scheduler.cache.num_evicted > 0
    assert {k: v.tokens for k, v in small.items()} == {k: v.tokens for k, v in big.items()}
    assert_idle_and_flush(core.scheduler)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_does_not_change_outputs(tiny_dir, page_size):
    """8 requests that need ~800 slots in a 600-slot pool: decode runs dry, requests are retracted
    and resumed from the tree; greedy and seeded sampled outputs equal those of a big pool."""
    g = torch.Generator().manual_seed(6)
    prompts = [rand_ids(g, 30 + 3 * i) for i in range(8)]

    def reqs():
        out = []
        for i, p in enumerate(prompts):
            sp = greedy(60) if i % 3 else SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i,
                                                         max_new_tokens=60, ignore_eos=True)
            out.append(Request(f"r{i}", p, sp))
        return out

    big = run_core(tiny_core(tiny_dir, page_size=page_size), reqs())
    # chunks of 10 tokens (not a multiple of the page size): some requests are retracted mid-prefill
    core = tiny_core(tiny_dir, page_size=page_size, kv_cache_memory=SMALL_POOL, chunked_prefill_size=10,
                     max_prefill_tokens=48)
    small = run_core(core, reqs())
    assert core.scheduler.stats.num_retractions > 0
    for k in big:
        assert small[k].tokens == big[k].tokens and len(small[k].tokens) == 60, k
        assert small[k].finish == "length"
    assert_idle_and_flush(core.scheduler)


def test_abort_and_bad_requests_mid_run(tiny_dir):
    """Aborts (running and waiting) and rejected requests during a run under a tiny pool: the others'
    outputs are unchanged, the aborted ones end with ``abort``, no slot leaks at any step."""
    g = torch.Generator().manual_seed(7)
    prompts = [rand_ids(g, 40 + 10 * i) for i in range(6)]
    reqs = lambda: [Request(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)]  # noqa: E731
    ref = run_core(tiny_core(tiny_dir), reqs())
    core = tiny_core(tiny_dir, kv_cache_memory=SMALL_POOL, max_running_requests=4)
    limit = min(core.scheduler.context_length, core.scheduler.pool.num_slots)
    bad = [
        (Request("e1", [], greedy(4)), "invalid_prompt"),
        (Request("e2", [5, 300, 6], greedy(4)), "invalid_prompt"),  # outside the vocabulary
        (Request("e3", [5] * limit, greedy(4)), "context_length_exceeded"),
        (Request("e4", [5] * 10, greedy(limit)), "context_length_exceeded"),
        (Request("e5", [5] * 10, SamplingParams(temperature=-1.0)), "invalid_value"),
        (Request("e6", [5] * 10, SamplingParams(top_p=float("nan"))), "invalid_value"),
    ]

    def on_step(step, core, res):
        sched = core.scheduler
        if step == 3:
            running = [r.rid for r in sched.running]
            waiting = [r.rid for r in sched.waiting]
            assert len(running) == 4 and waiting
            for rid in (running[0], running[-1], waiting[0]):
                assert core.abort(rid)
                res[rid].aborted = True
            assert not core.abort("no-such-request")
            check_ownership(sched)
        if step in (2, 5):
            before = (len(sched.waiting), len(sched.running))
            for req, code in bad:
                with pytest.raises(RequestError) as ei:
                    core.add_request(req)
                assert ei.value.code == code, (req.rid, ei.value.code)
            assert (len(sched.waiting), len(sched.running)) == before

    res = run_core(core, reqs(), on_step=on_step)
    aborted = [k for k, v in res.items() if getattr(v, "aborted", False)]
    assert len(aborted) == 3
    for k, v in res.items():
        if k in aborted:
            assert v.finish == "abort"
        else:
            assert v.tokens == ref[k].tokens and v.finish == "length", k
    assert core.scheduler.stats.num_aborted == 3
    assert_idle_and_flush(core.scheduler)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_under_memory_pressure(tiny_dir, seed):
    """Random configurations (page size, chunk size, step budget, policy, eviction policy, pool of
    300-800 tokens) and random workloads (shared stems, arrivals over time, greedy and seeded
    sampling, aborts): slot ownership holds after every step, nothing stalls, and every request that
    was not aborted produces exactly what it produces on a big pool with default settings."""
    import random

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pool_tokens = rng.choice([300, 500, 800])
    cfg = dict(page_size=rng.choice([1, 4]), chunked_prefill_size=rng.choice([7, 16, 64, 2048]),
               max_prefill_tokens=rng.choice([24, 64, 512]), schedule_policy=rng.choice(["fcfs", "lpm", "dfs-weight"]),
               radix_eviction_policy=rng.choice(["lru", "gdsf"]), max_running_requests=rng.choice([3, 8, 64]),
               kv_cache_memory=str(pool_tokens * TINY_BYTES_PER_TOKEN))
    stems = [rand_ids(g, rng.randint(10, 80)) for _ in range(3)]
    prompts, params, arrivals, aborts = [], [], [], {}
    for i in range(rng.randint(10, 18)):
        stem = rng.choice(stems)
        prompts.append(stem[: rng.randint(0, len(stem))] + rand_ids(g, rng.randint(1, 40)))
        n = rng.randint(1, 50)
        params.append(greedy(n) if rng.random() < 0.6 else
                      SamplingParams(temperature=1.0, top_k=20, seed=rng.randint(0, 99), max_new_tokens=n, ignore_eos=True))
        arrivals.append(rng.randint(0, 25))
        if rng.random() < 0.2:
            aborts.setdefault(arrivals[-1] + rng.randint(0, 15), []).append(f"r{i}")

    def reqs():
        return [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    ref = run_core(tiny_core(tiny_dir), reqs())
    core = tiny_core(tiny_dir, **cfg)

    def on_step(step, core, res):
        for rid in aborts.get(step, []):
            if rid in res and res[rid].finish is None:
                assert core.abort(rid)
                res[rid].aborted = True

    res = run_core(core, reqs(), arrivals=arrivals, on_step=on_step)
    for k, v in res.items():
        if getattr(v, "aborted", False):
            assert v.finish == "abort" and ref[k].tokens[: len(v.tokens)] == v.tokens, k
        else:
            assert v.tokens == ref[k].tokens and v.finish == "length", (k, cfg)
    assert_idle_and_flush(core.scheduler)


def test_flush_refused_while_requests_run(tiny_dir):
    core = tiny_core(tiny_dir)
    core.add_request(Request("a", [5] * 20, greedy(5)))
    assert not core.scheduler.flush_cache()  # waiting
    core.step()
    assert not core.scheduler.flush_cache()  # running
    check_ownership(core.scheduler)
    while core.has_work():
        core.step()
    assert_idle_and_flush(core.scheduler)


def test_seeds_tiny(tiny_dir):
    """Same seed -> same tokens alone, in a batch of others, arriving later; different seeds differ."""
    g = torch.Generator().manual_seed(8)
    prompt = rand_ids(g, 12)
    others = [rand_ids(g, 5 + 9 * i) for i in range(5)]

    def sampled(seed):
        return SamplingParams(temperature=1.0, top_k=50, seed=seed, max_new_tokens=24, ignore_eos=True)

    alone = run_core(tiny_core(tiny_dir), [Request("s", prompt, sampled(1234))])["s"].tokens
    mixed = [Request(f"o{i}", p, sampled(i) if i % 2 else greedy(30)) for i, p in enumerate(others)]
    in_batch = run_core(tiny_core(tiny_dir), mixed[:3] + [Request("s", prompt, sampled(1234))] + mixed[3:])
    late = run_core(tiny_core(tiny_dir, page_size=4),
                    [Request(f"o{i}", p, greedy(30)) for i, p in enumerate(others)] +
                    [Request("s", prompt, sampled(1234))], per_step=2)
    assert in_batch["s"].tokens == alone == late["s"].tokens
    other_seeds = [run_core(tiny_core(tiny_dir), [Request("s", prompt, sampled(s))])["s"].tokens
                   for s in (1, 2)]
    assert other_seeds[0] != alone and other_seeds[1] != alone and other_seeds[0] != other_seeds[1]


def test_stop_token_ids_and_min_new_tokens(tiny_dir):
    g = torch.Generator().manual_seed(9)
    prompt = rand_ids(g, 15)
    ref = run_core(tiny_core(tiny_dir), [Request("a", prompt, greedy(12))])["a"].tokens
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i])  # first new token from step 2 on
    core = tiny_core(tiny_dir)
    out = run_core(core, [Request("a", prompt, greedy(12, stop_token_ids=[ref[k]]))])["a"]
    assert out.tokens == ref[: k + 1] and out.finish == "stop" and out.matched_stop == ref[k]
    out = run_core(core, [Request("b", prompt, greedy(12, stop_token_ids=[ref[k]], min_new_tokens=k + 2))])["b"]
    assert out.tokens[:k] == ref[:k] and out.tokens[k] != ref[k] and len(out.tokens) >= k + 2
    one = run_core(core, [Request("c", prompt, greedy(1))])["c"]
    assert one.tokens == ref[:1] and one.finish == "length"
    assert_idle_and_flush(core.scheduler)


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory, smollm2_dir) -> str:
    """A tiny random Llama with SmolLM2's vocabulary size and tokenizer files, for the offline Engine."""
    path = make_tiny_model(tmp_path_factory.mktemp("tinytok"), arch="qwen2", tie=True, vocab_size=49152)
    for name in os.listdir(smollm2_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    return path


def test_offline_engine_greedy_equals_transformers_tiny(tiny_tok_dir):
    engine = Engine(model=tiny_tok_dir, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS,
                    page_size=4, chunked_prefill_size=16)
    hf = load_hf(tiny_tok_dir)
    g = torch.Generator().manual_seed(10)
    prompts = [rand_ids(g, n, 49152) for n in (1, 6, 23, 40, 9)]
    outs = engine.generate(prompts, greedy(14), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p and len(o.token_ids) == 14 and o.finish_reason == "length"
        check_greedy(hf, p, o.token_ids, what="tiny qwen2 via Engine")
    assert_idle_and_flush(engine.core.scheduler)


def test_unknown_architecture_is_rejected(tmp_path):
    path = make_tiny_model(tmp_path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        Engine(model=path, dtype="float32", kv_cache_memory="1MiB", num_threads=TEST_THREADS)


# ============================================================================ SmolLM2 (session engine)


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' to Spanish.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_dir):
    """transformers' model on the same (dequantized, converted) SmolLM2 weights, float32."""
    return load_hf(smollm2_dir)


def engine_idle_accounting(engine: Engine) -> None:
    with engine._lock:
        sched = engine.core.scheduler
        assert not sched.running and not sched.waiting
        check_ownership(sched)
    kv = engine.stats()["kv"]
    assert kv["in_use"] == 0 and kv["free"] + kv["cached"] == kv["total"]


@contextlib.contextmanager
def radix_disabled(engine: Engine):
    """Run the session engine as if built with disable_radix_cache=True (the scheduler's own
    NoPrefixCache), restoring the radix cache afterwards."""
    sched = engine.core.scheduler
    assert engine.flush_cache()
    saved = sched.kv.cache
    sched.kv.cache = NoPrefixCache(sched.pool, sched.config.page_size)
    try:
        yield
    finally:
        engine_idle_accounting(engine)
        sched.kv.cache = saved


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_readme_example_in_the_default_dtype_and_bfloat16(smollm2_dir, dtype):
    """The README's example with the default settings (bfloat16 on CPUs with native bf16 matmul,
    float32 elsewhere; the fused kernels and, on AMX CPUs, the AMX attention and linears) and in
    bfloat16 on any CPU answers Paris, alone and in a batch. Its float32 top-2 margins are >= 1 logit
    over the first 10 tokens, so bf16 rounding cannot flip it; "What is the capital of France?" is a
    0.08-logit near-tie and did flip to "L'Etoile, ..." alone (found by a fresh-clone pass)."""
    from idleless.model.runner import resolve_dtype

    engine = Engine(model=smollm2_dir, kv_cache_memory="64MiB", num_threads=TEST_THREADS, dtype=dtype)
    assert engine.core.runner.dtype == resolve_dtype(dtype)
    msgs = [{"role": "user", "content": "Name the capital of France."}]
    p = SamplingParams(temperature=0, max_new_tokens=16)
    alone = engine.generate([msgs], p, use_tqdm=False)[0].text
    batch = engine.generate([msgs] + [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS], p, use_tqdm=False)
    assert "Paris" in alone, alone
    assert "Paris" in batch[0].text, batch[0].text


def test_smollm2_greedy_equals_transformers(smollm2_engine, smollm2_hf):
    """8 chat prompts batched, 32 tokens (or up to eos): transformers' greedy tokens; raw logprobs
    within 2e-4 of transformers' log-softmax (float32 both: measured <= 1.5e-5); the capital of
    France is Paris."""
    engine = smollm2_engine
    params = SamplingParams(temperature=0, max_new_tokens=32, logprobs=True, top_logprobs=2)
    outs = engine.generate([[{"role": "user", "content": q}] for q in CHAT_QUESTIONS], params, use_tqdm=False)
    assert "Paris" in outs[0].text, outs[0].text
    eos = engine.tokenizer.eos_token_ids
    for q, o in zip(CHAT_QUESTIONS, outs):
        ids = o.token_ids
        assert o.finish_reason == ("stop" if ids[-1] in eos else "length")
        assert len(ids) == 32 or o.finish_reason == "stop"
        logits = hf_logits(smollm2_hf, o.prompt_token_ids + ids[:-1])
        n = check_greedy(smollm2_hf, o.prompt_token_ids, ids, logits=logits, what=q)
        ref_lp = torch.log_softmax(logits[len(o.prompt_token_ids) - 1:], -1)
        for i in range(n):
            assert abs(o.logprobs[i] - float(ref_lp[i, ids[i]])) < 2e-4, (q, i)
    engine_idle_accounting(engine)


# 16 prompts of mixed lengths (a few tokens to a few hundred), some sharing prefixes
_LONG = ("The history of the printing press begins with Johannes Gutenberg, who around 1440 combined movable "
         "metal type, oil-based inks and a wooden press adapted from those used for wine. ")


def _mixed_prompts() -> list[str]:
    return [
        "Hi", "Once upon a time", "The capital of Italy is", "List the planets:", _LONG * 3,
        "def fibonacci(n):", "Water boils at", _LONG + "In summary,", "1, 2, 3, 4,", "Roses are red,",
        _LONG * 2 + "Its impact was", "The quick brown fox", "Q: What is 2+2?\nA:", "Paris is", "Dear Sir,",
        "In 1969, the first humans",
    ]


def test_smollm2_batch_of_16_equals_alone(smollm2_engine):
    engine = smollm2_engine
    prompts = _mixed_prompts()
    params = [SamplingParams(temperature=0, max_new_tokens=4 + i % 5) for i in range(16)]
    assert engine.flush_cache()
    batch = engine.generate(prompts, params, use_tqdm=False)
    lens = sorted(len(o.prompt_token_ids) for o in batch)
    assert lens[0] <= 2 and lens[-1] >= 100
    for p, sp, b in zip(prompts, params, batch):
        assert engine.flush_cache()  # alone and cold: no cache hit either
        alone = engine.generate(p, sp, use_tqdm=False)
        assert b.token_ids == alone.token_ids and b.text == alone.text, p[:40]
    engine_idle_accounting(engine)


def test_smollm2_radix_on_off_shared_prefix(smollm2_engine):
    """A batch sharing a long system prompt: identical outputs with the radix cache on and off; on,
    the first request computes the system prompt and every other hits exactly its common prefix with
    the first (hand-computed from the token ids); off, nothing is cached."""
    engine = smollm2_engine
    system = {"role": "system", "content": "You are a careful assistant for a general knowledge quiz. Answer "
              "every question with one short, complete sentence, and never add explanations, lists, "
              "greetings or follow-up questions of your own."}
    msgs = [[system, {"role": "user", "content": q}] for q in CHAT_QUESTIONS[:6]]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert engine.flush_cache()
    on = engine.generate(msgs, params, use_tqdm=False)
    first = on[0].prompt_token_ids
    assert lcp(first, on[1].prompt_token_ids) >= 40  # > SHARE_BLOCK: the others wait one step for it
    expected = [0] + [min(lcp(o.prompt_token_ids, first), len(o.prompt_token_ids) - 1) for o in on[1:]]
    assert [o.cached_tokens for o in on] == expected
    with radix_disabled(engine):
        off = engine.generate(msgs, params, use_tqdm=False)
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    assert [o.text for o in off] == [o.text for o in on]
    assert all(o.cached_tokens == 0 for o in off)
    engine_idle_accounting(engine)


def test_smollm2_seeds(smollm2_engine):
    engine = smollm2_engine
    prompt = "Write a short poem about the sea."

    def sp(seed, n=1):
        return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_new_tokens=12, n=n, ignore_eos=True)

    alone = engine.generate(prompt, sp(5), use_tqdm=False, chat=True)
    # in a different batch composition: other prompts, greedy and sampled, around it
    batch = engine.generate(["Tell me a joke.", prompt, "Count to five."],
                            [sp(1), sp(5), SamplingParams(temperature=0, max_new_tokens=12)], use_tqdm=False,
                            chat=True)
    assert batch[1].token_ids == alone.token_ids
    pair = engine.generate(prompt, sp(4, n=2), use_tqdm=False, chat=True)  # choice i uses seed 4 + i
    assert pair[1].token_ids == alone.token_ids
    assert pair[0].token_ids != alone.token_ids
    engine_idle_accounting(engine)


def _stream(engine: Engine, prompt, params, chat=True):
    async def go():
        return [d async for d in engine.generate_stream(prompt, params, chat=chat)]
    return asyncio.run(go())


def test_smollm2_stop_string_across_token_boundary(smollm2_engine):
    engine = smollm2_engine
    tok = engine.tokenizer
    prompt = "Describe the Eiffel Tower in two sentences."
    full = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
                           use_tqdm=False, chat=True)
    ids, text = full.token_ids, full.text
    # a stop string made of the last 2 characters of one token and the first 2 of the next
    stop = None
    for k in range(4, len(ids) - 2):
        b = len(tok.decode(ids[:k]))
        if text[:b] == tok.decode(ids[:k]) and len(tok.decode(ids[k:k + 1])) >= 3 and b >= 3:
            cand = text[b - 2: b + 2]
            if text.find(cand) == b - 2 and len(tok.decode(ids[k - 1:k])) >= 3:
                stop, cut, k_stop = cand, b - 2, k
                break
    assert stop is not None, text
    stats = engine.core.scheduler.stats
    aborted, finished = stats.num_aborted, stats.num_finished
    out = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=[stop]),
                          use_tqdm=False, chat=True)
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.matched_stop == stop
    assert out.token_ids == ids[: k_stop + 1]  # generation ended with the token completing the stop
    incl = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True), use_tqdm=False, chat=True)
    assert incl.text == text[: cut + len(stop)]
    deltas = _stream(engine, prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=[stop]))
    assert "".join(d.text for d in deltas) == text[:cut]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].matched_stop == stop
    # a stop string ends the request in the frontend, which tells the engine: finished, not aborted
    assert (stats.num_aborted, stats.num_finished) == (aborted, finished + 3)
    engine_idle_accounting(engine)


def test_smollm2_utf8_stream(smollm2_engine):
    """A Chinese prompt makes the model answer in CJK and emoji (multi-byte characters split over
    several byte-level tokens): the streamed deltas never carry U+FFFD and join to the final text."""
    engine = smollm2_engine
    prompt = "请用中文回答：你好吗？"
    probe = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24), use_tqdm=False, chat=True)
    # the longest prefix of the output that ends on a whole character, so the final text is clean
    n = max(k for k in range(1, len(probe.token_ids) + 1)
            if "\ufffd" not in engine.tokenizer.decode(probe.token_ids[:k]))
    params = SamplingParams(temperature=0, max_new_tokens=n)
    whole = probe if n == len(probe.token_ids) else engine.generate(prompt, params, use_tqdm=False, chat=True)
    assert any(ord(c) > 0x2E80 for c in whole.text), whole.text  # CJK or emoji
    split = [t for t in whole.token_ids if "\ufffd" in engine.tokenizer.decode([t])]
    assert split, "no character spans several tokens: the test would not test anything"
    deltas = _stream(engine, prompt, params)
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == whole.text and "\ufffd" not in whole.text
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert deltas[-1].finish_reason == whole.finish_reason
    engine_idle_accounting(engine)


def test_smollm2_max_new_tokens_1_and_min_new_tokens(smollm2_engine):
    engine = smollm2_engine
    q = "What is the capital of France?"
    base = engine.generate(q, SamplingParams(temperature=0, max_new_tokens=32), use_tqdm=False, chat=True)
    assert base.finish_reason == "stop" and len(base.token_ids) < 20  # a short answer, then eos
    one = engine.generate(q, SamplingParams(temperature=0, max_new_tokens=1), use_tqdm=False, chat=True)
    assert one.token_ids == base.token_ids[:1] and one.finish_reason == "length" and one.completion_tokens == 1
    m = len(base.token_ids) + 3
    longer = engine.generate(q, SamplingParams(temperature=0, max_new_tokens=m + 5, min_new_tokens=m),
                             use_tqdm=False, chat=True)
    eos = engine.tokenizer.eos_token_ids
    assert len(longer.token_ids) >= m and not any(t in eos for t in longer.token_ids[: m - 1])
    assert longer.token_ids[: len(base.token_ids) - 1] == base.token_ids[:-1]
    engine_idle_accounting(engine)


def test_smollm2_bad_requests_do_not_disturb_a_stream(smollm2_engine, tmp_path):
    """While a stream runs: an empty prompt, an over-long prompt, over-long max tokens, bad
    parameters and bad messages are refused with RequestError; another stream is abandoned (aborted);
    an engine for an unknown architecture fails to load. The stream ends exactly as it does alone."""
    engine = smollm2_engine
    prompt = "Explain photosynthesis in simple words."
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    alone = engine.generate(prompt, params, use_tqdm=False, chat=True)
    limit = min(engine.core.scheduler.context_length, engine.core.scheduler.pool.num_slots)
    aborted = engine.core.scheduler.stats.num_aborted

    bad_arch = make_tiny_model(tmp_path)
    with open(os.path.join(bad_arch, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FalconForCausalLM"]
    with open(os.path.join(bad_arch, "config.json"), "w") as f:
        json.dump(cfg, f)

    async def go():
        deltas = []
        agen = engine.generate_stream(prompt, params, chat=True)
        deltas.append(await agen.__anext__())
        errors = {}
        for name, call in [
            ("empty", lambda: engine.generate("", params, use_tqdm=False)),
            ("empty-ids", lambda: engine.generate([[]], params, use_tqdm=False)),
            ("too-long", lambda: engine.generate([5] * (limit + 10), params, use_tqdm=False)),
            ("max-tokens", lambda: engine.generate("Hi", SamplingParams(max_new_tokens=limit), use_tqdm=False)),
            ("temperature", lambda: engine.generate("Hi", SamplingParams(temperature=-2), use_tqdm=False)),
            ("bad-token", lambda: engine.generate([1, 2, 10 ** 9], params, use_tqdm=False)),
            ("messages", lambda: engine.generate([[{"content": "no role"}]], params, use_tqdm=False)),
        ]:
            with pytest.raises(RequestError) as ei:
                call()
            errors[name] = ei.value.code
        assert errors["too-long"] == errors["max-tokens"] == "context_length_exceeded"
        with pytest.raises(ValueError, match="FalconForCausalLM"):
            Engine(model=bad_arch, dtype="float32", kv_cache_memory="1MiB", num_threads=TEST_THREADS)
        # long enough that it cannot end before its consumer leaves
        other = engine.generate_stream("Count from one to one hundred.",
                                       SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True), chat=True)
        await other.__anext__()
        await other.aclose()  # the consumer leaves: the request is aborted
        async for d in agen:
            deltas.append(d)
        return deltas

    deltas = asyncio.run(go())
    assert "".join(d.text for d in deltas) == alone.text
    assert sum((d.token_ids for d in deltas), []) == alone.token_ids
    assert deltas[-1].finish_reason == "length"
    engine_idle_accounting(engine)
    # the abandoned stream is aborted at once: its abort waited on the engine loop's lock for seconds (the
    # loop re-took it step after step) and, after test_bench_offline, missed the request's end
    assert engine.core.scheduler.stats.num_aborted == aborted + 1
    assert engine.flush_cache()
    kv = engine.stats()["kv"]
    assert kv["free"] == kv["total"]


def test_parse_memory_units_fractions_and_limits():
    """Bytes with binary / decimal units, plain bytes, fractions of the available RAM; a fraction above
    0.9 (``--kv-cache-memory 1`` took all free RAM, 22 GiB here) and non-positive sizes are refused."""
    assert parse_memory("2GiB") == 2 * 1024**3 and parse_memory("512MB") == 512e6 and parse_memory("64KiB") == 65536
    assert parse_memory("4096") == 4096.0
    assert abs(parse_memory("0.25") - 0.25 * available_memory_bytes()) <= 0.01 * available_memory_bytes()
    for bad in ("1", 1, "0.95", "0", "-3", "lots"):
        with pytest.raises(ValueError):
            parse_memory(bad)
