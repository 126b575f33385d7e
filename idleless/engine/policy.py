"""Waiting-queue order: which waiting request admission tries first.

* ``fcfs``: higher ``priority`` first, then arrival order.
* ``lpm`` (longest prefix match first; SGLang paper, arXiv 2312.07104, section 3): requests with the
  most tokens already in the radix cache go first, so the prefixes they need are used before they
  are evicted.
* ``dfs-weight`` (same paper, section 3): the waiting requests form a tree by their shared prompt
  prefixes; walk it depth first, visiting cached subtrees before uncached ones (as SGLang's walk of
  the radix tree does: a group already in service continues) and heavier subtrees (more waiting
  requests) first, and take requests in the order the walk reaches them. Requests that share a
  prefix run back to back.

Both cache-aware policies fall back to fcfs when the queue is longer than ``fallback_threshold``
(ordering costs grow with the queue). **Aging rule:** a request that has waited longer than
``max_queue_delay`` seconds goes before every request ordered by cache affinity (fcfs among such
requests), so cache-aware ordering never delays a cache-cold request past that bound; it can still
wait for memory or a running-request slot. Within every policy, higher ``priority`` goes first.
"""

from __future__ import annotations

import time
from typing import Optional

from idleless.engine.request import Request

POLICIES = ("fcfs", "lpm", "dfs-weight")

# dfs-weight groups prompts by blocks of this many tokens (a cheap stand-in for a token-level trie)
DFS_BLOCK = 32


def _fcfs_key(r: Request):
    return (-r.priority, r.arrival_time)


def dfs_weight_order(reqs: list[Request], cache=None) -> list[Request]:
    """DFS over the prefix tree of ``reqs`` (block granularity): cached subtrees first (``cache``
    needs ``peek_prefix_len``), then the heaviest; ties by the earliest arrival in the subtree.
    Requests ending at a node come before its children."""
    root: dict = {"children": {}, "reqs": [], "weight": 0, "first": float("inf"), "cached": True}
    for r in reqs:
        ids = r.all_ids
        cached_blocks = cache.peek_prefix_len(ids) // DFS_BLOCK if cache is not None else 0
        node = root
        node["weight"] += 1
        node["first"] = min(node["first"], r.arrival_time)
        for k in range(0, len(ids) // DFS_BLOCK * DFS_BLOCK, DFS_BLOCK):
            key = tuple(ids[k:k + DFS_BLOCK])
            child = node["children"].get(key)
            if child is None:
                child = node["children"][key] = {"children": {}, "reqs": [], "weight": 0, "first": float("inf"),
                                                 "cached": False}
            child["cached"] |= k // DFS_BLOCK < cached_blocks
            node = child
            node["weight"] += 1
            node["first"] = min(node["first"], r.arrival_time)
        node["reqs"].append(r)
    out: list[Request] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(sorted(node["reqs"], key=lambda r: r.arrival_time))
        kids = sorted(node["children"].values(), key=lambda c: (not c["cached"], -c["weight"], c["first"]))
        stack.extend(reversed(kids))
    return out


def order_waiting(waiting: list[Request], policy: str, cache, fallback_threshold: int = 128,
                  max_queue_delay: Optional[float] = None, now: Optional[float] = None) -> list[Request]:
    """Return the waiting requests in the order admission should try them (a new list).

    ``cache`` needs ``peek_prefix_len(token_ids) -> int`` (for lpm). Raises ValueError for an
    unknown policy."""
    if policy not in POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r} (supported: {', '.join(POLICIES)})")
    if policy == "fcfs" or len(waiting) > fallback_threshold:
        return sorted(waiting, key=_fcfs_key)
    now = time.monotonic() if now is None else now
    aged: list[Request] = []
    rest = waiting
    if max_queue_delay is not None:
        aged = sorted((r for r in waiting if now - r.arrival_time > max_queue_delay), key=_fcfs_key)
        if aged:
            ids = {id(r) for r in aged}
            rest = [r for r in waiting if id(r) not in ids]
    if policy == "lpm":
        ordered = sorted(rest, key=lambda r: (-r.priority, -cache.peek_prefix_len(r.all_ids), r.arrival_time))
    else:
        by_prio: dict[int, list[Request]] = {}
        for r in rest:
            by_prio.setdefault(r.priority, []).append(r)
        ordered = [r for p in sorted(by_prio, reverse=True) for r in dfs_weight_order(by_prio[p], cache)]
    return aged + ordered
