"""The scheduler through its plan -> execute -> commit interface, with a scripted runner and no model.

The scripted "model" is a pure function of the tokens before a position (``next_token``), so the
expected output of every request is known by hand; the runner checks each plan it executes against
its own record of each request's tokens (the KV it was told to write), the way a real runner's
attention would read them.
"""

from __future__ import annotations

import types

import pytest

from idleless.cache.kv_pool import KVPool
from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.plan import StepPlan, StepResult
from idleless.engine.request import Request, SamplingParams
from idleless.spec.proposer import Proposer
from kv_invariants import check_ownership, tree_nodes

VOCAB = 64
EOS = 1


def next_token(ids) -> int:
    """The scripted model: the next token after ``ids`` (never EOS)."""
    return 2 + (ids[-1] * 7 + len(ids)) % (VOCAB - 2)


def expected(prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt):]


class ScriptedRunner:
    """Executes plans with ``next_token``. Keeps, per rid, the token at every position whose KV was
    written (dropped when the plan says the request finished), and asserts the plan is consistent:
    a step starts where the KV ends (or at a cached prefix), slots are distinct and in the pool."""

    def __init__(self, num_slots: int, page_size: int = 1, context_length: int = 4096):
        self.pool = KVPool(1, 1, 4, num_slots, __import__("torch").float32, "cpu", page_size)
        self.model_config = types.SimpleNamespace(vocab_size=VOCAB, eos_token_ids=[EOS])
        self.context_length = context_length
        self.plans: list[StepPlan] = []
        self.kv_tokens: dict[int, int] = {}  # slot -> token whose KV it holds

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        written = set()
        sampled, lps, tops = [], [], []
        for r in plan.requests:
            assert len(r.slot_table) == r.start + r.num_tokens
            out = r.out_slots.tolist()
            assert not written & set(out), "two requests write one slot"
            written |= set(out)
            # the prefix this step attends to must hold the request's tokens (cached or computed)
            seq = [self.kv_tokens[s] for s in r.slot_table[: r.start].tolist()] + list(r.token_ids)
            for s, t in zip(out, r.token_ids):
                self.kv_tokens[s] = t
            k = r.num_sampled
            rows = [next_token(seq[: r.start + r.num_known + j]) for j in range(k)]
            sampled.append(rows)
            lps.append([-0.5] * k)
            tops.append([None] * k)
        return StepResult(sampled, lps, tops)


def make_core(num_slots=256, page_size=1, proposer=None, **kw) -> EngineCore:
    cfg = EngineConfig(kv_cache_memory="1MiB", page_size=page_size, **kw)
    core = EngineCore(cfg, runner=ScriptedRunner(num_slots, page_size))
    if proposer is not None:
        core.scheduler.proposer = proposer
    return core


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_new_tokens=n, **kw)


def run(core, reqs, max_steps=1000):
    for r in reqs:
        core.add_request(r)
    toks, reasons = {}, {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.rid] = o.finish_reason.value
        check_ownership(core.scheduler)
    assert not core.has_work()
    return toks, reasons


PROMPT = list(range(10, 20))


def test_chunked_prefill_then_decode_plans():
    core = make_core(chunked_prefill_size=4)
    core.add_request(Request("a", PROMPT, greedy(3)))
    plans = []
    for _ in range(6):
        plans.append(core.scheduler.schedule())
        core.scheduler.commit(plans[-1], core.runner.execute(plans[-1]))
    got = [(p.requests[0].token_ids, p.requests[0].start, p.requests[0].sampling is not None) for p in plans[:5]]
    out = expected(PROMPT, 3)
    assert got == [(PROMPT[0:4], 0, False), (PROMPT[4:8], 4, False), (PROMPT[8:10], 8, True),
                   ([out[0]], 10, True), ([out[1]], 11, True)]
    # finished in step 5; an empty plan is not executed, so the runner is told with the next real plan
    assert plans[5].requests == [] and plans[5].finished_ids == []
    assert core.scheduler.take_outputs()[-1].new_token_ids == out[2:]
    core.add_request(Request("b", PROMPT, greedy(1)))
    assert core.scheduler.schedule().finished_ids == ["a"]


def test_mixed_step_decode_and_admitted_prefill_share_one_plan():
    core = make_core()
    core.add_request(Request("a", PROMPT, greedy(5)))
    p1 = core.scheduler.schedule()
    core.scheduler.commit(p1, core.runner.execute(p1))
    core.add_request(Request("b", [5, 6, 7], greedy(2)))
    p2 = core.scheduler.schedule()
    assert [(r.rid, r.num_known, r.start) for r in p2.requests] == [("a", 1, 10), ("b", 3, 0)]
    assert p2.num_tokens == 4 and all(r.sampling is not None for r in p2.requests)
    core.scheduler.commit(p2, core.runner.execute(p2))
    toks, _ = run(core, [])
    assert core.scheduler.stats.num_finished == 2


def test_outputs_equal_the_scripted_model_with_cache_hits_and_retraction():
    prompts = [PROMPT + [i] * 30 for i in range(6)] + [PROMPT + [0] * 30]  # the last repeats the first
    reqs = [Request(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)]
    big, _ = run(make_core(num_slots=4096), reqs)
    core = make_core(num_slots=140, max_running_requests=8)
    small, reasons = run(core, [Request(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)])
    assert core.scheduler.stats.num_retractions > 0  # the tiny pool forced retraction
    for i, p in enumerate(prompts):
        assert big[f"r{i}"] == small[f"r{i}"] == expected(p, 20), i
    assert set(reasons.values()) == {"length"}


