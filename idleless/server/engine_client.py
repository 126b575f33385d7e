"""Frontend side of the engine core: spawn the core process, send it requests, route its outputs.

    client = await EngineClient.start(config)          # spawns the engine core, waits for CoreReady
    client.check_request(prompt_ids, params)           # RequestError for what the engine would refuse
    sub = client.submit([prompt_ids], params)          # n engine requests per prompt
    async for delta in sub: ...                        # CompletionDelta, any choice, in order
    sub.close()                                        # aborts what is unfinished (client gone)
    stats = await client.call(GetStats())              # any control verb (idleless.engine.messages)
    tokens = await client.pin_prefix(ids, ttl_s=600, pin_id="sys")   # also tracks the pinned total

Transport: two ZMQ PUSH/PULL pipes over ``ipc://`` sockets in a private (0700) temporary
directory, pickled messages (``idleless.engine.messages``). The frontend binds both ends; the
core connects. One reader task routes each ``RequestOutput`` by rid to its ``RequestState``
(incremental detokenization + stop strings) and puts the resulting ``CompletionDelta`` on the
owning submission's asyncio queue; a stop-string match sends an ``AbortRequest`` so the engine
frees the request's KV at once. A watchdog notices the core's death within ~0.25 s: every
in-flight submission then raises ``EngineDeadError`` and ``on_death`` is called.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from idleless.config import EngineConfig
from idleless.engine.admission import AdmissionLimits, check_request
from idleless.engine.core_process import run_engine_core
from idleless.engine.messages import (AbortRequest, AddEosIds, AddRequest, ControlCall, ControlReply, ControlVerb,
                                      CoreFailed, CoreReady, ErrorOutput, FlushCache, PinPrefix, Ping, Shutdown,
                                      UnpinPrefix)
from idleless.engine.request import RequestError, RequestOutput, SamplingParams
from idleless.text.output import CompletionDelta, CompletionOutput, RequestState, fan_out
from idleless.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class Overloaded(RuntimeError):
    """Admitting the request would exceed the in-flight limit (the server answers 503)."""


class CallRefused(RuntimeError):
    """The engine core declined a control call (``ControlReply.code == "refused"``): the caller's
    fault, e.g. a pin over the pinned budget or with the prefix cache disabled (the server answers 400)."""


class CallFailed(RuntimeError):
    """A control call failed inside the engine core (an unknown verb or an internal error)."""


@dataclass
class _Track:
    state: RequestState
    sub: "Submission"
    arrival: float
    last_token: Optional[float] = None
    error_code: Optional[str] = None
    error_param: Optional[str] = None


class Submission:
    """The engine requests of one API request: ``len(prompts) * n`` choices sharing one queue.

    Iterate (``async for``) to get every CompletionDelta in arrival order (``delta.index`` is the
    choice index prompt_index * n + i); iteration ends when every choice has finished and raises
    EngineDeadError if the core died. ``close()`` (idempotent; always call it, e.g. in ``finally``)
    aborts unfinished choices in the engine and releases the admission slots.
    """

    def __init__(self, client: "EngineClient", states: list[RequestState], arrival: float):
        self.client = client
        self.states = states
        self.arrival = arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.errors: dict[int, tuple[Optional[str], Optional[str]]] = {}  # choice index -> (code, param)
        self._pending = len(states)  # choices whose final delta has not been consumed yet
        self._error: Optional[BaseException] = None  # met by ``ready``; the next ``__anext__`` raises it

    @property
    def finished(self) -> bool:
        return all(st.finished for st in self.states)

    def error_info(self, index: int) -> tuple[Optional[str], Optional[str]]:
        """(code, param) of an ErrorOutput the engine sent for choice ``index`` (else (None, None))."""
        return self.errors.get(index, (None, None))

    def __aiter__(self):
        return self

    async def __anext__(self) -> CompletionDelta:
        if self._pending <= 0:
            raise StopAsyncIteration
        if self._error is not None:
            item, self._error = self._error, None
        else:
            item = await self.queue.get()
        if isinstance(item, BaseException):
            self._pending = 0
            raise item
        if item.finish_reason is not None:
            self._pending -= 1
        return item

    def ready(self) -> list[CompletionDelta]:
        """The deltas already queued, in order, taken without waiting: what ``__anext__`` would
        return next without suspending (up to an error, which the next ``__anext__`` raises; none
        once every choice has finished). Lets a stream write a step's deltas, or a backlog, at once."""
        out: list[CompletionDelta] = []
        q = self.queue
        while self._pending > 0 and self._error is None and not q.empty():
            item = q.get_nowait()
            if isinstance(item, BaseException):
                self._error = item
                break
            if item.finish_reason is not None:
                self._pending -= 1
            out.append(item)
        return out

    async def collect(self) -> list[CompletionOutput]:
        """Wait for every choice; returns their CompletionOutputs in choice order."""
        async for _ in self:
            pass
        return [st.result() for st in self.states]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.client._close(self)


