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

from idleless.errors import RequestError  # noqa: F401 - re-exported: part of the request vocabulary
from idleless.sampling_params import SamplingParams  # noqa: F401


class FinishReason(str, enum.Enum):
    """Why a request ended: ``stop`` (eos, a stop token id or a stop string), ``length``
    (max_new_tokens or the context length), ``abort`` (client abort or error)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


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
