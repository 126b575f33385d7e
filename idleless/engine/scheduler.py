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
from dataclasses import dataclass, field

import torch

from idleless.cache.radix_cache import NoPrefixCache, RadixCache
from idleless.config import EngineConfig
from idleless.engine.policy import order_waiting
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput
from idleless.model.runner import ForwardBatch, ModelRunner
from idleless.model.sampler import sample

log = logging.getLogger(__name__)

# In-batch prefix sharing: a waiting request that shares at least this many not-yet-cached tokens
# with a request admitted in the same step waits one step and then hits the cache instead.
SHARE_BLOCK = 32


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
            self.cache = RadixCache(self.pool, config.page_size, config.radix_eviction_policy)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.new_token_ratio = 0.3  # share of remaining max_new_tokens reserved at admission
        self._outputs: list[RequestOutput] = []

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
        limit = min(self.context_length, self.pool.num_slots)
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this model serves at most {limit - 1} prompt tokens "
                               f"(context length {self.context_length}, KV pool {self.pool.num_slots} tokens)",
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
        """Empty the radix cache; refused (False) while requests are running."""
        if self.running:
            return False
        self.cache.reset()
        return True

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
        scheduled: list[tuple[Request, int]] = []
        # 1. running requests, most progressed (and highest priority) first; victims come from the end
        self.running.sort(key=lambda r: (-r.priority, -len(r.output_ids), -r.num_computed, r.arrival_time))
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = req.seq_len - req.num_computed
            if remaining > 1:  # still prefilling: a chunk within the budget
                n = min(remaining, cfg.chunked_prefill_size, budget)
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

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        cfg = self.config
        out = []
        shared_blocks: set[int] = set()  # hashes of block-aligned prefixes admitted this step
        deferred = False
        for req in order_waiting(list(self.waiting), cfg.schedule_policy, self.cache):
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
                    deferred = True
                    continue
            remaining = len(ids) - cached
            n = min(remaining, cfg.chunked_prefill_size, budget)
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
            self.waiting.remove(req)
            self.running.append(req)
            out.append((req, n))
            budget -= n
            if not isinstance(self.cache, NoPrefixCache):
                for end in range(SHARE_BLOCK, len(ids), SHARE_BLOCK):
                    shared_blocks.add(hash(tuple(ids[:end])))
        if not deferred and not out:
            pass
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
        """Run one scheduler step; returns the outputs (token deltas, finishes) it produced."""
        t0 = time.perf_counter()
        scheduled = self._schedule()
        if scheduled:
            batch, samplers = self._build_batch(scheduled)
            t1 = time.perf_counter()
            logits = self.runner.forward(batch)
            result = sample(logits, samplers, self.eos_ids) if samplers else None
            t2 = time.perf_counter()
            self.stats.forward_time += t2 - t1
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
            self.stats.schedule_time += (t1 - t0) + (time.perf_counter() - t2)
        else:
            self.stats.schedule_time += time.perf_counter() - t0
        outputs, self._outputs = self._outputs, []
        return outputs

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
    def kv_usage(self) -> dict:
        """Slot ownership in tokens: free + cached (tree) + in_use (requests' own) == total."""
        own = sum(len(r.slots) - r.num_tree_tokens for r in self.running if r.slots is not None)
        if self.pool.page_size > 1:
            ps = self.pool.page_size
            own = sum(-(-(len(r.slots) - r.num_tree_tokens) // ps) * ps for r in self.running if r.slots is not None)
        return {"total": self.pool.num_slots, "free": self.pool.num_free_slots,
                "cached": self.cache.total_size, "in_use": own}
