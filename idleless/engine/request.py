"""Requests and outputs: the messages between frontend and engine core, and the engine's own record.

The engine core only sees token ids; text (prompts, stop strings, detokenization) lives in the
frontend (``idleless.text``). ``Request`` and ``RequestOutput`` are plain dataclasses that pickle
over ZMQ; ``RequestRecord`` is engine-private state.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from idleless.errors import RequestError  # noqa: F401 - re-exported: part of the request vocabulary
from idleless.sampling_params import SamplingParams  # noqa: F401


class FinishReason(str, enum.Enum):
    """Why a request ended: ``stop`` (eos, a stop token id or a stop string), ``length``
    (max_new_tokens or the context length), ``abort`` (client abort or error)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class PromptLogprob(NamedTuple):
    """One prompt token's entry of ``prompt_logprobs``: the token, its raw logprob given the tokens
    before it (float32 log-softmax, the same function as a sampled token's), its rank (1 + the tokens
    strictly more likely) and the ``prompt_logprobs`` most likely (token_id, logprob) pairs there,
    most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Request:
    """The request message: what a frontend asks of the engine core (pickled over ZMQ as is).

    One sequence: a request with n > 1 is n of these sharing a prompt. Frozen; the engine keeps its
    own ``RequestRecord`` (progress, KV slots, cache handle, seed) built from it at admission.
    ``priority``: higher is admitted first and retracted last. ``arrival_time``: time.monotonic() s.
    ``kv_transfer_params``: vLLM's field for prefill/decode disaggregation; on a decode engine,
    ``{"do_remote_prefill": True, "remote_host": ..., "remote_port": ...}`` names the prefill engine
    whose KV of this prompt is pulled before the request is queued (``idleless.disagg``)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer_params: Optional[dict] = None


@dataclass(eq=False)
class RequestRecord:
    """The engine core's state of one request (never sent back; built from a ``Request``).

    Token bookkeeping (all counts in tokens):
      prompt_ids + output_ids = all token ids so far;
      num_computed: leading tokens whose KV is in ``slots`` (prefix hit + prefilled + decoded);
      cached_tokens: prompt tokens served by the prefix cache at first admission (-1 before it).
    ``slots``: the KV slot table (int64 tensor) or None while waiting; ``cache_handle``: the locked
    prefix-cache handle covering ``slots[:num_tree_tokens]`` (None while waiting);
    ``max_new_tokens``: the request's limit with None resolved to the context length at admission.
    ``prompt_logprobs``: with ``params.prompt_logprobs`` set, the entries computed so far, in prompt
    order from position ``params.prompt_logprobs_start`` (None for position 0), else None;
    ``prompt_logprobs_sent``: whether an output carried them.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    max_new_tokens: int
    seed: int = 0  # the sampler's key: a position's random number is keyed_uniform(seed, position)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[int | str] = None
    cached_tokens: int = -1
    num_computed: int = 0
    num_retractions: int = 0
    first_token_time: Optional[float] = None
    slots: object = None
    cache_handle: object = None
    num_sent: int = 0  # output tokens already reported
    prompt_logprobs: Optional[list[Optional[PromptLogprob]]] = None
    prompt_logprobs_sent: bool = False
    accepted_per_verify: list[int] = field(default_factory=list)  # proposed tokens accepted, per verify step

    def __post_init__(self):
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] if self.params.prompt_logprobs_start == 0 else []

    @property
    def num_tree_tokens(self) -> int:
        """Leading slots of the table owned by the prefix cache (the rest are the request's own)."""
        return self.cache_handle.cached_len if self.cache_handle is not None else 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.params.logprobs or self.params.top_logprobs)

    @property
    def prompt_logit_rows(self) -> range:
        """Positions whose logits are still needed for prompt logprobs (row r scores prompt token
        r + 1): from the first entry not computed yet to the last prompt token but one (the last
        row samples). Empty when none were asked for or all are in."""
        if self.prompt_logprobs is None:
            return range(0)
        start = self.params.prompt_logprobs_start
        first = max(start, 1) - 1 + len(self.prompt_logprobs) - (start == 0)
        return range(first, len(self.prompt_ids) - 1)

    @property
    def reusable_prefix(self) -> int:
        """The most leading tokens whose KV may come from the prefix cache: all known tokens but the
        last (its logits are needed), and none from the first prompt position whose logits are still
        needed (a cached prefix has K/V, not logits; SGLang and vLLM limit the hit the same way)."""
        rows = self.prompt_logit_rows
        return min(self.seq_len - 1, rows.start) if rows else self.seq_len - 1


@dataclass
class RequestOutput:
    """What the engine core reports for a request after a step (deltas since the last report).

    new_token_ids / new_logprobs / new_top_logprobs: tokens sampled since the last output.
    prompt_logprobs: the request's ``PromptLogprob`` entries (see ``RequestRecord``), all of them, on
    the first output after the prompt's last logits (with the first token, or the finish of a
    prefill-only request); None on every other output and when not asked for.
    finish_reason is set on the last output of a request; ``error`` carries a message for requests
    that failed inside the engine. Token counts are totals so far. ``accepted_per_verify`` (last output
    only): with speculative decoding, the proposed tokens accepted at each verify step of the request.
    ``weight_version``: the engine's weight version when the step that sampled ``new_token_ids`` ran
    (an RL rollout that spans a weight update says which tokens came from which weights).
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[int | str] = None
    new_logprobs: Optional[list[float]] = None
    new_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_logprobs: Optional[list[Optional[PromptLogprob]]] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None
    accepted_per_verify: Optional[list[int]] = None
    weight_version: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
