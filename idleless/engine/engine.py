"""Offline ``Engine``: the engine core in-process, with the text layer in front.

    from idleless import Engine, SamplingParams
    engine = Engine()                                   # the bundled SmolLM2-135M-Instruct
    out = engine.generate("The capital of France is", SamplingParams(max_new_tokens=8))
    print(out.text)

``generate`` takes text prompts, token-id lists or chat message lists, one or many, and blocks.
With ``SamplingParams(prompt_logprobs=k)`` each ``CompletionOutput.prompt_logprobs`` is vLLM's list:
None for the first prompt token, then an ``idleless.engine.request.PromptLogprob`` (token_id,
logprob, rank, top k) per prompt token; ``max_new_tokens=0`` scores a text without generating.
``generate_stream`` is an async generator of ``CompletionDelta`` for one prompt. Both may be used
at once: whichever thread steps the engine dispatches outputs to their owners.

Weights are replaced in place with SGLang's calls (``update_weights_from_tensor`` with (name, tensor)
pairs, ``update_weights_from_disk``, the ``*_weights_update_group`` trio and
``update_weights_from_distributed``; ``get_weight_version``), checked first and written between steps
(``idleless.rl``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, NamedTuple, Optional, Sequence, Union

from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.messages import (DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, UpdateWeightsFromDisk,
                                      UpdateWeightsFromDistributed)
from idleless.engine.request import FinishReason, RequestError, RequestOutput, SamplingParams
from idleless.rl.control import PendingUpdate, WeightControl
from idleless.text.output import CompletionDelta, CompletionOutput, RequestState, fan_out
from idleless.telemetry.timing import LoopReporter
from idleless.text.tokenizer import Tokenizer

Prompt = Union[str, list[int], list[dict]]


class PinnedPrefix(NamedTuple):
    """What ``Engine.pin_prefix`` pinned: the pin's id (for ``unpin_prefix``) and its tokens."""

    pin_id: str
    num_tokens: int


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, (list, tuple)) and prompts:
        return all(isinstance(p, int) and not isinstance(p, bool) for p in prompts) or \
            all(isinstance(p, dict) for p in prompts)
    return False


