"""The adaptive speculation controller on scripted costs and acceptances (no model).

References: expected tokens by enumerating accept/reject outcomes; draft lengths by brute force over
every draft-length vector; the acceptance estimate by hand-computed decayed counts."""

from __future__ import annotations

import itertools
import random
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idleless.spec.adaptive import (CATCHUP_HORIZON, DECAY, MARGIN, MIN_SAMPLES, PLAIN_REFRESH, PRIOR_WEIGHT, WINDOW,
                                    AdaptiveProposer, StepCost, expected_tokens)
from idleless.spec.proposer import Proposer


def rec(rid):
    return types.SimpleNamespace(rid=rid, prompt_ids=[1, 2], output_ids=[3], all_ids=[1, 2, 3])


class Fixed(Proposer):
    """Proposes k copies of token 7 and records the calls."""

    name = "fixed"

    def __init__(self):
        self.calls = []

    def propose(self, requests, max_tokens):
        self.calls.append(list(max_tokens))
        return [[7] * k for k in max_tokens]


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_expected_tokens_matches_enumeration(a, k):
    # P(exactly i accepted) = a^i (1 - a) for i < k, a^k for i = k; each verify yields i + 1 tokens
    ref = sum((i + 1) * a ** i * (1 - a) for i in range(k)) + (k + 1) * a ** k
    assert expected_tokens(a, k) == pytest.approx(ref)


def scripted_cost(fn, sizes):
    c = StepCost()
    for x in sizes:
        for _ in range(3):
            c.add(x, fn(x))
    return c


def test_step_cost_interpolates_scales_below_and_is_flat_above():
    c = scripted_cost(lambda x: 0.1 + 0.01 * x, [1, 8, 64])
    assert c.predict(1) == pytest.approx(0.11)
    assert c.predict(8) == pytest.approx(0.18)
    assert c.predict(36) == pytest.approx(0.18 + (0.74 - 0.18) * 28 / 56)
    assert c.predict(0.5) == pytest.approx(0.055)  # scaled down in proportion below the smallest size
    assert c.predict(1000) == pytest.approx(0.74)  # optimistic (flat) above the largest
    assert StepCost().predict(4) is None
    one = StepCost()
    one.add(4, 0.2)
    assert one.predict(4) is None and one.samples(4) == 1  # a bucket is trusted after MIN_SAMPLES samples
    one.add(4, 0.4)
    assert one.samples(4) == 2 and one.samples(3) == one.samples(5) == 0  # a bucket per count up to 8
    assert one.predict(4) == pytest.approx(0.3)
    for x in (20, 30, 33):
        one.add(x, 1.0)
    assert one.samples(17) == one.samples(32) == 2 and one.samples(33) == 1  # then per power of two: (16, 32]


def test_step_cost_is_the_median_of_recent_steps():
    """A slow first step (caches being built) or one that met a busy machine does not move the
    estimate; the window forgets steps older than WINDOW."""
    c = StepCost()
    for t in (2.0, 0.1, 0.11, 0.1, 9.0):
        c.add(4, t)
    assert c.predict(4) == pytest.approx(0.11)
    for _ in range(WINDOW):
        c.add(4, 0.3)
    assert c.predict(4) == pytest.approx(0.3)


def brute_force(ctl, rates, caps, catchup_s=None):
    """The best (ratio, draft lengths) over every draft-length vector, plain decoding's ratio taken
    MARGIN times; ``catchup_s[i]``: seconds charged when request i drafts (default none)."""
    B = len(rates)
    catchup_s = catchup_s or [0.0] * B
    best, best_ks = None, None
    for ks in itertools.product(*[range(c + 1) for c in caps]):
        m = sum(ks)
        value = B + sum(a ** j for a, k in zip(rates, ks) for j in range(1, k + 1))
        depth, drafting = max(ks), sum(1 for k in ks if k)
        ratio = value / (ctl.step_cost.predict(B + m) + depth * (ctl.draft_step_cost.predict(drafting) or 0.0)
                         + sum(c for c, k in zip(catchup_s, ks) if k))
        ratio *= MARGIN if m == 0 else 1.0
        if best is None or ratio > best + 1e-12:
            best, best_ks = ratio, ks
    return best, best_ks


