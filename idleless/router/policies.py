"""Routing policies: one small class each behind ``Policy.select``.

``round_robin``: the next worker in turn. ``power_of_two``: two workers drawn at random, the less
loaded (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001).
``cache_aware_approx``: SGLang's router (a character tree of routed text, ``text_tree.ApproxTree``;
its thresholds and defaults). ``exact``: the engines' own KV events (``events``, ``index``) and load
reports; the worker with the least expected time to first token, in prefill-token units:

    cost(w) = queued_prefill_tokens(w) + running_cost * load(w) + (prompt tokens - credit(w))
    credit(w) = cached(w) / (1 + spread * (load(w) - min load))

``cached(w)``: the prompt's longest prefix the worker holds (its index, or a prompt routed to it and
not yet reported). The spread term discounts a cached prefix on a worker busier than the least
loaded (as Dynamo's overlap-credit decay), so a hot prefix gets copied to a second worker instead of
piling every request onto the first.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from idleless.router.text_tree import ApproxTree

POLICIES = ("round_robin", "power_of_two", "cache_aware_approx", "exact")


@dataclass
class RouteInput:
    """What a policy sees of a request: ``text`` (the prompt, or the chat messages' contents,
    for the text tree) and ``tokens`` (the prompt's token ids after the chat template, for exact;
    None when the policy does not need them)."""

    text: str
    tokens: Optional[list[int]] = None


class Policy(abc.ABC):
    """Picks one worker out of the healthy ones. Workers expose ``url``, ``load()`` (requests in
    flight: the router's count or the engine's report, the larger), ``queued_prefill_tokens()`` and
    ``cached_prefix(tokens)``. ``select`` returns (worker, predicted cached prompt tokens)."""

    name: str
    needs_tokens = False

    @abc.abstractmethod
    def select(self, workers: Sequence, req: RouteInput) -> tuple[object, int]:
        """``workers``: non-empty, in the pool's order."""

    def on_removed(self, url: str) -> None:
        """Forget a worker that left the pool."""


class RoundRobin(Policy):
    """The workers in turn (the turn counts decisions, over whichever workers are healthy)."""

    name = "round_robin"

    def __init__(self):
        self.turn = 0

    def select(self, workers, req):
        w = workers[self.turn % len(workers)]
        self.turn += 1
        return w, 0


class PowerOfTwo(Policy):
    """Two distinct workers drawn with ``rng``; the one with the smaller ``load()`` (the first drawn on
    a tie)."""

    name = "power_of_two"

    def __init__(self, rng: Optional[random.Random] = None):
        self.rng = rng or random.Random()

    def select(self, workers, req):
        if len(workers) == 1:
            return workers[0], 0
        a, b = self.rng.sample(list(workers), 2)
        return (b if b.load() < a.load() else a), 0


class CacheAwareApprox(Policy):
    """SGLang's cache-aware policy (sgl-router; defaults as its ``--cache-threshold 0.3
    --balance-abs-threshold 64 --balance-rel-threshold 1.5``): when the loads are imbalanced (max -
    min > abs threshold and max > min x rel threshold) the least loaded worker; else the worker whose
    routed text shares the longest prefix with this request when that prefix is more than
    ``cache_threshold`` of the text, else the worker with the smallest tree. The text is then
    recorded for the chosen worker."""

    name = "cache_aware_approx"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 26):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproxTree(max_tree_size)

    def select(self, workers, req):
        loads = [w.load() for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen = workers[loads.index(lo)]
        else:
            by_url = {w.url: w for w in workers}
            matched, url = self.tree.prefix_match(req.text, by_url)
            if url is not None and req.text and matched / len(req.text) > self.cache_threshold:
                chosen = by_url[url]
            else:
                chosen = min(workers, key=lambda w: self.tree.size(w.url))
        self.tree.insert(req.text, chosen.url)
        return chosen, 0

    def on_removed(self, url):
        self.tree.remove_tenant(url)


class Exact(Policy):
    """The cost rule in the module docstring; ties go to the less loaded, then the earlier worker.
    ``running_cost``: prefill tokens one request in flight is worth; ``spread``: the credit decay."""

    name = "exact"
    needs_tokens = True

    def __init__(self, running_cost: float = 8.0, spread: float = 0.1):
        self.running_cost = running_cost
        self.spread = spread

    def costs(self, workers, tokens: list[int]) -> list[tuple[float, int]]:
        """(cost, cached tokens) per worker, in ``workers``' order."""
        loads = [w.load() for w in workers]
        lo = min(loads)
        out = []
        for w, load in zip(workers, loads):
            cached = w.cached_prefix(tokens)
            credit = cached / (1.0 + self.spread * (load - lo))
            cost = w.queued_prefill_tokens() + self.running_cost * load + (len(tokens) - credit)
            out.append((cost, cached))
        return out

    def select(self, workers, req):
        costs = self.costs(workers, req.tokens or [])
        i = min(range(len(workers)), key=lambda j: (costs[j][0], workers[j].load(), j))
        return workers[i], costs[i][1]


def make_policy(name: str, **kwargs) -> Policy:
    """The policy called ``name`` (one of POLICIES) built with its keyword settings. Raises ValueError."""
    cls = {"round_robin": RoundRobin, "power_of_two": PowerOfTwo, "cache_aware_approx": CacheAwareApprox,
           "exact": Exact}.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return cls(**kwargs)
