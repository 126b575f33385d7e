"""The proposer interface of speculative decoding (vLLM V1 ``spec_decode`` proposers are the model).

A proposer guesses the next tokens of decoding requests; the scheduler appends the guesses to the
request's decode token, the runner computes them in one extend, and the scheduler's commit accepts
the longest prefix the target model agrees with, frees the slots of the rest and never caches them.
"""

from __future__ import annotations

from typing import Sequence


class Proposer:
    """Proposes nothing: decoding runs one token per request per step.

    ``propose(requests, max_tokens)``: the decoding requests (engine records: ``rid``,
    ``prompt_ids``, ``output_ids``, ``params``) and the most tokens each may take (>= 0); returns one
    list of proposed token ids per request, each at most that long."""

    def propose(self, requests: Sequence, max_tokens: Sequence[int]) -> list[list[int]]:
        return [[] for _ in requests]
