"""Frontend-side request state: engine token deltas -> text deltas and final outputs.

Used alike by the offline ``Engine`` and the HTTP server: ``fan_out`` turns prompts with ``n``
choices into engine requests, and each choice's ``RequestState`` consumes the ``RequestOutput``
messages of its request, detokenizes incrementally, applies stop strings (asking the caller to abort
the engine request when one matches) and keeps the usage counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from idleless.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from idleless.text.tokenizer import TextStream, Tokenizer


@dataclass
class CompletionDelta:
    """One streamed piece of a request: new text and the token ids whose text it is.

    ``token_ids`` (and ``logprobs`` / ``top_logprobs``, one entry per id) are exactly the ids
    whose text ``text`` carries: ids whose text is held back (an unfinished UTF-8 character, a
    possible stop-string prefix) come with it in a later delta, so the deltas of a choice add up
    to its ``CompletionOutput`` entry for entry. The last delta may carry the stop token (an eos
    id or a ``stop_token_ids`` entry), whose text is not in the output (``TextStream``).
    finish_reason is set on the last delta ("stop", "length" or "abort"); matched_stop is the
    stop string or stop token id that ended it. Token counts are totals so far. ``weight_versions``:
    the engine's weight version that sampled each id (``RequestOutput.weight_version``)."""

    rid: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[int | str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None
    weight_versions: list[str] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """A finished request: its text, token ids, finish_reason, usage, and logprobs when asked.

    ``token_ids`` are the generated ids up to the one that ended the request: the stop token
    (kept, as vLLM does, though its text is not in ``text`` unless include_stop_str_in_output) or
    the id whose text completed a stop string (ids sampled after it are dropped)."""

    rid: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    matched_stop: Optional[int | str]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_token_ids: list[int] = field(default_factory=list)
    # with params.prompt_logprobs: engine.request.PromptLogprob per prompt position from
    # params.prompt_logprobs_start (None at position 0), as vLLM's RequestOutput.prompt_logprobs
    prompt_logprobs: Optional[list] = None
    error: Optional[str] = None
    # with speculative decoding: the proposed tokens accepted at each verify step ([] without)
    accepted_per_verify: list[int] = field(default_factory=list)
    # the engine's weight version that sampled each token id (RL rollouts spanning a weight update)
    weight_versions: list[str] = field(default_factory=list)


class RequestState:
    """Text state of one engine request (one choice). ``process(out)`` returns the delta to hand
    to the user (None if nothing new) and whether the engine request must now be aborted (a stop
    string matched). Messages after the request finished are ignored. The output rules (stop
    token text, stop strings, min_new_tokens) are ``TextStream``'s."""

    def __init__(self, rid: str, index: int, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.rid = rid
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = TextStream(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                 params.skip_special_tokens, params.min_new_tokens)
        # logprobs of every id received, in order (the output keeps the first len(token_ids))
        self._logprobs: Optional[list[float]] = [] if (params.logprobs or params.top_logprobs) else None
        self._top_logprobs: Optional[list] = [] if params.top_logprobs else None
        self._versions: list[Optional[str]] = []  # the weight version of every id received, in order
        self._sent = 0  # ids handed out in deltas
        self.finish_reason: Optional[str] = None
        self.matched_stop: Optional[int | str] = None
        self.error: Optional[str] = None
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.prompt_logprobs: Optional[list] = None  # the engine's entries, once they arrive
        self.accepted_per_verify: list[int] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """The output's token ids so far (``TextStream.output_ids``; do not modify)."""
        return self.stream.output_ids

    def process(self, out: RequestOutput) -> tuple[Optional[CompletionDelta], bool]:
        if self.finished:
            return None, False
        self.cached_tokens = out.cached_tokens
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.accepted_per_verify is not None:
            self.accepted_per_verify = list(out.accepted_per_verify)
        new_ids = list(out.new_token_ids)
        self._versions += [out.weight_version] * len(new_ids)
        if self._logprobs is not None and out.new_logprobs:
            self._logprobs += out.new_logprobs
        if self._top_logprobs is not None and out.new_top_logprobs:
            self._top_logprobs += out.new_top_logprobs
        # The engine reports the id that ended the request as matched_stop (an eos or stop token id).
        stop_token = bool(new_ids) and out.finish_reason == FinishReason.STOP and \
            isinstance(out.matched_stop, int) and new_ids[-1] == out.matched_stop
        text, matched = self.stream.feed(new_ids, stop_token) if new_ids else ("", None)
        abort = False
        if matched is not None:
            self.finish_reason, self.matched_stop = FinishReason.STOP.value, matched
            abort = not out.finished
        elif out.finished:
            text += self.stream.finish()
            if self.stream.matched_stop is not None:
                self.finish_reason, self.matched_stop = FinishReason.STOP.value, self.stream.matched_stop
            else:
                self.finish_reason = FinishReason(out.finish_reason).value
                self.matched_stop = out.matched_stop
            self.error = out.error
        a, b = self._sent, self.stream.num_released
        self._sent = b
        if not text and a == b and not self.finished:
            return None, abort
        delta = CompletionDelta(
            rid=self.rid, index=self.index, text=text, token_ids=self.token_ids[a:b],
            logprobs=self._logprobs[a:b] if self._logprobs is not None else None,
            top_logprobs=self._top_logprobs[a:b] if self._top_logprobs is not None else None,
            finish_reason=self.finish_reason, matched_stop=self.matched_stop,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=len(self.token_ids), error=self.error, weight_versions=self._versions[a:b])
        return delta, abort

    def result(self) -> CompletionOutput:
        n = len(self.token_ids)
        return CompletionOutput(
            rid=self.rid, index=self.index, text=self.stream.text, token_ids=list(self.token_ids),
            finish_reason=self.finish_reason, matched_stop=self.matched_stop,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=n,
            logprobs=self._logprobs[:n] if self._logprobs is not None else None,
            top_logprobs=self._top_logprobs[:n] if self._top_logprobs is not None else None,
            prompt_token_ids=list(self.prompt_ids), prompt_logprobs=self.prompt_logprobs, error=self.error,
            accepted_per_verify=list(self.accepted_per_verify), weight_versions=self._versions[:n])


def fan_out(base: str, prompts: Sequence[Sequence[int]], params: SamplingParams, tokenizer: Tokenizer,
            priority: int = 0, kv_transfer_params: Optional[dict] = None) -> list[tuple[RequestState, Request]]:
    """The engine requests of one call: ``params.n`` choices per prompt, each its own request.
    ``kv_transfer_params`` (prefill/decode disaggregation) goes on every request.

    Choice i of prompt p gets rid ``f"{base}-{p}-{i}"``, index ``p * n + i`` (OpenAI's numbering of
    choices over a list of prompts) and a copy of ``params`` with ``n = 1`` and ``seed + i`` (when
    seeded, so choices differ yet each is reproducible). Returns (state, request) pairs in index
    order; nothing is sent or queued here."""
    n = params.n
    out: list[tuple[RequestState, Request]] = []
    for pi, ids in enumerate(prompts):
        for i in range(n):
            p = replace(params, n=1, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                        seed=None if params.seed is None else params.seed + i)
            rid = f"{base}-{pi}-{i}"
            out.append((RequestState(rid, pi * n + i, tokenizer, list(ids), p),
                        Request(rid, list(ids), p, priority=int(priority), kv_transfer_params=kv_transfer_params)))
    return out
