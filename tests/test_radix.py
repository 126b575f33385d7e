"""The prefix caches (idleless/cache/) against a brute-force model: one conformance suite run
against both implementations of ``PrefixCache`` (the radix tree, and NoPrefixCache, whose model
stays empty).

The model of the tree is a dict ``{page-aligned token prefix (tuple): KV slots of its last page}``
holding every cached prefix (with page_size 1: every prefix -> the slot of its last token); the tree
is right iff walking it gives exactly that dict. Hypothesis drives random
sequences of match / insert (with and without a prior match, so duplicate slots and node splits
happen) / lock / unlock / pin / unpin / TTL expiry / evict / reset over a small alphabet and a small
pool, for page_size 1 and 4 and both eviction policies (lru, gdsf), and after every step checks: the tree's content, lock refs (brute-force count of the locks whose
prefix runs through each node), evictable/protected sizes, page alignment, and slot ownership (every
slot is either free or in the tree, never both, since no request holds slots between steps).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from idleless.cache.kv_pool import KVPool
from idleless.cache.radix_cache import NoPrefixCache, RadixCache
from idleless.engine.kv_manager import RequestKV
from idleless.engine.request import RequestRecord, SamplingParams

NUM_SLOTS = 48  # small, so that inserts run the pool dry and force eviction

# 2 symbols, and sequences grown from a few common stems: many shared prefixes and splits inside pages
_STEMS = [[0] * 8, [0, 1] * 4, [0, 0, 0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 1]]
tokens = st.one_of(
    st.lists(st.integers(0, 1), min_size=0, max_size=14),
    st.tuples(st.sampled_from(_STEMS), st.lists(st.integers(0, 1), max_size=6)).map(lambda t: t[0] + t[1]),
)


def _pool(page_size: int, num_slots: int = NUM_SLOTS) -> KVPool:
    return KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_slots=num_slots, dtype=torch.float32,
                  page_size=page_size)


def _free_slots(pool: KVPool) -> list[int]:
    """The pool's free slots (every slot of every free page)."""
    ps = pool.page_size
    pages = pool._free_pages[: pool._num_free_pages].tolist()
    return [p * ps + i for p in pages for i in range(ps)]


def _nodes(cache):
    """(node, path tokens from the root to the end of node) for every non-root node (none for a
    cache without a tree)."""
    root = getattr(cache, "root", None)
    stack = [(c, tuple(c.key)) for c in root.children.values()] if root is not None else []
    while stack:
        node, path = stack.pop()
        yield node, path
        stack.extend((c, path + tuple(c.key)) for c in node.children.values())


def tree_content(cache: RadixCache) -> dict[tuple, tuple]:
    """Walk the tree: {prefix ending on a page boundary: slots of that page} for every page it holds."""
    ps = cache.page_size
    out = {}
    for node, path in _nodes(cache):
        start = len(path) - len(node.key)
        v = node.value.tolist()
        for j in range(0, len(v), ps):
            out[path[: start + j + ps]] = tuple(v[j: j + ps])
    return out


def page_keys(seq, page_size: int, upto: int) -> list[tuple]:
    """Model keys of the first ``upto`` tokens of seq (upto page-aligned)."""
    return [tuple(seq[: j + page_size]) for j in range(0, upto, page_size)]


def model_match(model: dict[tuple, tuple], seq, page_size: int) -> list[int]:
    """Brute force: slots of the longest page-aligned prefix of seq present in the model."""
    seq = tuple(seq)
    m = 0
    while m + page_size <= len(seq) and seq[: m + page_size] in model:
        m += page_size
    return [s for k in page_keys(seq, page_size, m) for s in model[k]]


