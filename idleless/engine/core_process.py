"""The engine core: scheduler + model runner behind a message interface.

``EngineCore`` is driven in-process by the offline ``Engine`` and, in its own process, by
``run_engine_core`` (ZMQ in/out) for the server. It never sees text.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from idleless.config import EngineConfig
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput
from idleless.engine.core import EngineCore  # noqa: F401 - the loop drives it

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


@dataclass
class ErrorOutput(RequestOutput):
    """The last (and only) output of a request the engine core refused or failed:
    ``finish_reason`` is ``abort``, ``error`` the message; ``code`` / ``param`` as in RequestError
    (``internal_error`` when the engine itself failed)."""

    code: Optional[str] = None
    param: Optional[str] = None


@dataclass
class CoreReady:
    """First message of a started engine core: what the frontend needs to validate requests.

    vocab_size: ids in [0, vocab_size) are valid; context_length and kv_slots are in tokens (a
    request needs prompt + max_tokens <= min(context_length, kv_slots)); load_seconds: model load."""

    pid: int
    model_dir: str
    dtype: str
    vocab_size: int
    context_length: int
    kv_slots: int
    page_size: int
    max_running_requests: int
    eos_token_ids: list[int]
    load_seconds: float


@dataclass
class CoreFailed:
    """Sent instead of CoreReady when the engine core cannot start (the process then exits 1)."""

    message: str
    traceback: str = ""


# --------------------------------------------------------------------------------------------------
# The engine core as a process (server): ZMQ in, ZMQ out
# --------------------------------------------------------------------------------------------------
class EngineCoreLoop:
    """The busy loop of the engine-core process.

    Each turn: drain the inbox (without blocking when there is work; blocking up to
    ``idle_poll_ms`` when idle), handle every message, run one ``EngineCore.step()``, and send
    everything produced in the turn (RequestOutputs, ControlReplies) as ONE pickled list.

    Inbox messages (pickled): AddRequest, AbortRequest, ControlRequest. A message that cannot be
    unpickled, or a request the core refuses (RequestError) or fails on, never ends the loop: it is
    answered with an ``ErrorOutput`` for that rid (when there is one) and logged. An exception in
    ``step()`` aborts every request in the core with an ErrorOutput (code ``internal_error``) and
    the loop goes on. Control kinds: ``ping`` -> "pong", ``stats``, ``flush_cache``,
    ``add_eos_ids`` (payload ``{"ids": [...]}``: more ids that end generation, e.g. the tokenizer's),
    ``shutdown`` (reply, abort what is left, leave the loop). The loop also ends when the parent process is gone.
    """

    def __init__(self, core: EngineCore, pull, push, idle_poll_ms: int = 500, parent_check_s: float = 1.0):
        self.core = core
        self.pull = pull
        self.push = push
        self.idle_poll_ms = idle_poll_ms
        self.parent_check_s = parent_check_s
        self.pending: list = []
        self.running = True
        self._last_parent_check = time.monotonic()

    # -- messages ------------------------------------------------------------------------------
    def handle(self, data: bytes) -> None:
        try:
            msg = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a bad message must not end the loop
            log.error("engine core: dropping a message that does not unpickle: %r", e)
            return
        try:
            if isinstance(msg, AddRequest):
                self._add(msg.request)
            elif isinstance(msg, AbortRequest):
                self.core.abort(msg.rid)
            elif isinstance(msg, ControlRequest):
                self._control(msg)
            else:
                rid = getattr(getattr(msg, "request", msg), "rid", None)
                log.error("engine core: unknown message type %s", type(msg).__name__)
                if isinstance(rid, str):
                    self.pending.append(ErrorOutput(rid, [], FinishReason.ABORT, error="unknown message type",
                                                    code="internal_error"))
        except Exception as e:  # noqa: BLE001
            log.exception("engine core: error handling %s", type(msg).__name__)
            rid = getattr(getattr(msg, "request", None), "rid", None)
            if isinstance(rid, str):
                self.pending.append(ErrorOutput(rid, [], FinishReason.ABORT, error=f"engine error: {e}",
                                                code="internal_error"))

    def _add(self, req: Request) -> None:
        if not isinstance(req, Request) or not isinstance(req.rid, str):
            raise TypeError(f"AddRequest.request must be a Request, got {type(req).__name__}")
        try:
            self.core.add_request(req)
        except RequestError as e:
            self.pending.append(ErrorOutput(req.rid, [], FinishReason.ABORT, error=e.message, code=e.code,
                                            param=e.param, prompt_tokens=len(req.prompt_ids or [])))
        except Exception as e:  # noqa: BLE001 - e.g. a malformed Request that slipped through
            log.exception("engine core: add_request(%s) failed", req.rid)
            self.core.abort(req.rid)
            self.pending.append(ErrorOutput(req.rid, [], FinishReason.ABORT, error=f"bad request: {e}",
                                            code="invalid_request"))

    def _control(self, msg: ControlRequest) -> None:
        try:
            if msg.kind == "ping":
                result = "pong"
            elif msg.kind == "shutdown":
                result = True
                self.running = False
            elif msg.kind == "add_eos_ids":
                ids = {int(i) for i in msg.payload.get("ids", ())}
                self.core.scheduler.eos_ids |= ids
                result = sorted(self.core.scheduler.eos_ids)
            else:
                result = self.core.control(msg.kind, msg.payload)
            self.pending.append(ControlReply(msg.call_id, True, result))
        except Exception as e:  # noqa: BLE001
            self.pending.append(ControlReply(msg.call_id, False, error=f"{type(e).__name__}: {e}"))

    # -- loop ----------------------------------------------------------------------------------
    def _drain(self, timeout_ms: int) -> None:
        import zmq
        if timeout_ms and not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(data)

    def _flush(self) -> None:
        if self.pending:
            out, self.pending = self.pending, []
            self.push.send(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))

    def _parent_alive(self) -> bool:
        import multiprocessing
        now = time.monotonic()
        if now - self._last_parent_check < self.parent_check_s:
            return True
        self._last_parent_check = now
        parent = multiprocessing.parent_process()
        return parent is None or parent.is_alive()

    def _fail_all(self, why: str) -> None:
        sched = self.core.scheduler
        rids = [r.rid for r in list(sched.waiting) + list(sched.running)]
        for rid in rids:
            try:
                self.core.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("engine core: abort(%s) failed", rid)
        try:
            self.core.step()  # collect (and drop) the abort outputs; the ErrorOutputs replace them
        except Exception:  # noqa: BLE001
            sched._outputs = []
        try:  # a failed step may have left uncomputed KV in the tree: drop it
            self.core.control("flush_cache")
        except Exception:  # noqa: BLE001
            log.exception("engine core: flush_cache after a failure failed")
        for rid in rids:
            self.pending.append(ErrorOutput(rid, [], FinishReason.ABORT, error=why, code="internal_error"))

    def run(self) -> None:
        # Wall-time buckets (idleless.telemetry.timing): waiting for a message with nothing to do is
        # idle_no_work; receiving/handling messages and sending outputs is io; step() charges
        # schedule and forward itself.
        sched = self.core.scheduler
        clock = sched.clock
        clock.reset()
        while self.running:
            busy = self.core.has_work()
            if not busy:
                if sched.tracer is not None:
                    sched.tracer.flush()  # a run's trace is complete on disk once the engine idles
                clock.mark("io")
                self.pull.poll(self.idle_poll_ms)
                clock.mark("idle_no_work")
            self._drain(0)
            clock.mark("io")
            if not self._parent_alive():
                log.warning("engine core: the frontend process is gone; exiting")
                break
            if self.running and self.core.has_work():
                try:
                    self.pending.extend(self.core.step())
                except Exception as e:  # noqa: BLE001
                    log.exception("engine core: step failed; aborting all requests")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._flush()
            clock.mark("io")
        # shutdown: whatever is left is aborted and reported
        if self.core.has_work():
            self._fail_all("the server is shutting down")
        self._flush()


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, extra_eos_ids: tuple = ()) -> None:
    """Entry point of the engine-core process (start it with multiprocessing "spawn").

    Connects a PULL socket to ``in_addr`` (messages from the frontend) and a PUSH socket to
    ``out_addr`` (lists of RequestOutput / ControlReply), loads the model, sends ``[CoreReady]``
    (or ``[CoreFailed]`` and exits 1), then runs ``EngineCoreLoop`` until a ``shutdown`` control
    call or the parent's death. ``extra_eos_ids``: more ids that end generation (the tokenizer's,
    as the offline Engine adds them). SIGINT and SIGTERM are ignored: a signal to the whole process
    group (Ctrl-C, systemd, ``timeout``) reaches the core too, and the frontend drives the shutdown
    (drain, then ``shutdown``; SIGKILL if the core lingers; the core also leaves when its parent dies).
    """
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=str(config.log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(out_addr)
    try:
        core = EngineCore(config)
        core.scheduler.eos_ids |= set(int(i) for i in extra_eos_ids)
        r = core.runner
        ready = CoreReady(pid=os.getpid(), model_dir=str(r.model_dir), dtype=str(r.dtype).replace("torch.", ""),
                          vocab_size=int(r.model_config.vocab_size), context_length=int(r.context_length),
                          kv_slots=int(r.pool.num_slots), page_size=int(config.page_size),
                          max_running_requests=int(config.max_running_requests),
                          eos_token_ids=sorted(core.scheduler.eos_ids),
                          load_seconds=float(getattr(r, "load_seconds", 0.0)))
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the frontend
        log.error("engine core failed to start: %s", e)
        push.send(pickle.dumps([CoreFailed(f"{type(e).__name__}: {e}", traceback.format_exc())]))
        push.close(linger=2000)
        pull.close(linger=0)
        ctx.term()
        sys.exit(1)
    push.send(pickle.dumps([ready]))
    loop = EngineCoreLoop(core, pull, push)
    try:
        loop.run()
    finally:
        push.close(linger=2000)
        pull.close(linger=0)
        ctx.term()
    log.info("engine core: stopped")
