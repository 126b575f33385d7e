"""SGLang's approximate routing tree: a character radix tree of the text routed to each worker.

It records what the router *sent*, not what the engines hold (it never hears of an eviction, and
characters are not tokens); each node keeps, per worker ("tenant"), when that worker last got text
through it. A worker's share is capped at ``max_size`` characters: past it, its least recently used
leaves are dropped (SGLang's router evicts on a timer; here on the insert that goes over).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Optional


def _common(key: str, text: str, at: int) -> int:
    """Length of the common prefix of ``key`` and ``text[at:]``."""
    if text.startswith(key, at):
        return len(key)
    lo, hi = 0, min(len(key), len(text) - at)  # the longest equal slice, by bisection (slices compare in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(key[:mid], at):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("key", "children", "parent", "tenants")

    def __init__(self, key: str, parent: Optional["_Node"], tenants: Optional[dict] = None):
        self.key = key
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, int] = dict(tenants or {})  # worker -> last access (a counter)


class ApproxTree:
    """``insert(text, worker)``, ``prefix_match(text, eligible) -> (chars matched, worker)``,
    ``size(worker)`` (characters attributed to it), ``remove_tenant(worker)``."""

    def __init__(self, max_size: int = 1 << 26):
        self.root = _Node("", None)
        self.max_size = max_size
        self.sizes: dict[str, int] = {}
        self._clock = itertools.count(1)

    def size(self, worker: str) -> int:
        """Characters attributed to ``worker``."""
        return self.sizes.get(worker, 0)

    def _split(self, node: _Node, k: int) -> _Node:
        upper = _Node(node.key[:k], node.parent, node.tenants)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def insert(self, text: str, worker: str) -> None:
        """Attribute every prefix of ``text`` to ``worker`` (now), then cap its size."""
        now = next(self._clock)
        node, done = self.root, 0
        while done < len(text):
            child = node.children.get(text[done])
            if child is None:
                child = _Node(text[done:], node)
                node.children[text[done]] = child
            else:
                k = _common(child.key, text, done)
                if k < len(child.key):
                    child = self._split(child, k)
            if worker not in child.tenants:
                self.sizes[worker] = self.sizes.get(worker, 0) + len(child.key)
            child.tenants[worker] = now
            node, done = child, done + len(child.key)
        if self.sizes.get(worker, 0) > self.max_size:
            self._evict(worker, self.max_size)

    def prefix_match(self, text: str, eligible: Iterable[str]) -> tuple[int, Optional[str]]:
        """The longest prefix of ``text`` some eligible worker got, in characters, and the most
        recently used such worker (None when nothing matches)."""
        eligible = set(eligible)
        node, done, best = self.root, 0, (0, None)
        while done < len(text):
            child = node.children.get(text[done])
            if child is None:
                break
            holders = [(t, w) for w, t in child.tenants.items() if w in eligible]
            if not holders:
                break
            k = _common(child.key, text, done)
            best = (done + k, max(holders)[1])
            if k < len(child.key):
                break
            node, done = child, done + k
        return best

    def _drop(self, node: _Node, worker: str) -> None:
        del node.tenants[worker]
        self.sizes[worker] -= len(node.key)
        if not node.tenants and not node.children:
            del node.parent.children[node.key[0]]

    def _evict(self, worker: str, limit: int) -> None:
        """Drop ``worker``'s least recently used leaves until it holds at most ``limit`` characters."""
        heap = [(n.tenants[worker], id(n), n) for n in self._nodes(worker)
                if not any(worker in c.tenants for c in n.children.values())]
        heapq.heapify(heap)
        while heap and self.sizes.get(worker, 0) > limit:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._drop(node, worker)
            if parent is not self.root and worker in parent.tenants and \
                    not any(worker in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[worker], id(parent), parent))

    def remove_tenant(self, worker: str) -> None:
        """Forget everything routed to ``worker`` (it left the pool)."""
        self._evict(worker, -1)
        self.sizes.pop(worker, None)

    def _nodes(self, worker: str):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if worker in n.tenants:
                yield n
                stack.extend(n.children.values())