class Engine:
    """Load a model and serve requests in-process. Keyword arguments are ``EngineConfig`` fields.

    Raises FileNotFoundError / ValueError when the model cannot be loaded."""

    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            config = replace(config, **kwargs)
        self.config = config
        self.core = EngineCore(config)
        mc = self.core.runner.model_config
        self.tokenizer = Tokenizer.load(config.tokenizer or self.core.runner.model_dir,
                                        extra_eos_ids=mc.eos_token_ids)
        self.core.add_eos_ids(self.tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._handlers: dict[str, Callable[[RequestOutput], None]] = {}
        self._wake = threading.Event()
        self._loop_thread: Optional[threading.Thread] = None
        self._reporter = LoopReporter()
        self.weights = WeightControl(self.core)
        self.core.scheduler.clock.reset()  # account from the end of loading

    # -- prompts -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Text -> ids with the tokenizer (chat=True wraps it as one user message and applies the
        chat template); a list of ids is taken as is; a list of message dicts gets the chat
        template. Raises RequestError for anything else."""
        if isinstance(prompt, str):
            try:
                if chat:
                    return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                return self.tokenizer.encode(prompt)
            except ValueError as e:  # not valid Unicode
                raise RequestError(str(e), param="prompt") from e
        if isinstance(prompt, (list, tuple)):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            if all(isinstance(m, dict) for m in prompt):
                try:
                    return self.tokenizer.apply_chat_template(list(prompt))
                except (ValueError, KeyError, TypeError) as e:
                    raise RequestError(f"bad chat messages: {e}", param="messages") from e
        raise RequestError(f"a prompt must be a string, a list of token ids or a list of chat messages, "
                           f"got {type(prompt).__name__}", param="prompt")

    def _submit(self, prompt_ids: list[int], params: SamplingParams, handler_for, priority: int = 0) -> list[RequestState]:
        """Queue the n choices of one prompt (``idleless.text.output.fan_out``, as the server does);
        all or none (RequestError leaves nothing queued). ``priority``: higher goes first in every
        schedule policy and is retracted last."""
        choices = fan_out(uuid.uuid4().hex[:12], [prompt_ids], params, self.tokenizer, priority)
        queued: list[RequestState] = []
        with self._lock:
            try:
                for st, req in choices:
                    self._handlers[st.rid] = handler_for(st)
                    self.core.add_request(req)
                    queued.append(st)
            except Exception:
                for st in queued:
                    self.core.abort(st.rid)
                for st, _ in choices:
                    self._handlers.pop(st.rid, None)
                raise
        self._wake.set()
        return queued

    # -- stepping ----------------------------------------------------------------------------
    def _step_once(self) -> bool:
        with self._lock:
            clock = self.core.scheduler.clock
            if not self.core.has_work():
                clock.mark("idle_no_work")
                return False
            clock.mark("io")  # submissions and the caller's own work since the last step
            outs = self.core.step()
            for out in outs:
                h = self._handlers.get(out.rid)
                if h is not None:
                    h(out)
                if out.finished:
                    self._handlers.pop(out.rid, None)
            clock.mark("other")
            self._reporter.maybe_log(self.core.scheduler)
        return True

    def _sync_handler(self, st: RequestState):
        def handle(out: RequestOutput):
            _, abort = st.process(out)
            if abort:  # a stop string ended it: finished, not aborted
                self.core.abort(st.rid, FinishReason.STOP)  # called while holding the lock, inside _step_once
        return handle

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, chat: bool = False, priority: Union[int, Sequence[int]] = 0
                 ) -> Union[CompletionOutput, list[CompletionOutput], list[list[CompletionOutput]]]:
        """Run prompts to completion. One prompt -> one CompletionOutput (a list of n when n > 1);
        many -> a list of those, in order. ``priority``: one int or one per prompt (higher is
        admitted first and retracted last; default 0). Raises RequestError (nothing runs) if any
        prompt or parameter is invalid."""
        single = _is_single(prompts)
        plist = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(plist):
                raise ValueError("sampling_params must be one SamplingParams or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(plist)
        if isinstance(priority, (list, tuple)):
            if len(priority) != len(plist):
                raise ValueError("priority must be one int or one per prompt")
            priorities = [int(p) for p in priority]
        else:
            priorities = [int(priority)] * len(plist)
        encoded = [self.encode_prompt(p, chat) for p in plist]
        groups: list[list[RequestState]] = []
        try:
            for ids, sp, prio in zip(encoded, params, priorities):
                groups.append(self._submit(ids, sp, self._sync_handler, prio))
        except Exception:
            with self._lock:
                for g in groups:
                    for st in g:
                        self.core.abort(st.rid)
                        self._handlers.pop(st.rid, None)
            raise
        bar = None
        if use_tqdm and len(plist) > 1:
            from tqdm import tqdm
            bar = tqdm(total=sum(len(g) for g in groups), desc="generate", unit="req")
        pending = [st for g in groups for st in g]
        while pending:
            self._step_once()
            still = [st for st in pending if not st.finished]
            if bar is not None:
                bar.update(len(pending) - len(still))
            pending = still
            if pending and not self.core.has_work():  # another thread stepped our last outputs
                self._wake.wait(0.001)
        if bar is not None:
            bar.close()
        results = [[st.result() for st in g] for g in groups]
        results = [r[0] if len(r) == 1 else r for r in results]
        return results[0] if single else results

    # -- async streaming ---------------------------------------------------------------------
    def _ensure_loop_thread(self) -> None:
        if self._loop_thread is None or not self._loop_thread.is_alive():
            self._loop_thread = threading.Thread(target=self._run_loop, name="idleless-engine", daemon=True)
            self._loop_thread.start()

    def _run_loop(self) -> None:
        while True:
            if not self._step_once():
                self._wake.wait(0.05)
                self._wake.clear()
            else:
                # let a thread waiting on the lock (a submit, a consumer's abort) take it: a lock is not
                # fair, and re-taking it at once starved an abort for seconds, past its request's end
                time.sleep(0)

    async def generate_stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                              chat: bool = False, priority: int = 0) -> AsyncIterator[CompletionDelta]:
        """Stream deltas of one prompt (n choices interleaved, told apart by ``delta.index``).
        Cancelling the consumer aborts the request. Raises RequestError before the first delta."""
        params = sampling_params or SamplingParams()
        ids = self.encode_prompt(prompt, chat)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def handler_for(st: RequestState):
            def handle(out: RequestOutput):
                delta, abort = st.process(out)
                if abort:  # a stop string ended it
                    self.core.abort(st.rid, FinishReason.STOP)
                if delta is not None:
                    loop.call_soon_threadsafe(queue.put_nowait, delta)
            return handle

        states = self._submit(ids, params, handler_for, priority)
        self._ensure_loop_thread()
        try:
            # Each choice ends with exactly one delta carrying its finish_reason; count those rather
            # than reading st.finished, which the engine thread sets before the delta is queued.
            done = 0
            while done < len(states):
                delta = await queue.get()
                if delta.finish_reason is not None:
                    done += 1
                yield delta
        finally:
            unfinished = [st for st in states if not st.finished]
            if unfinished:
                with self._lock:
                    for st in unfinished:
                        self.core.abort(st.rid)
                        self._handlers.pop(st.rid, None)

    # -- admin -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Engine totals: requests, prompt/cached/computed/generated tokens, hit rate, KV usage
        (tokens: total, free, cached, in_use), retractions, steps, forward and schedule seconds."""
        with self._lock:
            return self.core.stats()

    def pin_prefix(self, prompt: Prompt, ttl: float = 600.0, pin_id: Optional[str] = None,
                   chat: bool = False) -> "PinnedPrefix":
        """Keep ``prompt``'s KV in the prefix cache for ``ttl`` seconds (prefilling it first if it is
        not cached). ``pin_id`` names the pin (re-pinning an id replaces its pin; default: a new id).
        Returns ``PinnedPrefix(pin_id, num_tokens)``: the id to pass to ``unpin_prefix`` and the tokens
        pinned. Raises RequestError if the prefix cache is off, the pinned budget
        (``max_pinned_tokens``) would be exceeded, the prompt is empty, invalid or too long, or ``ttl``
        is not a finite number of seconds > 0 (all checked before any prefill)."""
        ids = self.encode_prompt(prompt, chat)
        pin_id = pin_id or uuid.uuid4().hex[:12]
        result: dict = {}

        def done(n, err):
            result["n"], result["err"] = n, err

        with self._lock:
            self.core.pin_prefix(pin_id, ids, ttl, done)
        self._wake.set()
        while not result:
            if not self._step_once():
                self._wake.wait(0.001)
        if result["err"]:
            raise RequestError(result["err"], param="prompt")
        return PinnedPrefix(pin_id, result["n"])

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pin early; False if unknown."""
        with self._lock:
            return self.core.unpin_prefix(pin_id)

    def flush_cache(self) -> bool:
        """Empty the radix cache (False while requests run)."""
        with self._lock:
            return self.core.flush_cache()

    # -- weight updates (idleless.rl) --------------------------------------------------------
    def get_weight_version(self) -> str:
        """The weights' version label: "default" until an update names one."""
        return self.weights.weight_version

    def update_weights_from_tensor(self, named_tensors, weight_version: Optional[str] = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Write (HF name, tensor) pairs into the served model (a subset of the weights is fine; any
        floating dtype and device, cast on the write). Checked first: raises WeightUpdateError
        (a RequestError) for an unknown name, a name twice, a non-float tensor or another shape, and
        nothing is written. Then written between steps: with ``flush_cache`` (default) once no request
        runs (the requests already queued finish first on the old weights, unless
        ``abort_all_requests`` ends them with finish_reason ``abort``) and the prefix cache is emptied;
        with ``flush_cache=False`` at once, the cache kept. Returns ``UpdateResult.as_dict()``
        (success, weight_version, num_tensors, flushed_cache, num_aborted_requests, seconds)."""
        with self._lock:
            pending = self.weights.check(list(named_tensors), False, flush_cache, weight_version)
        return self._commit_update(pending, abort_all_requests)

    def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                 flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Replace every weight with the checkpoint at ``model_path`` (an HF directory or GGUF file of
        the same model shape), as ``update_weights_from_tensor`` otherwise. Raises WeightUpdateError
        for an unreadable path, another shape, or a missing, unknown or misshapen tensor."""
        verb = UpdateWeightsFromDisk(model_path, weight_version, flush_cache, abort_all_requests)
        with self._lock:
            pending = self.weights.prepare(verb)
        return self._commit_update(pending, abort_all_requests)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weights_update_group", backend: str = "gloo",
                                  timeout_s: float = 300.0) -> bool:
        """Join a trainer's weights-update group as rank ``rank_offset`` (the trainer is rank 0 and
        hosts the store at master_address:master_port); blocks until all ranks joined. Raises
        WeightUpdateError when the rendezvous fails or a group is joined already."""
        with self._lock:
            return self.weights.init_group(InitWeightsUpdateGroup(master_address, master_port, rank_offset,
                                                                  world_size, group_name, backend, timeout_s))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = "weights_update_group",
                                        weight_version: Optional[str] = None, flush_cache: bool = True,
                                        abort_all_requests: bool = False) -> dict:
        """Receive one broadcast from the trainer's rank 0 per name (dtype name, shape), then update as
        ``update_weights_from_tensor``. Raises WeightUpdateError when the broadcast fails (the group
        is dropped) or the tensors do not fit."""
        verb = UpdateWeightsFromDistributed(names, dtypes, shapes, group_name, weight_version, flush_cache,
                                            abort_all_requests)
        with self._lock:
            pending = self.weights.prepare(verb)
        return self._commit_update(pending, abort_all_requests)

    def destroy_weights_update_group(self, group_name: str = "weights_update_group") -> bool:
        """Leave the weights-update group; WeightUpdateError if no such group is joined."""
        with self._lock:
            return self.weights.destroy_group(DestroyWeightsUpdateGroup(group_name))

    def _commit_update(self, pending: PendingUpdate, abort_all_requests: bool) -> dict:
        with self._lock:
            if abort_all_requests:
                pending.num_aborted = self.weights.updater.abort_all()
        while True:
            with self._lock:
                if not pending.flush_cache or not self.core.has_work():
                    return self.weights.commit(pending).as_dict()
            if not self._step_once():
                self._wake.wait(0.001)
