"""Admission rules: whether a request can ever be served, written once.

The engine core (``Scheduler.add_request``) and the server's frontend (``EngineClient.submit``,
before anything is sent) both call ``check_request``, so a request the frontend accepts is one the
engine accepts, given the same ``AdmissionLimits``. The frontend learns ``pinned_tokens`` from the
replies to its pin/unpin calls (and the pins' expiry); the engine reads it from its prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from idleless.errors import RequestError
from idleless.sampling_params import SamplingParams


@dataclass(frozen=True)
class AdmissionLimits:
    """What bounds one request. All in tokens but ``vocab_size`` (ids).

    vocab_size: prompt ids must lie in [0, vocab_size); context_length: the model's positions;
    kv_slots: the whole KV pool; pinned_tokens: pool slots held by pinned prefixes, which no request
    can use. A request needs prompt + max_new_tokens <= ``max_seq_len``."""

    vocab_size: int
    context_length: int
    kv_slots: int
    pinned_tokens: int = 0

    @property
    def max_seq_len(self) -> int:
        """min(context_length, kv_slots - pinned_tokens): prompt + output tokens of one request."""
        return min(self.context_length, self.kv_slots - self.pinned_tokens)

    def describe(self) -> str:
        """The limits in words, for error messages."""
        pinned = f", {self.pinned_tokens} of them pinned" if self.pinned_tokens else ""
        return f"context length {self.context_length}, KV pool {self.kv_slots} tokens{pinned}"


def _is_token_id(t, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size


def check_request(prompt_ids: Sequence[int], params: SamplingParams, limits: AdmissionLimits) -> int:
    """Check one request against ``limits``; returns its effective max_new_tokens (``params.
    max_new_tokens``, or everything the limit leaves after the prompt when that is None). Pure:
    ``params`` is not modified.

    Raises RequestError, first failing rule wins:
      - empty prompt, or an id that is not an int in [0, vocab_size) (bools are refused):
        param ``prompt``, code ``invalid_prompt``;
      - a sampling value out of range: ``SamplingParams.validate``'s (code ``invalid_value``);
      - prompt length >= max_seq_len (no room for one output token): param ``prompt``, code
        ``context_length_exceeded``;
      - prompt + max_new_tokens > max_seq_len: param ``max_tokens``, code ``context_length_exceeded``.
    """
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("the prompt is empty", param="prompt", code="invalid_prompt")
    v = limits.vocab_size  # builtins first: a long prompt costs no Python call per token
    plain = all(type(t) is int for t in prompt_ids) and 0 <= min(prompt_ids) and max(prompt_ids) < v
    for t in () if plain else prompt_ids:  # else the first offender, for the message
        if not _is_token_id(t, v):
            raise RequestError(f"prompt token id {t!r} is outside the vocabulary [0, {limits.vocab_size})",
                               param="prompt", code="invalid_prompt")
    params.validate(limits.vocab_size)
    limit = limits.max_seq_len
    if n >= limit:
        raise RequestError(f"the prompt has {n} tokens; at most {max(limit - 1, 0)} prompt tokens can be served "
                           f"({limits.describe()})", param="prompt", code="context_length_exceeded")
    if params.max_new_tokens is None:
        return limit - n
    if n + params.max_new_tokens > limit:
        raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_new_tokens}) = "
                           f"{n + params.max_new_tokens} exceeds the limit of {limit} tokens ({limits.describe()})",
                           param="max_tokens", code="context_length_exceeded")
    return params.max_new_tokens
