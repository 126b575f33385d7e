"""The prefix cache interface: token ids and KV slots in, handles out.

The engine uses a prefix cache in one pattern (mini-sglang's ``BasePrefixCache`` is the model):
``match_prefix`` -> ``lock`` the handle -> compute the rest -> ``insert`` -> ``lock`` the new handle,
``unlock`` the old one; ``evict`` frees unlocked entries by policy. The cache sees token ids and slot
indices only, never requests. ``RadixCache`` (the radix tree) and ``NoPrefixCache`` (caching off) are
sibling implementations; the scheduler never asks which one it has.

Slot ownership (the KV pool's one-owner invariant): slots returned by ``match_prefix`` and the
``handle.slots`` of an insert belong to the cache; a caller may read them only while it holds a lock
on a handle covering them.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class CacheHandle:
    """A cached prefix: its length in tokens, its KV slots (int64 [cached_len], owned by the cache) and
    the implementation's own reference (a tree node for the radix cache; None when nothing is cached)."""

    cached_len: int
    slots: torch.Tensor
    node: Any = None


EMPTY_HANDLE = CacheHandle(0, EMPTY_SLOTS, None)


class InsertResult(NamedTuple):
    """``prefix_len``: tokens of the inserted key that were cached before (the caller still owns its
    copies of those, duplicates to free); ``handle``: the cached prefix of the key after the insert
    (the cache owns ``handle.slots``; ``handle.cached_len`` is 0 when the cache keeps nothing)."""

    prefix_len: int
    handle: CacheHandle


class PrefixCache(abc.ABC):
    """A prefix KV cache over a ``KVPool``. Sizes are in tokens; keys are token-id lists, cut to whole
    pages (``page_size``) by every operation.

    ``evictable_size``: cached tokens no lock protects; ``protected_size``: the rest; their sum is
    ``total_size``. ``pins`` maps pin id -> (handle, expiry, tokens)."""

    page_size: int
    keeps_prefixes: bool  # False for the no-cache variant: waiting for a prefix to be cached never pays
    evictable_size: int
    protected_size: int
    num_evicted: int
    max_pinned_tokens: int
    pins: dict

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @property
    def pinned_size(self) -> int:
        """Tokens held by pins."""
        return sum(n for _, _, n in self.pins.values())

    @abc.abstractmethod
    def match_prefix(self, key: list[int], hit: bool = True) -> CacheHandle:
        """The longest cached, page-aligned prefix of ``key``. ``hit`` counts the match as a use
        (value-aware eviction). The handle's slots are safe to use only once it is locked."""

    @abc.abstractmethod
    def peek_prefix_len(self, key: list[int]) -> int:
        """Length in tokens of the cached prefix of ``key``, changing nothing."""

    @abc.abstractmethod
    def insert(self, key: list[int], slots: torch.Tensor) -> InsertResult:
        """Offer ``key`` with its KV ``slots`` (int64 [len(key)]); a partial tail page is ignored.
        The cache takes ownership of ``slots[prefix_len:handle.cached_len]``."""

    @abc.abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's prefix from eviction (counted: each lock needs one unlock)."""

    @abc.abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one ``lock(handle)``. Raises AssertionError on an unlock without a lock."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked entries by policy; returns the tokens freed
        (fewer when not enough is evictable)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every entry and pin and free their slots; no lock may be held."""

    @abc.abstractmethod
    def pin(self, pin_id: str, key: list[int], ttl: float, now: Optional[float] = None) -> int:
        """Keep the cached prefix ``key`` from eviction for ``ttl`` seconds (re-pinning an id replaces
        its pin). Returns the tokens pinned. Raises ValueError when the prefix is not fully cached, the
        pinned budget ``max_pinned_tokens`` would be exceeded, or the cache keeps nothing."""

    def check_pin(self, pin_id: str, num_tokens: int) -> None:
        """Raise ValueError when pinning ``num_tokens`` under ``pin_id`` (replacing its pin, if any)
        would exceed ``max_pinned_tokens``, or when the cache keeps nothing; returns otherwise."""
        if not self.keeps_prefixes:
            raise ValueError("the prefix cache is disabled")
        already = self.pins[pin_id][2] if pin_id in self.pins else 0
        if self.pinned_size - already + num_tokens > self.max_pinned_tokens:
            raise ValueError(f"pinning {num_tokens} tokens would exceed the pinned budget of "
                             f"{self.max_pinned_tokens} tokens ({self.pinned_size} pinned)")

    def unpin(self, pin_id: str) -> bool:
        """Release a pin early; False if the id is unknown."""
        entry = self.pins.pop(pin_id, None)
        if entry is None:
            return False
        self.unlock(entry[0])
        return True

    def unpin_expired(self, now: Optional[float] = None) -> int:
        """Release the pins whose TTL ran out; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [p for p, (_, t, _) in self.pins.items() if t <= now]
        for p in expired:
            self.unpin(p)
        return len(expired)