@pytest.mark.parametrize("shape", ["memory_bound", "roofline", "compute_bound"])
@pytest.mark.parametrize("rates", [(0.9, 0.5, 0.1), (0.0, 0.0, 0.0), (0.99, 0.99, 0.7), (0.6, 0.2, 0.4)])
def test_draft_lengths_are_the_best_ratio(shape, rates):
    fn = {"memory_bound": lambda x: 0.05 + 1e-4 * x,
          "roofline": lambda x: max(0.05, 0.004 * x),
          "compute_bound": lambda x: 0.01 * x}[shape]
    ctl = AdaptiveProposer(Fixed(), max_draft=4)
    ctl.step_cost = scripted_cost(fn, [1, 2, 3, 4, 6, 8, 12, 16])
    ctl.draft_step_cost = scripted_cost(lambda x: 0.002 + 0.0005 * x, [1, 2, 3])  # per draft step
    ks = ctl.draft_lengths(list(rates), [4, 4, 4])
    best, ref = brute_force(ctl, rates, [4, 4, 4])
    m = sum(ks)
    value = 3 + sum(a ** j for a, k in zip(rates, ks) for j in range(1, k + 1))
    depth, drafting = max(ks), sum(1 for k in ks if k)
    ratio = value / (ctl.step_cost.predict(3 + m) + depth * (ctl.draft_step_cost.predict(drafting) if m else 0.0))
    ratio *= MARGIN if m == 0 else 1.0
    assert ratio >= 0.99 * best  # near the optimum when drafting costs per step
    free = AdaptiveProposer(Fixed(), max_draft=4)  # drafting free (ngram): exactly the optimum
    free.step_cost = ctl.step_cost
    ks = free.draft_lengths(list(rates), [4, 4, 4])
    best_free, _ = brute_force(free, rates, [4, 4, 4])
    value = 3 + sum(a ** j for a, k in zip(rates, ks) for j in range(1, k + 1))
    margin = MARGIN if sum(ks) == 0 else 1.0
    assert margin * value / free.step_cost.predict(3 + sum(ks)) == pytest.approx(best_free)
    if shape == "compute_bound" or max(rates) == 0.0:
        assert ks == [0, 0, 0]  # extra tokens cost as much as they are worth or more: off
    if shape == "memory_bound" and rates == (0.99, 0.99, 0.7):
        assert ks == [4, 4, 4]


def test_auto_off_skips_the_proposer_and_counts_the_step():
    inner = Fixed()
    ctl = AdaptiveProposer(inner, max_draft=4)
    ctl.step_cost = scripted_cost(lambda x: 0.01 * x, [1, 2, 4, 8])  # compute-bound: never pays
    out = ctl.propose([rec("a"), rec("b")], [4, 4])
    assert out == [[], []] and inner.calls == []
    assert ctl.stats()["num_steps_off"] == 1 and ctl.stats()["num_steps_on"] == 0


def test_cold_start_measures_plain_steps_and_fixed_mode_asks_for_the_room():
    inner = Fixed()
    ctl = AdaptiveProposer(inner, max_draft=3)
    assert ctl.propose([rec("a"), rec("b")], [5, 1]) == [[], []]  # nothing measured: plain
    ctl.observe_step(2, 0, 0.05)  # plain steps of 2 tokens; verifies assumed no dearer (flat above)
    assert ctl.propose([rec("a"), rec("b")], [5, 1]) == [[], []]
    ctl.observe_step(2, 0, 0.05)
    assert ctl.propose([rec("a"), rec("b")], [5, 1]) == [[7, 7, 7], [7]]
    fixed = AdaptiveProposer(Fixed(), max_draft=3, adaptive=False)
    fixed.step_cost = scripted_cost(lambda x: 0.01 * x, [1, 2, 4, 8])
    assert fixed.propose([rec("a")], [2]) == [[7, 7]]


