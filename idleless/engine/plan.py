"""The typed step plan between the scheduler and the model runner (vLLM V1's ``SchedulerOutput`` shape).

``Scheduler.schedule()`` returns a ``StepPlan``; ``ModelRunner.execute(plan)`` turns it into tensors,
runs the forward and the sampler and returns a ``StepResult``; ``Scheduler.commit(plan, result)``
applies it. The scheduler builds no tensors beyond slot tables; the runner keeps no request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from idleless.engine.request import PromptLogprob
from idleless.model.sampler import SamplingRow


@dataclass(frozen=True, eq=False)
class PromptLogprobRows:
    """The rows of one scheduled request whose logits give prompt logprobs this step.

    first: the offset in the step's ``token_ids`` of the first such row; the rows are
    ``first .. first + len(targets) - 1``, consecutive. targets: the prompt token each row scores (the
    token after the row's, which may lie in the next chunk). num_top: (token, logprob) alternatives
    per row (the request's ``prompt_logprobs``)."""

    first: int
    targets: list[int]
    num_top: int


@dataclass(frozen=True, eq=False)
class ScheduledRequest:
    """One request's work in a step.

    token_ids: the tokens to compute, ``num_known`` known tokens (a prompt chunk, or the last sampled
      token for a decode) followed by ``len(token_ids) - num_known`` proposed (draft) tokens;
      a verify step is an ordinary extend.
    start: tokens whose KV already exists (the position of ``token_ids[0]``).
    slot_table: int64 [start + len(token_ids)], the request's KV slots; the last len(token_ids) are
      written this step.
    sampling: the sampler's row for this request when it samples this step (its known tokens end
      the sequence), else None (a prompt chunk before the prompt's end, or a prefill-only request).
      A request that samples gets one sampled row per proposed token plus one.
    prompt_logprobs: the rows whose logits give prompt logprobs this step, or None.
    """

    rid: str
    token_ids: list[int]
    num_known: int
    start: int
    slot_table: torch.Tensor
    sampling: Optional[SamplingRow] = None
    prompt_logprobs: Optional[PromptLogprobRows] = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_proposed(self) -> int:
        return len(self.token_ids) - self.num_known

    @property
    def proposed(self) -> list[int]:
        return self.token_ids[self.num_known:]

    @property
    def out_slots(self) -> torch.Tensor:
        """int64 [len(token_ids)]: the KV slots this step writes."""
        return self.slot_table[self.start:]

    @property
    def num_sampled(self) -> int:
        return 0 if self.sampling is None else self.num_proposed + 1


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step: the scheduled requests in batch order, the requests that finished or were aborted
    since the last plan with requests (``finished_ids``: a runner holding per-request state drops it;
    a plan without requests is not executed, so it carries none), and the ids
    that end generation (``eos_ids``, for the sampler's min_new_tokens rule)."""

    requests: list[ScheduledRequest]
    finished_ids: list[str] = field(default_factory=list)
    eos_ids: frozenset = frozenset()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def num_proposed(self) -> int:
        """Proposed (draft) tokens in the step: those the verify accepts or rejects."""
        return sum(r.num_proposed for r in self.requests)


@dataclass
class StepResult:
    """What the runner returns for a plan, one entry per scheduled request in plan order:
    ``sampled[i]`` the tokens sampled for request i (``num_sampled`` of them: [] when it does not
    sample); ``logprobs[i]`` / ``top_logprobs[i]`` alike (entries None where not asked for);
    ``prompt_logprobs[i]`` one ``PromptLogprob`` per row of its ``prompt_logprobs`` rows, in order
    ([] without them; the whole list may be empty when no request has any)."""

    sampled: list[list[int]]
    logprobs: list[list[Optional[float]]]
    top_logprobs: list[list[Optional[list[tuple[int, float]]]]]
    prompt_logprobs: list[list[PromptLogprob]] = field(default_factory=list)
