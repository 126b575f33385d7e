"""The engine core: scheduler + model runner, one step at a time.

``EngineCore.step()`` is plan -> execute -> commit (DESIGN.md section 7): the scheduler plans a
``StepPlan``, the model runner executes it (tensors, forward, sampler) and the scheduler commits the
result. The offline ``Engine`` drives it in-process; ``core_process.EngineCoreLoop`` drives it in
its own process for the server. It never sees text.
"""

from __future__ import annotations

from typing import Any

from idleless.config import EngineConfig
from idleless.engine.request import Request, RequestOutput
from idleless.engine.scheduler import Scheduler
from idleless.model.runner import ModelRunner


class EngineCore:
    """Loads the model (``ModelRunner``) and owns the ``Scheduler``.

    eos ids come from the model's config (config.json / generation_config.json)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.runner, set(self.runner.model_config.eos_token_ids))

    def add_request(self, req: Request) -> None:
        """Queue a request; raises RequestError if it can never be served."""
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        return self.scheduler.step()

    def control(self, kind: str, payload: dict | None = None) -> Any:
        """Admin operations: ``flush_cache`` -> bool, ``stats`` -> dict."""
        if kind == "flush_cache":
            return self.scheduler.flush_cache()
        if kind == "stats":
            return self.stats()
        raise ValueError(f"unknown control call {kind!r}")

    def stats(self) -> dict:
        s = self.scheduler.refresh_stats()
        d = {k: getattr(s, k) for k in s.__dataclass_fields__}
        d["cache_hit_rate"] = s.cache_hit_rate
        d["kv"] = self.scheduler.kv_usage()
        d["time"] = self.scheduler.clock.snapshot()
        d["num_running"] = len(self.scheduler.running)
        d["num_waiting"] = len(self.scheduler.waiting)
        return d
