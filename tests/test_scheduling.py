"""Issue 4: cache-aware scheduling, chunked prefill, value-aware eviction, pinning, retraction.

Policy tests order hand-made queues and compare with hand-computed orders. The rest drive
``EngineCore`` directly with token ids on a tiny random Llama (no tokenizer needed), stepping it by
hand and checking after every step that each KV page is owned by exactly one of: the free list, the
radix tree, a running request. Only the Engine-level tests (``priority=``, ``pin_prefix``) need a
tokenizer: they copy SmolLM2's tokenizer files into a tiny model with SmolLM2's vocabulary.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from conftest import make_tiny_model
from idleless.cache.kv_pool import KVPool
from idleless.cache.radix_cache import RadixCache
from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.policy import order_waiting
import kv_invariants
from idleless.engine.request import FinishReason, Request, RequestError, RequestRecord, SamplingParams

VOCAB = 256  # the tiny model's vocabulary
# tiny model KV bytes per token: 2 (K, V) * 2 layers * 2 KV heads * head_dim 16 * 4 bytes (float32)
TINY_KV_BYTES = KVPool.bytes_per_token(2, 2, 16, torch.float32)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama with an 8k context (for the 4k-token prompt)."""
    return make_tiny_model(tmp_path_factory.mktemp("sched"), max_position_embeddings=8192)


def make_core(model_dir: str, slots: int, **kw) -> EngineCore:
    cfg = dict(model=model_dir, dtype="float32", kv_cache_memory=str(slots * TINY_KV_BYTES), num_threads=1)
    cfg.update(kw)
    core = EngineCore(EngineConfig(**cfg))
    assert core.runner.pool.num_slots == slots - slots % core.runner.pool.page_size
    return core


def rand_ids(n: int, seed: int, lo: int = 3, hi: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def req(rid: str, ids: list[int], arrival: float = 0.0, priority: int = 0, max_new: int = 4) -> RequestRecord:
    """A waiting request as the scheduler holds it (what order_waiting sorts)."""
    return RequestRecord(rid, list(ids), greedy(max_new), priority, arrival, max_new)


def check_ownership(core: EngineCore) -> None:
    kv_invariants.check_ownership(core.scheduler)


def drive(core: EngineCore, max_steps: int = 10_000, on_step=None):
    """Step until idle. Returns ({rid: token ids}, {rid: finish reason}, steps). Checks slot
    ownership after every step; ``on_step(step_index, outputs)`` sees each step's outputs."""
    toks: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    steps = 0
    while core.has_work():
        assert steps < max_steps, f"no progress: still working after {max_steps} steps"
        outs = core.step()
        for o in outs:
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.rid] = o.finish_reason
        check_ownership(core)
        if on_step is not None:
            on_step(steps, outs)
        steps += 1
    return toks, reasons, steps


def record_batches(core: EngineCore) -> list[list[int]]:
    """Wrap the runner so each executed plan's per-request token counts are recorded."""
    seen: list[list[int]] = []
    orig = core.runner.execute

    def execute(plan):
        seen.append([r.num_tokens for r in plan.requests])
        return orig(plan)

    core.runner.execute = execute
    return seen


def small_cache(slots: int = 1024, page_size: int = 1, **kw) -> RadixCache:
    return RadixCache(KVPool(1, 1, 1, slots, torch.float32, page_size=page_size), page_size, **kw)


def cache_insert(cache: RadixCache, ids: list[int]) -> None:
    slots = cache.pool.alloc(0, 0, len(ids))
    dup = cache.insert(ids, slots).prefix_len
    cache.pool.free(slots[:dup])


def rids(reqs) -> list[str]:
    return [r.rid for r in reqs]


# --------------------------------------------------------------------------------------------------
# policy order on hand-made queues
# --------------------------------------------------------------------------------------------------
A, B, C = rand_ids(64, 1, 10, 100), rand_ids(64, 2, 100, 200), rand_ids(64, 3, 200, 256)


def test_fcfs_is_priority_then_arrival():
    q = [req("late", A, 3.0), req("early", B, 1.0), req("vip", C, 5.0, priority=2), req("mid", A, 2.0)]
    assert rids(order_waiting(q, "fcfs", small_cache())) == ["vip", "early", "mid", "late"]


def test_lpm_orders_by_cached_prefix_length():
    cache = small_cache()
    cache_insert(cache, A + B)  # 128 tokens
    cache_insert(cache, C[:40])
    q = [req("cold", rand_ids(50, 9, 3, 9), 0.0),  # first token 3..8: no cached prefix
         req("c40", C[:40] + rand_ids(10, 10), 1.0),  # 40 cached
         req("ab128", A + B + rand_ids(5, 11), 2.0),  # 128 cached
         req("a64", A + C, 3.0),  # 64 cached (diverges inside the A+B node)
         req("a64-later", A + rand_ids(8, 12, 200, 256), 4.0)]  # 64 cached, later arrival
    before = cache.total_size
    assert rids(order_waiting(q, "lpm", cache)) == ["ab128", "a64", "a64-later", "c40", "cold"]
    assert cache.total_size == before and len(cache.root.children) == 2  # peeking split nothing


