"""The engine core's busy loop body: admit, batch, run, sample, finish.

One ``step()``: (1) every running request gets its new tokens for this step (1 for decode, a chunk
of at most ``chunked_prefill_size`` for a prompt still being prefilled) under one token budget (the
vLLM V1 rule), evicting from the radix cache and retracting the least-progressed requests when
slots run out; (2) waiting requests are admitted in policy order while the budget, the running
limit and the KV memory allow, each matched against the radix cache first; (3) one forward over the
mixed batch, sampling for the requests whose known tokens are all computed; (4) finished requests
go into the radix cache and release their slots. New requests join at every step (continuous batching).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Optional
from dataclasses import dataclass, field

import torch

from idleless.cache.radix_cache import NoPrefixCache, RadixCache
from idleless.config import EngineConfig
from idleless.engine.policy import order_waiting
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput
from idleless.model.runner import ForwardBatch, ModelRunner
from idleless.model.sampler import sample
from idleless.telemetry.timing import StepTracer, TimeAccount

log = logging.getLogger(__name__)

# In-batch prefix sharing: a waiting request that shares at least this many not-yet-cached tokens
# with a request admitted in the same step waits one step and then hits the cache instead.
SHARE_BLOCK = 32
# the sliding window of the engine-level hit rate, in admitted requests
HIT_WINDOW = 256


@dataclass
class SchedulerStats:
    """Engine totals. Tokens unless said otherwise; seconds for *_time."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished requests (first admission)
    cached_tokens: int = 0  # of which served by the radix cache
    computed_prompt_tokens: int = 0  # prefill/extend tokens actually run (recomputation included)
    generation_tokens: int = 0
    num_retractions: int = 0
    evicted_tokens: int = 0
    pinned_tokens: int = 0
    queue_time: float = 0.0  # seconds from arrival to first admission, summed over admitted requests
    num_admitted: int = 0
    window_hit_rate: float = 0.0  # hit rate over the last HIT_WINDOW admissions
    num_steps: int = 0
    forward_time: float = 0.0
    schedule_time: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    """Owns the waiting queue, the running batch and the prefix cache; drives the ModelRunner.

    Not thread-safe: ``add_request``, ``abort`` and ``step`` are called from one loop."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, eos_ids: set[int]):
        self.config = config
        self.runner = runner
        self.pool = runner.pool
        self.eos_ids = set(eos_ids)
        self.vocab_size = runner.model_config.vocab_size
        self.context_length = runner.context_length
        if config.disable_radix_cache:
            self.cache: RadixCache = NoPrefixCache(self.pool, config.page_size)
        else:
            self.cache = RadixCache(self.pool, config.page_size, config.radix_eviction_policy,
                                    config.max_pinned_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.new_token_ratio = 0.3  # share of remaining max_new_tokens reserved at admission
        self._outputs: list[RequestOutput] = []
        self._hit_window: deque[tuple[int, int]] = deque(maxlen=HIT_WINDOW)  # (prompt, cached) per admission
        self._pin_waiters: dict[str, tuple[str, float, Callable]] = {}  # internal rid -> (pin id, ttl, done)
        self.clock = TimeAccount()
        self.tracer = StepTracer(config.trace_file) if config.trace_file else None

    # -- requests in -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Validate and queue. Raises RequestError (nothing is queued) for an empty prompt, token
        ids outside the vocabulary, bad sampling parameters, or prompt + max_new_tokens above the
        context length or above the whole KV pool (code ``context_length_exceeded``)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt", code="invalid_prompt")
        bad = [t for t in req.prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt", code="invalid_prompt")
        req.params.validate(self.vocab_size)
        limit = min(self.context_length, self.pool.num_slots - self.cache.pinned_size)
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this model serves at most {limit - 1} prompt tokens "
                               f"(context length {self.context_length}, KV pool {self.pool.num_slots} tokens, "
                               f"{self.cache.pinned_size} of them pinned)",
                               param="prompt", code="context_length_exceeded")
        if req.params.max_new_tokens is None:
            req.params.max_new_tokens = limit - n
        elif n + req.params.max_new_tokens > limit:
            raise RequestError(f"prompt ({n} tokens) + max_new_tokens ({req.params.max_new_tokens}) = "
                               f"{n + req.params.max_new_tokens} exceeds the limit of {limit} tokens",
                               param="max_tokens", code="context_length_exceeded")
        if len(self.waiting) >= self.config.max_queued_requests:
            raise RequestError("the waiting queue is full", code="queue_full")
        seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        req.generator = torch.Generator().manual_seed(seed)
        self.waiting.append(req)
        self.stats.num_requests += 1

    def abort(self, rid: str) -> bool:
        """Abort a waiting or running request: it is reported with finish_reason ``abort`` at the
        next step and its KV slots are released now. Returns False if the rid is unknown."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT)
                return True
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, FinishReason.ABORT)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outputs)

    def flush_cache(self) -> bool:
        """Empty the radix cache (pins included); refused (False) while requests run or wait."""
        if self.running or self.waiting:
            return False
        self.cache.reset()
        return True

    def pin_prefix(self, pin_id: str, prompt_ids: list[int], ttl: float,
                   done: Callable[[Optional[int], Optional[str]], None]) -> None:
        """Pin ``prompt_ids`` in the radix cache for ``ttl`` seconds. If the prefix is not cached
        yet it is prefilled first by an internal one-token request. ``done(tokens, error)`` is
        called (from ``step`` or at once) with the pinned token count, or an error message
        (prefix cache disabled, over the pinned budget, invalid prompt)."""
        if ttl <= 0:
            done(None, "ttl must be > 0")
            return
        if isinstance(self.cache, NoPrefixCache):
            done(None, "the prefix cache is disabled")
            return
        if self.cache.peek_prefix_len(prompt_ids) >= len(prompt_ids) - len(prompt_ids) % self.pool.page_size:
            self._do_pin(pin_id, prompt_ids, ttl, done)
            return
        from idleless.engine.request import SamplingParams
        req = Request(f"__pin__{pin_id}", list(prompt_ids), SamplingParams(max_new_tokens=1, temperature=0.0),
                      priority=1 << 30)
        try:
            self.add_request(req)
        except RequestError as e:
            done(None, e.message)
            return
        self._pin_waiters[req.rid] = (pin_id, ttl, done)

    def _do_pin(self, pin_id, prompt_ids, ttl, done) -> None:
        try:
            n = self.cache.pin(pin_id, prompt_ids, ttl)
        except ValueError as e:
            done(None, str(e))
            return
        done(n, None)

    # -- memory ------------------------------------------------------------------------------
    def _alloc(self, req: Request, n: int) -> torch.Tensor | None:
        have = len(req.slots)
        need = self.pool.tokens_needed(have, n)
        short = need - self.pool.num_free_slots
        if short > 0:
            self.cache.evict(short)
        last = int(req.slots[-1]) if have else 0
        return self.pool.alloc(have, last, n)

    def _retract(self, req: Request) -> None:
        """Send a running request back to the front of the queue; its computed KV stays in the tree."""
        self.running.remove(req)
        self.cache.cache_finished_req(req)
        req.num_computed = 0
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def _reserved_tokens(self) -> int:
        """Decode tokens held back for running requests (share new_token_ratio of what they may still emit)."""
        rem = sum(r.params.max_new_tokens - len(r.output_ids) for r in self.running)
        return int(rem * self.new_token_ratio)

    # -- one step ----------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Request, int]]:
        cfg = self.config
        budget = cfg.max_prefill_tokens
        self._fresh_budget = budget - sum(1 for r in self.running if r.seq_len - r.num_computed == 1)
        scheduled: list[tuple[Request, int]] = []
        # 1. running requests, most progressed (and highest priority) first; victims come from the end
        self.running.sort(key=lambda r: (-r.priority, -len(r.output_ids), -r.num_computed, r.arrival_time))
        budget -= sum(1 for r in self.running if r.seq_len - r.num_computed == 1)  # decodes first
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = req.seq_len - req.num_computed
            if remaining > 1:  # still prefilling: a chunk within the budget
                n = self._chunk(remaining, budget)
                if n <= 0:
                    i += 1
                    continue
            else:
                n = 1
            slots = self._alloc(req, n)
            if slots is None:
                victim = self.running[-1]
                self._retract(victim)
                if victim is req:
                    break
                continue
            req.slots = torch.cat([req.slots, slots])
            if remaining > 1:
                budget -= n
            scheduled.append((req, n))
            i += 1
        # 2. admit waiting requests
        if self.waiting and budget > 0:
            scheduled += self._admit(budget)
        return scheduled

    def _chunk(self, remaining: int, budget: int) -> int:
        """New tokens a prefilling request gets this step: a chunk within the budget; with chunked
        prefill off the whole rest, and only if the budget is untouched by other prefills."""
        if self.config.chunked_prefill_size <= 0:
            return remaining if budget >= min(remaining, self._fresh_budget) else 0
        return min(remaining, self.config.chunked_prefill_size, budget)

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        cfg = self.config
        out = []
        shared_blocks: set[int] = set()  # hashes of block-aligned prefixes being computed now
        if not isinstance(self.cache, NoPrefixCache):
            for r in self.running:  # prompts still being prefilled in chunks count as in flight
                if r.seq_len - r.num_computed > 1:
                    ids = r.all_ids
                    for end in range(SHARE_BLOCK, len(ids), SHARE_BLOCK):
                        shared_blocks.add(hash(tuple(ids[:end])))
        now = time.monotonic()
        order = order_waiting(list(self.waiting), cfg.schedule_policy, self.cache,
                              cfg.schedule_fallback_threshold, cfg.max_queue_delay, now)
        for req in order:
            if len(self.running) >= cfg.max_running_requests or budget <= 0:
                break
            ids = req.all_ids
            slots, node = self.cache.match_prefix(ids[: len(ids) - 1])
            cached = len(slots)
            if shared_blocks and not isinstance(self.cache, NoPrefixCache):
                shared = 0
                for end in range(SHARE_BLOCK, len(ids), SHARE_BLOCK):
                    if hash(tuple(ids[:end])) not in shared_blocks:
                        break
                    shared = end
                if shared - cached >= SHARE_BLOCK:
                    continue
            remaining = len(ids) - cached
            n = self._chunk(remaining, budget) if remaining > 1 else 1
            if n <= 0:
                break
            self.cache.inc_lock_ref(node)
            need = self.pool.tokens_needed(cached, n)
            available = self.pool.num_free_slots + self.cache.evictable_size
            if available < need + self._reserved_tokens():
                self.cache.dec_lock_ref(node)
                break
            req.slots, req.last_node, req.num_tree_tokens = slots, node, cached
            req.num_computed = cached
            new = self._alloc(req, n)
            if new is None:  # cannot happen after the check above, but never leak the lock
                self.cache.dec_lock_ref(node)
                req.slots, req.last_node, req.num_tree_tokens, req.num_computed = None, None, 0, 0
                break
            req.slots = torch.cat([slots, new])
            if req.cached_tokens < 0:
                req.cached_tokens = min(cached, len(req.prompt_ids))
                self._hit_window.append((len(req.prompt_ids), req.cached_tokens))
                self.stats.queue_time += now - req.arrival_time
                self.stats.num_admitted += 1
            self.waiting.remove(req)
            self.running.append(req)
            out.append((req, n))
            budget -= n
            if not isinstance(self.cache, NoPrefixCache):
                for end in range(SHARE_BLOCK, len(ids), SHARE_BLOCK):
                    shared_blocks.add(hash(tuple(ids[:end])))
        return out

    def _build_batch(self, scheduled: list[tuple[Request, int]]):
        ids, pos, locs, ext, pre, tables, rows, samplers = [], [], [], [], [], [], [], []
        row = 0
        for req, n in scheduled:
            start = req.num_computed
            if n == 1 and start == req.seq_len - 1 and req.output_ids:
                ids.append(req.output_ids[-1])
            else:
                ids.extend(req.all_ids[start:start + n])
            pos.extend(range(start, start + n))
            locs.append(req.slots[start:start + n])
            ext.append(n)
            pre.append(start)
            tables.append(req.slots)
            if start + n == req.seq_len:
                rows.append(row + n - 1)
                samplers.append(req)
            row += n
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                             torch.cat(locs), ext, pre, tables, torch.tensor(rows, dtype=torch.int64))
        return batch, samplers

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs (token deltas, finishes) it produced.
        Charges its time to the ``schedule`` and ``forward`` buckets of ``self.clock``."""
        clock = self.clock
        if self.cache.pins:
            self.cache.unpin_expired()
        scheduled = self._schedule()
        if scheduled:
            batch, samplers = self._build_batch(scheduled)
            d_sched = clock.mark("schedule")
            logits = self.runner.forward(batch)
            result = sample(logits, samplers, self.eos_ids) if samplers else None
            d_fwd = clock.mark("forward")
            self.stats.forward_time += d_fwd
            self.stats.num_steps += 1
            for req, n in scheduled:
                if req.num_computed < len(req.prompt_ids):
                    self.stats.computed_prompt_tokens += min(n, len(req.prompt_ids) - req.num_computed)
                req.num_computed += n
            if result is not None:
                for i, req in enumerate(samplers):
                    self._append_token(req, result.next_ids[i], result.logprobs[i], result.top_logprobs[i])
            for req, n in scheduled:
                if not req.finished and n > 1:
                    self.cache.cache_unfinished_req(req)  # share prefilled prefixes at once
            self.new_token_ratio = max(0.1, self.new_token_ratio - 0.002)
            d_sched += clock.mark("schedule")
            self.stats.schedule_time += d_sched
            if self.tracer is not None:
                self._trace(scheduled, d_sched, d_fwd, len(samplers))
        else:
            self.stats.schedule_time += clock.mark("schedule")
        outputs, self._outputs = self._outputs, []
        return outputs

    def _trace(self, scheduled, d_sched: float, d_fwd: float, sampled: int) -> None:
        n_decode = sum(1 for _, n in scheduled if n == 1)
        kind = "decode" if n_decode == len(scheduled) else "prefill" if n_decode == 0 else "mixed"
        self.tracer.write({
            "t": round(time.perf_counter() - self.clock.start, 6), "kind": kind, "batch_size": len(scheduled),
            "new_tokens": sum(n for _, n in scheduled), "decode": n_decode, "sampled": sampled,
            # requests admitted in this step (their first chunk started at the cached prefix):
            # prompt tokens, and of those served by the radix cache
            "admitted_prompt_tokens": sum(len(r.prompt_ids) for r, n in scheduled if r.num_computed - n == r.cached_tokens),
            "cached_tokens": sum(r.cached_tokens for r, n in scheduled if r.num_computed - n == r.cached_tokens),
            "running": len(self.running), "waiting": len(self.waiting),
            "schedule_s": round(d_sched, 6), "forward_s": round(d_fwd, 6),
            "hit_rate": round(self.stats.cache_hit_rate, 4)})

    def _append_token(self, req: Request, tok: int, lp, top) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(tok)
        if req.params.logprobs or req.params.top_logprobs:
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top or [])
        self.stats.generation_tokens += 1
        p = req.params
        reason = None
        if tok in p.stop_token_ids:
            reason, req.matched_stop = FinishReason.STOP, tok
        elif not p.ignore_eos and tok in self.eos_ids and len(req.output_ids) > p.min_new_tokens - 1:
            reason, req.matched_stop = FinishReason.STOP, tok
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_length:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)
        else:
            self._emit(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.cache.cache_finished_req(req)
        waiter = self._pin_waiters.pop(req.rid, None)
        if waiter is not None:
            pin_id, ttl, done = waiter
            if reason == FinishReason.ABORT:
                done(None, "aborted before the prefix was cached")
            else:
                self._do_pin(pin_id, req.prompt_ids, ttl, done)
            return
        if reason == FinishReason.ABORT:
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        if req.cached_tokens >= 0:
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.cached_tokens += req.cached_tokens
        self._emit(req)

    def _emit(self, req: Request) -> None:
        k = req.num_sent
        want_lp = req.params.logprobs or req.params.top_logprobs
        self._outputs.append(RequestOutput(
            rid=req.rid, new_token_ids=req.output_ids[k:], finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            new_logprobs=req.output_logprobs[k:] if want_lp else None,
            new_top_logprobs=req.output_top_logprobs[k:] if req.params.top_logprobs else None,
            prompt_tokens=len(req.prompt_ids), cached_tokens=max(req.cached_tokens, 0),
            completion_tokens=len(req.output_ids)))
        req.num_sent = len(req.output_ids)

    # -- accounting --------------------------------------------------------------------------
    def refresh_stats(self) -> SchedulerStats:
        """Bring the derived figures (evictions, pins, windowed hit rate) up to date and return the stats."""
        st = self.stats
        st.evicted_tokens = self.cache.num_evicted
        st.pinned_tokens = self.cache.pinned_size
        p = sum(a for a, _ in self._hit_window)
        st.window_hit_rate = sum(c for _, c in self._hit_window) / p if p else 0.0
        return st

    def kv_usage(self) -> dict:
        """Slot ownership in tokens: free + cached (tree) + in_use (requests' own) == total."""
        ps = self.pool.page_size  # a request's own slots occupy whole pages
        own = sum(-(-(len(r.slots) - r.num_tree_tokens) // ps) * ps for r in self.running if r.slots is not None)
        return {"total": self.pool.num_slots, "free": self.pool.num_free_slots,
                "cached": self.cache.total_size, "in_use": own}
