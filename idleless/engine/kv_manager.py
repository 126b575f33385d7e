"""KV ownership of requests: slot tables, the prefix cache and the pool, kept consistent.

Every KV slot is owned by exactly one of: the pool's free list, the prefix cache, one request (the
part of its slot table past ``num_tree_tokens``). This module is the only place that moves slots
between a request and the other two; the prefix cache itself sees token ids and slots only.
"""

from __future__ import annotations

import torch

from idleless.cache.base import PrefixCache
from idleless.cache.kv_pool import KVPool
from idleless.engine.request import RequestRecord


class RequestKV:
    """The request-side glue over a ``KVPool`` and a ``PrefixCache``. Sizes are in tokens."""

    def __init__(self, pool: KVPool, cache: PrefixCache):
        self.pool = pool
        self.cache = cache

    def attach_prefix(self, rec: RequestRecord, cap: int) -> int:
        """Match ``rec``'s first ``cap`` known tokens against the cache and lock the hit; the table
        becomes the cached slots. Returns the tokens hit (``rec.num_computed`` is set to it)."""
        handle = self.cache.match_prefix(rec.all_ids[:cap])
        self.cache.lock(handle)
        rec.cache_handle, rec.slots = handle, handle.slots
        rec.num_computed = handle.cached_len
        return handle.cached_len

    def grow(self, rec: RequestRecord, n: int) -> torch.Tensor | None:
        """Slots for ``n`` more tokens of ``rec``'s table, evicting unlocked cache entries if the pool
        is short; appended to ``rec.slots`` and returned (int64 [n]), or None (nothing taken)."""
        have = len(rec.slots)
        short = self.pool.tokens_needed(have, n) - self.pool.num_free_slots
        if short > 0:
            self.cache.evict(short)
        new = self.pool.alloc(have, int(rec.slots[-1]) if have else 0, n)
        if new is not None:
            rec.slots = torch.cat([rec.slots, new])
        return new

    def truncate(self, rec: RequestRecord, length: int) -> None:
        """Give back the slots of ``rec``'s table past ``length`` tokens (rejected draft tokens):
        whole pages past the one holding token ``length - 1`` return to the pool; slots inside that
        page stay in the table's last page and are overwritten by the next tokens. Never cached."""
        ps = self.pool.page_size
        keep_slots = -(-length // ps) * ps
        if len(rec.slots) > keep_slots:
            self.pool.free(rec.slots[keep_slots:])
        rec.slots = rec.slots[:length]

    def cache_computed(self, rec: RequestRecord) -> None:
        """Offer ``rec``'s computed whole pages to the cache and move its lock there. The table's
        cached head is rewritten to the cache's slots; the request's duplicate copies are freed."""
        n = rec.num_computed - rec.num_computed % self.pool.page_size
        if n <= rec.num_tree_tokens:
            return
        prefix_len, handle = self.cache.insert(rec.all_ids[:n], rec.slots[:n])
        if prefix_len > rec.num_tree_tokens:
            self.pool.free(rec.slots[rec.num_tree_tokens:prefix_len])
        if handle.cached_len:
            rec.slots = torch.cat([handle.slots, rec.slots[handle.cached_len:]])
        self.cache.lock(handle)
        if rec.cache_handle is not None:
            self.cache.unlock(rec.cache_handle)
        rec.cache_handle = handle

    def release(self, rec: RequestRecord) -> None:
        """``rec`` is done, aborted or retracted: its computed pages go into the cache, its lock is
        released and every slot it still owns is freed. Leaves ``slots`` and ``cache_handle`` None."""
        if rec.slots is not None:
            self.cache_computed(rec)
            self.pool.free(rec.slots[rec.num_tree_tokens:])
        if rec.cache_handle is not None:
            self.cache.unlock(rec.cache_handle)
        rec.slots, rec.cache_handle = None, None

    def own_tokens(self, rec: RequestRecord) -> int:
        """Slots the request owns itself (whole pages), 0 while it holds none."""
        if rec.slots is None:
            return 0
        ps = self.pool.page_size
        return -(-(len(rec.slots) - rec.num_tree_tokens) // ps) * ps
