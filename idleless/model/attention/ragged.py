"""Ragged attention on AMX tiles (bfloat16 on CPUs with AMX): shared segments and multi-token tails in
``cpu_kernels.ragged_attn`` straight from the pool: no padding, no masks, no gathers; one call for all
tails and one per set of segments with distinct rows, each row's causal limit given as a number. The
kernel packs keys into the tile layout; a segment's packing is kept across forwards (a system prompt is
packed at its first decode step, not at every one) until the pool frees a slot (``KVPool.free_epoch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.cache.kv_pool import KVPool
from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan

# Packed shared segments kept across forwards (bytes, all layers together): a decode step's system
# prompt and documents are packed once, at their first step, not once per step.
PACK_CACHE_BYTES = 512 << 20


@dataclass
class PackedKeys:
    """A ragged call's keys in the kernel's tile layout: per layer a uint8 [work_bytes] buffer, None
    until that layer's call packs it. One small buffer per layer rather than one large block: glibc
    maps blocks over 32 MiB afresh each time, and first touches of fresh pages are slow (figures in
    benchmarks/README.md)."""

    bufs: list[torch.Tensor | None]


@dataclass
class RaggedGroup:
    """Items attended in one ragged kernel call: item i's keys are slots[key_offsets[i]:key_offsets[i+1]],
    its query rows rows[row_offsets[i]:row_offsets[i+1]] (distinct across items); row entry j sees its
    item's first limits[j] keys (the causal tails of multi-token extends) or all of them (limits None:
    shared segments). merge: fold into the tails' results (segments) rather than write (tails).
    work_bytes: the packing buffer the call needs. Index tensors int64."""

    key_offsets: torch.Tensor
    slots: torch.Tensor
    row_offsets: torch.Tensor
    rows: torch.Tensor
    limits: torch.Tensor | None
    merge: bool
    work_bytes: int
    packed: PackedKeys | None = None  # kept across forwards (shared segments), else the shared work buffer


class RaggedAmxAttention(AttentionBackend):
    """Tails and segments in the AMX ragged kernel (no window). kernels: a bfloat16 CpuKernels with
    ``has_amx``; head_dim a multiple of 32 up to 256 (``supports``). The pool: its free_epoch says when
    kept packings are stale."""

    writes_model_dtype = False  # the kernel writes float32 with the log-sum-exp

    @staticmethod
    def supports(kernels, head_dim: int) -> bool:
        return kernels is not None and kernels.has_amx and head_dim % 32 == 0 and head_dim <= 256

    def __init__(self, pool: KVPool, kernels, num_kv_heads: int, head_dim: int):
        self.pool = pool
        self.num_layers = pool.k_cache.shape[0]
        self.kernels = kernels
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self._work = torch.empty(0, dtype=torch.uint8)  # the K/V packing buffer of unkept calls, grown
        # shared segments' packed K/V by their slots; valid while no slot was freed (pool.free_epoch)
        self._packs: dict[bytes, PackedKeys] = {}
        self._packs_epoch = -1

    def prepare(self, work: AttnWork) -> BackendPlan:
        """Raises ValueError for a window."""
        if work.window is not None:
            raise ValueError("the ragged kernel has no sliding window")
        tails = []
        t = work.tails
        if t is not None:  # one call for all tails, causal limits per row
            tails.append(self._group(
                t.slots, [torch.arange(s, s + n) for s, n in zip(t.starts, t.new)],
                torch.cat([torch.arange(p + 1, p + 1 + n) for p, n in zip(t.past, t.new)]), merge=False))
        segments = self._segment_calls(work.segments)
        self._keep_packed(segments)
        need = max([g.work_bytes for g in tails + segments if g.packed is None], default=0)
        if need > self._work.numel():
            self._work = torch.empty(need, dtype=torch.uint8)
        return BackendPlan(tails, segments)

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        for g in plan.tails:
            self._run(q, kc, vc, g, layer_id, out, lse)
        for g in plan.segments:
            self._run(q, kc, vc, g, layer_id, out, lse)
        return out

    def _keep_packed(self, groups: list[RaggedGroup]) -> None:
        """Give the segment calls their packing from earlier forwards (or a new one to fill), keyed by
        their slots. A shared prefix's slots hold the same K/V while any request holds them, and slots
        are rewritten only after being freed, so every pack is dropped when the pool frees a slot, and
        packs of segments absent from this forward are dropped too (at most PACK_CACHE_BYTES kept)."""
        if self.pool.free_epoch != self._packs_epoch:
            self._packs, self._packs_epoch = {}, self.pool.free_epoch
        kept, total = {}, 0
        for g in groups:
            size = self.num_layers * g.work_bytes
            if total + size > PACK_CACHE_BYTES:
                continue  # packed per call in the shared work buffer instead
            key = g.key_offsets.numpy().tobytes() + g.slots.numpy().tobytes()
            g.packed = kept[key] = self._packs.get(key) or PackedKeys([None] * self.num_layers)
            total += size
        self._packs = kept

    def _group(self, slots: list[torch.Tensor], rows: list[torch.Tensor], limits: torch.Tensor | None,
               merge: bool) -> RaggedGroup:
        """One ragged kernel call over items (slots[i] [L_i], rows[i] [R_i]); limits [sum R_i] or None."""
        lens = [t.numel() for t in slots]
        return RaggedGroup(torch.tensor([0] + lens).cumsum(0), torch.cat(slots),
                           torch.tensor([0] + [r.numel() for r in rows]).cumsum(0), torch.cat(rows), limits, merge,
                           self.kernels.ragged_work_bytes(lens, self.num_kv_heads, self.head_dim))

    def _segment_calls(self, segs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[RaggedGroup]:
        """Shared segments (rows [R], slots [L]) as ragged calls that merge into the tails' results:
        a call takes a segment whose rows it does not hold yet (each row is merged once per call), so
        a system prompt shared by all and the documents shared by groups of them make two calls."""
        calls: list[tuple[list, set]] = []
        for rows, slots in segs:
            rset = set(rows.tolist())
            call = next((c for c in calls if not (c[1] & rset)), None)
            if call is None:
                calls.append(([], set()))
                call = calls[-1]
            call[0].append((rows, slots))
            call[1].update(rset)
        return [self._group([sl for _, sl in c], [r for r, _ in c], None, merge=True) for c, _ in calls]

    def _run(self, q, kc, vc, g: RaggedGroup, layer_id: int, out, lse) -> None:
        p, done = g.packed, False
        work = self._work
        if p is not None:
            done = p.bufs[layer_id] is not None
            work = p.bufs[layer_id] if done else torch.empty(g.work_bytes, dtype=torch.uint8)
        self.kernels.ragged_attn(q, kc, vc, g.key_offsets, g.slots, g.row_offsets, g.rows, g.limits, self.scale,
                                 out, lse, g.merge, work, done)
        if p is not None:
            p.bufs[layer_id] = work
