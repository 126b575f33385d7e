"""Adaptive speculation: how many tokens to draft for each request, and whether to draft at all.

``AdaptiveProposer`` wraps any proposer. Each step it gives every decoding request a draft length
from two measured things:

* the request's acceptance rate ``a`` (the chance that a guess is accepted given the ones before it
  were): a decayed count of accepted guesses and first rejections, so it follows the request as its
  text moves between copying and free writing (SGLang's adaptive EAGLE keeps an EMA the same way);
* a cost model of the step, measured online: its seconds outside drafting (planning, forward or
  verify, commit) as a function of the tokens in it (``StepCost``: the median of the recent steps
  per power-of-two bucket of token counts, interpolated), plus the proposer's seconds per draft step
  (a draft model runs one step per guess depth for all drafting requests together) as a function
  of the number of drafting requests (another ``StepCost``; before it is measured, its start-up
  prior times the ratio of the run's plain step to its start-up twin (the same context makes both
  dearer: 1.2x for 4 requests of random.json on Zen 4), else the proposer's ``cost_hint`` times a
  target step); the draft time of a plan is its depth times that;
* the proposer's catch-up: a draft model must first compute the tokens of a request it has not seen
  (its prompt) or that it fell behind on (steps without guesses), ``Proposer.catchup_tokens``. That
  forward's seconds per token are measured online (a third ``StepCost``, by catch-up tokens; before
  it is measured, the proposer's ``catchup_cost_hint``). A catch-up is paid once and serves the
  request's remaining steps, so a plan that starts drafting for a lagging request is charged its
  catch-up seconds times the share of the request's remaining tokens (at most ``CATCHUP_HORIZON``)
  this step is expected to produce.

Under the usual i.i.d. model (Leviathan et al., arXiv 2211.17192, section 3.1) the j-th guess of a
request adds ``a**j`` expected tokens. The controller adds guesses in order of that value, across
the whole batch, and keeps the count at which the expected tokens per second of the step
(``B + sum of a**j`` over ``step time(B + drafts) + draft time + catch-up charge``) is highest,
if that beats plain decoding by ``MARGIN`` (a 15% predicted gain: the costs are measured, but they
drift between measurements, and the rates are optimistic). Speculation is therefore off for a step when no guess pays: at large
batches, where the verify tokens are no longer free (the step is compute-bound), when drafting costs
about what it saves, or when nothing is being accepted. Plans use an upper confidence bound
of the rate (the estimate plus ``OPTIMISM / sqrt(1 + evidence)``), and the evidence of requests left
without drafts decays, so a request is probed again a while after its guesses stopped paying (the
exploration of UCB1, Auer et al. 2002). A plain step of the batch's size is always measured before
a verify is judged against it (until its bucket holds ``MIN_SAMPLES`` steps, speculation is off): a
verify must never be compared with a guess of what plain decoding costs; and it is measured again
now and then (``PLAIN_REFRESH``), so one taken on a busy moment or at a shorter context is corrected. Costs
are in process CPU seconds where the engine passes that clock (``clock``): on a shared machine the wall
time of a step is mostly the other jobs' and moves by several times between a plain step and a verify
measured minutes apart. Only decode steps enter the step cost (the requests of the step's
``propose`` call, one token each plus their guesses): a prefill's tokens attend to less context.

The engine primes the step costs at start-up (``idleless.spec.prime``: target steps of 1-256 tokens,
draft steps of 1-64 requests, timed on dummy requests): outside the measured range a prediction is
the nearest measured bucket plus the start-up curve's difference, so a verify, and a draft step
before its first one, are judged by what they cost rather than tried to find out. Unprimed (a
scripted runner), the model is flat above the largest measured step, so a larger verify is assumed
no dearer than that and gets tried (and measured).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import statistics
import time
from typing import Sequence

from idleless.spec.proposer import Proposer

# Decay of a request's accepted / rejected counts per verify result (an EMA with weight 1 - DECAY).
DECAY = 0.7
# Per step without drafts, a request's counts shrink by this factor toward the batch-wide prior.
IDLE_DECAY = 0.95
# Pseudo-counts of the batch-wide acceptance rate in every request's estimate.
PRIOR_WEIGHT = 2.0
# Optimism in the planning rate: + OPTIMISM / sqrt(1 + evidence) (an upper confidence bound), so a
# request whose guesses stopped paying is probed again once its decayed evidence has shrunk. With the
# step costs measured at start-up (``idleless.spec.prime``) only the acceptance is unknown at first, and
# OPTIMISM_PRIMED applies: a request without evidence is planned at the prior (0.5 before any verify)
# + 0.5, so a draft that pays only at high acceptance (an int4 self-draft at one request: about 0.85 on
# AMD EPYC Zen 4) is tried. Unprimed, the cost model is the optimistic part (a verify above the largest
# measured step is assumed no dearer), and the smaller OPTIMISM applies.
OPTIMISM = 0.3
OPTIMISM_PRIMED = 0.5
# ... for at most this many requests of a step (those with the least evidence)
EXPLORE_REQUESTS = 4
# Step-cost buckets: samples before a bucket is trusted, and how many recent ones its median covers
# (a median, so a first step that builds caches or a step that met a busy machine does not move it).
MIN_SAMPLES = 2
WINDOW = 5
# Token counts up to this have a bucket each (a step of 3 tokens, or 3 drafting requests, is not one of
# 4); larger ones share power-of-two buckets.
EXACT_BUCKETS = 8
# Speculation must be predicted this much faster than plain decoding: costs drift between measurements
# (attention grows with the context) and plans use optimistic rates (at 0.96 accepted, six guesses are
# planned as worth 7 tokens, not 6.2), so a predicted gain of a few percent must not become a loss.
MARGIN = 1.15
# A catch-up is charged over at most this many of the request's remaining tokens (a request may end
# at EOS long before its max_tokens).
CATCHUP_HORIZON = 128
# With n samples of the plain step of the batch's size (at most WINDOW), one step in PLAIN_REFRESH * n
# speculating ones is plain, so a plain cost measured on a busy moment, or at a shorter context, is
# corrected.
PLAIN_REFRESH = 8
# Accepted-length histogram size for the metrics (0 .. MAX_HIST accepted guesses per verify).
MAX_HIST = 16


def _bucket(tokens: float) -> int:
    """``ceil(tokens)`` up to ``EXACT_BUCKETS``, then one bucket per power of two."""
    if tokens <= EXACT_BUCKETS:
        return max(1, math.ceil(tokens))
    return EXACT_BUCKETS + math.ceil(math.log2(tokens / EXACT_BUCKETS))


class StepCost:
    """Seconds of a step as a function of its token count, learnt online, optionally shaped by a
    start-up measurement (``prime``).

    Per bucket (one per token count up to ``EXACT_BUCKETS``, then one per power of two) the last
    ``WINDOW`` (tokens, seconds) samples; the bucket's point
    is their median tokens and median seconds. ``predict`` interpolates linearly between trusted
    buckets (``MIN_SAMPLES`` samples). Outside the trusted range: without a prior, below the smallest
    it scales that bucket's time down in proportion to the tokens, above the largest it is flat (a
    larger step is assumed no dearer than the largest measured, so it gets tried and measured); with
    a prior (start-up costs, ``prime``), the dearer of two readings from the nearest trusted bucket:
    its seconds plus the prior's difference between the two token counts, or its seconds times the
    prior's ratio (the start-up measured what 24 more tokens cost at 256 tokens of context; the run
    measures the level. A guess row's attention grows with its request's context, so when the run's
    step is dearer than its start-up twin the extra tokens are too: on Zen 4 a 448-token verify over
    shared_prefix.json's ~880 tokens of context cost 1.48 s, 7x the plain 64-token step, where the
    added difference predicted 3.8x and the ratio 8.9x); below the smallest bucket never less than
    its proportional share. None until a bucket is trusted or a prior
    is set."""

    def __init__(self):
        self._buckets: dict[int, collections.deque] = {}  # bucket -> deque of (tokens, seconds)
        self._pts = None  # the trusted (tokens, seconds) points, sorted; rebuilt after an add
        self._prior: list[tuple[float, float]] = []  # start-up (tokens, seconds), sorted by tokens

    def add(self, tokens: int, seconds: float) -> None:
        """One executed step: ``tokens`` (>= 1) computed in ``seconds``."""
        if tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        self._buckets.setdefault(_bucket(tokens), collections.deque(maxlen=WINDOW)).append((float(tokens), seconds))
        self._pts = None

    def prime(self, points) -> None:
        """Set the prior: ``points``, (tokens >= 1, seconds > 0) pairs measured at start-up (the same
        clock as ``add``); pairs with other values are ignored. Replaces an earlier prior."""
        pts = sorted((float(x), float(t)) for x, t in points if x >= 1 and math.isfinite(t) and t > 0)
        self._prior = [p for i, p in enumerate(pts) if i == 0 or p[0] > pts[i - 1][0]]

    @property
    def primed(self) -> bool:
        return bool(self._prior)

    @property
    def measured(self) -> bool:
        """Whether any bucket is trusted (holds ``MIN_SAMPLES`` samples)."""
        return any(len(b) >= MIN_SAMPLES for b in self._buckets.values())

    def prior(self, tokens: float):
        """The prior's seconds at ``tokens``: interpolated between its points, scaled down in
        proportion below the smallest, extended along its last segment's (non-negative) slope above
        the largest (measured costs grow with the tokens on a compute-bound device; on a device where
        they do not, the measured slope is ~0). None without a prior."""
        pts = self._prior
        if not pts:
            return None
        i = bisect.bisect_left([x for x, _ in pts], tokens)
        if i == 0:
            return pts[0][1] * min(1.0, tokens / pts[0][0])
        if i == len(pts):
            if len(pts) == 1:
                return pts[-1][1]
            (x0, t0), (x1, t1) = pts[-2], pts[-1]
            return t1 + max(0.0, (t1 - t0) / (x1 - x0)) * (tokens - x1)
        (x0, t0), (x1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (tokens - x0) / (x1 - x0)

    def samples(self, tokens: float) -> int:
        """Samples (at most ``WINDOW``) in the bucket holding ``tokens`` (>= 1); trusted from ``MIN_SAMPLES``."""
        return len(self._buckets.get(_bucket(tokens), ()))

    def predict(self, tokens: float):
        """Predicted seconds for a step of ``tokens`` tokens, or None before any bucket is trusted
        and without a prior."""
        if self._pts is None:
            pts = sorted((statistics.median(x for x, _ in b), statistics.median(t for _, t in b))
                         for b in self._buckets.values() if len(b) >= MIN_SAMPLES)
            self._pts = (pts, [x for x, _ in pts])
        pts, xs = self._pts
        if not pts:
            return self.prior(tokens)
        i = bisect.bisect_left(xs, tokens)
        if 0 < i < len(pts):
            (x0, t0), (x1, t1) = pts[i - 1], pts[i]
            return t0 + (t1 - t0) * (tokens - x0) / (x1 - x0) if x1 > x0 else t1
        if i < len(pts) and xs[i] == tokens:
            return pts[i][1]
        x, t = pts[0] if i == 0 else pts[-1]
        if self._prior:  # from the nearest trusted bucket along the prior, the dearer of two readings
            p, px = self.prior(tokens), self.prior(x)
            return max(t + p - px, t * p / px, t * tokens / x if i == 0 else 0.0)
        return t * min(1.0, tokens / x) if i == 0 else t


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens a verify of ``k`` guesses yields at acceptance rate ``a``: the accepted run
    plus the target's own token, ``sum_{j=0..k} a**j`` (Leviathan et al., eq. 1)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class AdaptiveProposer(Proposer):
    """Wraps ``inner`` (the proposer that guesses) with per-request draft lengths and auto-off.

    max_draft: the most guesses per request per step (``--speculative-num-draft-tokens``);
    adaptive=False always asks for max_draft (bounded by the scheduler's room) and never switches off.
    ``stats()``: counters for /metrics and the offline report (see its docstring)."""

    def __init__(self, inner: Proposer, max_draft: int, adaptive: bool = True, clock=None, clock_threads: int = 1):
        self.inner = inner
        # The cost model's clock. None: the step seconds the scheduler reports and the wall clock around
        # drafting. A CPU clock (``time.process_time``, what the engine passes): a step's cost is the CPU
        # seconds between two ``observe_step`` calls less the drafting's, at most the reported step
        # seconds times ``clock_threads`` (the torch threads; so a gap between steps cannot count).
        # On a shared machine a step's wall time is mostly the other jobs: at 1 thread and load ~5 on
        # AMD EPYC Zen 4 a plain 64-token step took 0.22-1.05 s of wall for 0.21-0.27 s of CPU, and plain
        # steps and verifies measured minutes apart compared the load, not the steps.
        self.clock = clock
        self.clock_threads = max(1, clock_threads)
        self._clock_mark = None  # the clock at the last observe_step
        self._clock_draft = 0.0  # the clock's drafting seconds since then
        self.name = inner.name
        self.max_draft = max_draft
        self.adaptive = adaptive
        self.step_cost = StepCost()
        self.draft_step_cost = StepCost()  # seconds per draft step, by the number of drafting requests
        self.catchup_cost = StepCost()  # seconds of the proposer's catch-up forward, by its tokens
        self._counts: dict[str, list[float]] = {}  # rid -> [accepted, rejected] (decayed)
        self._global = [1.0, 1.0]  # batch-wide decayed counts (the prior of every request)
        self.num_verifies = 0  # request-verifies: one per request per step with guesses
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_steps_on = 0
        self.num_steps_off = 0
        self._on_since_plain = 0  # steps with guesses since the last one without
        self._step_batch = None  # decoding requests of this step's propose call (None: no call yet)
        self.draft_seconds = 0.0
        self.accepted_hist = [0] * (MAX_HIST + 1)

    # -- planning --------------------------------------------------------------------------
    def acceptance(self, rid: str) -> float:
        """The request's estimated acceptance rate in [0, 1] (the batch-wide one before it has any)."""
        g_acc, g_rej = self._global
        prior = g_acc / (g_acc + g_rej)
        acc, rej = self._counts.get(rid, (0.0, 0.0))
        return (acc + PRIOR_WEIGHT * prior) / (acc + rej + PRIOR_WEIGHT)

    def planning_rate(self, rid: str, explore: bool = True) -> float:
        """``acceptance(rid)`` plus the optimism bonus ``OPTIMISM / sqrt(1 + evidence)`` (``OPTIMISM_PRIMED``
        once the step costs are primed and ``explore``), at most 1."""
        acc, rej = self._counts.get(rid, (0.0, 0.0))
        bonus = OPTIMISM_PRIMED if self.step_cost.primed and explore else OPTIMISM
        return min(1.0, self.acceptance(rid) + bonus / math.sqrt(1.0 + acc + rej))

    def planning_rates(self, requests: Sequence) -> list[float]:
        """``planning_rate`` per request, the larger primed bonus for at most ``EXPLORE_REQUESTS`` of
        them (the least evidence first, then the batch order): a trial at 64 requests then costs a few
        requests' guesses, not 64 x k (on shared_prefix.json such a verify cost 5-7 plain steps), and
        the batch-wide prior the trial moves serves the others."""
        ev = [sum(self._counts.get(r.rid, (0.0, 0.0))) for r in requests]
        explore = set(sorted(range(len(requests)), key=lambda i: ev[i])[:EXPLORE_REQUESTS])
        return [self.planning_rate(r.rid, i in explore) for i, r in enumerate(requests)]

    def draft_lengths(self, rates: Sequence[float], room: Sequence[int],
                      catchup: Sequence[int] = ()) -> list[int]:
        """Guesses per request that maximise the step's expected tokens per second (module
        docstring). ``rates``: acceptance per request; ``room``: the most each may take (its
        remaining tokens less one); ``catchup``: tokens the proposer must compute for each before
        its first guess (``Proposer.catchup_tokens``; none when empty). The verify cost depends on
        the number m of guesses, the draft cost on their depth and on how many requests draft, plus
        the amortised catch-up of the drafting ones; so for every depth cap d and every m, the m
        guesses of highest value ``a**j`` with j <= d are taken (once among all requests, once among
        those without a catch-up), and the best ratio wins (the fewest guesses on a tie) if it beats
        plain decoding by ``MARGIN``. Exact when drafting is free (a tie-free top-m is then optimal);
        near it otherwise. All zeros when no guess pays (speculation off), while a plain step of this
        batch size is not measured yet, and for the plain refreshes (``PLAIN_REFRESH``)."""
        caps = [min(r, self.max_draft) for r in room]
        if not self.adaptive:
            return caps
        B = len(rates)
        n = self.step_cost.samples(B)  # measure plain decoding at this batch size first, and refresh it
        if n < MIN_SAMPLES or self._on_since_plain >= PLAIN_REFRESH * n:
            return [0] * B
        t_plain = self.step_cost.predict(B)
        charge = self._catchup_charges(rates, room, caps, catchup)
        gains = sorted(((a ** j, j, i) for i, a in enumerate(rates) for j in range(1, caps[i] + 1)),
                       key=lambda g: (-g[0], g[1], g[2]))
        verify = [self.step_cost.predict(B + m) for m in range(len(gains) + 1)]
        best, best_plan = MARGIN * B / t_plain, []
        # no plan of m guesses beats (B + the m largest gains) / verify[m] (its draft and catch-up
        # seconds are >= 0): where that bound loses for every m, speculation is off without the search
        # below (most steps of a batch whose verifies do not pay; the same answer, found sooner)
        bound, top = float(B), []
        for m, (gain, _, _) in enumerate(gains, 1):
            bound += gain
            top.append(bound / verify[m])
        if not top or max(top) <= best * (1 + 1e-12):
            return [0] * B
        hint = self.inner.cost_hint  # until the proposer is measured: its hint times a target step
        # a start-up draft step read the context of a dummy request; until the run's draft steps are
        # measured, they are taken as much dearer as the run's plain step is than its start-up twin
        prior = self.step_cost.prior(B)
        level = max(1.0, t_plain / prior) if prior and not self.draft_step_cost.measured else 1.0
        per_step = [0.0] + [level * self._draft_step(n, hint) for n in range(1, B + 1)]
        # the lagging requests' catch-up is all-or-nothing per request: plans with and without them
        pools = [None] + ([{i for i, c in enumerate(charge) if c == 0.0}] if any(charge) else [])
        for allowed, cap in itertools.product(pools, range(1, max(caps, default=0) + 1)):
            value, taken, depth, drafting, caught, plan = float(B), [0] * B, 0, 0, 0.0, []
            for gain, j, i in gains:
                if j > cap or (allowed is not None and i not in allowed):
                    continue
                value += gain
                if taken[i] == 0:
                    drafting += 1
                    caught += charge[i]
                taken[i] += 1
                depth = max(depth, taken[i])
                plan.append(i)
                ratio = value / (verify[len(plan)] + depth * per_step[drafting] + caught)
                if ratio > best * (1 + 1e-12):
                    best, best_plan = ratio, list(plan)
        ks = [0] * B
        for i in best_plan:
            ks[i] += 1
        return ks

    def _catchup_charges(self, rates, room, caps, catchup) -> list[float]:
        """Per request, the seconds of catch-up a plan that drafts for it is charged: its catch-up
        tokens times the seconds per catch-up token (measured at the batch's total, else the
        proposer's ``catchup_cost_hint``), times the share of its remaining tokens (at most
        ``CATCHUP_HORIZON``) that one verify at its cap is expected to yield."""
        total = sum(catchup)
        if not total:
            return [0.0] * len(rates)
        t = self.catchup_cost.predict(total)
        per_token = t / total if t is not None else self.inner.catchup_cost_hint
        return [n * per_token * min(1.0, expected_tokens(a, c) / min(r + 1, CATCHUP_HORIZON)) if n else 0.0
                for a, r, c, n in zip(rates, room, caps, catchup)]

    def _draft_step(self, n: int, hint: float) -> float:
        """Predicted seconds of one draft step for ``n`` drafting requests: measured, else the
        proposer's ``cost_hint`` times a target step of n tokens."""
        t = self.draft_step_cost.predict(n)
        if t is None:
            t = hint * (self.step_cost.predict(n) or 0.0)
        return t

    def propose(self, requests: Sequence, max_tokens: Sequence[int]) -> list[list[int]]:
        self._step_batch = len(requests)
        catchup = self.inner.catchup_tokens(requests) if self.adaptive else ()
        ks = self.draft_lengths(self.planning_rates(requests), max_tokens, catchup)
        if not any(ks):
            self._on_since_plain = 0
            self.num_steps_off += 1
            self._drift(requests)
            return [[] for _ in requests]
        self._on_since_plain += 1
        c0 = self.clock() if self.clock is not None else None
        t0 = time.perf_counter()
        drafts = [list(d[:k]) for d, k in zip(self.inner.propose(requests, ks), ks)]
        wall = dt = time.perf_counter() - t0
        self.draft_seconds += wall
        if c0 is not None:
            dt = max(self.clock() - c0, 0.0)
            self._clock_draft += dt
        depth = max(map(len, drafts))
        if depth:
            catchup = self.inner.last_catchup_s  # a prompt caught up: its forward is no draft step
            if catchup and c0 is not None:  # the proposer times it on the wall clock: its share of dt
                catchup = dt * min(1.0, catchup / wall) if wall > 0 else 0.0
            if catchup:
                self.catchup_cost.add(self.inner.last_catchup_tokens, catchup)
            if not catchup:
                self.draft_step_cost.add(sum(1 for d in drafts if d), dt / depth)
            elif depth > 1:
                self.draft_step_cost.add(sum(1 for d in drafts if d), max(dt - catchup, 0.0) / (depth - 1))
            self.num_steps_on += 1
        self._drift([r for r, d in zip(requests, drafts) if not d])
        return drafts

    def _drift(self, requests: Sequence) -> None:
        """Requests without guesses this step: their counts shrink toward the batch-wide prior."""
        for r in requests:
            c = self._counts.get(r.rid)
            if c is not None:
                c[0] *= IDLE_DECAY
                c[1] *= IDLE_DECAY

    # -- feedback --------------------------------------------------------------------------
    def observe(self, request, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        rejected = 1.0 if num_accepted < num_proposed else 0.0
        for c in (self._counts.setdefault(request.rid, [0.0, 0.0]), self._global):
            c[0] = DECAY * c[0] + num_accepted
            c[1] = DECAY * c[1] + rejected
        self.num_verifies += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.accepted_hist[min(num_accepted, MAX_HIST)] += 1
        self.inner.observe(request, num_proposed, num_accepted)

    def observe_step(self, num_tokens: int, num_proposed: int, step_s: float) -> None:
        """One executed step of ``num_tokens`` tokens (``num_proposed`` of them guesses) that took
        ``step_s`` seconds outside drafting (wall clock, the scheduler's). Its cost enters the model
        in the model's clock (``clock``; the first step with a CPU clock only starts it), and only for
        a decode step: exactly the requests of this step's ``propose`` call, one token each plus their
        guesses. A step with prompt tokens (a prefill, or decodes with a chunk beside them) is left
        out: its tokens attend to less context than a decode's, so its seconds per token would make
        verifies look cheaper than they are; the model compares a verify with plain decoding only."""
        decode = self._step_batch is not None and num_tokens == self._step_batch + num_proposed
        self._step_batch = None
        if self.clock is None:
            if decode:
                self.step_cost.add(num_tokens, step_s)
        else:
            now = self.clock()
            if self._clock_mark is not None and decode:
                cost = now - self._clock_mark - self._clock_draft
                self.step_cost.add(num_tokens, min(max(cost, 0.0), step_s * self.clock_threads))
            self._clock_mark, self._clock_draft = now, 0.0
        self.inner.observe_step(num_tokens, num_proposed, step_s)

    def finish(self, request) -> None:
        self._counts.pop(request.rid, None)
        self.inner.finish(request)

    def stats(self) -> dict:
        """``algorithm``; ``num_drafts`` (request-verifies), ``num_draft_tokens``,
        ``num_accepted_tokens``; ``acceptance_rate`` (accepted / drafted tokens);
        ``mean_accepted_length`` (tokens per verify: accepted guesses + the target's own);
        ``num_steps_on`` (steps with guesses) / ``num_steps_off`` (steps the cost model kept
        guess-free; steps where the proposer found nothing count as neither);
        ``draft_seconds``; ``accepted_hist`` (verifies by accepted guesses, 0..MAX_HIST); and the
        proposer's own counters under ``proposer``."""
        v = self.num_verifies
        return {
            "algorithm": self.name, "num_drafts": v, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "mean_accepted_length": (self.num_accepted_tokens + v) / v if v else 0.0,
            "num_steps_on": self.num_steps_on, "num_steps_off": self.num_steps_off,
            "draft_seconds": self.draft_seconds, "accepted_hist": list(self.accepted_hist),
            "proposer": self.inner.stats(),
        }