def model_insert(model: dict[tuple, tuple], seq, slots: list[int], start: int, page_size: int) -> None:
    """Add the pages of seq from token ``start`` (page-aligned) on, with their slots."""
    n = len(seq) - len(seq) % page_size
    for j in range(start, n, page_size):
        model[tuple(seq[: j + page_size])] = tuple(slots[j: j + page_size])


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"
    cache_cls = RadixCache

    def __init__(self):
        super().__init__()
        self.pool = _pool(self.page_size)
        if self.cache_cls is RadixCache:
            self.cache = RadixCache(self.pool, self.page_size, self.policy)
        else:
            self.cache = self.cache_cls(self.pool, self.page_size)
        self.keeps = self.cache.keeps_prefixes
        self.model: dict[tuple, tuple] = {}
        self.locks: list[tuple[object, tuple]] = []  # (handle, the prefix it covers)
        self.pins: dict[str, tuple[tuple, float, int]] = {}  # pin id -> (prefix, expiry, tokens)
        self.clock = 1000.0

    def _locked_prefixes(self) -> list[tuple]:
        return [p for _, p in self.locks] + [p for p, _, _ in self.pins.values()]

    # -- helpers -----------------------------------------------------------------------------
    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _evict(self, n: int) -> int:
        before = tree_content(self.cache)
        free_before = self.pool.num_free_slots
        evictable = self.cache.evictable_size
        freed = self.cache.evict(n)
        after = tree_content(self.cache)
        assert set(after) <= set(before)
        removed = set(before) - set(after)
        assert self.pool.num_free_slots == free_before + freed
        if n > 0:
            # every unlocked node can go (locks cover whole root paths), leaves first
            assert freed >= min(n, evictable)
        assert freed == len(removed) * self.page_size
        for prefix in self._locked_prefixes():  # a locked or pinned prefix is never evicted
            for k in page_keys(prefix, self.page_size, len(prefix)):
                assert k in after
        for k in removed:
            del self.model[k]
        return freed

    def _alloc(self, num_have: int, last: int, n: int):
        slots = self.pool.alloc(num_have, last, n)
        if slots is None:
            short = self.pool.tokens_needed(num_have, n) - self.pool.num_free_slots
            self._evict(short)
            slots = self.pool.alloc(num_have, last, n)
        return slots

    # -- rules -------------------------------------------------------------------------------
    @rule(seq=tokens)
    def match(self, seq):
        expected = model_match(self.model, seq, self.page_size)
        assert self.cache.peek_prefix_len(seq) == len(expected)
        handle = self.cache.match_prefix(list(seq))
        assert handle.slots.dtype == torch.int64
        assert handle.slots.tolist() == expected and handle.cached_len == len(expected)
        if not self.keeps:
            return
        # the node returned covers exactly the matched prefix (a partial match was split)
        path = []
        n = handle.node  # None for an empty match
        while n is not None and n is not self.cache.root:
            path = list(n.key) + path
            n = n.parent
        assert path == list(seq[: len(expected)])

    @rule(seq=tokens)
    def insert_without_match(self, seq):
        """A request that computed all of seq itself: its copies of cached tokens are duplicates."""
        n = len(seq)
        if n == 0:
            return
        slots = self._alloc(0, 0, n)
        if slots is None:
            return
        expected_cached = len(model_match(self.model, seq, self.page_size))
        cached, handle = self.cache.insert(list(seq), slots)
        assert cached == expected_cached
        kept = handle.cached_len  # the cache owns slots[cached:kept] now
        assert kept == (self._aligned(n) if self.keeps else 0)
        if self.keeps:
            model_insert(self.model, seq, slots.tolist(), cached, self.page_size)
        assert handle.slots.tolist() == model_match(self.model, seq, self.page_size)
        self.pool.free(slots[:cached])  # duplicates stay the caller's
        self.pool.free(slots[max(kept, cached):])  # the partial tail page (or all of it) is never kept

    @rule(seq=tokens, keep_lock=st.booleans())
    def insert_after_match(self, seq, keep_lock):
        """The scheduler's path: match, lock, compute the rest, insert, unlock (or, like a running
        request, move the lock to the node of the whole inserted sequence and keep it)."""
        handle = self.cache.match_prefix(list(seq))
        matched = handle.slots
        m = len(matched)
        assert matched.tolist() == model_match(self.model, seq, self.page_size)
        self.cache.lock(handle)
        self.locks.append((handle, tuple(seq[:m])))
        rest = self._alloc(m, int(matched[-1]) if m else 0, len(seq) - m)
        self.locks.pop()
        if rest is None:
            self.cache.unlock(handle)
            return
        assert tree_content(self.cache).keys() >= set(page_keys(seq, self.page_size, m))
        full = torch.cat([matched, rest])
        cached, new = self.cache.insert(list(seq), full)
        assert cached == m
        kept = new.cached_len
        if self.keeps:
            model_insert(self.model, seq, full.tolist(), m, self.page_size)
        assert new.slots.tolist() == full[:kept].tolist()
        self.pool.free(full[max(kept, m):])
        if keep_lock:
            self.cache.lock(new)
            self.locks.append((new, tuple(seq[:kept])))
        self.cache.unlock(handle)

    @rule(seq=tokens)
    def lock(self, seq):
        handle = self.cache.match_prefix(list(seq))
        if handle.cached_len == 0:
            return
        self.cache.lock(handle)
        self.locks.append((handle, tuple(seq[: handle.cached_len])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        handle, _ = self.locks.pop(i)
        self.cache.unlock(handle)

    @rule(n=st.integers(0, NUM_SLOTS + 8))
    def evict(self, n):
        self._evict(n)

    @rule(pin_id=st.sampled_from(["p0", "p1", "p2"]), seq=tokens, ttl=st.sampled_from([1.0, 3.0]))
    def pin(self, pin_id, seq, ttl):
        n = self._aligned(len(seq))
        cached = len(model_match(self.model, seq, self.page_size))
        others = sum(t for p, (_, _, t) in self.pins.items() if p != pin_id)
        budget_ok = others + n <= self.cache.max_pinned_tokens  # re-pinning an id replaces its pin
        try:
            got = self.cache.pin(pin_id, list(seq), ttl, now=self.clock)
        except ValueError:
            assert not (self.keeps and cached == n and budget_ok)
            # a failed re-pin keeps the old pin
            assert (pin_id in self.cache.pins) == (pin_id in self.pins)
            return
        assert cached == n and budget_ok and got == n
        self.pins[pin_id] = (tuple(seq[:n]), self.clock + ttl, n)
        assert self.cache.pinned_size == sum(t for _, _, t in self.pins.values())

    @precondition(lambda self: self.model)
    @rule(pin_id=st.sampled_from(["p0", "p1", "p2"]), data=st.data(), ttl=st.sampled_from([1.0, 3.0]))
    def pin_cached(self, pin_id, data, ttl):
        """Pin a prefix that is in the tree (the common case: a system prompt already served)."""
        self.pin(pin_id, list(data.draw(st.sampled_from(sorted(self.model)))), ttl)

    @rule(pin_id=st.sampled_from(["p0", "p1", "p2", "nope"]))
    def unpin(self, pin_id):
        assert self.cache.unpin(pin_id) == (self.pins.pop(pin_id, None) is not None)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0]))
    def time_passes(self, dt):
        self.clock += dt
        expired = [p for p, (_, t, _) in self.pins.items() if t <= self.clock]
        assert self.cache.unpin_expired(now=self.clock) == len(expired)
        for p in expired:
            del self.pins[p]

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model.clear()
        self.pins.clear()
        assert self.pool.num_free_slots == self.pool.num_slots and not self.cache.pins

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def content_matches_model(self):
        assert tree_content(self.cache) == self.model

    @invariant()
    def structure_and_locks(self):
        ps = self.page_size
        locked = self._locked_prefixes()
        locked_pages = set()
        for prefix in locked:
            locked_pages |= set(page_keys(prefix, ps, len(prefix)))
        evictable = protected = 0
        for node, path in _nodes(self.cache):
            assert len(node.key) > 0 and len(node.key) % ps == 0
            assert len(node.value) == len(node.key)
            assert node.parent.children[tuple(node.key[:ps])] is node
            # brute-force lock count: locks whose prefix runs through (the end of) this node
            want = sum(1 for p in locked if p[: len(path)] == path and len(p) >= len(path))
            assert node.lock_ref == want, (path, node.lock_ref, want)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            if ps > 1:  # whole pages of consecutive slots
                v = node.value.tolist()
                for j in range(0, len(v), ps):
                    assert v[j] % ps == 0 and v[j: j + ps] == list(range(v[j], v[j] + ps))
        assert self.cache.evictable_size == evictable
        assert self.cache.protected_size == protected == len(locked_pages) * ps
        assert self.cache.total_size == len(self.model) * ps

    @invariant()
    def slot_ownership(self):
        tree_slots = [s for page in self.model.values() for s in page]
        free = _free_slots(self.pool)
        assert len(set(tree_slots)) == len(tree_slots), "a slot is in the tree twice"
        assert len(set(free)) == len(free), "a page is free twice"
        assert not set(tree_slots) & set(free), "a slot is both free and in the tree"
        assert sorted(tree_slots + free) == list(range(self.pool.num_slots))
        assert self.pool.num_free_slots + self.cache.total_size == self.pool.num_slots


