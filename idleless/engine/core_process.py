"""The engine core as a process (the server's back end): ZMQ in, ``EngineCore.step()``, ZMQ out.

``run_engine_core`` is the process's entry point; ``EngineCoreLoop`` its busy loop. The messages
are in ``idleless.engine.messages``; the core itself (scheduler + model runner) in
``idleless.engine.core``. It never sees text.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Callable, Optional

from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.messages import (AbortRequest, AddEosIds, AddRequest, ControlCall, ControlReply, CoreFailed,
                                      ContinueGeneration, CoreReady, DestroyWeightsUpdateGroup, ErrorOutput, FlushCache, GetStats,
                                      GetWeightVersion, InitWeightsUpdateGroup, PauseGeneration, PinPrefix, Ping,
                                      ReleaseMemoryOccupation, ResumeMemoryOccupation, Shutdown, UnpinPrefix,
                                      UpdateWeightsFromDisk, UpdateWeightsFromDistributed, UpdateWeightsFromTensor,
                                      dumps_messages)
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput
from idleless.rl.control import PendingUpdate, WeightControl
from idleless.rl.memory import MemoryOccupation, MemoryOccupationError
from idleless.rl.updates import WeightUpdateError

log = logging.getLogger(__name__)


class Reply:
    """The one answer to a ``ControlCall``: a handler calls ``ok(result)`` or ``refuse(message)``,
    now or from a later turn (a pin waits for its prefill). Answers after the first are ignored."""

    def __init__(self, loop: "EngineCoreLoop", call_id: int):
        self.loop = loop
        self.call_id = call_id
        self.answered = False
        loop.open_calls[call_id] = self

    def _send(self, reply: ControlReply) -> None:
        if self.answered:
            return
        self.answered = True
        self.loop.open_calls.pop(self.call_id, None)
        self.loop.pending.append(reply)

    def ok(self, result: Any = None) -> None:
        self._send(ControlReply(self.call_id, True, result))

    def refuse(self, message: str) -> None:
        """The engine declined (the caller's fault): code ``refused``."""
        self._send(ControlReply(self.call_id, False, error=message, code="refused"))

    def fail(self, message: str, code: str = "internal_error") -> None:
        self._send(ControlReply(self.call_id, False, error=message, code=code))


class EngineCoreLoop:
    """The busy loop of the engine-core process.

    Each turn: drain the inbox (without blocking when there is work; blocking up to
    ``idle_poll_ms`` when idle), handle every message, run one ``EngineCore.step()``, and send
    everything produced in the turn (RequestOutputs, ControlReplies) as ONE pickled list (``messages.dumps_messages``).

    Inbox messages (pickled): AddRequest, AbortRequest, ControlCall. A message that cannot be
    unpickled, or a request the core refuses (RequestError) or fails on, never ends the loop: it is
    answered with an ``ErrorOutput`` for that rid (when there is one) and logged. An exception in
    ``step()`` aborts every request in the core with an ErrorOutput (code ``internal_error``) and
    the loop goes on. A ``ControlCall``'s verb is dispatched by its type through ``handlers`` (one
    entry per verb; each handler answers through the ``Reply`` it is given, and an exception it raises
    becomes a failed reply). ``Shutdown`` ends the loop after the turn (what is left is aborted and
    reported); the loop also ends when the parent process is gone.

    Weight updates (``idleless.rl.control``) are checked when their verb arrives (a refusal is
    answered at once, nothing written) and written between two steps: at once with
    ``flush_cache=False``, otherwise once the core has no request (``abort_all_requests`` aborts them
    first; else the requests already in the engine finish on the old weights). Requests arriving
    while an update waits are held back (``held``) and queued after it, so none of them mixes weights.
    ``PauseGeneration`` stops the steps (and holds new requests) until ``ContinueGeneration``;
    ``ReleaseMemoryOccupation`` does too until every released tag is resumed (``paused``).
    """

    def __init__(self, core: EngineCore, pull, push, idle_poll_ms: int = 500, parent_check_s: float = 1.0):
        self.core = core
        self.pull = pull
        self.push = push
        self.idle_poll_ms = idle_poll_ms
        self.parent_check_s = parent_check_s
        self.pending: list = []
        self.running = True
        self.exit_code = 0  # the process's exit status once run() returns (1: stopped by a failure)
        self.open_calls: dict[int, Reply] = {}  # call_id -> Reply not answered yet (deferred pins)
        self._last_parent_check = time.monotonic()
        self.handlers: dict[type, Callable[[Any, Reply], None]] = {
            Ping: self._ping,
            Shutdown: self._shutdown,
            FlushCache: self._flush_cache,
            GetStats: self._get_stats,
            AddEosIds: self._add_eos_ids,
            PinPrefix: self._pin_prefix,
            UnpinPrefix: self._unpin_prefix,
            GetWeightVersion: self._get_weight_version,
            UpdateWeightsFromDisk: self._update_weights,
            UpdateWeightsFromTensor: self._update_weights,
            UpdateWeightsFromDistributed: self._update_weights,
            InitWeightsUpdateGroup: self._init_weights_update_group,
            DestroyWeightsUpdateGroup: self._destroy_weights_update_group,
            PauseGeneration: self._pause_generation,
            ContinueGeneration: self._continue_generation,
            ReleaseMemoryOccupation: self._release_memory,
            ResumeMemoryOccupation: self._resume_memory,
        }
        self.pause_requested = False  # PauseGeneration: no step until ContinueGeneration
        self.memory = MemoryOccupation(core)  # released memory: no step until it is resumed
        self.weights = WeightControl(core)
        self.deferred: list[tuple[PendingUpdate, Reply]] = []  # updates waiting for the core to be idle
        self.held: list[Request] = []  # requests that arrived while an update waits

    # -- messages ------------------------------------------------------------------------------
    def handle(self, data: bytes) -> None:
        """Unpickle and handle one inbox message; never raises."""
        try:
            msg = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a bad message must not end the loop
            log.error("engine core: dropping a message that does not unpickle: %r", e)
            return
        try:
            if isinstance(msg, AddRequest):
                self._add(msg.request)
            elif isinstance(msg, AbortRequest):
                if not self._drop_held(msg.rid):
                    self.core.abort(msg.rid, FinishReason.STOP if msg.stopped else FinishReason.ABORT)
            elif isinstance(msg, ControlCall):
                self._call(msg)
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
        if self.deferred or self.paused:
            self.held.append(req)
            return
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

    def _call(self, call: ControlCall) -> None:
        reply = Reply(self, call.call_id)
        handler = self.handlers.get(type(call.verb))
        if handler is None:
            reply.fail(f"unknown control verb {type(call.verb).__name__}", code="unknown_verb")
            return
        try:
            handler(call.verb, reply)
        except RequestError as e:
            reply.refuse(e.message)
        except Exception as e:  # noqa: BLE001 - a failed call must not end the loop
            log.exception("engine core: %s failed", type(call.verb).__name__)
            reply.fail(f"{type(e).__name__}: {e}")

    # -- control verbs (one handler each) ------------------------------------------------------
    def _ping(self, verb: Ping, reply: Reply) -> None:
        reply.ok("pong")

    def _shutdown(self, verb: Shutdown, reply: Reply) -> None:
        self.running = False
        reply.ok(True)

    def _flush_cache(self, verb: FlushCache, reply: Reply) -> None:
        reply.ok(self.core.flush_cache())

    def _get_stats(self, verb: GetStats, reply: Reply) -> None:
        reply.ok(self.core.stats())

    def _add_eos_ids(self, verb: AddEosIds, reply: Reply) -> None:
        reply.ok(self.core.add_eos_ids(int(i) for i in verb.ids))

    def _pin_prefix(self, verb: PinPrefix, reply: Reply) -> None:
        """Answered when the core calls ``done`` (at once, or from a later step after a prefill)."""

        def done(tokens: Optional[int], error: Optional[str]) -> None:
            if error is not None:
                reply.refuse(error)
            else:
                reply.ok(tokens)

        self.core.pin_prefix(verb.pin_id, list(verb.input_ids), float(verb.ttl_s), done)

    def _unpin_prefix(self, verb: UnpinPrefix, reply: Reply) -> None:
        reply.ok(self.core.unpin_prefix(verb.pin_id))

    def _get_weight_version(self, verb: GetWeightVersion, reply: Reply) -> None:
        reply.ok(self.weights.weight_version)

    def _update_weights(self, verb, reply: Reply) -> None:
        """Any ``UpdateWeightsFrom*`` verb: checked now (a refusal aborts nothing), written now with
        ``flush_cache=False``, else deferred until the core is idle (``_run_deferred``)."""
        if "weights" in self.memory.released:  # (a trainer's broadcast then ends at its group timeout)
            raise WeightUpdateError("the weights are released (release_memory_occupation): "
                                    "resume_memory_occupation first, then push them")
        pending = self.weights.prepare(verb)
        if verb.abort_all_requests:
            pending.num_aborted = self.weights.updater.abort_all() + self._abort_held()
        if not pending.flush_cache:
            reply.ok(self.weights.commit(pending).as_dict())
        else:
            self.deferred.append((pending, reply))

    def _init_weights_update_group(self, verb: InitWeightsUpdateGroup, reply: Reply) -> None:
        reply.ok(self.weights.init_group(verb))

    def _destroy_weights_update_group(self, verb: DestroyWeightsUpdateGroup, reply: Reply) -> None:
        reply.ok(self.weights.destroy_group(verb))

    def _pause_generation(self, verb: PauseGeneration, reply: Reply) -> None:
        if verb.mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"mode must be abort, retract or in_place, got {verb.mode!r}", param="mode")
        sched = self.core.scheduler
        n = 0
        if verb.mode == "abort":
            n = self.weights.updater.abort_all() + self._abort_held()
            self.pending.extend(self.core.step())  # nothing left to run: this only reports the aborts
        elif verb.mode == "retract":
            for rec in list(sched.running):
                sched._retract(rec)  # noqa: SLF001 - Scheduler has no public retract yet (see the report)
                n += 1
        self.pause_requested = True
        reply.ok(n)

    def _continue_generation(self, verb: ContinueGeneration, reply: Reply) -> None:
        self.pause_requested = False
        if not self.deferred and not self.paused:
            self._release_held()
        reply.ok(True)

    @property
    def paused(self) -> bool:
        """No step runs and arriving requests are held: paused, or memory released."""
        return self.pause_requested or bool(self.memory.released)

    def _release_memory(self, verb: ReleaseMemoryOccupation, reply: Reply) -> None:
        if self.deferred:
            raise MemoryOccupationError("a weight update is waiting to be written: release memory after it")
        freed = self.memory.release(verb.tags)
        reply.ok({"released": sorted(self.memory.released), "bytes": freed})

    def _resume_memory(self, verb: ResumeMemoryOccupation, reply: Reply) -> None:
        taken = self.memory.resume(verb.tags)
        if not self.paused and not self.deferred:
            self._release_held()
        reply.ok({"released": sorted(self.memory.released), "bytes": taken})

    def _release_held(self) -> None:
        held, self.held = self.held, []
        for req in held:
            self._add(req)  # refusals become the request's ErrorOutput there

    def _update_ready(self) -> bool:
        """A deferred update waits and may be written now."""
        return bool(self.deferred) and (not self.core.has_work() or (self.paused and not self.core.scheduler.running))

    def _run_deferred(self) -> None:
        """Between steps, once the core is idle (paused: once no request runs): write the waiting
        updates in arrival order, answer each, then queue the requests held back meanwhile."""
        if not self._update_ready():
            return
        updates, self.deferred = self.deferred, []
        for pending, reply in updates:
            try:
                reply.ok(self.weights.commit(pending).as_dict())
            except Exception as e:  # noqa: BLE001 - a failed write must not end the loop
                log.exception("engine core: weight update failed")
                reply.fail(f"{type(e).__name__}: {e}")
        if not self.paused:
            self._release_held()

    def _drop_held(self, rid: str) -> bool:
        """Abort a request held back by a waiting update: it ends with finish_reason ``abort``."""
        for i, req in enumerate(self.held):
            if req.rid == rid:
                del self.held[i]
                self.pending.append(RequestOutput(rid, [], FinishReason.ABORT, prompt_tokens=len(req.prompt_ids)))
                return True
        return False

    def _abort_held(self) -> int:
        n = len(self.held)
        for req in list(self.held):
            self._drop_held(req.rid)
        return n

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

    def _wait_idle(self) -> None:
        """Sleep until a frontend message, or a message on a socket the engine core serves between
        steps (a prefill engine's KV transfer port: ``kv_connector.wake_sockets``), or the idle poll."""
        wake = self.core.kv_connector.wake_sockets
        if not wake:
            self.pull.poll(self.idle_poll_ms)
            return
        import zmq
        poller = zmq.Poller()
        for sock in (self.pull, *wake):
            poller.register(sock, zmq.POLLIN)
        if any(sock is not self.pull for sock, _ in poller.poll(self.idle_poll_ms)):
            self.pending.extend(self.core.step())  # serves the pulls (an empty plan; after-step hooks work)

    def _flush(self) -> None:
        if self.pending:
            out, self.pending = self.pending, []
            self.push.send(dumps_messages(out))

    def _parent_alive(self) -> bool:
        import multiprocessing
        now = time.monotonic()
        if now - self._last_parent_check < self.parent_check_s:
            return True
        self._last_parent_check = now
        parent = multiprocessing.parent_process()
        return parent is None or parent.is_alive()

    def _fail_all(self, why: str) -> None:
        """Abort every request in the core and report each with an ErrorOutput (code
        ``internal_error``); calls still waiting (pins being prefilled) fail with ``why``."""
        sched = self.core.scheduler
        rids = [r.rid for r in list(sched.waiting) + list(sched.running)] + [r.rid for r in self.held]
        self.held, self.deferred = [], []  # their replies are failed with the other open calls below
        for rid in rids:
            try:
                self.core.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("engine core: abort(%s) failed", rid)
        try:
            self.core.step()  # collect (and drop) the abort outputs; the ErrorOutputs replace them
        except Exception:  # noqa: BLE001
            sched.take_outputs()
        try:  # a failed step may have left uncomputed KV in the tree: drop it
            self.core.flush_cache()
        except Exception:  # noqa: BLE001
            log.exception("engine core: flush_cache after a failure failed")
        for rid in rids:
            self.pending.append(ErrorOutput(rid, [], FinishReason.ABORT, error=why, code="internal_error"))
        for reply in list(self.open_calls.values()):
            reply.fail(why)

    def run(self) -> None:
        # Wall-time buckets (idleless.telemetry.timing): waiting for a message with nothing to do is
        # idle_no_work; receiving/handling messages and sending outputs is io; step() charges
        # schedule and forward itself.
        sched = self.core.scheduler
        clock = sched.clock
        clock.reset()
        while self.running:
            busy = (self.core.has_work() and not self.paused) or self._update_ready()
            if not busy:
                if sched.tracer is not None:
                    sched.tracer.flush()  # a run's trace is complete on disk once the engine idles
                clock.mark("io")
                self._wait_idle()
                clock.mark("idle_no_work")
            self._drain(0)
            self._run_deferred()
            clock.mark("io")
            if not self._parent_alive():
                log.warning("engine core: the frontend process is gone; exiting")
                break
            if self.running and self.core.has_work() and not self.paused:
                try:
                    self.pending.extend(self.core.step())
                except Exception as e:  # noqa: BLE001
                    log.exception("engine core: step failed; aborting all requests")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    from idleless.dist.group import TensorParallelError
                    if isinstance(e, TensorParallelError):  # a tensor-parallel rank is gone: no step can run
                        log.error("engine core: exiting after a tensor-parallel failure")
                        self.running = False
                        self.exit_code = 1
            self._flush()
            clock.mark("io")
        # shutdown: whatever is left is aborted and reported, and every call still open is answered
        if self.core.has_work() or self.held:
            self._fail_all("the server is shutting down")
        for reply in list(self.open_calls.values()):
            reply.fail("the engine core is shutting down")
        self._flush()