def test_acceptance_estimate_follows_hand_computed_decayed_counts():
    ctl = AdaptiveProposer(Fixed(), max_draft=4)
    r = rec("a")
    assert ctl.acceptance("a") == pytest.approx(0.5)  # the batch-wide prior starts at 1 : 1
    ctl.observe(r, 4, 4)  # all accepted: 4 successes, no rejection
    ctl.observe(r, 4, 1)  # one accepted, then rejected
    acc = DECAY * 4 + 1
    rej = DECAY * 0 + 1
    g_acc = DECAY * (DECAY * 1 + 4) + 1
    g_rej = DECAY * (DECAY * 1 + 0) + 1
    prior = g_acc / (g_acc + g_rej)
    assert ctl.acceptance("a") == pytest.approx((acc + PRIOR_WEIGHT * prior) / (acc + rej + PRIOR_WEIGHT))
    st = ctl.stats()
    assert (st["num_drafts"], st["num_draft_tokens"], st["num_accepted_tokens"]) == (2, 8, 5)
    assert st["acceptance_rate"] == pytest.approx(5 / 8)
    assert st["mean_accepted_length"] == pytest.approx((5 + 2) / 2)
    assert st["accepted_hist"][4] == 1 and st["accepted_hist"][1] == 1
    ctl.finish(r)
    assert ctl.acceptance("a") == pytest.approx(prior)  # state dropped: back to the batch-wide rate


def test_a_request_that_stops_matching_gets_shorter_drafts_then_none():
    ctl = AdaptiveProposer(Fixed(), max_draft=6)
    ctl.step_cost = scripted_cost(lambda x: 0.05 + 0.002 * x, [1, 2, 4, 8, 16])
    good, bad = rec("good"), rec("bad")
    for _ in range(6):
        ctl.observe(good, 6, 6)
        ctl.observe(bad, 6, 0)
    ks = ctl.draft_lengths([ctl.acceptance("good"), ctl.acceptance("bad")], [6, 6])
    assert ks[0] == 6 and ks[1] < 2


def test_an_unmeasured_draft_costs_its_hint_times_a_target_step():
    """A draft model as large as the target (cost_hint 1) never pays at acceptance 0.6 on a
    memory-bound step, before anything about it is measured; a free proposer (hint 0) does."""
    class Heavy(Fixed):
        cost_hint = 1.0

    for inner, speculates in ((Heavy(), False), (Fixed(), True)):
        ctl = AdaptiveProposer(inner, max_draft=4)
        ctl.step_cost = scripted_cost(lambda x: 0.05 + 1e-4 * x, [1, 2, 4, 8])
        assert any(ctl.draft_lengths([0.6], [4])) == speculates


def test_before_any_measurement_no_proposer_speculates():
    class Heavy(Fixed):
        cost_hint = 0.3

    assert AdaptiveProposer(Heavy(), max_draft=3).draft_lengths([0.9, 0.9], [5, 5]) == [0, 0]
    assert AdaptiveProposer(Fixed(), max_draft=3).draft_lengths([0.9, 0.9], [5, 5]) == [0, 0]


def test_a_verify_is_never_judged_against_an_unmeasured_plain_step():
    """The 4-requests-at-once case of the int4 self-draft: plain steps measured only at 1 token (a
    warm-up's slow first decode steps) and verifies of 4 x (1 + 6) tokens. The plain 4-token step was
    then interpolated between the two (0.081 s, twice its real 0.040 s), so a verify plus six draft
    steps looked worth 2x plain decoding and speculation stayed on. Now the plain step is measured
    first; once it is, the plan is the brute-force optimum (with plain decoding's MARGIN)."""
    ctl = AdaptiveProposer(Fixed(), max_draft=6)
    for _ in range(3):
        ctl.step_cost.add(1, 0.08)
        ctl.step_cost.add(28, 0.091)
        ctl.draft_step_cost.add(4, 0.025)
    rates = [0.95] * 4
    assert ctl.draft_lengths(rates, [127] * 4) == [0] * 4
    for _ in range(2):
        ctl.step_cost.add(4, 0.040)
    # measured, the best plan is predicted a few percent faster than plain decoding: within the MARGIN,
    # so plain decoding (the real run lost 10% there)
    ks = ctl.draft_lengths(rates, [127] * 4)
    best, ref = brute_force(ctl, rates, [6] * 4)
    assert ks == [0] * 4 and ref == (0, 0, 0, 0)
    spec = max((4 + sum(a ** j for a, k in zip(rates, ks) for j in range(1, k + 1)))
               / (ctl.step_cost.predict(4 + sum(ks)) + max(ks) * ctl.draft_step_cost.predict(sum(1 for k in ks if k)))
               for ks in itertools.product(range(7), repeat=4) if any(ks))
    assert 4 / 0.040 < spec < MARGIN * 4 / 0.040


