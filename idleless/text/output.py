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
    """One streamed piece of a request: new text and token ids since the previous delta.

    finish_reason is set on the last delta ("stop", "length" or "abort"); matched_stop is the
    stop string or stop token id that ended it. Token counts are totals so far."""

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


@dataclass
class CompletionOutput:
    """A finished request: its text, token ids, finish_reason, usage, and logprobs when asked."""

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


class RequestState:
    """Text state of one engine request (one choice). ``process(out)`` returns the delta to hand
    to the user (None if nothing new) and whether the engine request must now be aborted (a stop
    string matched). Messages after the request finished are ignored."""

    def __init__(self, rid: str, index: int, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.rid = rid
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = TextStream(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                 params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[float]] = [] if (params.logprobs or params.top_logprobs) else None
        self.top_logprobs: Optional[list] = [] if params.top_logprobs else None
        self.finish_reason: Optional[str] = None
        self.matched_stop: Optional[int | str] = None
        self.error: Optional[str] = None
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.prompt_logprobs: Optional[list] = None  # the engine's entries, once they arrive

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: RequestOutput) -> tuple[Optional[CompletionDelta], bool]:
        if self.finished:
            return None, False
        self.cached_tokens = out.cached_tokens
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        new_ids = list(out.new_token_ids)
        text, matched = self.stream.feed(new_ids) if new_ids else ("", None)
        self.token_ids += new_ids
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs += out.new_logprobs
        if self.top_logprobs is not None and out.new_top_logprobs:
            self.top_logprobs += out.new_top_logprobs
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
        if not text and not new_ids and not self.finished:
            return None, abort
        delta = CompletionDelta(
            rid=self.rid, index=self.index, text=text, token_ids=new_ids,
            logprobs=out.new_logprobs if self.logprobs is not None else None,
            top_logprobs=out.new_top_logprobs if self.top_logprobs is not None else None,
            finish_reason=self.finish_reason, matched_stop=self.matched_stop,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=len(self.token_ids), error=self.error)
        return delta, abort

    def result(self) -> CompletionOutput:
        return CompletionOutput(
            rid=self.rid, index=self.index, text=self.stream.text, token_ids=list(self.token_ids),
            finish_reason=self.finish_reason, matched_stop=self.matched_stop,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=len(self.token_ids), logprobs=self.logprobs, top_logprobs=self.top_logprobs,
            prompt_token_ids=list(self.prompt_ids), prompt_logprobs=self.prompt_logprobs, error=self.error)


def fan_out(base: str, prompts: Sequence[Sequence[int]], params: SamplingParams, tokenizer: Tokenizer,
            priority: int = 0) -> list[tuple[RequestState, Request]]:
    """The engine requests of one call: ``params.n`` choices per prompt, each its own request.

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
                        Request(rid, list(ids), p, priority=int(priority))))
    return out
