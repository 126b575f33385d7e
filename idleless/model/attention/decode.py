"""Fused decode attention: requests with one new token each, attended by ``cpu_kernels.decode_attn``
straight from the pool (no gather, no padding), float32 softmax; writes the model dtype or float32
with the log-sum-exp (when segments are merged in after)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan


@dataclass
class DecodeGroup:
    """Request b's query and output row is rows[b], its keys the slots slots[offsets[b]:offsets[b+1]]
    (its tail; all visible). rows [B], offsets [B+1], slots int64."""

    rows: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor


class FusedDecodeAttention(AttentionBackend):
    """Tails of one new token in the decode kernel. kernels: a CpuKernels of the pool's dtype."""

    def __init__(self, kernels, head_dim: int):
        self.kernels = kernels
        self.scale = head_dim ** -0.5

    def prepare(self, work: AttnWork) -> BackendPlan:
        """Raises ValueError for segments, a window or a tail of several new tokens."""
        t = work.tails
        if work.segments or work.window is not None or (t is not None and any(n != 1 for n in t.new)):
            raise ValueError("the decode kernel takes tails of one new token, no segments or window")
        if t is None:
            return BackendPlan([], [])
        offsets = torch.tensor([0] + [p + 1 for p in t.past]).cumsum(0)
        return BackendPlan([DecodeGroup(torch.tensor(t.starts), torch.cat(t.slots), offsets)], [])

    def covers_batch(self, plan: BackendPlan, num_tokens: int) -> bool:
        return len(plan.tails) == 1 and torch.equal(plan.tails[0].rows, torch.arange(num_tokens))

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        for g in plan.tails:
            self.kernels.decode_attn(q, g.rows, kc, vc, g.slots, g.offsets, self.scale, out, g.rows, lse)
        return out
