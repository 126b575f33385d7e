"""The engine core: scheduler + model runner behind a message interface.

``EngineCore`` is driven in-process by the offline ``Engine`` and, in its own process, by
``run_engine_core`` (ZMQ in/out) for the server. It never sees text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from idleless.config import EngineConfig
from idleless.engine.request import Request, RequestOutput
from idleless.engine.scheduler import Scheduler
from idleless.model.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class AddRequest:
    request: Request


@dataclass
class AbortRequest:
    rid: str


@dataclass
class ControlRequest:
    """Admin call answered by a ControlReply with the same ``call_id``: ``flush_cache``, ``stats``."""

    call_id: int
    kind: str
    payload: dict = field(default_factory=dict)


@dataclass
class ControlReply:
    call_id: int
    ok: bool
    result: Any = None
    error: Optional[str] = None


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
        s = self.scheduler.stats
        d = {k: getattr(s, k) for k in s.__dataclass_fields__}
        d["cache_hit_rate"] = s.cache_hit_rate
        d["kv"] = self.scheduler.kv_usage()
        d["num_running"] = len(self.scheduler.running)
        d["num_waiting"] = len(self.scheduler.waiting)
        return d
