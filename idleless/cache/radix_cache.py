"""Radix-tree prefix KV cache (RadixAttention, SGLang paper, arXiv 2312.07104).

Nodes hold a span of token ids and the KV slot indices of those tokens. The tree implements the
``PrefixCache`` interface (``cache/base.py``): ``match_prefix`` -> ``lock`` -> (compute) -> ``insert`` ->
``unlock``; ``evict`` frees unlocked leaves by policy: ``lru`` (least recently used first) or
``gdsf`` (value-aware: Greedy-Dual-Size-Frequency, Cherkasova 1998, HP Labs HPL-98-69R1: a node's
value is L + hits * cost / size, where cost / size is the recompute cost per token, growing with the
node's position because attention over a longer prefix costs more, and L is the value of the last
evicted node, which ages everything else). ``pin`` keeps a prefix (a system prompt, a RAG
document) from eviction until its TTL runs out, within a capped pinned budget. With ``page_size > 1``
only whole pages are matched and inserted. ``NoPrefixCache`` is the sibling that keeps nothing.

``listener`` (None by default) hears every change to what the tree holds, for KV events
(``idleless.router.events``): ``on_stored(tokens, start)`` when an insert adds a node (the tree
now holds ``tokens``, of which it held ``tokens[:start]`` before), ``on_removed(tokens, start)`` when
eviction deletes a leaf (``tokens`` is the leaf's whole path; ``tokens[:start]`` stay), and
``on_cleared()`` on ``reset``. Splitting a node changes no held tokens and is not reported.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Optional

import torch

from idleless.cache.base import EMPTY_HANDLE, EMPTY_SLOTS as _EMPTY, CacheHandle, InsertResult, PrefixCache
from idleless.cache.kv_pool import KVPool


class TreeNode:
    """A span of ``key`` (token ids) with ``value`` (their KV slots, int64 [len(key)])."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "hit_count", "id",
                 "start", "value_score")
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: Optional["TreeNode"], start: int = 0):
        self.children: dict[tuple, TreeNode] = {}
        self.start = start  # tokens before this node on its path (its position in the sequence)
        self.value_score = 0.0  # GDSF value
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.hit_count = 0
        self.id = next(TreeNode._ids)

    def __lt__(self, other: "TreeNode") -> bool:  # heap tie-break
        return self.id < other.id