class NoCacheMachine(RadixMachine):
    cache_cls = NoPrefixCache


class NoCacheMachinePage4(RadixMachine):
    cache_cls = NoPrefixCache
    page_size = 4


class RadixMachinePage4(RadixMachine):
    page_size = 4


class RadixMachineGDSF(RadixMachine):
    policy = "gdsf"


class RadixMachineGDSFPage4(RadixMachine):
    page_size = 4
    policy = "gdsf"


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestRadixLRUPage1 = RadixMachine.TestCase
TestRadixLRUPage4 = RadixMachinePage4.TestCase
TestRadixGDSFPage1 = RadixMachineGDSF.TestCase
TestRadixGDSFPage4 = RadixMachineGDSFPage4.TestCase
TestNoPrefixCachePage1 = NoCacheMachine.TestCase
TestNoPrefixCachePage4 = NoCacheMachinePage4.TestCase
for _t in (TestRadixLRUPage1, TestRadixLRUPage4, TestRadixGDSFPage1, TestRadixGDSFPage4, TestNoPrefixCachePage1,
           TestNoPrefixCachePage4):
    _t.settings = _settings
del _t  # or pytest collects the loop variable as one more test class


# ---------------------------------------------------------------------------- worked examples


def test_split_on_partial_match():
    pool = _pool(1)
    cache = RadixCache(pool)
    a = pool.alloc(0, 0, 5)
    assert cache.insert([1, 2, 3, 4, 5], a).prefix_len == 0
    b = pool.alloc(0, 0, 5)
    assert cache.insert([1, 2, 3, 9, 9], b).prefix_len == 3  # b[:3] are duplicates, still the caller's
    pool.free(b[:3])
    (mid,) = cache.root.children.values()
    assert mid.key == [1, 2, 3] and mid.value.tolist() == a[:3].tolist()
    assert sorted(c.key for c in mid.children.values()) == [[4, 5], [9, 9]]
    handle = cache.match_prefix([1, 2, 3, 9, 7])
    slots, node = handle.slots, handle.node
    assert slots.tolist() == a[:3].tolist() + b[3:4].tolist()
    assert node.key == [9] and node.parent is mid  # the [9, 9] leaf was split at the match
    assert cache.total_size == 7 and pool.num_free_slots == NUM_SLOTS - 7


