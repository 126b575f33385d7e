"""The scheduler: which tokens each request computes this step, and what a step's result changes.

``schedule()`` returns a ``StepPlan``: (1) every running request gets its new tokens for this step
(1 for decode, plus what the proposer guesses; a chunk of at most ``chunked_prefill_size`` for a
prompt still being prefilled) under one token budget (the vLLM V1 rule: tokens to compute = known
tokens + proposed tokens), evicting from the prefix cache and retracting the least-progressed
requests when slots run out; (2) waiting requests are admitted in policy order while the budget, the
running limit and the KV memory allow, each matched against the prefix cache first.
``commit(plan, result)`` accepts proposed tokens the sampled ones agree with, appends tokens,
finishes requests, offers computed prefixes to the cache and frees slots. The scheduler never
builds model inputs (``ModelRunner.execute`` does) and never asks which prefix cache it has.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from idleless.cache import make_prefix_cache
from idleless.cache.kv_pool import KVPool
from idleless.config import EngineConfig
from idleless.engine.admission import AdmissionLimits, check_request
from idleless.engine.plan import PromptLogprobRows, ScheduledRequest, StepPlan, StepResult
from idleless.engine.policy import order_waiting
from idleless.engine.kv_manager import RequestKV
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput, RequestRecord
from idleless.model.sampler import SamplingRow
from idleless.spec.proposer import Proposer
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
    """Owns the waiting queue, the running requests and the prefix cache over ``pool``.

    ``vocab_size`` and ``context_length`` bound admitted requests; ``eos_ids`` end generation;
    ``proposer`` guesses extra decode tokens (the base ``Proposer`` guesses none). Not thread-safe:
    ``add_request``, ``abort``, ``schedule`` and ``commit`` are called from one loop."""

    def __init__(self, config: EngineConfig, pool: KVPool, vocab_size: int, context_length: int,
                 eos_ids: set[int], proposer: Optional[Proposer] = None):
        self.config = config
        self.pool = pool
        self.eos_ids = set(eos_ids)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.kv = RequestKV(pool, make_prefix_cache(config, pool))
        self.proposer = proposer or Proposer()
        self.waiting: deque[RequestRecord] = deque()
        self.running: list[RequestRecord] = []
        self.stats = SchedulerStats()
        self.new_token_ratio = 0.3  # share of remaining max_new_tokens reserved at admission
        self._outputs: list[RequestOutput] = []
        self._finished_ids: list[str] = []
        self._hit_window: deque[tuple[int, int]] = deque(maxlen=HIT_WINDOW)  # (prompt, cached) per admission
        self.clock = TimeAccount()
        self.tracer = StepTracer(config.trace_file) if config.trace_file else None

    @property
    def cache(self):
        """The prefix cache (a ``PrefixCache``: the radix tree, or the one that keeps nothing)."""
        return self.kv.cache

    # -- requests in -------------------------------------------------------------------------
    def admission_limits(self) -> AdmissionLimits:
        """The limits ``check_request`` applies now (the pinned tokens change with pins; expired pins
        are dropped first, as the frontend drops them at their TTL)."""
        if self.cache.pins:
            self.cache.unpin_expired()
        return AdmissionLimits(self.vocab_size, self.context_length, self.pool.num_slots, self.cache.pinned_size)

    def add_request(self, req: Request) -> None:
        """Validate and queue. Raises RequestError (nothing is queued) for an empty prompt, token
        ids outside the vocabulary, bad sampling parameters, prompt + max_new_tokens above the
        context length or above the KV pool less its pinned tokens (``context_length_exceeded``),
        or a full waiting queue (``queue_full``)."""
        max_new = check_request(req.prompt_ids, req.params, self.admission_limits())
        if len(self.waiting) >= self.config.max_queued_requests:
            raise RequestError("the waiting queue is full", code="queue_full")
        seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.waiting.append(RequestRecord(req.rid, list(req.prompt_ids), req.params, req.priority, req.arrival_time,
                                          max_new, seed=seed))
        self.stats.num_requests += 1

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a waiting or running request from outside: it is reported with ``reason`` (ABORT; STOP
        when the frontend matched a stop string, so the stats count it finished) at the next step and
        its KV slots are released now. Returns False if the rid is unknown."""
        for queue in (self.waiting, self.running):
            for rec in queue:
                if rec.rid == rid:
                    queue.remove(rec)
                    self._finish(rec, reason)
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outputs)

    def flush_cache(self) -> bool:
        """Empty the prefix cache (pins included); refused (False) while requests run or wait."""
        if self.running or self.waiting:
            return False
        self.cache.reset()
        return True

    # -- plan --------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step (see the module docstring). Allocates the KV slots the plan writes."""
        if self.cache.pins:
            self.cache.unpin_expired()
        work = self._schedule_running()
        if self.waiting and self._budget > 0:
            work += self._admit()
        # finished ids travel with a plan the runner executes (an empty plan is not executed)
        finished, self._finished_ids = (self._finished_ids, []) if work else ([], self._finished_ids)
        return StepPlan([self._scheduled(rec, n, extra) for rec, n, extra in work], finished,
                        frozenset(self.eos_ids))

    def _schedule_running(self) -> list[tuple[RequestRecord, int, list[int]]]:
        """Running requests, most progressed (and highest priority) first; retraction victims come
        from the end. Returns (record, known tokens, proposed tokens) per scheduled request."""
        self.running.sort(key=lambda r: (-r.priority, -len(r.output_ids), -r.num_computed, r.arrival_time))
        decoding = [r for r in self.running if r.seq_len - r.num_computed == 1]
        budget = self.config.max_prefill_tokens - len(decoding)  # decodes first
        self._fresh_budget = budget
        proposals = self._propose(decoding, budget)
        work = []
        i = 0
        while i < len(self.running):
            rec = self.running[i]
            remaining = rec.seq_len - rec.num_computed
            extra = proposals.get(rec.rid, []) if remaining == 1 else []
            if remaining > 1:  # still prefilling: a chunk within the budget
                n = self._chunk(remaining, budget)
                if n <= 0:
                    i += 1
                    continue
            else:
                n = 1
            if self.kv.grow(rec, n + len(extra)) is None:
                victim = self.running[-1]
                self._retract(victim)
                if victim is rec:
                    break
                continue
            budget -= (n if remaining > 1 else 0) + len(extra)
            work.append((rec, n, extra))
            i += 1
        self._budget = budget
        return work

    def _propose(self, decoding: list[RequestRecord], budget: int) -> dict[str, list[int]]:
        """The proposer's guesses for decoding requests, cut to each request's remaining token
        limits and, in order, to the step's token budget."""
        if not decoding:
            return {}
        room = [max(0, min(r.max_new_tokens - len(r.output_ids), self.context_length - r.seq_len) - 1)
                for r in decoding]
        out = {}
        self.clock.mark("schedule")
        guesses = self.proposer.propose(decoding, room)
        self.clock.mark("draft")
        for rec, guess, cap in zip(decoding, guesses, room):
            guess = list(guess[:min(cap, max(budget, 0))])
            if guess:
                out[rec.rid] = guess
                budget -= len(guess)
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        """New tokens a prefilling request gets this step: a chunk within the budget; with chunked
        prefill off the whole rest, and only if the budget is untouched by other prefills."""
        if self.config.chunked_prefill_size <= 0:
            return remaining if budget >= min(remaining, self._fresh_budget) else 0
        return min(remaining, self.config.chunked_prefill_size, budget)

    def _retract(self, rec: RequestRecord) -> None:
        """Send a running request back to the front of the queue; its computed KV stays cached."""
        self.running.remove(rec)
        self.kv.release(rec)
        rec.num_computed = 0
        rec.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.appendleft(rec)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def _reserved_tokens(self) -> int:
        """Decode tokens held back for running requests (share new_token_ratio of what they may still emit)."""
        rem = sum(r.max_new_tokens - len(r.output_ids) for r in self.running)
        return int(rem * self.new_token_ratio)

    @staticmethod
    def _shared_blocks(ids: list[int]):
        """Hashes of the SHARE_BLOCK-aligned prefixes of ``ids``, in order, lazily. Each hash folds in
        the one before it (a hash chain over blocks), so all of them cost O(len(ids)), not the
        O(len(ids)^2 / SHARE_BLOCK) of hashing every prefix whole."""
        h = 0
        for end in range(SHARE_BLOCK, len(ids), SHARE_BLOCK):
            h = hash((h, tuple(ids[end - SHARE_BLOCK:end])))
            yield h

    def _admit(self) -> list[tuple[RequestRecord, int, list[int]]]:
        cfg = self.config
        out = []
        budget = self._budget
        sharing = self.cache.keeps_prefixes
        in_flight: set[int] = set()  # hashes of block-aligned prefixes being computed now
        if sharing:
            for r in self.running:  # prompts still being prefilled in chunks count as in flight
                if r.seq_len - r.num_computed > 1:
                    in_flight.update(self._shared_blocks(r.all_ids))
        now = time.monotonic()
        order = order_waiting(list(self.waiting), cfg.schedule_policy, self.cache,
                              cfg.schedule_fallback_threshold, cfg.max_queue_delay, now)
        for rec in order:
            if len(self.running) >= cfg.max_running_requests or budget <= 0:
                break
            ids = rec.all_ids
            reusable = rec.reusable_prefix
            cached = self.kv.attach_prefix(rec, reusable)  # matched and locked
            if in_flight:
                shared = 0
                for end, h in zip(range(SHARE_BLOCK, len(ids), SHARE_BLOCK), self._shared_blocks(ids)):
                    if h not in in_flight:
                        break
                    shared = end
                if min(shared, reusable) - cached >= SHARE_BLOCK:
                    self._detach(rec)
                    continue
            remaining = len(ids) - cached
            n = self._chunk(remaining, budget) if remaining > 1 else 1
            available = self.pool.num_free_slots + self.cache.evictable_size
            if n <= 0 or available < self.pool.tokens_needed(cached, n) + self._reserved_tokens() \
                    or self.kv.grow(rec, n) is None:
                self._detach(rec)
                break
            if rec.cached_tokens < 0:
                rec.cached_tokens = min(cached, len(rec.prompt_ids))
                self._hit_window.append((len(rec.prompt_ids), rec.cached_tokens))
                self.stats.queue_time += now - rec.arrival_time
                self.stats.num_admitted += 1
            self.waiting.remove(rec)
            self.running.append(rec)
            out.append((rec, n, []))
            budget -= n
            if sharing:
                in_flight.update(self._shared_blocks(ids))
        self._budget = budget
        return out

    def _detach(self, rec: RequestRecord) -> None:
        """Undo an admission attempt: unlock the matched prefix, free what was taken."""
        self.kv.release(rec)
        rec.num_computed = 0

    def _scheduled(self, rec: RequestRecord, n: int, extra: list[int]) -> ScheduledRequest:
        start = rec.num_computed
        if n == 1 and start == rec.seq_len - 1 and rec.output_ids:
            known = [rec.output_ids[-1]]  # a decode: skip building prompt + output
        else:
            known = rec.all_ids[start:start + n]
        samples = start + n == rec.seq_len and rec.max_new_tokens > 0
        row = SamplingRow(rec.params, None, rec.prompt_ids, rec.output_ids, seed=rec.seed) if samples else None
        need = rec.prompt_logit_rows
        lo, hi = max(need.start, start), min(need.stop, start + n)
        scored = PromptLogprobRows(lo - start, rec.prompt_ids[lo + 1:hi + 1], rec.params.prompt_logprobs) \
            if lo < hi else None
        return ScheduledRequest(rec.rid, known + extra, n, start, rec.slots, row, scored)

    # -- commit ------------------------------------------------------------------------------
    def commit(self, plan: StepPlan, result: StepResult) -> None:
        """Apply a step's result: accept the proposed tokens that agree with the sampled ones (the
        sampled token after the last accepted one is appended too), free the slots of the rejected
        ones (never cached), append and check finish, offer prefilled prefixes to the cache."""
        by_rid = {r.rid: r for r in self.running}
        for i, sr in enumerate(plan.requests):
            rec = by_rid.get(sr.rid)
            if rec is None:  # aborted between schedule and commit
                continue
            if rec.num_computed < len(rec.prompt_ids):
                self.stats.computed_prompt_tokens += min(sr.num_known, len(rec.prompt_ids) - rec.num_computed)
            if sr.prompt_logprobs is not None:
                rec.prompt_logprobs.extend(result.prompt_logprobs[i])
            if sr.sampling is None:
                rec.num_computed += sr.num_known
                if rec.num_computed == rec.seq_len and rec.max_new_tokens == 0:  # prefill only
                    self._end(rec, FinishReason.LENGTH)
                elif sr.num_known > 1:
                    self.kv.cache_computed(rec)  # share prefilled prefixes at once
                continue
            sampled, proposed = result.sampled[i], sr.proposed
            accepted = 0
            while accepted < len(proposed) and sampled[accepted] == proposed[accepted]:
                accepted += 1
            if proposed:
                rec.accepted_per_verify.append(accepted)
                self.proposer.observe(rec, len(proposed), accepted)
            base = rec.num_computed + sr.num_known
            for j in range(accepted + 1):
                # KV holds the known tokens and the accepted proposed tokens appended so far (a finish
                # releases the request inside _append_token, caching what is computed)
                rec.num_computed = base + min(j + 1, accepted)
                if self._append_token(rec, sampled[j], result.logprobs[i][j], result.top_logprobs[i][j]):
                    break
            if not rec.finished:
                self.kv.truncate(rec, rec.num_computed)
                if sr.num_known > 1:
                    self.kv.cache_computed(rec)
                self._emit(rec)
        self.new_token_ratio = max(0.1, self.new_token_ratio - 0.002)

    def account_step(self, plan: StepPlan, schedule_s: float, forward_s: float) -> None:
        """Add one executed step's times (seconds) to the stats and the trace."""
        self.stats.forward_time += forward_s
        self.stats.schedule_time += schedule_s
        self.stats.num_steps += 1
        self.proposer.observe_step(plan.num_tokens, plan.num_proposed, forward_s + schedule_s)
        if self.tracer is not None:
            self._trace(plan, schedule_s, forward_s)

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs (token deltas, finishes) produced since the last call."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def _trace(self, plan: StepPlan, d_sched: float, d_fwd: float) -> None:
        reqs = plan.requests
        n_decode = sum(1 for r in reqs if r.num_known == 1)
        kind = "decode" if n_decode == len(reqs) else "prefill" if n_decode == 0 else "mixed"
        recs = {r.rid: r for r in self.running}
        # requests admitted in this step (their first chunk started at the cached prefix)
        admitted = [recs[r.rid] for r in reqs if r.rid in recs and r.start == recs[r.rid].cached_tokens]
        self.tracer.write({
            "t": round(time.perf_counter() - self.clock.start, 6), "kind": kind, "batch_size": len(reqs),
            "new_tokens": plan.num_tokens, "proposed": plan.num_proposed, "decode": n_decode, "sampled": sum(r.num_sampled for r in reqs),
            "admitted_prompt_tokens": sum(len(r.prompt_ids) for r in admitted),
            "cached_tokens": sum(r.cached_tokens for r in admitted),
            "running": len(self.running), "waiting": len(self.waiting),
            "schedule_s": round(d_sched, 6), "forward_s": round(d_fwd, 6),
            "hit_rate": round(self.stats.cache_hit_rate, 4)})

    def _append_token(self, rec: RequestRecord, tok: int, lp, top) -> bool:
        """Append one sampled token; True when it ends the request (which is then finished)."""
        if rec.first_token_time is None:
            rec.first_token_time = time.monotonic()
        rec.output_ids.append(tok)
        if rec.wants_logprobs:
            rec.output_logprobs.append(lp)
            rec.output_top_logprobs.append(top or [])
        self.stats.generation_tokens += 1
        p = rec.params
        reason = None
        if tok in p.stop_token_ids:
            reason, rec.matched_stop = FinishReason.STOP, tok
        elif not p.ignore_eos and tok in self.eos_ids and len(rec.output_ids) > p.min_new_tokens - 1:
            reason, rec.matched_stop = FinishReason.STOP, tok
        elif len(rec.output_ids) >= rec.max_new_tokens or rec.seq_len >= self.context_length:
            reason = FinishReason.LENGTH
        if reason is None:
            return False
        self._end(rec, reason)
        return True

    def _end(self, rec: RequestRecord, reason: FinishReason) -> None:
        self.running.remove(rec)
        self._finish(rec, reason)

    def _finish(self, rec: RequestRecord, reason: FinishReason) -> None:
        rec.finish_reason = reason
        self.kv.release(rec)
        self.proposer.finish(rec)
        self._finished_ids.append(rec.rid)
        if reason == FinishReason.ABORT:
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        if rec.cached_tokens >= 0:
            self.stats.prompt_tokens += len(rec.prompt_ids)
            self.stats.cached_tokens += rec.cached_tokens
        self._emit(rec)

    def _emit(self, rec: RequestRecord) -> None:
        k = rec.num_sent
        want_lp = rec.wants_logprobs
        prompt_lps = None
        if rec.prompt_logprobs is not None and not rec.prompt_logprobs_sent and not rec.prompt_logit_rows:
            prompt_lps, rec.prompt_logprobs_sent = rec.prompt_logprobs, True
        self._outputs.append(RequestOutput(
            rid=rec.rid, new_token_ids=rec.output_ids[k:], finish_reason=rec.finish_reason,
            matched_stop=rec.matched_stop,
            new_logprobs=rec.output_logprobs[k:] if want_lp else None,
            new_top_logprobs=rec.output_top_logprobs[k:] if rec.params.top_logprobs else None,
            prompt_logprobs=prompt_lps,
            prompt_tokens=len(rec.prompt_ids), cached_tokens=max(rec.cached_tokens, 0),
            completion_tokens=len(rec.output_ids),
            accepted_per_verify=list(rec.accepted_per_verify) if rec.finished else None))
        rec.num_sent = len(rec.output_ids)

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
        """Slot ownership in tokens: free + cached (tree) + in_use (requests' own) == total; and
        ``evictable``: the cached tokens no request holds (reusable without preempting anyone)."""
        return {"total": self.pool.num_slots, "free": self.pool.num_free_slots,
                "cached": self.cache.total_size, "in_use": sum(self.kv.own_tokens(r) for r in self.running),
                "evictable": self.cache.evictable_size}
