"""The time to first token of a disaggregated request, split into queue, prefill, transfer and first decode.

Each part is measured on the engine that spends it, as a duration on that engine's own monotonic
clock (no clock is compared across machines):

- ``queue``: on the prefill engine, from the request's arrival at its frontend to the start of the step
  that admitted it;
- ``prefill``: on the prefill engine, from there to its first (and only) token;
- ``transfer``: on the decode engine, from sending the pull to the KV written into its pool (this
  includes the prefill engine's wait for a step boundary to lock the prefix);
- ``first_decode``: on the decode engine, from there to its first token (its own queue, the last
  prompt token recomputed for its logits, the sample).

The prefill engine's two parts travel to the decode engine in the KV reply's header (``wire``), keyed
by the router's ``transfer_id``; the decode engine keeps the four per request (``SplitStats``). The
parts are disjoint intervals of the request's life, so their sum is at most the TTFT a client sees.
A layer-wise transfer (``layerwise``) overlaps the prefill: its ``transfer`` part runs from the pull
to the last layer written, so it includes the prefill, and its ``queue`` and ``prefill`` parts are
not reported (the prefill engine sends them with no message).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

PARTS = ("queue", "prefill", "transfer", "first_decode")
#: upper bounds (seconds) of the cumulative histogram buckets; +Inf is ``count``
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def prefill_parts(arrival: float, admitted: float, first_token: float) -> dict:
    """The prefill engine's parts (seconds, >= 0) from three times on one monotonic clock."""
    return {"queue_s": max(0.0, admitted - arrival), "prefill_s": max(0.0, first_token - admitted)}


def valid_prefill_parts(obj) -> Optional[dict]:
    """``{"queue_s", "prefill_s"}`` from a peer's header when both are finite numbers >= 0, else None."""
    if not isinstance(obj, dict):
        return None
    out = {}
    for key in ("queue_s", "prefill_s"):
        v = obj.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
            return None
        out[key] = float(v)
    return out


class SplitStats:
    """The decode engine's per-request splits: cumulative Prometheus-style histograms per part (bucket
    bounds ``BUCKETS``; a part the prefill engine did not report is left out of its histogram) and
    the last ``keep`` records, for percentiles over a benchmark run."""

    def __init__(self, keep: int = 1024):
        self.count = 0
        self.counts = {p: [0] * len(BUCKETS) for p in PARTS}
        self.observed = {p: 0 for p in PARTS}
        self.sums = {p: 0.0 for p in PARTS}
        self.recent: deque[dict] = deque(maxlen=keep)

    def add(self, record: dict) -> None:
        """Add one request's ``{"<part>_s": seconds or None, ...}``."""
        self.count += 1
        for p in PARTS:
            v = record.get(p + "_s")
            if v is None:
                continue
            self.observed[p] += 1
            self.sums[p] += v
            for i, bound in enumerate(BUCKETS):
                if v <= bound:
                    self.counts[p][i] += 1
        self.recent.append(dict(record))

    def snapshot(self) -> dict:
        """JSON-ready: ``count`` (requests), ``buckets`` (bounds), per part ``counts`` (cumulative per
        bound), ``observed`` (its +Inf count) and ``sums`` (seconds), ``recent`` (oldest first)."""
        return {"count": self.count, "buckets": list(BUCKETS), "counts": {p: list(c) for p, c in self.counts.items()},
                "observed": dict(self.observed), "sums": dict(self.sums), "recent": list(self.recent)}