def test_page_size_4_matches_and_inserts_whole_pages():
    pool = _pool(4)
    cache = RadixCache(pool, page_size=4)
    slots = pool.alloc(0, 0, 10)
    assert slots[:8].tolist() == sorted(slots[:8].tolist())
    assert cache.insert(list(range(10)), slots).prefix_len == 0
    pool.free(slots[8:])
    assert cache.total_size == 8
    assert cache.match_prefix(list(range(7))).slots.tolist() == slots[:4].tolist()
    assert cache.match_prefix(list(range(12))).slots.tolist() == slots[:8].tolist()
    assert cache.match_prefix([0, 1, 2, 9, 9, 9, 9, 9]).slots.numel() == 0  # mismatch inside page 0
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).slots.tolist() == slots[:4].tolist()
    assert pool.num_free_slots + cache.total_size == pool.num_slots


def test_lru_eviction_order_and_locks():
    pool = _pool(1)
    cache = RadixCache(pool)
    seqs = [[0, 1, 1], [0, 2, 2], [0, 3, 3]]
    for s in seqs:
        slots = pool.alloc(0, 0, 3)
        pool.free(slots[: cache.insert(s, slots).prefix_len])  # the duplicate of [0]
    pool_free = pool.num_free_slots
    cache.match_prefix([0, 1, 1])  # touch the first: the second is now least recently used
    handle = cache.match_prefix([0, 3, 3])
    cache.lock(handle)  # and the third is locked
    assert cache.evict(1) == 2  # one leaf of 2 tokens: [2, 2]
    assert cache.peek_prefix_len([0, 2, 2]) == 1 and cache.peek_prefix_len([0, 1, 1]) == 3
    assert cache.evict(100) == 2  # only [1, 1] can go; [0] is an ancestor of the locked leaf
    assert cache.peek_prefix_len([0, 3, 3]) == 3
    assert cache.evictable_size == 0 and cache.protected_size == 3
    cache.unlock(handle)
    assert cache.evict(100) == 3
    assert pool.num_free_slots == pool_free + 7 == pool.num_slots