def test_dfs_weight_groups_biggest_shared_prefix_first():
    # 3 requests share A, 2 share B, 1 alone (C), arriving interleaved
    q = [req("b1", B + rand_ids(40, 21), 0.0), req("c1", C + rand_ids(40, 22), 1.0),
         req("a1", A + rand_ids(40, 23), 2.0), req("b2", B + rand_ids(40, 24), 3.0),
         req("a2", A + rand_ids(40, 25), 4.0), req("a3", A + rand_ids(40, 26), 5.0)]
    assert rids(order_waiting(q, "dfs-weight", small_cache())) == ["a1", "a2", "a3", "b1", "b2", "c1"]


def test_dfs_weight_nested_groups_and_ties():
    # inside A: a sub-group of 2 (A+B) outweighs a single earlier A+C; B and C alone tie on weight:
    # the earlier arrival goes first; a request that is only the shared prefix precedes its children
    q = [req("ac", A + C, 0.0), req("c", C + A, 1.0), req("ab1", A + B + rand_ids(40, 31), 2.0),
         req("b", B + C, 3.0), req("ab2", A + B + rand_ids(40, 32), 4.0), req("a", A, 5.0)]
    assert rids(order_waiting(q, "dfs-weight", small_cache())) == ["a", "ab1", "ab2", "ac", "c", "b"]


