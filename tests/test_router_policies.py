"""The routing policies (idleless/router/policies.py) on hand-computed cases: each worker is a stub
with a fixed load, queued prefill tokens and cached prefix, and the expected choice is worked out
from the policy's rule by hand in the comments."""

from __future__ import annotations

import random

import pytest

from idleless.router.policies import CacheAwareApprox, Exact, PowerOfTwo, RoundRobin, RouteInput, make_policy
from idleless.router.text_tree import ApproxTree


class Stub:
    def __init__(self, url, load=0, queued=0, held=()):
        self.url, self._load, self._queued, self.held = url, load, queued, [list(h) for h in held]

    def load(self):
        return self._load

    def queued_prefill_tokens(self):
        return self._queued

    def cached_prefix(self, tokens):
        best = 0
        for h in self.held:
            i = 0
            while i < min(len(h), len(tokens)) and h[i] == tokens[i]:
                i += 1
            best = max(best, i)
        return best


def test_round_robin_cycles_in_order():
    ws = [Stub("a"), Stub("b"), Stub("c")]
    p = RoundRobin()
    assert [p.select(ws, RouteInput(""))[0].url for _ in range(5)] == ["a", "b", "c", "a", "b"]


class FixedDraws:
    """An rng whose sample() returns scripted pairs."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def sample(self, population, k):
        names = self.pairs.pop(0)
        return [next(w for w in population if w.url == n) for n in names]


def test_power_of_two_takes_the_less_loaded_of_the_two_drawn():
    ws = [Stub("a", load=5), Stub("b", load=1), Stub("c", load=3)]
    p = PowerOfTwo(FixedDraws([("a", "c"), ("c", "b"), ("a", "b")]))
    # a(5) vs c(3) -> c; c(3) vs b(1) -> b; a(5) vs b(1) -> b
    assert [p.select(ws, RouteInput(""))[0].url for _ in range(3)] == ["c", "b", "b"]
    tie = PowerOfTwo(FixedDraws([("c", "a")]))
    assert tie.select([Stub("a", 2), Stub("c", 2)], RouteInput(""))[0].url == "c"  # a tie: the first drawn
    # never the most loaded of three when the draws are random (it loses both of its pairs)
    rnd = PowerOfTwo(random.Random(0))
    assert all(rnd.select(ws, RouteInput(""))[0].url != "a" for _ in range(50))


def test_cache_aware_approx_follows_sglangs_rule():
    a, b = Stub("a"), Stub("b")
    p = CacheAwareApprox()
    # empty trees: smallest tree is a tie -> the first (a); the text is recorded for a
    assert p.select([a, b], RouteInput("system: you are a pirate. user: hi"))[0] is a
    # a new text with no match: smallest tree -> b (a holds 34 chars, b 0)
    assert p.select([a, b], RouteInput("completely different"))[0] is b
    # shares "system: you are a pirate. user: " (32 chars) of 39 = 0.82 > 0.3 -> a
    assert p.select([a, b], RouteInput("system: you are a pirate. user: weather"))[0] is a
    # shares only "system: you are a " (18 of 64 = 0.28 <= 0.3) -> smallest tree: b (20 chars) vs a (41)
    assert p.select([a, b], RouteInput("system: you are a robot. user: tell me about the sea and the sky"))[0] is b
    # imbalance: loads 70 and 2 (gap 68 > 64, 70 > 2 x 1.5) -> the least loaded, whatever the match
    a._load, b._load = 70, 2
    assert p.select([a, b], RouteInput("system: you are a pirate. user: weather"))[0] is b
    # gap 60 <= 64: balanced -> the match again ("system: you are a pirate. user: weather" is on a and b now;
    # the most recently used holder is b)
    a._load, b._load = 62, 2
    assert p.select([a, b], RouteInput("system: you are a pirate. user: weather"))[0] is b
    p.on_removed("b")
    assert p.tree.size("b") == 0
    assert p.select([a], RouteInput("system: you are a pirate. user: weather"))[0] is a


def test_approx_tree_evicts_least_recently_used_text_past_its_cap():
    t = ApproxTree(max_size=10)
    t.insert("aaaaaa", "w")
    t.insert("bbbbbb", "w")  # 12 > 10: the older leaf "aaaaaa" goes
    assert t.size("w") == 6
    assert t.prefix_match("aaaaaa", ["w"]) == (0, None)
    assert t.prefix_match("bbbbbbzz", ["w"]) == (6, "w")
    t.insert("bbbcc", "x")
    assert t.prefix_match("bbbcc", ["w", "x"]) == (5, "x") and t.prefix_match("bbbcc", ["w"]) == (3, "w")


def test_exact_minimises_expected_time_to_first_token():
    prompt = list(range(100))
    p = Exact(running_cost=8.0, spread=0.1)
    # a holds 80 prompt tokens, load 2, queued 0; b holds none, load 0, queued 0
    # credit(a) = 80 / (1 + 0.1 * 2) = 66.67 -> cost a = 0 + 16 + 100 - 66.67 = 49.33; cost b = 0 + 0 + 100 = 100
    a, b = Stub("a", load=2, held=[prompt[:80]]), Stub("b")
    costs = p.costs([a, b], prompt)
    assert costs[0][0] == pytest.approx(16 + 100 - 80 / 1.2) and costs[1][0] == pytest.approx(100.0)
    assert p.select([a, b], RouteInput("", prompt)) == (a, 80)
    # a is busy: load 10 -> credit 80 / 2 = 40, cost 80 + 100 - 40 = 140 > b's 100 -> b (the hot prefix spreads)
    a._load = 10
    assert p.select([a, b], RouteInput("", prompt))[0] is b
    # b has 120 queued prefill tokens: cost b = 220 > a's 140 -> a
    b._queued = 120
    assert p.select([a, b], RouteInput("", prompt))[0] is a
    # no prefix anywhere and equal loads: a tie -> the first
    assert p.select([Stub("x"), Stub("y")], RouteInput("", prompt))[0].url == "x"


def test_make_policy_rejects_unknown_names():
    assert make_policy("exact").name == "exact"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")