def test_a_catch_up_is_charged_over_the_requests_remaining_tokens():
    """Drafting pays at 4 requests when the draft is caught up (cheap draft steps), and not when each
    request must first catch its 230-token prompt up at a measured 3.26 ms per token, amortised over
    its 128 remaining tokens at the expected tokens of one verify; a single lagging request is left
    out while the others draft. Reference: brute force with hand-computed charges."""
    ctl = AdaptiveProposer(Fixed(), max_draft=6)
    for _ in range(3):
        for x, t in ((1, 0.026), (4, 0.040), (28, 0.091)):
            ctl.step_cost.add(x, t)
        ctl.draft_step_cost.add(4, 0.010)
        ctl.draft_step_cost.add(3, 0.009)
    rates, room = [0.95] * 4, [127] * 4
    ks = ctl.draft_lengths(rates, room)
    assert all(ks) and tuple(ks) == brute_force(ctl, rates, [6] * 4)[1]
    ctl.catchup_cost.add(920, 3.0)
    ctl.catchup_cost.add(920, 3.0)
    per_request = 230 * 3.0 / 920 * expected_tokens(0.95, 6) / min(128, CATCHUP_HORIZON)
    assert ctl.draft_lengths(rates, room, [230] * 4) == [0] * 4
    assert brute_force(ctl, rates, [6] * 4, [per_request] * 4)[1] == (0, 0, 0, 0)
    ctl.catchup_cost.add(230, 0.75)  # a single prompt: measured apart (bucket 8)
    ctl.catchup_cost.add(230, 0.75)
    one = [230 * 0.75 / 230 * expected_tokens(0.95, 6) / 128, 0.0, 0.0, 0.0]
    ks = ctl.draft_lengths(rates, room, [230, 0, 0, 0])
    assert ks[0] == 0 and all(ks[1:])
    best, ref = brute_force(ctl, rates, [6] * 4, one)
    assert tuple(ks) == ref


