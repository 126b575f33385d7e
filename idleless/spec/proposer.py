"""The proposer interface of speculative decoding (vLLM V1 ``spec_decode`` proposers are the model).

A proposer guesses the next tokens of decoding requests; the scheduler appends the guesses to the
request's decode token, the runner computes them in one extend (the verify step), and the
scheduler's commit accepts the longest prefix the target model agrees with, frees the slots of the
rest and never caches them. Proposals are point guesses (a draft distribution concentrated on one
token), so "sample the target's token at each position and accept while it equals the guess" is
the rejection rule of Leviathan et al. (arXiv 2211.17192) exactly: the output distribution is the
target's, and with position-keyed random numbers the same seed gives the same tokens as without
speculation.

The scheduler calls, from its one loop: ``propose`` while planning a step, ``observe`` when it
commits a request's verify result, ``observe_step`` once per executed step, ``finish`` when a
request ends (finished or aborted) so per-request state can go.
"""

from __future__ import annotations

from typing import Sequence


class Proposer:
    """Proposes nothing: decoding runs one token per request per step. The base of every proposer.

    Requests handed to a proposer are engine records (``RequestRecord``): read ``rid``,
    ``prompt_ids``, ``output_ids``, ``all_ids``, ``params``; never modify them."""

    name = "none"
    # A draft step's seconds relative to a target step of the same batch, assumed until measured
    # (0: guessing is free, e.g. lookups in text already seen).
    cost_hint = 0.0
    # Seconds per catch-up token (``catchup_tokens``) assumed until the adaptive controller measures it.
    catchup_cost_hint = 0.0
    # Seconds and tokens of the last ``propose``'s catch-up forward (a draft model computing a new
    # prompt, or tokens it fell behind on), 0 when it had none: the adaptive cost model charges them
    # as catch-up and leaves them out of the seconds per draft step.
    last_catchup_s = 0.0
    last_catchup_tokens = 0

    def propose(self, requests: Sequence, max_tokens: Sequence[int]) -> list[list[int]]:
        """One list of guessed next token ids per decoding request, the i-th at most
        ``max_tokens[i]`` (>= 0) long; [] proposes nothing for that request."""
        return [[] for _ in requests]

    def catchup_tokens(self, requests: Sequence) -> list[int]:
        """Per decoding request, the tokens ``propose`` would first have to compute (beyond the one or
        two a request that got guesses last step always needs) before it can guess; 0 for a
        proposer without model state."""
        return [0] * len(requests)

    def observe(self, request, num_proposed: int, num_accepted: int) -> None:
        """The verify result of one request: of ``num_proposed`` guesses the first ``num_accepted``
        were accepted (the target then added one token of its own, unless the request ended)."""

    def observe_step(self, num_tokens: int, num_proposed: int, step_s: float) -> None:
        """One executed step: ``num_tokens`` tokens computed (``num_proposed`` of them guesses) in
        ``step_s`` seconds outside the proposer (planning, forward or verify, commit)."""

    def finish(self, request) -> None:
        """``request`` ended (finished, aborted or failed): drop its state. Its ``output_ids`` are final."""

    def stats(self) -> dict:
        """Counters for /metrics and the offline report (empty for the base proposer)."""
        return {}