class ScriptedProposer(Proposer):
    """Proposes the true next tokens with the token at ``wrong_at`` replaced (wrong_at=None: all right)."""

    def __init__(self, k: int, wrong_at=None):
        self.k, self.wrong_at = k, wrong_at

    def propose(self, requests, max_tokens):
        out = []
        for rec, cap in zip(requests, max_tokens):
            guess = expected(rec.all_ids, min(self.k, cap))
            if self.wrong_at is not None and self.wrong_at < len(guess):
                guess[self.wrong_at] = 2 + (guess[self.wrong_at] - 1) % (VOCAB - 2)  # any other token
            out.append(guess)
        return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_proposed_tokens_accepted_in_part_and_rejected_slots_freed_never_cached(page_size):
    core = make_core(num_slots=512, page_size=page_size, proposer=ScriptedProposer(3, wrong_at=2))
    core.add_request(Request("a", PROMPT, greedy(12)))
    sched = core.scheduler
    p = sched.schedule()
    sched.commit(p, core.runner.execute(p))  # prefill: one sampled token
    rec = sched.running[0]
    free_before = sched.pool.num_free_slots
    p = sched.schedule()
    (sr,) = p.requests
    assert sr.num_known == 1 and sr.num_proposed == 3 and sr.num_sampled == 4 and p.num_tokens == 4
    true = expected(rec.all_ids, 3)
    assert sr.proposed[:2] == true[:2] and sr.proposed[2] != true[2]
    sched.commit(p, core.runner.execute(p))
    # two proposed tokens accepted + the model's own third: three new tokens from one step
    assert rec.output_ids == expected(PROMPT, 4)
    assert rec.num_computed == len(PROMPT) + 3  # the known token and the two accepted ones
    assert len(rec.slots) == rec.num_computed  # the rejected token's slot left the table
    tokens_held = -(-rec.num_computed // page_size) * page_size - -(-(len(PROMPT)) // page_size) * page_size
    assert sched.pool.num_free_slots == free_before - tokens_held
    check_ownership(sched)
    toks, _ = run(core, [])
    assert rec.output_ids == expected(PROMPT, 12)
    # nothing cached ever holds a rejected token: every cached path is a prefix of the true sequence
    truth = PROMPT + expected(PROMPT, 12)
    for node in tree_nodes(sched.cache):
        path, n = [], node
        while n is not sched.cache.root:
            path = n.key + path
            n = n.parent
        assert truth[: len(path)] == path


def test_proposals_respect_max_new_tokens_and_a_stop_inside_them():
    core = make_core(proposer=ScriptedProposer(8))
    out = expected(PROMPT, 8)
    toks, reasons = run(core, [Request("a", PROMPT, greedy(5)), Request("b", PROMPT, greedy(8, stop_token_ids=[out[2]]))])
    assert toks["a"] == out[:5] and reasons["a"] == "length"
    assert toks["b"] == out[:3] and reasons["b"] == "stop"
    # after the first token, a may take 4 more (1 known + 3 proposed) and b 7: no more was proposed
    widest = {rid: max(r.num_tokens for p in core.runner.plans for r in p.requests if r.rid == rid and r.num_known == 1)
              for rid in "ab"}
    assert widest == {"a": 4, "b": 7}


def test_abort_between_schedule_and_commit_frees_everything():
    core = make_core()
    core.add_request(Request("a", PROMPT, greedy(5)))
    core.add_request(Request("b", PROMPT[:5], greedy(5)))
    p = core.scheduler.schedule()
    result = core.runner.execute(p)
    assert core.abort("a")
    core.scheduler.commit(p, result)
    check_ownership(core.scheduler)
    assert [r.rid for r in core.scheduler.running] == ["b"]
    assert core.scheduler.schedule().finished_ids == ["a"]


def test_prefill_only_request_samples_nothing_and_caches_its_prompt():
    core = make_core()
    toks, reasons = run(core, [Request("p", PROMPT, SamplingParams(max_new_tokens=0))])
    assert toks["p"] == [] and reasons["p"] == "length"
    assert all(r.sampling is None for p in core.runner.plans for r in p.requests)
    assert core.scheduler.cache.peek_prefix_len(PROMPT) == len(PROMPT)


def test_pin_prefix_prefills_then_pins_and_survives_a_flood():
    core = make_core(num_slots=200, max_pinned_tokens=64)
    hot = list(range(10, 50))
    res = {}
    core.pin_prefix("sys", hot, 60.0, lambda n, err: res.update(n=n, err=err))
    assert res == {}  # not cached yet: prefilled first
    run(core, [])
    assert res == {"n": 40, "err": None}
    flood = [Request(f"f{i}", [50 + i % 7] * 50, greedy(10)) for i in range(12)]
    run(core, flood)
    assert core.scheduler.stats.evicted_tokens > 0 or core.scheduler.cache.num_evicted > 0
    assert core.scheduler.cache.peek_prefix_len(hot) == 40
    res.clear()
    core.pin_prefix("big", list(range(2, 62)), 60.0, lambda n, err: res.update(n=n, err=err))
    run(core, [])
    assert res["n"] is None and "pinned budget" in res["err"]
    assert core.unpin_prefix("sys") and not core.unpin_prefix("sys")
    nocache = make_core(disable_radix_cache=True)
    nocache.pin_prefix("x", hot, 60.0, lambda n, err: res.update(n=n, err=err))
    assert res["n"] is None and "disabled" in res["err"]