def test_a_prompt_catch_up_is_not_charged_to_the_draft_steps(monkeypatch):
    """A draft model that caught a new prompt up in its first forward reports those seconds
    (``last_catchup_s``): the seconds per draft step are the rest over the other steps (a scripted
    clock: 1.0 s in propose, 0.9 s of it catch-up, 3 guesses -> 0.05 s per draft step; without
    catch-up the same call is 1/3 s per step)."""
    from idleless.spec import adaptive
    from idleless.spec.proposer import Proposer

    class Inner(Proposer):
        name, cost_hint = "scripted", 0.5

        def __init__(self):
            self.catchup = 0.0

        def propose(self, requests, max_tokens):
            self.last_catchup_s, self.last_catchup_tokens = self.catchup, 200 if self.catchup else 0
            return [[1, 2, 3] for _ in requests]

    ticks = itertools.count()
    monkeypatch.setattr(adaptive.time, "perf_counter", lambda: (lambda i: 10.0 * (i // 2) + i % 2)(next(ticks)))
    inner = Inner()
    req = types.SimpleNamespace(rid="a")
    for catchup, per_step in ((0.9, 0.05), (0.0, 1 / 3)):
        ctl = adaptive.AdaptiveProposer(inner, max_draft=3, adaptive=False)
        inner.catchup = catchup
        for _ in range(adaptive.MIN_SAMPLES):
            ctl.propose([req], [3])
        assert ctl.draft_step_cost.predict(1) == pytest.approx(per_step)
        assert ctl.catchup_cost.predict(200) == (pytest.approx(catchup) if catchup else None)


def test_the_plain_step_is_measured_again_now_and_then():
    """Plain 2-token steps measured twice on a busy moment (0.5 s), verifies cheap: speculation runs,
    and after PLAIN_REFRESH * n steps with guesses one step is plain (n: the bucket's samples, at
    most WINDOW); the median soon is the quiet plain step's cost."""
    ctl = AdaptiveProposer(Fixed(), max_draft=3)
    for _ in range(MIN_SAMPLES):
        ctl.propose([rec("a"), rec("b")], [5, 5])
        ctl.observe_step(2, 0, 0.5)
    plain_at = []
    for step in range(2000):
        drafts = ctl.propose([rec("a"), rec("b")], [5, 5])
        m = sum(map(len, drafts))
        if m == 0:
            plain_at.append(step)
        ctl.observe_step(2 + m, m, 0.05 if m == 0 else 0.06 + 0.001 * m)
    n, expect, on = MIN_SAMPLES, [], 0
    for step in range(2000):  # the schedule by hand
        if on >= PLAIN_REFRESH * n:
            expect.append(step)
            n, on = min(n + 1, WINDOW), 0
        else:
            on += 1
    assert plain_at == expect and len(plain_at) > 2000 // (PLAIN_REFRESH * WINDOW + 1)
    assert ctl.step_cost.predict(2) == pytest.approx(0.05)


class Clock:
    """A scripted CPU clock: ``advance`` moves it; calls read it."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += s


def test_a_cpu_clock_times_steps_between_observations_less_drafting_capped_by_wall():
    clock = Clock()

    class Drafting(Fixed):
        def propose(self, requests, max_tokens):
            clock.advance(0.3)  # drafting's CPU seconds, not the step's
            return super().propose(requests, max_tokens)

    ctl = AdaptiveProposer(Drafting(), max_draft=2, adaptive=False, clock=clock, clock_threads=2)
    clock.advance(5.0)  # loading, warm-up: before the first observation, never a step's cost
    ctl.observe_step(1, 0, 0.1)
    assert ctl.step_cost.samples(1) == 0
    clock.advance(0.05)
    ctl.propose([rec("a")], [2])
    clock.advance(0.15)
    ctl.observe_step(3, 2, 0.4)  # 0.5 s of CPU since the last observation, 0.3 of it drafting
    ctl.propose([rec("a")], [2])  # 0.3 s of drafting
    clock.advance(0.25)
    ctl.observe_step(3, 2, 0.4)
    ctl.propose([rec("a")], [2])
    clock.advance(3.0)  # a gap of other work: capped at the step's wall seconds x threads (0.4 x 2)
    ctl.observe_step(3, 2, 0.4)
    assert [t for _, t in ctl.step_cost._buckets[3]] == pytest.approx([0.2, 0.25, 0.8])
    assert ctl.draft_step_cost._buckets[1][0][1] == pytest.approx(0.3 / 2)  # depth 2, on the same clock


def test_only_decode_steps_enter_the_step_cost():
    """A step enters the model only when it is the last propose call's decoding requests, one token
    each plus their guesses: a prefill step (no propose call: no decoding requests) and a step with a
    prompt chunk beside the decodes (more tokens) are left out, and so is a step a retraction cut short."""
    ctl = AdaptiveProposer(Fixed(), max_draft=2, adaptive=False)
    ctl.observe_step(300, 0, 1.0)  # a prefill: no propose call
    ctl.propose([rec("a"), rec("b")], [2, 0])
    ctl.observe_step(4, 2, 0.05)  # 2 decodes + 2 guesses
    ctl.propose([rec("a"), rec("b")], [2, 0])
    ctl.observe_step(260, 2, 0.9)  # the same with a 256-token chunk beside it
    ctl.propose([rec("a"), rec("b")], [2, 0])
    ctl.observe_step(3, 2, 0.04)  # b was retracted
    ctl.propose([rec("a"), rec("b")], [1, 0])
    ctl.observe_step(3, 1, 0.06)
    ctl.observe_step(3, 1, 0.06)  # no propose call since the last step
    assert {b: [t for _, t in d] for b, d in ctl.step_cost._buckets.items()} == {3: [0.06], 4: [0.05]}


def test_busy_plain_steps_on_the_wall_clock_turn_speculation_on_and_cpu_time_keeps_it_off():
    """The shared_prefix case (1 thread, bf16, AMD EPYC Zen 4, load ~5): plain 64-token steps cost
    0.22 s of CPU, a verify of 64 + m tokens 0.22 * (64 + m) / 64 (compute-bound: verify tokens are not
    free), acceptance 0.5; the wall clock measured plain steps on a busy minute (x4.5) and verifies on a
    quieter one (x2). On the wall clock the controller speculates, losing CPU time; on the CPU clock it
    keeps every step plain."""
    cpu = lambda n: 0.22 * n / 64  # noqa: E731
    reqs = [rec(f"r{i}") for i in range(64)]

    def run(clock):
        ctl = AdaptiveProposer(Fixed(), max_draft=6, clock=clock, clock_threads=1)
        for r in reqs:
            for _ in range(3):
                ctl.observe(r, 4, 2)  # acceptance about 0.5
        spent = tokens = 0.0
        for step in range(40):
            drafts = ctl.propose(reqs, [100] * 64)
            m = sum(map(len, drafts))
            c = cpu(64 + m)
            wall = c * (4.5 if m == 0 else 2.0)
            if clock is not None:
                clock.advance(c)
            ctl.observe_step(64 + m, m, wall)
            spent += c
            tokens += 64 + sum(expected_tokens(0.5, len(d)) - 1 for d in drafts)
        return ctl.num_steps_on, tokens / spent

    on_wall, rate_wall = run(None)
    on_cpu, rate_cpu = run(Clock())
    assert on_wall > 0 and rate_wall < 64 / cpu(64)  # the wall clock's decisions cost CPU per token
    # on the CPU clock: only the probes that measure the verify bucket (flat above the largest
    # measured step, MIN_SAMPLES of them), then plain
    assert on_cpu == MIN_SAMPLES and on_wall > 3 * on_cpu and rate_cpu > rate_wall


# -- start-up costs (idleless.spec.prime): the prior's shape, the run's level --------------------------
def test_a_prior_alone_is_interpolated_and_extended_along_its_last_segment():
    c = StepCost()
    c.prime([(4, 0.04), (1, 0.02), (16, 0.10), (0, 5.0), (8, float("nan"))])  # bad pairs ignored
    assert c.primed and c.predict(1) == pytest.approx(0.02)
    assert c.predict(2) == pytest.approx(0.02 + 0.02 / 3)
    assert c.predict(10) == pytest.approx(0.04 + 0.06 * 6 / 12)
    assert c.predict(0.5) == pytest.approx(0.01)  # in proportion below the smallest
    assert c.predict(28) == pytest.approx(0.10 + 0.005 * 12)  # the last segment's slope (0.06 / 12 per token)
    flat = StepCost()
    flat.prime([(1, 0.02), (16, 0.02), (64, 0.019)])
    assert flat.predict(256) == pytest.approx(0.019)  # a falling last segment extends flat, never down


def test_a_prior_reads_from_the_nearest_measured_bucket_the_dearer_way():
    """Outside the measured range the nearest trusted bucket's seconds plus the prior's difference, or
    times the prior's ratio, whichever is dearer: a plain 4-token step measured at 0.060 s (0.040 s at
    start-up) predicts a 28-token verify at 0.060 x 0.160 / 0.040 (the ratio: 0.24 s > 0.18 s); measured
    at 0.030 s, at 0.030 + 0.120 (the difference); below, never less than that bucket scaled down in
    proportion; between measured buckets the run's own points are interpolated."""
    c = StepCost()
    c.prime([(1, 0.02), (4, 0.04), (28, 0.16), (64, 0.30)])
    for _ in range(MIN_SAMPLES):
        c.add(4, 0.060)
    assert c.predict(4) == pytest.approx(0.060)
    assert c.predict(28) == pytest.approx(0.060 * 0.16 / 0.04)
    assert c.predict(2) == pytest.approx(0.060 - (0.04 - (0.02 + 0.02 / 3)))  # the difference is dearer here
    for _ in range(WINDOW):
        c.add(4, 0.030)
    assert c.predict(28) == pytest.approx(0.030 + 0.12)
    assert c.predict(1) == pytest.approx(0.030 * 0.02 / 0.04)  # 0.030 - 0.020 is less: the ratio
    for _ in range(WINDOW):
        c.add(4, 0.010)  # 0.010 - 0.020 < 0: the ratio (0.005 s, above the proportional 0.0025 s)
    assert c.predict(1) == pytest.approx(0.010 * 0.02 / 0.04)
    for _ in range(MIN_SAMPLES):
        c.add(64, 0.36)
    assert c.predict(28) == pytest.approx(0.010 + 0.35 * 24 / 60)  # now between two measured buckets
    assert c.predict(128) == pytest.approx(0.36 * (0.30 + 0.14 / 36 * 64) / 0.30)


# the 4-requests-at-once case, deterministic bf16 target and W4A8 int4 self-draft at 1 thread on AMD EPYC
# Zen 4 (start-up measurements, seconds of CPU): target steps by tokens, draft steps by requests
ZEN4_TARGET = [(1, 0.0145), (2, 0.0182), (3, 0.0230), (4, 0.0267), (5, 0.0332), (6, 0.0180), (7, 0.0228),
               (8, 0.0268), (16, 0.0425), (32, 0.0622), (64, 0.1139), (128, 0.2381)]
ZEN4_DRAFT = [(1, 0.0074), (2, 0.0121), (3, 0.0164), (4, 0.0205), (5, 0.0243), (6, 0.0291), (7, 0.0337),
              (8, 0.0381), (16, 0.0704), (32, 0.1406), (64, 0.2910)]


def _interp(points, x):
    c = StepCost()
    c.prime(points)
    return c.predict(x)


def _scripted_run(primed: bool, batch: int, steps: int = 60, accept: float = 0.95):
    """A controller over ``batch`` requests whose steps cost what the Zen 4 start-up measured (a
    draft step 1.3x its measurement, as the run's extra bookkeeping made it), every guess accepted
    with probability ``accept`` (seeded draws). Returns (steps with guesses,
    tokens per CPU second, plain decoding's tokens per CPU second)."""
    clock = Clock()

    class Draft(Fixed):
        cost_hint = 0.28  # the int4 / bf16 weight-byte ratio: the unprimed controller's guess

        def propose(self, requests, max_tokens):
            drafting = sum(1 for k in max_tokens if k)
            clock.advance(max(max_tokens) * 1.3 * _interp(ZEN4_DRAFT, drafting) if drafting else 0.0)
            return super().propose(requests, max_tokens)

    ctl = AdaptiveProposer(Draft(), max_draft=6, clock=clock, clock_threads=1)
    if primed:
        ctl.step_cost.prime(ZEN4_TARGET)
        ctl.draft_step_cost.prime(ZEN4_DRAFT)
    reqs = [rec(f"r{i}") for i in range(batch)]
    rng = random.Random(0)
    ctl.observe_step(batch, 0, 1.0)  # starts the clock
    spent = tokens = 0.0
    for _ in range(steps):
        c0 = clock.t
        drafts = ctl.propose(reqs, [100] * batch)
        m = sum(map(len, drafts))
        draft_s = clock.t - c0
        verify_s = _interp(ZEN4_TARGET, batch + m)
        clock.advance(verify_s)
        ctl.observe_step(batch + m, m, verify_s)
        got = batch
        for r, d in zip(reqs, drafts):
            if d:
                n = next((j for j in range(len(d)) if rng.random() >= accept), len(d))
                ctl.observe(r, len(d), n)
                got += n
        spent += draft_s + verify_s
        tokens += got
    return ctl.num_steps_on, tokens / spent, batch / _interp(ZEN4_TARGET, batch)


@pytest.mark.parametrize("batch", [3, 4, 6, 8])
def test_start_up_costs_spare_the_probes_that_lose(batch):
    """At 3-8 requests a W4A8 draft step costs about what a plain bf16 step does. Unprimed, the
    controller probes (verifies assumed no dearer than the largest measured step, draft steps 0.28x a
    target step: MIN_SAMPLES probes each) and loses CPU time. Primed, it drafts only where a plan pays
    by the measured costs: at 6 and 8 requests never; at 3-4, guesses that fill the deterministic
    kernels' 6-row block (a 6-token step costs less than a 4-token one there), and those plans win."""
    on_cold, rate_cold, plain = _scripted_run(primed=False, batch=batch)
    on_primed, rate_primed, _ = _scripted_run(primed=True, batch=batch)
    assert on_cold >= MIN_SAMPLES and rate_cold < plain
    if batch >= 6:
        assert on_primed == 0 and rate_primed == pytest.approx(plain)
    else:
        assert on_primed > 0 and rate_primed > 1.1 * plain


def test_start_up_costs_keep_batch_one_speculating():
    """At one request the same costs make six guesses at acceptance 0.95 pay (a 7-token verify and six
    1-row draft steps against seven plain steps): the primed controller, planning a request without
    evidence at the optimistic rate, drafts from its first measured plain steps on and beats plain
    decoding by more than 10%."""
    on, rate, plain = _scripted_run(primed=True, batch=1)
    assert on >= 50 and rate > 1.1 * plain


def test_an_unmeasured_draft_step_takes_the_level_of_the_measured_plain_step():
    """One request, acceptance ~1. Start-up: a plain step 0.020 s, a 4-token verify 0.024 s, a draft
    step 0.016 s. The run's plain step measures 0.030 s (1.5x its start-up twin: context, load), so a
    4-token verify is predicted at 0.034 s and the unmeasured draft step at 1.5 x 0.016 s: three
    guesses give 4 tokens in 0.106 s, under MARGIN x plain decoding's 1 / 0.030 per second (at the
    start-up level of the draft step, 4 tokens in 0.082 s would have looked a 1.27x gain). Draft
    steps measured at 0.016 s count as measured: then the guesses pay."""
    ctl = AdaptiveProposer(Fixed(), max_draft=3)
    ctl.step_cost.prime([(1, 0.020), (4, 0.024)])
    ctl.draft_step_cost.prime([(1, 0.016)])
    for _ in range(MIN_SAMPLES):
        ctl.step_cost.add(1, 0.030)
    assert 4 / (0.034 + 3 * 0.016) > MARGIN / 0.030 > 4 / (0.034 + 3 * 1.5 * 0.016)
    assert ctl.draft_lengths([1.0], [10]) == [0]
    for _ in range(MIN_SAMPLES):
        ctl.draft_step_cost.add(1, 0.016)
    assert ctl.draft_lengths([1.0], [10]) == [3]


def test_the_primed_bonus_goes_to_a_few_requests_with_the_least_evidence():
    """Once primed, at most EXPLORE_REQUESTS requests per step (the least evidence first, ties in
    batch order) are planned with OPTIMISM_PRIMED, the rest with OPTIMISM: a first trial at 64
    requests is 4 requests' guesses. Unprimed, every request gets OPTIMISM."""
    from idleless.spec.adaptive import EXPLORE_REQUESTS, OPTIMISM, OPTIMISM_PRIMED
    ctl = AdaptiveProposer(Fixed(), max_draft=6)
    reqs = [rec(f"r{i}") for i in range(8)]
    ctl._counts["r0"] = [3.0, 0.0]  # r0 has evidence: not among the explorers
    assert ctl.planning_rates(reqs) == [ctl.planning_rate(r.rid, False) for r in reqs]
    ctl.step_cost.prime([(1, 0.01), (8, 0.02)])
    rates = ctl.planning_rates(reqs)
    assert rates[1:1 + EXPLORE_REQUESTS] == [pytest.approx(0.5 + OPTIMISM_PRIMED)] * EXPLORE_REQUESTS
    assert rates[1 + EXPLORE_REQUESTS:] == [pytest.approx(0.5 + OPTIMISM)] * (7 - EXPLORE_REQUESTS)
    assert rates[0] == pytest.approx(ctl.acceptance("r0") + OPTIMISM / 2)


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), base=st.floats(0.001, 0.1),
       per_token=st.floats(0.0, 0.02), caps=st.lists(st.integers(0, 4), min_size=3, max_size=3))
def test_free_drafting_is_exactly_the_optimum_near_the_off_threshold(rates, base, per_token, caps):
    """Drafting free (ngram): the plan equals the brute-force optimum over every draft-length vector,
    also where the best verify only just beats or loses to plain decoding (the search's early exit,
    a bound on every plan's ratio, must never turn off a plan that pays)."""
    B = len(rates)
    ctl = AdaptiveProposer(Fixed(), max_draft=4)
    ctl.step_cost = scripted_cost(lambda x: base + per_token * x, [1, 2, 3, 4, 6, 8, 12, 16])
    ks = ctl.draft_lengths(list(rates), caps[:B])
    best, _ = brute_force(ctl, rates, caps[:B])
    value = B + sum(a ** j for a, k in zip(rates, ks) for j in range(1, k + 1))
    margin = MARGIN if sum(ks) == 0 else 1.0
    assert margin * value / ctl.step_cost.predict(B + sum(ks)) == pytest.approx(best, rel=1e-9)
