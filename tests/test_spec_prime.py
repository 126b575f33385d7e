"""Start-up step costs for the adaptive controller (idleless.spec.prime) on tiny random Llamas built here.

What is checked: the dummy steps leave the runner's KV pool as it was (every page free again) and
nothing in any prefix cache; a size the pool cannot hold is skipped; an engine with adaptive
speculation starts with both priors set (the target's and, for a self-draft, the draft's), a fixed
draft length or a scripted runner primes nothing; and greedy outputs equal plain decoding's after
priming (the dummy K/V never reach a request)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from conftest import TEST_THREADS, make_tiny_model

from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.request import Request, SamplingParams
from idleless.spec.adaptive import AdaptiveProposer
from idleless.spec.prime import TARGET_GRID, measure_step_costs, prime
from idleless.spec.proposer import Proposer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prime"))


def cfg(model, **kw):
    return EngineConfig(model=model, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS, **kw)


@pytest.mark.parametrize("page_size", [1, 16])
def test_dummy_steps_leave_the_pool_as_it_was(model, page_size):
    core = EngineCore(cfg(model, page_size=page_size))
    pool = core.runner.pool
    free = pool.num_free_slots
    out = measure_step_costs(core.runner, (1, 3, 8, 40), 7, time.process_time, context=64)
    assert [x for x, _ in out] == [1, 3, 8, 40] and all(t > 0 for _, t in out)
    assert pool.num_free_slots == free and core.scheduler.cache.total_size == 0
    too_big = pool.num_free_slots + page_size  # more tokens than the pool holds: skipped, nothing taken
    assert measure_step_costs(core.runner, (2, too_big), 7, context=0) [-1][0] == 2
    assert pool.num_free_slots == free


def test_an_adaptive_engine_starts_primed_and_decodes_as_plain(model):
    plain = EngineCore(cfg(model))
    spec = EngineCore(cfg(model, speculative_algorithm="ngram", speculative_num_draft_tokens=3))
    ctl = spec.proposer
    assert ctl.step_cost.primed and [x for x, _ in ctl.step_cost._prior] == [float(x) for x in TARGET_GRID]
    assert not ctl.draft_step_cost.primed  # ngram drafts for free: no draft runner to time
    fixed = EngineCore(cfg(model, speculative_algorithm="ngram", speculative_disable_adaptive=True))
    assert not fixed.proposer.step_cost.primed
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11], [3] * 20]
    outs = []
    for core in (plain, spec):
        got = {}
        for i, p in enumerate(prompts):
            core.add_request(Request(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)))
            got[f"r{i}"] = []
        while core.has_work():
            for o in core.step():
                got[o.rid] += o.new_token_ids
        outs.append(got)
    assert outs[0] == outs[1]


def test_a_scripted_runner_is_not_primed():
    ctl = AdaptiveProposer(Proposer(), max_draft=3)
    prime(ctl, SimpleNamespace(pool=None, execute=lambda plan: None))
    assert not ctl.step_cost.primed and not ctl.draft_step_cost.primed