class RadixCache(PrefixCache):
    """The radix-tree prefix cache over a KVPool. Sizes are in tokens.

    Invariant: every slot in a node's value is owned by the tree (not free, not a request's own).
    ``evictable_size`` counts tokens in nodes with lock_ref == 0, ``protected_size`` the rest.
    """

    EVICTION_POLICIES = ("lru", "gdsf")
    # position (tokens) at which a token's attention cost equals its linear-layer cost, roughly,
    # for small Llama models; scales the GDSF recompute cost with depth
    GDSF_POSITION_SCALE = 3000.0
    keeps_prefixes = True
    listener = None  # see the module docstring

    def __init__(self, pool: KVPool, page_size: int = 1, eviction_policy: str = "lru",
                 max_pinned_tokens: Optional[int] = None):
        if eviction_policy not in self.EVICTION_POLICIES:
            raise ValueError(f"unknown radix eviction policy {eviction_policy!r} "
                             f"(supported: {', '.join(self.EVICTION_POLICIES)})")
        self.pool = pool
        self.max_pinned_tokens = pool.num_slots // 4 if max_pinned_tokens is None else max_pinned_tokens
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.reset()

    # -- bookkeeping -------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every node and pin (the caller must make sure no request holds a lock) and free their slots."""
        root = getattr(self, "root", None)
        if root is not None:
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                self.pool.free(n.value)
                stack.extend(n.children.values())
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0
        self.num_evicted = 0
        self.inflation = 0.0  # GDSF's L
        self.pins: dict[str, tuple[CacheHandle, float, int]] = {}  # pin id -> (handle, expiry, tokens)
        if self.listener is not None:
            self.listener.on_cleared()

    def _child_key(self, key: list[int]) -> tuple:
        return tuple(key[: self.page_size])

    def _common_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split ``node`` after its first k tokens; returns the new parent holding key[:k]."""
        new = TreeNode(node.key[:k], node.value[:k], node.parent, node.start)
        new.value_score = node.value_score
        node.start += k
        new.lock_ref = node.lock_ref
        new.last_access = node.last_access
        new.hit_count = node.hit_count
        new.children = {self._child_key(node.key[k:]): node}
        node.parent.children[self._child_key(new.key)] = new
        node.parent = new
        node.key = node.key[k:]
        node.value = node.value[k:]
        return new

    # -- the interface -----------------------------------------------------------------------
    def _touch(self, node: TreeNode, now: float, hit: bool) -> None:
        node.last_access = now
        if hit:
            node.hit_count += 1
        mid = node.start + len(node.key) / 2
        node.value_score = self.inflation + (node.hit_count + 1) * (1.0 + mid / self.GDSF_POSITION_SCALE)

    def match_prefix(self, key: list[int], hit: bool = True) -> CacheHandle:
        """Longest cached prefix of ``key`` (page-aligned) as a handle: slots int64 [m] and the node
        that covers exactly the matched prefix (a partially matched node is split). ``hit`` counts
        the match as a use of the prefix (for value-aware eviction)."""
        now = time.monotonic()
        node = self.root
        parts = []
        key = key[: len(key) - len(key) % self.page_size]
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            k = self._common_len(child.key, key)
            if k == 0:
                break
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child, now, hit)
            parts.append(child.value)
            node = child
            key = key[k:]
        if not parts:
            return EMPTY_HANDLE
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        return CacheHandle(len(slots), slots, node)

    def peek_prefix_len(self, key: list[int]) -> int:
        """Length of the cached prefix of ``key`` in tokens, without touching the tree."""
        node, done = self.root, 0
        n = len(key) - len(key) % self.page_size
        while done < n:
            child = node.children.get(self._child_key(key[done:done + self.page_size]))
            if child is None:
                break
            k = self._common_len(child.key, key[done:done + len(child.key)])
            done += k
            if k < len(child.key):
                break
            node = child
        return done

    def insert(self, key: list[int], value: torch.Tensor) -> InsertResult:
        """Insert ``key`` with slots ``value`` (int64 [len(key)]), page-aligned (a partial tail page
        is ignored). ``prefix_len``: leading tokens already cached (the caller still owns
        ``value[:prefix_len]``, duplicates to free); the tree now owns the rest, and ``handle``
        covers the whole inserted key (not yet locked)."""
        done = self._insert(key, value)
        return InsertResult(done, self.match_prefix(key, hit=False))

    def _insert(self, key: list[int], value: torch.Tensor) -> int:
        now = time.monotonic()
        n = len(key) - len(key) % self.page_size
        key, value = key[:n], value[:n]
        node = self.root
        done = 0
        while done < n:
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                new = TreeNode(rest, value[done:].clone(), node, done)
                self._touch(new, now, False)
                node.children[self._child_key(rest)] = new
                self.evictable_size += len(rest)
                if self.listener is not None:
                    self.listener.on_stored(key, done)
                return done
            k = self._common_len(child.key, rest)
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child, now, False)
            node = child
            done += k
        return done

    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's node and its ancestors from eviction."""
        node = handle.node
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one ``lock(handle)``."""
        node = handle.node
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def _eviction_priority(self, node: TreeNode) -> float:
        return node.value_score if self.eviction_policy == "gdsf" else node.last_access

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots by deleting unlocked leaves, least recently used
        first; returns the number of tokens freed (less if not enough is evictable)."""
        if num_tokens <= 0:
            return 0
        heap = [(self._eviction_priority(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            prio, node = heapq.heappop(heap)
            if self.eviction_policy == "gdsf":
                self.inflation = max(self.inflation, prio)
            self.pool.free(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            if self.listener is not None:
                self.listener.on_removed(self._path(node), node.start)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._eviction_priority(parent), parent))
        self.num_evicted += freed
        return freed

    # -- pinning -----------------------------------------------------------------------------
    def pin(self, pin_id: str, key: list[int], ttl: float, now: Optional[float] = None) -> int:
        """Keep the cached prefix ``key`` from eviction for ``ttl`` seconds (re-pinning the same id
        extends it). Returns the tokens pinned. Raises ValueError if ``key`` is not fully cached
        (page-aligned) or the pinned budget (``max_pinned_tokens``) would be exceeded."""
        now = time.monotonic() if now is None else now
        n = len(key) - len(key) % self.page_size
        handle = self.match_prefix(key[:n])
        if handle.cached_len < n:
            raise ValueError(f"only {handle.cached_len} of the {n} tokens to pin are cached")
        self.check_pin(pin_id, n)
        self.unpin(pin_id)  # re-pinning replaces (and so extends) the old pin; a failed one keeps it
        self.lock(handle)
        self.pins[pin_id] = (handle, now + ttl, n)
        return n

    def _path(self, node: TreeNode) -> list[int]:
        """The token ids from the root to the end of ``node``."""
        parts = []
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                yield n
            stack.extend(n.children.values())


class NoPrefixCache(PrefixCache):
    """The prefix cache with caching off (``--disable-radix-cache``): nothing matches, nothing is
    kept (an insert takes no slot, so a request's slots go straight back to the pool), nothing pins."""

    keeps_prefixes = False
    listener = None  # never called: nothing is ever held

    def __init__(self, pool: KVPool, page_size: int = 1, max_pinned_tokens: Optional[int] = None):
        self.pool = pool
        self.page_size = page_size
        self.max_pinned_tokens = 0
        self.reset()

    def reset(self) -> None:
        self.evictable_size = self.protected_size = self.num_evicted = 0
        self.pins = {}

    def match_prefix(self, key, hit=True) -> CacheHandle:
        return EMPTY_HANDLE

    def peek_prefix_len(self, key) -> int:
        return 0

    def insert(self, key, slots) -> InsertResult:
        return InsertResult(0, EMPTY_HANDLE)

    def lock(self, handle) -> None:
        return

    def unlock(self, handle) -> None:
        return

    def evict(self, num_tokens: int) -> int:
        return 0

    def pin(self, pin_id, key, ttl, now=None) -> int:
        raise ValueError("the prefix cache is disabled")
