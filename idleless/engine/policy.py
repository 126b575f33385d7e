"""Waiting-queue order. ``fcfs``: arrival order. ``lpm`` (longest prefix match first, SGLang paper
arXiv 2312.07104 section 3): requests with the most tokens already in the radix cache go first, so
the prefixes they need are used before eviction; it falls back to fcfs when the queue is longer
than ``lpm_queue_threshold`` (matching every waiting request each step would cost too much).
Within equal keys, higher ``priority`` and then earlier arrival go first.
"""

from __future__ import annotations

from idleless.engine.request import Request


def order_waiting(waiting: list[Request], policy: str, cache, lpm_queue_threshold: int = 128) -> list[Request]:
    """Return the waiting requests in the order admission should try them (a new list)."""
    if policy == "lpm" and len(waiting) <= lpm_queue_threshold:
        def key(r: Request):
            return (-r.priority, -cache.peek_prefix_len(r.all_ids), r.arrival_time)
        return sorted(waiting, key=key)
    return sorted(waiting, key=lambda r: (-r.priority, r.arrival_time))