def test_dfs_weight_continues_the_group_already_in_service():
    """One request of group A ran (its prefix S + docA is cached); A has 3 waiting, B and C 4 each.
    Walking the cached tree first (as SGLang's dfs-weight does: the DFS runs over the radix cache,
    children before a node's own requests) takes A's requests, whose document is already cached,
    before starting another group; counting only waiting requests puts B and C (4) before A (3)."""
    s_, docs = rand_ids(64, 500), {g: rand_ids(64, 501 + i) for i, g in enumerate("abc")}
    cache = small_cache()
    cache_insert(cache, s_ + docs["a"])
    q, t = [], 0.0
    for k in range(4):
        for g in "bca":
            if g == "a" and k == 3:
                continue
            q.append(req(f"{g}{k}", s_ + docs[g] + rand_ids(8, 600 + len(q)), t))
            t += 1.0
    order = rids(order_waiting(q, "dfs-weight", cache))
    assert order[:3] == ["a0", "a1", "a2"]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_policies_fall_back_to_fcfs_above_threshold(policy):
    cache = small_cache()
    cache_insert(cache, A + rand_ids(40, 41, 3, 9))
    q = [req("c", C + rand_ids(40, 42), 0.0), req("b", B + rand_ids(40, 43), 1.0),
         req("a1", A + rand_ids(40, 44), 2.0), req("a2", A + rand_ids(40, 45), 3.0)]
    cache_aware = rids(order_waiting(q, policy, cache, fallback_threshold=len(q)))
    assert cache_aware[:2] == ["a1", "a2"]
    assert rids(order_waiting(q, policy, cache, fallback_threshold=len(q) - 1)) == ["c", "b", "a1", "a2"]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_aging_bound_puts_old_cold_requests_first(policy):
    cache = small_cache()
    cache_insert(cache, A + rand_ids(40, 51, 3, 9))
    now = 100.0
    q = [req("hot1", A + rand_ids(40, 52), 95.0), req("hot2", A + rand_ids(40, 53), 96.0),
         req("cold-young", C + rand_ids(40, 54), 97.0),
         req("cold-old2", B + rand_ids(40, 55), 80.0), req("cold-old1", rand_ids(72, 56, 3, 9), 70.0)]
    # waited 30 s and 20 s > 10 s: both go first, fcfs among themselves; the young cold one waits
    order = rids(order_waiting(q, policy, cache, max_queue_delay=10.0, now=now))
    assert order[:2] == ["cold-old1", "cold-old2"]
    assert order[2:4] == ["hot1", "hot2"] and order[4] == "cold-young"
    # a bound nobody passed yet: pure cache-aware order
    order = rids(order_waiting(q, policy, cache, max_queue_delay=60.0, now=now))
    assert order[:2] == ["hot1", "hot2"]
    # priority still wins among the aged
    q[3].priority = 0
    q[4].priority = -1
    order = rids(order_waiting(q, policy, cache, max_queue_delay=10.0, now=now))
    assert order[:2] == ["cold-old2", "cold-old1"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_priority_beats_cache_affinity_and_arrival(policy):
    cache = small_cache()
    cache_insert(cache, A + rand_ids(40, 61, 3, 9))
    q = [req("hot1", A + rand_ids(40, 62), 0.0), req("hot2", A + rand_ids(40, 63), 1.0),
         req("low", A + rand_ids(40, 64), 2.0, priority=-5),
         req("vip", C + rand_ids(40, 65), 3.0, priority=3)]
    order = rids(order_waiting(q, policy, cache))
    assert order[0] == "vip" and order[-1] == "low" and order[1:3] == ["hot1", "hot2"]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        order_waiting([], "random", small_cache())
    with pytest.raises(ValueError):
        EngineConfig(schedule_policy="random")
    with pytest.raises(ValueError):
        EngineConfig(radix_eviction_policy="lfu")


# --------------------------------------------------------------------------------------------------
# the policies inside the scheduler
# --------------------------------------------------------------------------------------------------
def _admission_order(core: EngineCore, reqs: list[Request]) -> list[str]:
    for r in reqs:
        core.add_request(r)
    first_token: list[str] = []
    drive(core, on_step=lambda i, outs: first_token.extend(
        o.rid for o in outs if o.completion_tokens == len(o.new_token_ids) and o.new_token_ids))
    return first_token


def test_scheduler_admits_by_policy_with_one_running_slot(tiny_dir):
    """max_running_requests=1 serialises admission, so the order of first tokens is the policy order."""
    now = time.monotonic()
    # hot prefix A in the cache first
    core = make_core(tiny_dir, 4096, schedule_policy="lpm", max_running_requests=1, max_queue_delay=30.0)
    core.add_request(Request("warm", A + B, greedy(1)))
    drive(core)
    mk = lambda rid, ids, age, prio=0: Request(rid, ids, greedy(2), priority=prio, arrival_time=now - age)  # noqa: E731
    order = _admission_order(core, [mk("cold", C + rand_ids(30, 71), 3.0), mk("hot", A + B + rand_ids(5, 72), 2.0),
                                    mk("aged", rand_ids(60, 73, 3, 9), 100.0), mk("vip", C + B, 1.0, prio=1)])
    assert order == ["aged", "vip", "hot", "cold"]  # aging first (see policy.py), then priority, then hits
    # the same queue in fcfs: priority, then arrival
    core = make_core(tiny_dir, 4096, schedule_policy="fcfs", max_running_requests=1)
    order = _admission_order(core, [mk("cold", C + rand_ids(30, 71), 3.0), mk("hot", A + B + rand_ids(5, 72), 2.0),
                                    mk("aged", rand_ids(60, 73, 3, 9), 100.0), mk("vip", C + B, 1.0, prio=1)])
    assert order == ["vip", "aged", "cold", "hot"]


def test_in_batch_prefix_sharing_defers_the_second_request(tiny_dir):
    """Two requests sharing >= 32 uncached tokens: the second waits one step and then hits the cache."""
    core = make_core(tiny_dir, 4096)
    shared = rand_ids(96, 81)
    core.add_request(Request("x", shared + rand_ids(10, 82), greedy(3)))
    core.add_request(Request("y", shared + rand_ids(10, 83), greedy(3)))
    core.add_request(Request("z", rand_ids(50, 84), greedy(3)))  # unrelated: admitted at once
    batches = record_batches(core)
    outs = []
    drive(core, on_step=lambda i, o: outs.append(o))
    assert sorted(batches[0]) == [50, 106]
    first = {o.rid: o.cached_tokens for step in outs for o in step}
    assert first["y"] == 96 and first["x"] == 0 and first["z"] == 0


def test_shared_prefix_longer_than_a_chunk_is_computed_once(tiny_dir):
    core = make_core(tiny_dir, 4096, chunked_prefill_size=64)
    shared = rand_ids(300, 85)
    core.add_request(Request("x", shared + rand_ids(10, 86), greedy(2)))
    core.add_request(Request("y", shared + rand_ids(10, 87), greedy(2)))
    drive(core)
    st = core.stats()
    assert st["computed_prompt_tokens"] == 300 + 10 + 10  # today: 556 (y hits 64 of the 300 shared tokens)


# --------------------------------------------------------------------------------------------------
# chunked prefill
# --------------------------------------------------------------------------------------------------
def _mixed_workload() -> list[tuple[str, list[int], int]]:
    doc = rand_ids(300, 91)
    return [("long", rand_ids(1500, 92), 6), ("mid", rand_ids(700, 93), 9), ("short", rand_ids(40, 94), 12),
            ("doc1", doc + rand_ids(20, 95), 5), ("doc2", doc + rand_ids(30, 96), 7)]


def test_chunked_prefill_output_equals_unchunked(tiny_dir):
    results = []
    for chunk, budget in [(0, 8192), (128, 256), (64, 100)]:
        core = make_core(tiny_dir, 8192, chunked_prefill_size=chunk, max_prefill_tokens=budget)
        for rid, ids, n in _mixed_workload():
            core.add_request(Request(rid, ids, greedy(n)))
        batches = record_batches(core)
        toks, reasons, _ = drive(core)
        assert all(r == FinishReason.LENGTH for r in reasons.values())
        if chunk > 0:
            assert max(sum(b) for b in batches) <= budget  # one token budget per step
            assert max(max(b) for b in batches) <= chunk
            assert any(1 in b and max(b) > 1 for b in batches), "no mixed decode + prefill step"
        else:
            assert max(max(b) for b in batches) >= 1500  # a prompt in one go
        results.append(toks)
    assert results[1] == results[0]
    assert results[2] == results[0]


def test_decodes_advance_every_step_while_a_4k_prompt_is_prefilled(tiny_dir):
    chunk, budget, n_long = 512, 512, 4096
    core = make_core(tiny_dir, 8192, chunked_prefill_size=chunk, max_prefill_tokens=budget)
    decoders = [f"d{i}" for i in range(3)]
    for i, rid in enumerate(decoders):
        core.add_request(Request(rid, rand_ids(20 + i, 100 + i), greedy(60)))
    core.step()
    core.step()  # all three are decoding now
    core.add_request(Request("long", rand_ids(n_long, 110), greedy(3)))
    long_req = core.scheduler.waiting[-1]
    batches = record_batches(core)
    per_step: list[dict] = []
    computed: list[int] = []

    def on_step(i, outs):
        per_step.append({o.rid: len(o.new_token_ids) for o in outs})
        computed.append(long_req.num_computed)

    toks, _, _ = drive(core, on_step=on_step)
    prefill_steps = [i for i in range(len(computed))
                     if (computed[i - 1] if i else 0) < n_long and computed[i] > (computed[i - 1] if i else 0)]
    # the 4k prompt took several steps, and each decoder got exactly one token in every one of them
    assert len(prefill_steps) >= n_long // chunk
    assert prefill_steps == list(range(len(prefill_steps)))
    for i in prefill_steps:
        assert all(per_step[i].get(d) == 1 for d in decoders), (i, per_step[i])
        assert sum(batches[i]) <= budget and batches[i].count(1) == 3
    assert all(len(toks[d]) == 60 - 2 for d in decoders)  # two tokens came before recording
    # the chunked 4k prefill gives the same tokens as one unchunked prefill
    ref = make_core(tiny_dir, 8192, chunked_prefill_size=0)
    ref.add_request(Request("long", rand_ids(n_long, 110), greedy(3)))
    assert drive(ref)[0]["long"] == toks["long"]


# --------------------------------------------------------------------------------------------------
# eviction and pinning
# --------------------------------------------------------------------------------------------------
def _pin(core: EngineCore, pin_id: str, ids: list[int], ttl: float = 600.0):
    result = {}
    core.pin_prefix(pin_id, ids, ttl, lambda n, err: result.update(n=n, err=err))
    drive(core)
    return result["n"], result["err"]


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_pinned_hot_prefix_survives_eviction_pressure(tiny_dir, policy):
    hot = rand_ids(200, 120, 3, 9)  # tokens 3..8: the one-off documents below never use them
    survived = {}
    for pinned in (True, False):
        core = make_core(tiny_dir, 1000, radix_eviction_policy=policy)
        if pinned:
            assert _pin(core, "sys", hot) == (200, None)
        else:
            core.add_request(Request("hot", hot, greedy(1)))
            drive(core)
        assert core.scheduler.cache.peek_prefix_len(hot) == 200
        for k in range(4):  # 12 one-off 300-token documents, three at a time
            for j in range(3):
                core.add_request(Request(f"doc{k}-{j}", rand_ids(300, 1000 + 3 * k + j, 9, VOCAB), greedy(4)))
            drive(core)
        st = core.stats()
        assert st["evicted_tokens"] > 2000  # the pool turned over several times
        survived[pinned] = core.scheduler.cache.peek_prefix_len(hot)
        assert st["pinned_tokens"] == (200 if pinned else 0)
    assert survived[True] == 200
    if policy == "lru":
        assert survived[False] < 200  # without the pin, LRU evicts it: the pin is what kept it


def _hot_prefix_stream(rounds: int = 8, hot_len: int = 200, doc_len: int = 300, docs_per_round: int = 3):
    """Each round: two requests on a hot system prompt (first tokens 3..8, which no document uses),
    each with its own question, then one-off documents that are never reused. Every prompt after the
    hot prefix starts with a distinct token, so nothing is shared by chance. Returns (hot, prompts)."""
    hot = rand_ids(hot_len, 130, 3, 9)
    stream, first = [], iter(range(9, VOCAB))
    for r in range(rounds):
        stream += [hot + [next(first)] + rand_ids(19, 2000 + 2 * r + j, 9, VOCAB) for j in range(2)]
        stream += [[next(first)] + rand_ids(doc_len - 1, 3000 + docs_per_round * r + j, 9, VOCAB)
                   for j in range(docs_per_round)]
    return hot, stream


def _run_stream(tiny_dir, policy: str, stream, slots: int = 1000) -> tuple[float, EngineCore]:
    core = make_core(tiny_dir, slots, radix_eviction_policy=policy)
    for i, ids in enumerate(stream):  # one at a time: the order of cache use is the stream's
        core.add_request(Request(f"s{i}", ids, greedy(1)))
        drive(core)
    return core.stats()["cache_hit_rate"], core


def test_gdsf_beats_lru_on_hot_prefix_with_one_off_documents(tiny_dir):
    """Pool 1000 tokens; each round: the hot prefix (200) twice with its own question, then 3 one-off
    300-token documents. LRU evicts the hot prefix in every round (it is the least recently used when
    the third document arrives), so only the second use in a round hits; GDSF keeps it (two uses x
    recompute cost beat one use) and evicts the documents instead, so every use after the first hits."""
    hot, stream = _hot_prefix_stream()
    lru, lru_core = _run_stream(tiny_dir, "lru", stream)
    gdsf, gdsf_core = _run_stream(tiny_dir, "gdsf", stream)
    print(f"\nhot-prefix stream hit rate: lru {lru:.3f}  gdsf {gdsf:.3f}")
    assert gdsf > lru
    total = sum(len(ids) for ids in stream)
    uses = sum(1 for ids in stream if ids[:200] == hot)
    assert lru == pytest.approx(200 * uses / 2 / total)
    assert gdsf == pytest.approx(200 * (uses - 1) / total)
    assert lru_core.scheduler.cache.peek_prefix_len(hot) < 200
    assert gdsf_core.scheduler.cache.peek_prefix_len(hot) == 200
    assert gdsf_core.stats()["window_hit_rate"] == pytest.approx(gdsf)


def test_gdsf_counts_the_first_use():
    """A prefix used twice outvalues one used once (same size and depth). GDSF's frequency counts the
    reference that brought an entry in (Cherkasova 1998); counting only later hits made a prefix
    used twice tie with a one-off, and the tie went to the older, i.e. the reused one was evicted."""
    cache = small_cache(1000, eviction_policy="gdsf")
    x, y = rand_ids(100, 1, 10, 100), rand_ids(100, 2, 100, 200)
    cache_insert(cache, x)
    cache.match_prefix(x)  # x used a second time
    cache_insert(cache, y)  # y used once, later
    assert cache.evict(100) == 100
    assert cache.peek_prefix_len(x) == 100 and cache.peek_prefix_len(y) == 0
    lru = small_cache(1000, eviction_policy="lru")
    cache_insert(lru, x)
    lru.match_prefix(x)
    cache_insert(lru, y)
    lru.evict(100)
    assert lru.peek_prefix_len(x) == 0 and lru.peek_prefix_len(y) == 100  # LRU: recency only


def test_pin_ttl_expiry_and_pinned_budget_in_the_tree():
    cache = small_cache(300, max_pinned_tokens=50)
    a, b, c = rand_ids(30, 140, 10, 100), rand_ids(30, 141, 100, 200), rand_ids(100, 142, 200, 256)
    for ids in (a, b, c):
        cache_insert(cache, ids)
    assert cache.pin("a", a, ttl=10.0, now=0.0) == 30
    assert cache.pinned_size == 30 and cache.protected_size == 30
    with pytest.raises(ValueError, match="budget"):
        cache.pin("b", b, ttl=10.0, now=0.0)  # 30 + 30 > 50
    assert cache.pinned_size == 30 and "b" not in cache.pins
    assert cache.pin("a", a, ttl=20.0, now=1.0) == 30  # re-pin extends, does not double count
    assert cache.pinned_size == 30 and cache.protected_size == 30
    with pytest.raises(ValueError, match="cached"):
        cache.pin("new", rand_ids(10, 143, 3, 9), ttl=1.0)
    assert cache.evict(1000) == 130  # everything but the pinned prefix
    assert cache.peek_prefix_len(a) == 30
    assert cache.unpin_expired(now=20.5) == 0  # re-pinned at t=1 with ttl 20: expires at 21
    assert cache.unpin_expired(now=21.0) == 1
    assert cache.pins == {} and cache.pinned_size == 0 and cache.protected_size == 0
    assert cache.evict(1000) == 30 and cache.total_size == 0
    assert cache.pool.num_free_slots == 300
    assert cache.unpin("a") is False


def test_pin_through_the_engine_core_ttl_and_budget(tiny_dir):
    core = make_core(tiny_dir, 1000, max_pinned_tokens=150)
    sys_prompt, doc = rand_ids(100, 150), rand_ids(100, 151)
    assert _pin(core, "sys", sys_prompt) == (100, None)  # prefilled first by a prefill-only request
    st = core.stats()
    assert st["pinned_tokens"] == 100
    # the prefill is an ordinary prefill-only request: it computed the prompt and sampled nothing
    assert st["num_finished"] == 1 and st["generation_tokens"] == 0 and st["computed_prompt_tokens"] == 100
    n, err = _pin(core, "doc", doc)
    assert n is None and "budget" in err
    assert core.stats()["pinned_tokens"] == 100
    assert _pin(core, "bad", [VOCAB + 5])[0] is None  # invalid ids: an error, not a crash
    assert _pin(core, "zero", sys_prompt, ttl=0.0)[1]
    assert _pin(core, "short", doc[:40], ttl=0.05) == (40, None)
    assert core.stats()["pinned_tokens"] == 140
    time.sleep(0.1)
    core.step()  # every step releases expired pins
    assert core.stats()["pinned_tokens"] == 100 and set(core.scheduler.cache.pins) == {"sys"}
    assert core.scheduler.cache.unpin("sys")
    assert _pin(core, "doc", doc) == (100, None)  # the budget is free again
    check_ownership(core)
    off = make_core(tiny_dir, 1000, disable_radix_cache=True)
    n, err = _pin(off, "x", sys_prompt)
    assert n is None and "disabled" in err


# --------------------------------------------------------------------------------------------------
# retraction and admission limits
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_a_tiny_pool(tiny_dir, page_size):
    """10 requests of 30-50 prompt tokens and 60 new tokens each; a 200-token pool holds two at
    full length. Every request finishes with the greedy output of a big pool, nothing leaks, the
    top-priority request is never retracted, and no request starves."""
    specs = [(f"r{i}", rand_ids(30 + 2 * i, 160 + i), 60) for i in range(10)]
    bound = sum(len(ids) + n for _, ids, n in specs)  # every step advances the most progressed request

    def run(slots):
        core = make_core(tiny_dir, slots, page_size=page_size)
        reqs = [Request(rid, ids, greedy(n), priority=1 if rid == "r7" else 0) for rid, ids, n in specs]
        for r in reqs:
            core.add_request(r)
        records = {r.rid: r for r in core.scheduler.waiting}  # the engine's own records
        toks, reasons, steps = drive(core, max_steps=bound)
        return toks, reasons, steps, core, records

    big = run(4096)
    assert big[3].stats()["num_retractions"] == 0
    toks, reasons, steps, core, reqs = run(200)
    st = core.stats()
    print(f"\npage_size {page_size}: {st['num_retractions']} retractions, {steps} steps (big pool {big[2]})")
    assert st["num_retractions"] > 0
    assert set(reasons) == set(reqs) and all(r == FinishReason.LENGTH for r in reasons.values())
    assert toks == big[0]
    assert reqs["r7"].num_retractions == 0
    assert st["num_finished"] == len(specs) and st["kv"]["in_use"] == 0
    assert st["prompt_tokens"] == sum(len(ids) for _, ids, _ in specs)  # counted once per request


def test_retraction_with_chunked_prefill_and_sampling(tiny_dir):
    """Seeded sampling survives retraction (the generator is per request) and chunks can be retracted."""
    specs = [(f"r{i}", rand_ids(70 + 10 * i, 170 + i)) for i in range(6)]

    def run(slots):
        core = make_core(tiny_dir, slots, chunked_prefill_size=32, max_prefill_tokens=48)
        for rid, ids in specs:
            core.add_request(Request(rid, ids, SamplingParams(temperature=0.8, seed=7, max_new_tokens=40,
                                                              ignore_eos=True)))
        toks, reasons, _ = drive(core, max_steps=5000)
        assert len(reasons) == len(specs)
        return toks, core.stats()["num_retractions"]

    ref, n0 = run(4096)
    got, n = run(170)
    assert n0 == 0 and n > 0
    assert got == ref


def test_request_larger_than_the_pool_is_refused_at_admission(tiny_dir):
    core = make_core(tiny_dir, 100)
    with pytest.raises(RequestError) as e:
        core.add_request(Request("too-long", rand_ids(60, 180), greedy(50)))  # 110 > 100
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as e:
        core.add_request(Request("prompt-fills-pool", rand_ids(100, 181), greedy(1)))
    assert e.value.code == "context_length_exceeded"
    assert not core.has_work() and core.stats()["num_requests"] == 0
    # exactly the pool: accepted, and it runs to the end even while others compete for memory
    full = Request("full", rand_ids(60, 182), greedy(40))
    core.add_request(full)
    for i in range(3):
        core.add_request(Request(f"other{i}", rand_ids(30, 183 + i), greedy(30)))
    toks, reasons, _ = drive(core, max_steps=2000)
    assert len(toks["full"]) == 40 and reasons["full"] == FinishReason.LENGTH
    assert all(reasons[f"other{i}"] == FinishReason.LENGTH for i in range(3))
    # max_new_tokens=None means "up to the limit"
    core.add_request(Request("open", rand_ids(90, 190), SamplingParams(temperature=0.0, max_new_tokens=None,
                                                                      ignore_eos=True)))
    toks, reasons, _ = drive(core)
    assert len(toks["open"]) == 10 and reasons["open"] == FinishReason.LENGTH


def test_stats_queue_time_and_window_hit_rate(tiny_dir):
    core = make_core(tiny_dir, 4096, max_running_requests=1)
    shared = rand_ids(64, 200)
    for i in range(3):
        core.add_request(Request(f"q{i}", shared + rand_ids(16, 201 + i), greedy(5)))
    drive(core)
    st = core.stats()
    assert st["num_admitted"] == 3 and st["queue_time"] > 0
    assert st["cached_tokens"] == 2 * 64 and st["cache_hit_rate"] == pytest.approx(128 / 240)
    assert st["window_hit_rate"] == pytest.approx(st["cache_hit_rate"])


# --------------------------------------------------------------------------------------------------
# the offline Engine: priority keyword, pin/unpin (needs a tokenizer)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory, smollm2_dir) -> str:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer files."""
    d = make_tiny_model(tmp_path_factory.mktemp("sched-tok"), vocab_size=49152)
    for name in os.listdir(smollm2_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(smollm2_dir, name), d)
    return d


def test_engine_generate_priority_keyword(tiny_tok_dir):
    from idleless.engine.engine import Engine

    eng = Engine(model=tiny_tok_dir, dtype="float32", kv_cache_memory="8MiB", max_running_requests=1,
                 schedule_policy="fcfs", num_threads=1)
    seen: list[int] = []  # priorities in the order requests first appear in a plan (= admission order)
    planned: set[str] = set()
    orig = eng.core.runner.execute

    def spy(plan):
        prio = {r.rid: r.priority for r in eng.core.scheduler.running}
        for r in plan.requests:
            if r.rid not in planned:
                planned.add(r.rid)
                seen.append(prio[r.rid])
        return orig(plan)

    eng.core.runner.execute = spy
    outs = eng.generate(["first in", "second in", "third in"], greedy(3), use_tqdm=False, priority=[0, 5, 1])
    assert [o.completion_tokens for o in outs] == [3, 3, 3]
    assert seen == [5, 1, 0]  # one running slot: admitted by priority, not by submission order
    with pytest.raises(ValueError):
        eng.generate(["a", "b"], greedy(1), use_tqdm=False, priority=[1])
    # pin / unpin through the Engine
    pin_id, n = eng.pin_prefix("You are a helpful assistant. " * 8, ttl=60.0, pin_id="sys")
    assert pin_id == "sys" and n > 0 and eng.stats()["pinned_tokens"] == n
    assert eng.unpin_prefix("sys") is True and eng.unpin_prefix("sys") is False
    assert eng.stats()["pinned_tokens"] == 0
    # without a pin_id the returned id releases it; refusals come before any prefill (found by the
    # fresh-clone pass: an empty pin was taken, an infinite TTL accepted, and an over-budget pin refused
    # only after its prefill)
    auto = eng.pin_prefix("Hello pinned prefix", ttl=60.0)
    assert eng.unpin_prefix(auto.pin_id) is True
    steps = eng.stats()["num_steps"]
    for bad in ([], [10**9]):
        with pytest.raises(RequestError):
            eng.pin_prefix(bad, ttl=5.0)
    for ttl in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(RequestError, match="TTL"):
            eng.pin_prefix("Hello pinned prefix", ttl=ttl)
    eng.core.scheduler.cache.max_pinned_tokens = 16  # as --max-pinned-tokens 16 would set it
    with pytest.raises(RequestError, match="pinned budget"):
        eng.pin_prefix(list(range(5, 5 + 17)), ttl=5.0)
    assert eng.stats()["num_steps"] == steps  # nothing was prefilled for a refused pin


def test_request_that_only_fits_without_the_pins_is_refused_not_stuck(tiny_dir):
    core = make_core(tiny_dir, 1000, chunked_prefill_size=256)  # pinned budget: a quarter, 250 tokens
    assert _pin(core, "sys", rand_ids(250, 210, 3, 9)) == (250, None)
    try:
        core.add_request(Request("big", rand_ids(900, 211, 9, VOCAB), greedy(50)))  # 950 <= 1000, > 750
    except RequestError as e:
        assert e.code == "context_length_exceeded"
        return
    toks, reasons, _ = drive(core, max_steps=2000)  # fails: "no progress", the request waits forever
    assert reasons.get("big") is not None


# --------------------------------------------------------------------------------------------------
# everything at once, randomised: any pool, page size, chunk size, budget and policy gives the
# greedy tokens of a big plain engine, with no leaked KV page and no starvation
# --------------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@st.composite
def _scenarios(draw):
    prefixes = [rand_ids(draw(st.integers(1, 48)), 300 + i) for i in range(3)]
    reqs = []
    for i in range(draw(st.integers(2, 6))):
        head = prefixes[draw(st.integers(0, 2))] if draw(st.booleans()) else []
        tail = rand_ids(draw(st.integers(1, 40)), 400 + i)
        reqs.append((head + tail, draw(st.integers(1, 30)), draw(st.integers(-1, 1))))
    page = draw(st.sampled_from([1, 2, 4]))
    longest = max(len(ids) + n for ids, n, _ in reqs)
    slots = -(-longest // page) * page + draw(st.integers(0, 3)) * page * 8
    cfg = dict(page_size=page, chunked_prefill_size=draw(st.sampled_from([0, 8, 32])),
               max_prefill_tokens=draw(st.sampled_from([16, 48, 4096])),
               schedule_policy=draw(st.sampled_from(["fcfs", "lpm", "dfs-weight"])),
               radix_eviction_policy=draw(st.sampled_from(["lru", "gdsf"])),
               max_running_requests=draw(st.sampled_from([1, 3, 64])))
    return reqs, slots, cfg


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=_scenarios())
def test_random_scenarios_match_a_big_plain_engine(tiny_dir, scenario):
    reqs, slots, cfg = scenario
    bound = sum(len(ids) + n for ids, n, _ in reqs) + 10

    def run(core):
        for i, (ids, n, prio) in enumerate(reqs):
            core.add_request(Request(f"r{i}", ids, greedy(n), priority=prio))
        toks, reasons, _ = drive(core, max_steps=bound)
        assert len(reasons) == len(reqs) and all(r == FinishReason.LENGTH for r in reasons.values())
        assert core.stats()["kv"]["in_use"] == 0
        return toks

    ref = run(make_core(tiny_dir, 4096, chunked_prefill_size=0, schedule_policy="fcfs"))
    assert run(make_core(tiny_dir, slots, **cfg)) == ref


def test_bench_scheduling_subcommands_run(tiny_tok_dir, tmp_path, capsys):
    """`idleless bench policies | chunked-prefill | eviction` end to end on a tiny model (small sizes)."""
    import json

    from idleless.bench import scheduling

    common = ["--model", tiny_tok_dir, "--dtype", "float32", "--num-threads", "1", "--log-level", "warning"]
    out = tmp_path / "p.json"
    assert scheduling.main(["policies", "--num-requests", "8", "--settings", "constrained", "--policies", "fcfs,lpm",
                            "--constrained-max-running", "4", "--output", str(out)] + common) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in res] == ["fcfs", "lpm"] and all(r["outputs_equal_first_run"] for r in res)
    assert all(0 < r["cache_hit_rate"] < 1 and r["fraction_of_upper_bound"] is None for r in res)
    out = tmp_path / "c.json"
    assert scheduling.main(["chunked-prefill", "--decoders", "2", "--decode-tokens", "12", "--long-prompts", "1",
                            "--long-prompt-len", "600", "--first-arrival", "2", "--chunk-sizes", "128",
                            "--output", str(out)] + common) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["chunked_prefill_size"] for r in res] == [0, 128]
    assert all(r["outputs_equal_unchunked"] and r["num_itl_samples"] == 2 * 11 for r in res)
    out = tmp_path / "e.json"
    assert scheduling.main(["eviction", "--rounds", "3", "--docs-per-round", "4", "--output", str(out)] + common) == 0
    res = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert res["gdsf"]["cache_hit_rate"] >= res["lru"]["cache_hit_rate"]
    assert res["lru + pin"]["hot_prefix_hits"] == res["lru + pin"]["hot_prefix_uses"] == 6
    assert "policy" in capsys.readouterr().out
