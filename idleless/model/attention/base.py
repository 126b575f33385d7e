"""What an attention backend (one kernel family) is given and what it returns.

The composite (``composite.CompositeAttention``) cuts a batch into work for its backends: requests'
*tails* (their own keys, causal for their new tokens), whose results are written, and *shared segments*
(a stretch of KV slots several requests hold, fully visible to all their new rows), whose results are
merged into the tails' by log-sum-exp. A backend turns its work into a plan once per forward
(``prepare``) and runs the plan at every layer (``forward``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Tails:
    """Requests' tails, request j of them: new query rows [starts[j], starts[j] + new[j]) of the batch;
    keys slots[j] (int64 [past[j] + new[j]]: KV slots from the end of the request's shared segments on,
    its new tokens' last), of which the first past[j] are earlier tokens; new row r sees keys
    [0, past[j] + r]. Every new[j] >= 1."""

    starts: list[int]
    new: list[int]
    past: list[int]
    slots: list[torch.Tensor]


@dataclass
class AttnWork:
    """A backend's part of one batch. tails: written rows (None: none). segments: (rows int64 [R]
    distinct batch rows, slots int64 [L]) pairs, every row seeing every key, merged into the tails'
    results; a backend given segments gets all of the batch's (a backend that keeps copies of segments
    across forwards may drop those not listed). window: a sliding window (keys older than ``window``
    positions are invisible) in force for this batch, or None; with a window there are no segments and
    tail positions are absolute positions."""

    tails: Tails | None = None
    segments: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    window: int | None = None


@dataclass
class BackendPlan:
    """A backend's kernel calls for one batch: groups of tails (write) and of segments (merge); the
    group types are the backend's own."""

    tails: list[Any]
    segments: list[Any]


class AttentionBackend:
    """One kernel family behind ``prepare`` / ``forward``.

    Tensors: q [T, H, D] (rows may be strided views); kc / vc: one layer's K / V of the pool
    [num_slots, Hkv, D]; out [T, H, D] and lse [T, H] (float32, natural log-sum-exp of scaled scores)."""

    #: False when the kernels only write float32 outputs with their log-sum-exp (then the composite
    #: gives out float32 and lse even when nothing is merged)
    writes_model_dtype = True

    def prepare(self, work: AttnWork) -> BackendPlan:
        """The plan for ``work`` (index tensors shared by all layers). Raises ValueError for work the
        family cannot run."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, layer_id: int, plan: BackendPlan,
                out: torch.Tensor | None, lse: torch.Tensor | None) -> torch.Tensor:
        """Run ``plan`` at one layer (the new tokens' K/V are already in kc / vc). Writes the tails'
        rows of out (and of lse, when given), then merges the segments' rows into out / lse (given
        whenever the plan has segments); returns out. out None: the plan covers the whole batch
        (``covers_batch``) and a new output [T, H, D] in q's dtype is returned."""
        raise NotImplementedError

    def covers_batch(self, plan: BackendPlan, num_tokens: int) -> bool:
        """Whether ``forward(..., out=None, lse=None)`` can give the whole [num_tokens, H, D] output."""
        return False