class EngineClient:
    """Owns the engine-core process and the ZMQ pipes; see the module docstring.

    Attributes after ``start``: ``info`` (CoreReady: vocab_size, context_length, kv_slots, dtype,
    load_seconds, ...), ``tokenizer``, ``limit_tokens`` = min(context_length, kv_slots), the most
    tokens (prompt + output) any request can have; pinned prefixes lower it (``limits``).
    ``max_inflight``: engine requests (choices) admitted
    at once = max_running_requests + max_queued_requests (so at most max_queued_requests wait while
    the running batch is full); ``submit`` beyond it raises Overloaded (the server's 503).
    """

    def __init__(self, config: EngineConfig, metrics=None):
        self.config = config
        self.metrics = metrics
        self.info: Optional[CoreReady] = None
        self.tokenizer: Optional[Tokenizer] = None
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.dead = False
        self.stopping = False
        self.draining = False
        self.on_death: Optional[Callable[[], None]] = None
        self.max_inflight = config.max_running_requests + config.max_queued_requests
        self.num_inflight = 0  # unfinished engine requests admitted by this frontend
        self._tracks: dict[str, _Track] = {}
        self._subs: set[Submission] = set()
        self._calls: dict[int, asyncio.Future] = {}
        self._pins: dict[str, tuple[int, float]] = {}  # pin id -> (tokens, expiry in time.monotonic() s)
        self._call_ids = itertools.count(1)
        self._last_heard = 0.0
        self._tasks: list[asyncio.Task] = []
        self._tmpdir = tempfile.mkdtemp(prefix="idleless-zmq-")
        self._in_addr = f"ipc://{self._tmpdir}/to-core"
        self._out_addr = f"ipc://{self._tmpdir}/from-core"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self._in_addr)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._out_addr)

    # -- start / stop --------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, metrics=None, startup_timeout: float = 1800.0,
                    core_main: Callable[[EngineConfig, str, str], None] = run_engine_core) -> "EngineClient":
        """Resolve the model, spawn the engine core, load the tokenizer meanwhile, wait for CoreReady.

        ``core_main(config, in_addr, out_addr)`` is the core process's entry point (a module-level
        function, since it is spawned): ``run_engine_core``, or a stand-in speaking the same messages
        (``idleless.bench.stream_cost`` replays tokens to measure the frontend alone).
        Raises FileNotFoundError / ValueError (bad model), RuntimeError (the core failed to start;
        its message and traceback are logged)."""
        from idleless.model.loader import load_model_config, native_weight_dtype, prepare_model_dir

        self = cls(config, metrics)
        try:
            model_dir = await asyncio.to_thread(prepare_model_dir, config.model)
            mc = await asyncio.to_thread(load_model_config, model_dir)
            # --weight-dtype auto is the checkpoint's own format: decided from the file the user named
            # (the bundled GGUF: its Q4_1 blocks), before the core gets the converted directory.
            weight_dtype = config.weight_dtype
            if weight_dtype == "auto":
                weight_dtype = await asyncio.to_thread(native_weight_dtype, config.model) or "auto"
            # The frontend admits at most max_inflight requests, so the scheduler's own waiting-queue
            # check (which sees a burst of adds before its first step) is widened to never refuse them.
            core_config = replace(config, model=model_dir, weight_dtype=weight_dtype,
                                  max_queued_requests=self.max_inflight)
            ctx = multiprocessing.get_context("spawn")
            self.proc = ctx.Process(target=core_main, name="idleless-engine-core", daemon=True,
                                    args=(core_config, self._in_addr, self._out_addr))
            self.proc.start()
            tok_task = asyncio.ensure_future(asyncio.to_thread(
                Tokenizer.load, config.tokenizer or model_dir, extra_eos_ids=mc.eos_token_ids))
            self.info = await self._wait_ready(startup_timeout)
            self.tokenizer = await tok_task
            self._tasks = [asyncio.create_task(self._read_loop(), name="engine-reader"),
                           asyncio.create_task(self._watchdog(), name="engine-watchdog")]
            extra = sorted(set(self.tokenizer.eos_token_ids) - set(self.info.eos_token_ids))
            if extra:
                await self.call(AddEosIds(tuple(extra)), timeout=60)
            return self
        except BaseException:
            await self.shutdown(timeout=5)
            raise

    async def _wait_ready(self, timeout: float) -> CoreReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._pull.poll(250):
                msgs = pickle.loads(await self._pull.recv())
                for m in msgs:
                    if isinstance(m, CoreReady):
                        return m
                    if isinstance(m, CoreFailed):
                        log.error("engine core failed to start:\n%s", m.traceback)
                        raise RuntimeError(f"the engine core failed to start: {m.message}")
            elif not self.proc.is_alive():
                raise RuntimeError(f"the engine core exited during start-up (exit code {self.proc.exitcode})")
        raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (a ``Shutdown`` call, then SIGKILL if it lingers: it ignores SIGTERM) and close
        the pipes. Idempotent. In-flight submissions get EngineDeadError."""
        if self.stopping and self.proc is None:
            return
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.is_alive() and self.info is not None and not self.dead:
            try:
                await self.call(Shutdown(), timeout=timeout)
            except Exception:  # noqa: BLE001
                pass
        if proc is not None and proc.pid is not None:  # pid None: start() itself failed, nothing to join
            await asyncio.to_thread(proc.join, timeout)
            if proc.is_alive():
                log.warning("engine core did not exit; killing it")
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self.proc = None
        self._fail_all(EngineDeadError("the server is shutting down"))
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001
                pass
        self._tasks = []
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -- messages ------------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        if self.dead:
            raise EngineDeadError("the engine core is not running")
        try:
            self._push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
        except zmq.Again as e:
            raise EngineDeadError("the engine core does not accept messages") from e

    async def _read_loop(self) -> None:
        while True:
            self._dispatch(await self._pull.recv())

    def _dispatch(self, data: bytes) -> None:
        """Unpickle one message of the core (a list of outputs and replies) and route each."""
        self._last_heard = time.monotonic()
        try:
            msgs = pickle.loads(data)
        except Exception:  # noqa: BLE001
            log.exception("undecodable message from the engine core")
            return
        for m in msgs:
            try:
                if isinstance(m, RequestOutput):
                    self._route(m)
                elif isinstance(m, ControlReply):
                    fut = self._calls.pop(m.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(m)
            except Exception:  # noqa: BLE001 - one bad output must not stop routing
                log.exception("error routing %r", m)

    def _route(self, out: RequestOutput) -> None:
        tr = self._tracks.get(out.rid)
        if tr is None:
            return  # the client left, or a stop string ended it already
        now = time.monotonic()
        if isinstance(out, ErrorOutput):
            tr.sub.errors[tr.state.index] = (out.code, out.param)
        if out.new_token_ids and self.metrics is not None:
            if tr.last_token is None:
                self.metrics.observe_ttft(now - tr.arrival)
            else:
                self.metrics.observe_itl((now - tr.last_token) / len(out.new_token_ids), len(out.new_token_ids))
        if out.new_token_ids:
            tr.last_token = now
        delta, abort = tr.state.process(out)
        if abort:
            try:
                self._send(AbortRequest(out.rid, stopped=True))  # a stop string ended it
            except EngineDeadError:
                pass
        if delta is not None:
            tr.sub.queue.put_nowait(delta)
        if tr.state.finished:
            self._untrack(out.rid, tr, now)

    def _untrack(self, rid: str, tr: _Track, now: float) -> None:
        self._tracks.pop(rid, None)
        self.num_inflight -= 1
        if self.metrics is not None:
            st = tr.state
            self.metrics.observe_finished(st.finish_reason or "abort", st.prompt_tokens, st.cached_tokens,
                                          len(st.token_ids), now - tr.arrival)
            self.metrics.set_inflight(self.num_inflight)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if self.stopping:
                return
            if self.proc is not None and not self.proc.is_alive():
                self._on_core_death()
                return

    def _on_core_death(self) -> None:
        code = self.proc.exitcode if self.proc is not None else None
        log.error("the engine core process died (exit code %s); failing %d in-flight request(s)", code,
                  len(self._tracks))
        self.dead = True
        self._fail_all(EngineDeadError(f"the engine core process died (exit code {code})"))
        if self.on_death is not None:
            self.on_death()

    def _fail_all(self, err: BaseException) -> None:
        for sub in list(self._subs):
            sub.queue.put_nowait(err)
        self._subs.clear()
        self._tracks.clear()
        self.num_inflight = 0
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(str(err)))
        self._calls.clear()

    # -- requests ------------------------------------------------------------------------------
    @property
    def limit_tokens(self) -> int:
        return min(self.info.context_length, self.info.kv_slots)

    @property
    def pinned_tokens(self) -> int:
        """Tokens pinned through this client and not yet expired, unpinned or flushed."""
        now = time.monotonic()
        for pin_id in [p for p, (_, until) in self._pins.items() if until <= now]:
            del self._pins[pin_id]
        return sum(n for n, _ in self._pins.values())

    @property
    def limits(self) -> AdmissionLimits:
        """The engine's admission limits as this frontend knows them (pins included)."""
        info = self.info
        return AdmissionLimits(info.vocab_size, info.context_length, info.kv_slots, self.pinned_tokens)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The engine's own admission rule (``idleless.engine.admission.check_request``), checked here
        so nothing doomed is sent. Returns the effective max_new_tokens; raises RequestError."""
        return check_request(prompt_ids, params, self.limits)

    def submit(self, prompts: list[list[int]], params: SamplingParams, priority: int = 0,
               kv_transfer_params: Optional[dict] = None) -> Submission:
        """Queue ``params.n`` engine requests per prompt (``idleless.text.output.fan_out``, as the
        offline Engine does). ``priority``: higher is admitted first and retracted last (the engine's
        ``Request.priority``; every scheduling policy orders by it first). ``kv_transfer_params``: the
        engine's (prefill/decode disaggregation, ``idleless.disagg``). All or nothing. Raises
        RequestError (check_request, first),
        EngineDeadError, Overloaded (in-flight limit, or draining after SIGTERM)."""
        if self.dead or self.stopping:
            raise EngineDeadError("the engine core is not running")
        if self.draining:
            raise Overloaded("the server is shutting down")
        for ids in prompts:
            self.check_request(ids, params)
        n = params.n
        count = len(prompts) * n
        if count > self.max_inflight:  # could never be admitted: retrying is pointless, so not a 503
            raise RequestError(f"{len(prompts)} prompt(s) x n={n} = {count} sequences, more than the server ever "
                               f"runs at once ({self.max_inflight}: --max-running-requests + --max-queued-requests)",
                               param="n" if n > 1 else "prompt", code="invalid_value")
        if self.num_inflight + count > self.max_inflight:
            raise Overloaded(f"{self.num_inflight} requests in flight; the limit is {self.max_inflight} "
                             f"(--max-running-requests + --max-queued-requests)")
        now = time.monotonic()
        choices = fan_out(uuid.uuid4().hex[:16], prompts, params, self.tokenizer, priority, kv_transfer_params)
        sub = Submission(self, [st for st, _ in choices], now)
        for st, _ in choices:
            self._tracks[st.rid] = _Track(st, sub, now)
        self._subs.add(sub)
        self.num_inflight += count
        try:
            for _, req in choices:
                self._send(AddRequest(req))
        except EngineDeadError:
            sub.close()
            raise
        if self.metrics is not None:
            self.metrics.set_inflight(self.num_inflight)
        return sub

    def _close(self, sub: Submission) -> None:
        self._subs.discard(sub)
        now = time.monotonic()
        for st in sub.states:
            tr = self._tracks.get(st.rid)
            if tr is None:
                continue
            if not self.dead:
                try:
                    self._send(AbortRequest(st.rid))
                except EngineDeadError:
                    pass
            st.finish_reason = st.finish_reason or "abort"
            self._untrack(st.rid, tr, now)

    # -- control calls -------------------------------------------------------------------------
    async def call(self, verb: ControlVerb, timeout: float = 10.0) -> Any:
        """Send one control verb (``idleless.engine.messages``: Ping, GetStats, FlushCache, PinPrefix,
        ...) and return its result. Raises EngineDeadError, asyncio.TimeoutError, CallRefused (the
        engine declined), CallFailed (unknown verb or an error inside the engine)."""
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(ControlCall(call_id, verb))
            reply: ControlReply = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if not reply.ok:
            raise (CallRefused if reply.code == "refused" else CallFailed)(reply.error)
        return reply.result

    async def flush_cache(self, timeout: float = 30.0) -> bool:
        """Empty the engine's prefix cache, pins included; False while requests run or wait."""
        ok = await self.call(FlushCache(), timeout=timeout)
        if ok:
            self.forget_pins()
        return ok

    def forget_pins(self) -> None:
        """The engine's prefix cache was emptied (a flush, a weight update that flushed it): its pins
        are gone, so the frontend's account of pinned tokens starts again from zero."""
        self._pins.clear()

    async def pin_prefix(self, input_ids: list[int], ttl_s: float, pin_id: Optional[str] = None,
                         timeout: float = 600.0) -> tuple[str, int]:
        """Pin ``input_ids``' KV in the engine's prefix cache for ``ttl_s`` seconds (prefilled first
        when not cached, so this may take a step or several). Returns (pin id, tokens pinned: the ids
        cut to whole KV pages); the pin counts against ``limits`` until it expires or is unpinned.
        Raises RequestError (the ids are not a servable prompt: ``check_request``'s rule, or ttl_s
        <= 0), CallRefused (prefix cache disabled, pinned budget exceeded), EngineDeadError."""
        if not (isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool) and 0 < ttl_s < float("inf")):
            raise RequestError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}", param="ttl_s",
                               code="invalid_value")
        self.check_request(input_ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        pin_id = pin_id or uuid.uuid4().hex[:16]
        tokens = await self.call(PinPrefix(tuple(input_ids), float(ttl_s), pin_id), timeout=timeout)
        self._pins[pin_id] = (int(tokens), time.monotonic() + float(ttl_s))
        return pin_id, int(tokens)

    async def unpin_prefix(self, pin_id: str, timeout: float = 10.0) -> bool:
        """Release a pin early; False if the engine does not know ``pin_id`` (expired, flushed, never made)."""
        found = await self.call(UnpinPrefix(pin_id), timeout=timeout)
        self._pins.pop(pin_id, None)
        return found

    async def healthy(self, timeout: float = 5.0) -> bool:
        """True when the core answers: it sent something in the last second, or answers a ping
        within ``timeout`` s (a ping waits for the current step to end)."""
        if self.dead or self.stopping or self.proc is None or not self.proc.is_alive():
            return False
        if time.monotonic() - self._last_heard < 1.0:
            return True
        try:
            await self.call(Ping(), timeout=timeout)
            return True
        except Exception:  # noqa: BLE001
            return False