def _rec(ids, num_computed, pool, n):
    rec = RequestRecord("r", list(ids), SamplingParams(), 0, 0.0, 1)
    rec.slots, rec.num_computed = torch.empty(0, dtype=torch.int64), num_computed
    rec.slots = pool.alloc(0, 0, n)
    return rec


@pytest.mark.parametrize("page_size", [1, 4])
def test_request_kv_moves_slots_into_the_cache(page_size):
    """RequestKV.cache_computed / release: two requests that computed the same prompt independently
    end with one copy in the tree and nothing leaked."""
    pool = _pool(page_size)
    kv = RequestKV(pool, RadixCache(pool, page_size))
    cache = kv.cache
    ids = list(range(10))
    r1 = _rec(ids, 10, pool, 10)
    r2 = _rec(ids + [7], 10, pool, 10)
    kv.cache_computed(r1)
    n = 10 - 10 % page_size
    assert r1.num_tree_tokens == n and cache.protected_size == n
    kv.cache_computed(r2)  # its copy of the shared prefix is freed, its table rewritten
    assert r2.slots[:n].tolist() == r1.slots[:n].tolist()
    assert cache.total_size == n
    own = sum(kv.own_tokens(r) for r in (r1, r2))
    assert pool.num_free_slots + cache.total_size + own == pool.num_slots
    for r in (r1, r2):
        kv.release(r)
        assert r.slots is None and r.cache_handle is None
    assert cache.protected_size == 0
    assert pool.num_free_slots + cache.total_size == pool.num_slots
    cache.reset()
    assert pool.num_free_slots == pool.num_slots


def test_request_kv_over_no_prefix_cache_keeps_nothing():
    pool = _pool(1)
    kv = RequestKV(pool, NoPrefixCache(pool))
    r = _rec(range(6), 6, pool, 6)
    kv.cache_computed(r)
    assert kv.cache.match_prefix(list(range(6))).cached_len == 0 and r.num_tree_tokens == 0
    kv.release(r)
    assert pool.num_free_slots == pool.num_slots and kv.cache.total_size == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_request_kv_truncate_frees_whole_pages_past_the_kept_tokens(page_size):
    pool = _pool(page_size)
    kv = RequestKV(pool, RadixCache(pool, page_size))
    r = _rec(range(13), 5, pool, 5)
    assert kv.grow(r, 8) is not None and len(r.slots) == 13
    kv.truncate(r, 6)
    assert len(r.slots) == 6
    assert pool.num_free_slots == pool.num_slots - -(-6 // page_size) * page_size
    assert kv.grow(r, 3) is not None  # refills the kept page first
    kv.release(r)
    assert pool.num_free_slots + kv.cache.total_size == pool.num_slots
