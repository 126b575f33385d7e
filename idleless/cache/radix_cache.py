"""Radix-tree prefix KV cache (RadixAttention, SGLang paper, arXiv 2312.07104).

Nodes hold a span of token ids and the KV slot indices of those tokens. Requests use the tree through
one small handle-style interface: ``match_prefix`` -> ``inc_lock_ref`` -> (compute) -> ``insert`` ->
``dec_lock_ref``; ``evict`` frees unlocked leaves by policy: ``lru`` (least recently used first) or
``gdsf`` (value-aware: Greedy-Dual-Size-Frequency, Cherkasova 1998, HP Labs HPL-98-69R1: a node's
value is L + hits * cost / size, where cost / size is the recompute cost per token, growing with the
node's position because attention over a longer prefix costs more, and L is the value of the last
evicted node, which ages everything else). ``pin`` keeps a prefix (a system prompt, a RAG
document) from eviction until its TTL runs out, within a capped pinned budget. ``cache_unfinished_req`` and
``cache_finished_req`` do that dance for a running request. With ``page_size > 1`` only whole pages
are matched and inserted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Optional

import torch

from idleless.cache.kv_pool import KVPool

_EMPTY = torch.empty(0, dtype=torch.int64)


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


class RadixCache:
    """The prefix cache over a KVPool. Sizes are in tokens.

    Invariant: every slot in a node's value is owned by the tree (not free, not a request's own).
    ``evictable_size`` counts tokens in nodes with lock_ref == 0, ``protected_size`` the rest.
    """

    EVICTION_POLICIES = ("lru", "gdsf")
    # position (tokens) at which a token's attention cost equals its linear-layer cost, roughly,
    # for small Llama models; scales the GDSF recompute cost with depth
    GDSF_POSITION_SCALE = 3000.0

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
        self.pins: dict[str, tuple[TreeNode, float, int]] = {}  # pin id -> (node, expiry, tokens)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

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

    def match_prefix(self, key: list[int], hit: bool = True) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``key`` (page-aligned): (slots int64 [m], last node).

        The node returned covers exactly the matched prefix (a partially matched node is split).
        ``hit`` counts the match as a use of the prefix (for value-aware eviction)."""
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
        slots = torch.cat(parts) if parts else _EMPTY
        return slots, node

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

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert ``key`` with slots ``value`` (int64 [len(key)]), page-aligned (a partial tail page
        is ignored). Returns how many leading tokens were already cached: the caller still owns
        ``value[:that]`` (duplicates to free) and the tree now owns the rest."""
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
                return done
            k = self._common_len(child.key, rest)
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child, now, False)
            node = child
            done += k
        return done

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock_ref without inc_lock_ref"
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
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._eviction_priority(parent), parent))
        self.num_evicted += freed
        return freed

    # -- pinning -----------------------------------------------------------------------------
    @property
    def pinned_size(self) -> int:
        return sum(n for _, _, n in self.pins.values())

    def pin(self, pin_id: str, key: list[int], ttl: float, now: Optional[float] = None) -> int:
        """Keep the cached prefix ``key`` from eviction for ``ttl`` seconds (re-pinning the same id
        extends it). Returns the tokens pinned. Raises ValueError if ``key`` is not fully cached
        (page-aligned) or the pinned budget (``max_pinned_tokens``) would be exceeded."""
        now = time.monotonic() if now is None else now
        n = len(key) - len(key) % self.page_size
        slots, node = self.match_prefix(key[:n])
        if len(slots) < n:
            raise ValueError(f"only {len(slots)} of the {n} tokens to pin are cached")
        already = self.pins[pin_id][2] if pin_id in self.pins else 0
        if self.pinned_size - already + n > self.max_pinned_tokens:
            raise ValueError(f"pinning {n} tokens would exceed the pinned budget of {self.max_pinned_tokens} tokens "
                             f"({self.pinned_size} pinned)")
        self.unpin(pin_id)  # re-pinning replaces (and so extends) the old pin; a failed one keeps it
        self.inc_lock_ref(node)
        self.pins[pin_id] = (node, now + ttl, n)
        return n

    def unpin(self, pin_id: str) -> bool:
        """Release a pin (its prefix becomes evictable again). False if the id is unknown."""
        entry = self.pins.pop(pin_id, None)
        if entry is None:
            return False
        self.dec_lock_ref(entry[0])
        return True

    def unpin_expired(self, now: Optional[float] = None) -> int:
        """Release pins whose TTL ran out; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [p for p, (_, t, _) in self.pins.items() if t <= now]
        for p in expired:
            self.unpin(p)
        return len(expired)

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                yield n
            stack.extend(n.children.values())

    # -- request glue ------------------------------------------------------------------------
    def cache_unfinished_req(self, req) -> None:
        """Put the computed prefix of a running request into the tree and move its lock there.

        ``req.slots`` (int64) is rewritten in place so its tree-owned head uses the tree's slots;
        the request's redundant copies are freed. Called after each prefill chunk."""
        n = req.num_computed - req.num_computed % self.page_size
        if n <= req.num_tree_tokens:
            return
        key = req.all_ids[:n]
        cached = self.insert(key, req.slots[:n])
        if cached > req.num_tree_tokens:
            self.pool.free(req.slots[req.num_tree_tokens:cached])
        slots, node = self.match_prefix(key, hit=False)
        req.slots[:n] = slots
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = node
        req.num_tree_tokens = n

    def cache_finished_req(self, req) -> None:
        """A request is done (finished, aborted or retracted): its computed tokens go into the tree,
        its lock is released and every slot it still owns is freed. Leaves req.slots = None."""
        if req.slots is not None:
            self.cache_unfinished_req(req)
            own = req.slots[req.num_tree_tokens:]
            self.pool.free(own)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.slots, req.last_node, req.num_tree_tokens = None, None, 0


class NoPrefixCache(RadixCache):
    """The same interface with caching off (``--disable-radix-cache``): nothing matches, nothing
    is kept; a finished request's slots go straight back to the pool."""

    def match_prefix(self, key, hit=True):
        return _EMPTY, self.root

    def pin(self, pin_id, key, ttl, now=None) -> int:
        raise ValueError("the prefix cache is disabled")

    def peek_prefix_len(self, key) -> int:
        return 0

    def insert(self, key, value):
        raise RuntimeError("the prefix cache is disabled")

    def cache_unfinished_req(self, req) -> None:
        return

    def evict(self, num_tokens: int) -> int:
        return 0
