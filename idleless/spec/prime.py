"""Start-up costs for the adaptive controller (issue 13: "a cost model measured at start-up or online").

Before the first request, ``prime(controller, runner)`` times dummy steps of the target runner (the
verify's shape: requests of up to ``1 + max_draft`` tokens, every row sampled) at a grid of token
counts, and of the draft model's runner (one token per request, as a draft step) at a grid of
request counts, on the controller's clock, and hands them to ``StepCost.prime``. The online model
then knows from its first step what a verify of 28 tokens costs against a plain step of 4, and what
a draft step costs, instead of assuming verifies no dearer than the largest measured step and a draft
step its weight-byte ratio of a target step, and probing to find out (each probe a verify and k draft
steps that may not pay: on a 5-second run of 4 requests, 3-4 probes were several percent of the CPU
time). The online costs still set the level (``StepCost.predict``: the prior's shape scaled to the
nearest measured bucket), so the dummy steps' short context and quiet caches do not have to match the
run's.

The dummy requests attend to ``CONTEXT`` tokens of context (a decode's attention grows with it: a
plain 64-request step at random.json's ~300 tokens costs about twice one without context on Zen 4),
computed once, untimed, and read by every request through its own permutation of the context's pages,
so no two requests share a stretch of slots (a shared prefix would take the cheaper cascade path).
Their K/V go into slots taken from the runner's own pool and given back before anything else uses it;
no prefix cache sees them.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

# token counts timed on the target runner (plain steps of 1-8 requests, verifies up to 256 tokens)
TARGET_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256)
# request counts timed on the draft runner (one token each: a draft step)
DRAFT_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
# sizes up to this are timed twice (the cheaper of the two is kept: CPU time only grows with noise)
REPEAT_BELOW = 16
# tokens of context every dummy request attends to (fewer when the pool is smaller)
CONTEXT = 256


def measure_step_costs(runner, sizes: Sequence[int], tokens_per_request: int,
                       clock: Optional[Callable[[], float]] = None, context: int = CONTEXT) -> list[tuple[int, float]]:
    """Seconds (on ``clock``, default ``time.perf_counter``) of ``runner.execute`` for one dummy step
    per size in ``sizes``: ``ceil(size / tokens_per_request)`` requests of at most
    ``tokens_per_request`` tokens each (``size`` tokens in all) after ``context`` tokens of context
    (rounded down to whole pages; none when the pool cannot spare twice that), every row sampled
    greedily. The context is computed once and one step runs untimed first (caches, kernel set-up).
    A size the pool cannot hold is skipped. Returns (size, seconds) pairs; the runner's pool holds
    what it held before."""
    import torch

    from idleless.engine.plan import ScheduledRequest, StepPlan
    from idleless.spec.draft import GREEDY

    clock = clock or time.perf_counter
    pool = runner.pool
    ps = pool.page_size
    vocab = runner.model_config.vocab_size
    per = max(1, tokens_per_request)
    ctx_len = min(context, pool.num_free_slots // 2) // ps * ps
    ctx = pool.alloc(0, 0, ctx_len) if ctx_len else None
    if ctx is None:
        ctx_len, ctx = 0, torch.empty(0, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)

    def step(size: int, warm: bool = False) -> Optional[float]:
        lens = [min(per, size - i) for i in range(0, size, per)]
        slots, tables = [], []
        try:
            for n in lens:
                s = pool.alloc(0, 0, n)  # whole fresh pages after the context's
                if s is None:
                    return None
                slots.append(s)
                pages = torch.randperm(ctx_len // ps, generator=gen) if ctx_len else torch.empty(0, dtype=torch.int64)
                own = ctx.view(-1, ps)[pages].reshape(-1) if ctx_len else ctx
                tables.append(torch.cat([own, s]))
            plan = StepPlan([ScheduledRequest(f"prime#{j}", [(7 * j + i + 1) % vocab for i in range(n)], 1, ctx_len, t,
                                              GREEDY) for j, (n, t) in enumerate(zip(lens, tables))])
            t0 = clock()
            runner.execute(plan)
            return None if warm else clock() - t0
        finally:
            for s in slots:
                pool.free(s)

    try:
        if ctx_len:  # the context, computed once (prefill, no sampled row)
            runner.execute(StepPlan([ScheduledRequest("prime#ctx", [(3 * i + 1) % vocab for i in range(ctx_len)],
                                                      ctx_len, 0, ctx)]))
        out = []
        if sizes:
            step(min(8, max(sizes)), warm=True)
        for size in sizes:
            times = [t for t in (step(size) for _ in range(2 if size <= REPEAT_BELOW else 1)) if t is not None]
            if times and all(math.isfinite(t) for t in times):
                out.append((size, min(times)))
        return out
    finally:
        if ctx_len:
            pool.free(ctx)


def prime(controller, runner) -> None:
    """Prime ``controller`` (an ``AdaptiveProposer``) with start-up costs of ``runner`` (the target's
    ``ModelRunner``) and, for a proposer with a draft model of its own (``inner.runner``, a nonzero
    ``cost_hint``), of its draft steps. Does nothing for another runner (a scripted one in tests) or a
    tensor-parallel one (its workers run every plan rank 0 executes)."""
    from idleless.model.runner import ModelRunner

    if not controller.adaptive or not isinstance(runner, ModelRunner) or getattr(runner, "tp", None) is not None:
        return
    clock = controller.clock or time.perf_counter
    controller.step_cost.prime(measure_step_costs(runner, TARGET_GRID, 1 + controller.max_draft, clock))
    inner = controller.inner
    draft = getattr(inner, "runner", None)
    if inner.cost_hint > 0 and isinstance(draft, ModelRunner):
        controller.draft_step_cost.prime(measure_step_costs(draft, DRAFT_GRID, 1, clock))
