"""Fused decode attention: requests with one new token each, attended by ``cpu_kernels.decode_attn``
straight from the pool (no gather, no padding), float32 softmax; writes the model dtype or float32
with the log-sum-exp (when segments are merged in after).

Tails of a few new tokens (up to ``MAX_NEW_ROWS``: a speculative verify, a short extend) run here
too, each new row as a decode row over the keys it may see (the tail's past and the new tokens up to
its own). A few query rows over a prefix in the pool cost far less this way than gathered and padded
for flash attention (figures in benchmarks/README.md, issue 13)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan
from idleless.quant.kv import QuantizedKV


# The most new tokens of a tail this backend takes (each becomes a decode row).
MAX_NEW_ROWS = 16


@dataclass
class DecodeGroup:
    """Request b's query and output row is rows[b], its keys the slots slots[offsets[b]:offsets[b+1]]
    (its tail; all visible). rows [B], offsets [B+1], slots int64."""

    rows: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor


class FusedDecodeAttention(AttentionBackend):
    """Tails of 1 to ``max_new`` new tokens in the decode kernel, one decode row per new token.
    kernels: a CpuKernels of the pool's dtype, or of the model's over a quantised pool (K/V layers
    given as ``QuantizedKV``: ``decode_attn_q8`` reads the stored bytes and scales)."""

    max_new = MAX_NEW_ROWS

    def __init__(self, kernels, head_dim: int):
        self.kernels = kernels
        self.scale = head_dim ** -0.5

    def prepare(self, work: AttnWork) -> BackendPlan:
        """Raises ValueError for segments, a window or a tail of more than ``max_new`` new tokens."""
        t = work.tails
        if work.segments or work.window is not None or (t is not None and any(n > self.max_new for n in t.new)):
            raise ValueError(f"the decode kernel takes tails of 1 to {self.max_new} new tokens, "
                             "no segments or window")
        if t is None:
            return BackendPlan([], [])
        if all(n == 1 for n in t.new):
            offsets = torch.tensor([0] + [p + 1 for p in t.past]).cumsum(0)
            return BackendPlan([DecodeGroup(torch.tensor(t.starts), torch.cat(t.slots), offsets)], [])
        rows, slots, lens = [], [], []
        for start, n, past, table in zip(t.starts, t.new, t.past, t.slots):
            for r in range(n):  # new row r sees keys [0, past + r]
                rows.append(start + r)
                slots.append(table[:past + r + 1])
                lens.append(past + r + 1)
        offsets = torch.tensor([0] + lens).cumsum(0)
        return BackendPlan([DecodeGroup(torch.tensor(rows), torch.cat(slots), offsets)], [])

    def covers_batch(self, plan: BackendPlan, num_tokens: int) -> bool:
        return len(plan.tails) == 1 and torch.equal(plan.tails[0].rows, torch.arange(num_tokens))

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        attn = self.kernels.decode_attn_q8 if isinstance(kc, QuantizedKV) else self.kernels.decode_attn
        for g in plan.tails:
            attn(q, g.rows, kc, vc, g.slots, g.offsets, self.scale, out, g.rows, lse)
        return out
