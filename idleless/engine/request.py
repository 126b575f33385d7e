"""Requests, sampling parameters and outputs: the messages between frontend and engine core.

The engine core only sees token ids; text (prompts, stop strings, detokenization) lives in the
frontend (``idleless.text``). Everything here is a plain dataclass so it pickles over ZMQ.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional


class FinishReason(str, enum.Enum):
    """Why a request ended: ``stop`` (eos, a stop token id or a stop string), ``length``
    (max_new_tokens or the context length), ``abort`` (client abort or error)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestError(ValueError):
    """A request that can never be served (bad parameters, empty or over-long prompt).

    ``code`` follows the OpenAI error object (e.g. ``context_length_exceeded``) and ``param`` names
    the offending field, so the server can turn it into a 400 without guessing.
    """

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature: 0 means greedy (argmax). top_k <= 0 (or -1) disables top-k; top_p = 1 and
    min_p = 0 disable nucleus and min-p truncation. Penalties follow OpenAI (frequency/presence,
    over generated tokens, additive on logits) and HF (repetition, over prompt + generated tokens,
    divides positive logits / multiplies negative ones; CTRL paper, arXiv 1909.05858).
    max_new_tokens: None means "up to the context length". seed: a per-request torch.Generator
    so that the same seed gives the same tokens whatever else is in the batch.
    stop: stop strings (checked by the frontend on text); stop_token_ids: checked by the engine.
    logprobs: return the sampled token's logprob; top_logprobs: also the k most likely tokens.
    Logprobs are the model's raw log-softmax (before penalties/temperature/truncation).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows."""
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError (with ``param``) on any out-of-range value; NaN is out of range."""

        def bad(param: str, why: str):
            raise RequestError(f"{param} {why}", param=param, code="invalid_value")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.top_k is None or (self.top_k < 1 and self.top_k not in (0, -1)):
            bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not 0.01 <= self.repetition_penalty <= 100:
            bad("repetition_penalty", "must be in [0.01, 100]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            bad("max_new_tokens", "must be >= 1")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", "must be >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", "must be <= max_new_tokens")
        if not 0 <= self.top_logprobs <= 20:
            bad("top_logprobs", "must be in [0, 20]")
        if self.n < 1:
            bad("n", "must be >= 1")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"contains {t}, outside the vocabulary [0, {vocab_size})")


@dataclass
class Request:
    """One sequence inside the engine core (a request with n > 1 is n of these, sharing a prompt).

    Token bookkeeping (all counts in tokens):
      prompt_ids + output_ids = all token ids so far;
      num_computed: how many leading tokens have KV in ``slots`` (prefix hit + prefilled + decoded);
      cached_tokens: how many prompt tokens were served by the radix cache at (first) admission.
    ``slots`` is the request's KV slot table (int64 tensor), ``last_node`` the radix node it locks.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[int | str] = None
    cached_tokens: int = -1
    num_computed: int = 0
    num_retractions: int = 0
    first_token_time: Optional[float] = None
    # engine-private state (never sent back):
    slots: object = None
    last_node: object = None
    num_tree_tokens: int = 0  # leading slots owned by the radix tree (the rest are the request's own)
    generator: object = None
    num_sent: int = 0  # output tokens already reported

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine core reports for a request after a step (deltas since the last report).

    new_token_ids / new_logprobs / new_top_logprobs: tokens sampled since the last output.
    finish_reason is set on the last output of a request; ``error`` carries a message for requests
    that failed inside the engine. Token counts are totals so far.
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[int | str] = None
    new_logprobs: Optional[list[float]] = None
    new_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
