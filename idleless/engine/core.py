"""The engine core: scheduler + model runner, one step at a time.

``EngineCore.step()`` is plan -> execute -> commit (DESIGN.md section 7): the scheduler plans a
``StepPlan``, the model runner executes it (tensors, forward, sampler) and the scheduler commits the
result. The offline ``Engine`` drives it in-process; ``core_process.EngineCoreLoop`` drives it in
its own process for the server. It never sees text. Between-step work attaches as ``after_step``
hooks (DESIGN.md section 7): with ``kv_events_config`` set, the KV-event publisher
(``idleless.router.events``) listens to the radix tree and sends each step's events with the
``load_report``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Callable, Iterable, Optional

from idleless.config import EngineConfig
from idleless.disagg import make_kv_connector
from idleless.engine.admission import check_request
from idleless.engine.request import FinishReason, Request, RequestOutput
from idleless.engine.scheduler import Scheduler
from idleless.sampling_params import SamplingParams
from idleless.spec import make_proposer

PinDone = Callable[[Optional[int], Optional[str]], None]
PREFILL_ONLY = SamplingParams(max_new_tokens=0, temperature=0.0)  # a pin's prefill: compute and cache, sample nothing


#: the weight version of the weights loaded at start-up (SGLang's), until an update names another
DEFAULT_WEIGHT_VERSION = "default"

class EngineCore:
    """Owns the ``ModelRunner`` (loaded from ``config`` unless one is given) and the ``Scheduler``.

    eos ids come from the model's config (config.json / generation_config.json). ``runner`` may be
    any object with ``pool``, ``model_config`` (vocab_size, eos_token_ids), ``context_length`` and
    ``execute(plan) -> StepResult`` (tests drive the scheduler with a scripted runner)."""

    def __init__(self, config: EngineConfig, runner=None):
        if runner is None:
            from idleless.model.runner import ModelRunner
            runner = ModelRunner(config)
        self.config = config
        self.runner = runner
        mc = runner.model_config
        self.proposer = make_proposer(config, runner)
        self.scheduler = Scheduler(config, runner.pool, mc.vocab_size, runner.context_length, set(mc.eos_token_ids),
                                   self.proposer)
        self._pin_waiters: dict[str, tuple[str, list[int], float, PinDone]] = {}  # prefill rid -> pin
        self.after_step: list[Callable[["EngineCore"], None]] = []  # between-step work, run after each step
        self.weight_version = DEFAULT_WEIGHT_VERSION  # stamped on every output; set by weight updates (idleless.rl)
        self.kv_events = None
        if config.kv_events_config:
            self._attach_kv_events(config.kv_events_config)
        # prefill/decode disaggregation (idleless.disagg): a no-op connector unless a mode is set
        self.kv_connector = make_kv_connector(config, self)
        self.after_step.append(self.kv_connector.poll)

    def _attach_kv_events(self, text: str) -> None:
        """Publish the radix tree's changes and the load report after every step (and cache flush).
        Raises ValueError for a bad ``--kv-events-config``; zmq.ZMQError when an endpoint is taken."""
        from idleless.router.events import KVEventPublisher, KVEventsConfig
        cfg = KVEventsConfig.parse(text)
        if not cfg.enable_kv_cache_events:
            return
        self.kv_events = KVEventPublisher(cfg)
        self.scheduler.cache.listener = self.kv_events
        self.after_step.append(lambda core: core.kv_events.end_step(core.load_report()))

    def load_report(self) -> dict:
        """What a router weighs a replica by: ``num_running`` / ``num_waiting`` requests,
        ``queued_prefill_tokens`` (prompt tokens of waiting and running requests not computed yet),
        ``kv_usage`` (share of the KV pool neither free nor evictable, 0..1), ``timestamp`` (Unix s)."""
        sched = self.scheduler
        queued = sum(max(0, len(r.prompt_ids) - r.num_computed) for r in (*sched.waiting, *sched.running))
        total = sched.pool.num_slots
        busy = total - sched.pool.num_free_slots - sched.cache.evictable_size
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "queued_prefill_tokens": queued, "kv_usage": round(busy / total, 4) if total else 0.0,
                "timestamp": time.time()}

    def add_request(self, req: Request) -> None:
        """Queue a request (a decode engine's KV connector may hold it until its KV has arrived);
        raises RequestError if it can never be served."""
        if not self.kv_connector.admit(self, req):
            self.scheduler.add_request(req)

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort a waiting or running request (reported at the next step with ``reason``: ABORT, or STOP
        for a request the frontend ended at a stop string); False if unknown."""
        return self.scheduler.abort(rid, reason) or self.kv_connector.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.kv_connector.has_work()

    def step(self) -> list[RequestOutput]:
        """One step: plan -> execute -> commit. Returns the outputs it produced. Charges its time to
        the ``schedule``, ``draft`` (the proposer, inside planning), and ``forward`` buckets of
        ``scheduler.clock`` (``verify`` instead of ``forward`` for a step that checks proposed tokens)."""
        sched = self.scheduler
        clock = sched.clock
        before = clock.totals["schedule"]
        plan = sched.schedule()
        clock.mark("schedule")
        if plan.requests:
            result = self.runner.execute(plan)
            d_fwd = clock.mark("verify" if plan.num_proposed else "forward")
            sched.commit(plan, result)
            clock.mark("schedule")
            sched.account_step(plan, clock.totals["schedule"] - before, d_fwd)
        else:
            sched.stats.schedule_time += clock.totals["schedule"] - before
        outputs = sched.take_outputs()
        if self._pin_waiters:
            outputs = [o for o in outputs if not self._pin_prefilled(o)]
        for hook in self.after_step:
            hook(self)
        outputs += self.kv_connector.take_outputs()
        for o in outputs:
            o.weight_version = self.weight_version
        return outputs

    # -- between-step operations -------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Empty the prefix cache, pins included; False (nothing done) while requests run or wait
        (or wait on a KV transfer)."""
        done = not self.kv_connector.has_work() and self.scheduler.flush_cache()
        for hook in self.after_step:
            hook(self)
        return done

    def add_eos_ids(self, ids: Iterable[int]) -> list[int]:
        """More token ids that end generation (e.g. the tokenizer's); returns all of them, sorted."""
        self.scheduler.eos_ids |= {int(i) for i in ids}
        return sorted(self.scheduler.eos_ids)

    def pin_prefix(self, pin_id: str, prompt_ids: list[int], ttl_s: float, done: PinDone) -> None:
        """Keep ``prompt_ids``' KV in the prefix cache for ``ttl_s`` seconds (re-pinning an id
        replaces its pin). When the prefix is not cached yet it is prefilled first, as a prefill-only
        request (no token sampled). ``done(tokens, None)`` reports the tokens pinned, ``done(None,
        message)`` a refusal (the cache keeps nothing, the pinned budget would be exceeded, an empty,
        invalid or over-long prompt, a ttl that is not a finite number > 0), always before any prefill;
        called at once or from the ``step()`` that finishes the prefill."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (math.isfinite(ttl_s) and ttl_s > 0):
            done(None, f"the pin's TTL must be a finite number of seconds > 0, got {ttl_s!r}")
            return
        cache = self.scheduler.cache
        aligned = len(prompt_ids) - len(prompt_ids) % self.scheduler.pool.page_size
        try:  # refused before any prefill: bad ids, too long, over the pinned budget, cache off
            check_request(prompt_ids, PREFILL_ONLY, self.scheduler.admission_limits())
            cache.check_pin(pin_id, aligned)
        except ValueError as e:
            done(None, str(e))
            return
        if cache.peek_prefix_len(prompt_ids) >= aligned:
            self._pin(pin_id, prompt_ids, ttl_s, done)
            return
        rid = f"pin-{uuid.uuid4().hex[:12]}"
        try:
            self.scheduler.add_request(Request(rid, list(prompt_ids), PREFILL_ONLY, priority=1 << 30))
        except ValueError as e:  # RequestError
            done(None, str(e))
            return
        self._pin_waiters[rid] = (pin_id, list(prompt_ids), ttl_s, done)

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pin early; False if the id is unknown."""
        return self.scheduler.cache.unpin(pin_id)

    def _pin(self, pin_id: str, prompt_ids: list[int], ttl_s: float, done: PinDone) -> None:
        try:
            n = self.scheduler.cache.pin(pin_id, prompt_ids, ttl_s)
        except ValueError as e:
            done(None, str(e))
            return
        done(n, None)

    def _pin_prefilled(self, out: RequestOutput) -> bool:
        """Consume the output of a pin's prefill: pin when it finished. True if ``out`` was one."""
        waiter = self._pin_waiters.get(out.rid)
        if waiter is None:
            return False
        if out.finished:
            del self._pin_waiters[out.rid]
            pin_id, ids, ttl_s, done = waiter
            if out.finish_reason == FinishReason.ABORT:
                done(None, "aborted before the prefix was cached")
            else:
                self._pin(pin_id, ids, ttl_s, done)
        return True

    def stats(self) -> dict:
        """Engine totals (SchedulerStats fields, cache_hit_rate), KV usage in tokens, the time
        buckets in seconds, and the running and waiting counts."""
        s = self.scheduler.refresh_stats()
        d = {k: getattr(s, k) for k in s.__dataclass_fields__}
        d["cache_hit_rate"] = s.cache_hit_rate
        d["kv"] = self.scheduler.kv_usage()
        d["time"] = self.scheduler.clock.snapshot()
        d["num_running"] = len(self.scheduler.running)
        d["num_waiting"] = len(self.scheduler.waiting)
        d["speculative"] = self.proposer.stats()
        d["kv_transfer"] = self.kv_connector.stats()
        return d
