"""Execution-idle accounting: where every second of the engine core's wall time goes.

``TimeAccount`` splits wall time into exclusive buckets by *marks*: ``mark(bucket)`` charges the
time since the previous mark to ``bucket``, so the buckets always sum to the wall time since
``start`` (no gap, no double count). The engine loop marks ``io`` after receiving requests /
sending outputs and ``idle_no_work`` after waiting with nothing to run; the scheduler marks
``schedule`` (policy, radix match/insert, batch building), ``draft`` (a speculative proposer's
guessing, inside planning), ``forward`` (model forward and sampling) and ``verify`` (the forward of a
step that checks proposed tokens). With prefill/decode disaggregation ``kv_transfer`` takes serving
pulls (prefill side) and waiting for, receiving and writing KV (decode side). ``other`` takes what a loop does besides (e.g. handing outputs
to callers).

Busy fraction = (forward + verify) / (wall - idle_no_work): the share of the time with work to do
that the device spent computing the target model (a draft model's forwards are in ``draft``). On CPU the forward's wall time is the device time. (On CUDA the forward
would be timed with CUDA events so host-side gaps show up as execution-idle; there is no CUDA
backend yet.)
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

BUCKETS = ("forward", "verify", "draft", "schedule", "kv_transfer", "io", "idle_no_work", "other")

log = logging.getLogger("idleless.telemetry")


class TimeAccount:
    """Exclusive wall-time buckets (seconds). Not thread-safe: mark from the engine loop only."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start accounting afresh from now (e.g. once the model is loaded)."""
        self.start = time.perf_counter()
        self._last = self.start
        self.totals = dict.fromkeys(BUCKETS, 0.0)

    def mark(self, bucket: str) -> float:
        """Charge the time since the previous mark to ``bucket``; returns that interval (s).
        Raises KeyError for an unknown bucket."""
        now = time.perf_counter()
        dt = now - self._last
        self.totals[bucket] += dt
        self._last = now
        return dt

    def snapshot(self) -> dict:
        """Totals so far (s), the wall time they cover, and the busy fraction."""
        d = dict(self.totals)
        wall = self._last - self.start
        d["wall"] = wall
        work = wall - d["idle_no_work"]
        d["busy_fraction"] = (d["forward"] + d["verify"]) / work if work > 0 else 0.0
        return d


class StepTracer:
    """Per-step JSON lines (``--trace-file``): time, step kind, batch size, new tokens (``decode``
    of them one-token decodes; ``sampled`` requests got a token), the prompt tokens of the requests
    admitted in the step and how many of them the radix cache served, running/waiting,
    and the bucket durations of the step (s). Buffered; flushed every ``flush_every`` records, by
    ``flush`` (the server's engine loop calls it when it goes idle) and on ``close``. Raises
    OSError if the file cannot be opened."""

    def __init__(self, path: str, flush_every: int = 64):
        self._f = open(path, "a", buffering=1 << 16)
        self._n = 0
        self._flushed = 0
        self.flush_every = flush_every

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._n += 1
        if self._n % self.flush_every == 0:
            self._f.flush()
            self._flushed = self._n

    def flush(self) -> None:
        if self._n != self._flushed:
            self._f.flush()
            self._flushed = self._n

    def close(self) -> None:
        self._f.close()


class LoopReporter:
    """A periodic log line like SGLang's decode log: running, queued, generation tokens/s, hit
    rate, KV usage and busy fraction over the last ``interval`` seconds."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._t = time.monotonic()
        self._gen = 0
        self._acct: Optional[dict] = None

    def maybe_log(self, scheduler) -> None:
        now = time.monotonic()
        if now - self._t < self.interval:
            return
        st = scheduler.refresh_stats()
        snap = scheduler.clock.snapshot()
        prev = self._acct or dict.fromkeys(list(BUCKETS) + ["wall"], 0.0)
        fwd = snap["forward"] + snap["verify"] - prev["forward"] - prev["verify"]
        work = (snap["wall"] - prev["wall"]) - (snap["idle_no_work"] - prev["idle_no_work"])
        busy = fwd / work if work > 0 else 0.0
        rate = (st.generation_tokens - self._gen) / (now - self._t)
        kv = scheduler.kv_usage()
        if st.generation_tokens != self._gen or scheduler.running or scheduler.waiting:
            log.info("running %d, queued %d, gen %.1f tok/s, hit rate %.2f (window %.2f), KV used %.1f%% "
                     "(cached %d, free %d tokens), busy %.2f", len(scheduler.running), len(scheduler.waiting), rate,
                     st.cache_hit_rate, st.window_hit_rate, 100 * (1 - kv["free"] / kv["total"]), kv["cached"],
                     kv["free"], busy)
        self._t, self._gen, self._acct = now, st.generation_tokens, snap