def core_sockets(in_addr: str, out_addr: str):
    """An engine-core process's side of the link: signals left to the frontend (SIGINT, SIGTERM
    ignored), then (zmq context, PULL connected to ``in_addr``, PUSH with no send limit connected to
    ``out_addr``)."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(out_addr)
    return ctx, pull, push


def run_and_close(loop: EngineCoreLoop, ctx) -> None:
    """Run ``loop`` until it stops, then close its sockets (what is queued gets up to 2 s to leave)
    and the zmq context ``ctx`` (``core_sockets``'s)."""
    try:
        loop.run()
    finally:
        loop.push.close(linger=2000)
        loop.pull.close(linger=0)
        ctx.term()


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, extra_eos_ids: tuple = ()) -> None:
    """Entry point of the engine-core process (start it with multiprocessing "spawn").

    Connects a PULL socket to ``in_addr`` (messages from the frontend) and a PUSH socket to
    ``out_addr`` (lists of RequestOutput / ControlReply), loads the model, sends ``[CoreReady]``
    (or ``[CoreFailed]`` and exits 1), then runs ``EngineCoreLoop`` until a ``Shutdown`` call or
    the parent's death, and exits with the loop's ``exit_code`` (1 after a tensor-parallel failure).
    ``extra_eos_ids``: more ids that end generation (the tokenizer's,
    as the offline Engine adds them). SIGINT and SIGTERM are ignored: a signal to the whole process
    group (Ctrl-C, systemd, ``timeout``) reaches the core too, and the frontend drives the shutdown
    (drain, then ``Shutdown``; SIGKILL if the core lingers; the core also leaves when its parent dies).
    """
    logging.basicConfig(level=str(config.log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    ctx, pull, push = core_sockets(in_addr, out_addr)
    try:
        core = EngineCore(config)
        eos_ids = core.add_eos_ids(int(i) for i in extra_eos_ids)
        r = core.runner
        ready = CoreReady(pid=os.getpid(), model_dir=str(r.model_dir), dtype=str(r.dtype).replace("torch.", ""),
                          vocab_size=int(r.model_config.vocab_size), context_length=int(r.context_length),
                          kv_slots=int(r.pool.num_slots), page_size=int(config.page_size),
                          max_running_requests=int(config.max_running_requests),
                          eos_token_ids=list(eos_ids),
                          load_seconds=float(getattr(r, "load_seconds", 0.0)),
                          precision=getattr(r, "precision", None),
                          deterministic=bool(getattr(r, "deterministic", False)))
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the frontend
        log.error("engine core failed to start: %s", e)
        push.send(pickle.dumps([CoreFailed(f"{type(e).__name__}: {e}", traceback.format_exc())]))
        push.close(linger=2000)
        pull.close(linger=0)
        ctx.term()
        sys.exit(1)
    # the model, pool and tables live as long as this process: move them out of the garbage collector's
    # generations, so the collections a step's allocations trigger no longer walk them (as vLLM and SGLang
    # freeze after start-up); here, not in ModelRunner: frozen cycles are never collected, so a process
    # that builds engines one after another (benches, tests) would keep them all, and a full collection
    # per runner costs ~0.35 s in a test process. Unfrozen at exit (nanobind reports frozen objects as leaks)
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    push.send(pickle.dumps([ready]))
    loop = EngineCoreLoop(core, pull, push)
    run_and_close(loop, ctx)
    log.info("engine core: stopped")
    sys.exit(loop.exit_code)
