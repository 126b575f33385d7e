"""Batch-invariant attention (deterministic inference): one reduction order per query row.

A row's output is a function of its query and its keys only: not of the other rows in the batch, of
whether its keys came from the prefix cache or were computed in this step, of how its prompt was
chunked, or of whether part of its keys were attended as a shared segment. Keys are taken in chunks
of ``CHUNK`` aligned to absolute positions; each chunk is reduced in one fixed order and folded into
a running (max, sum, acc) softmax state in position order (FlashAttention's rescaling, Dao et al.,
arXiv 2205.14135), so a shared segment [0, s) (s a multiple of ``CHUNK``) attended once for many rows
and continued by each row's tail gives the bits of one pass over all keys (Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025; SGLang's ``--enable-deterministic-inference``).
The composite aligns shared segments to ``segment_align`` for this.

``ChunkedAttention`` runs ``cpu_kernels.chunk_attn``; ``TorchChunkedAttention`` is the same algorithm in
PyTorch ops (the fallback without the C kernels: each chunk padded to ``CHUNK`` keys so every
reduction has one shape; invariant on its own, not bit-equal to the kernel's exp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan

CHUNK = 64  # keys per softmax chunk; equals cpu_kernels.CpuKernels.BI_CHUNK


@dataclass
class ChunkCall:
    """One kernel call: items i with keys slots[key_offsets[i]:key_offsets[i+1]] and query rows
    rows[row_offsets[i]:row_offsets[i+1]], row entry j seeing its first limits[j] keys (None: all).
    int64 tensors; the first key of every item sits at a multiple of CHUNK."""

    key_offsets: torch.Tensor
    slots: torch.Tensor
    row_offsets: torch.Tensor
    rows: torch.Tensor
    limits: torch.Tensor | None


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def _segment_calls(segments: list[tuple[torch.Tensor, torch.Tensor]]) -> list[ChunkCall]:
    """Shared segments (rows int64 [R], slots int64 [L]), in nesting order, as kernel calls: each run of
    consecutive segments whose rows are pairwise disjoint becomes one call of several items. A row sits
    in at most one item of a call, so it folds its segments in the order given, as with a call per
    segment (the same bits), and a step over many groups of shared prefixes pays one call, not one per
    group."""
    calls, run, seen = [], [], set()
    for rows, slots in segments + [(None, None)]:
        ids = set(rows.tolist()) if rows is not None else set()
        if run and (rows is None or not seen.isdisjoint(ids)):
            calls.append(ChunkCall(_offsets([int(sl.numel()) for _, sl in run]), torch.cat([sl for _, sl in run]),
                                   _offsets([int(r.numel()) for r, _ in run]), torch.cat([r for r, _ in run]), None))
            run, seen = [], set()
        if rows is not None:
            run.append((rows, slots))
            seen |= ids
    return calls


class ChunkedAttention(AttentionBackend):
    """All of a batch (tails and shared segments) in one kernel family with one reduction order per
    row (module docstring). kernels: a cpu_kernels.CpuKernels of the pool's dtype.

    int8_attention (``--activation-dtype int8``): q.k and P.V on int8 codes (``CpuKernels.chunk_attn``)
    where the kernels take them (``chunk_attn_int8``: AVX-512 BF16 + VNNI, head_dim a multiple of 32); the
    attribute says whether they do. The codes are functions of one row, one key or one (row, chunk of
    keys), so the bits stay independent of the batch, the cache and the chunking."""

    segment_align = CHUNK

    def __init__(self, kernels, num_heads: int, head_dim: int, int8_attention: bool = False):
        self.kernels = kernels
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.int8_attention = bool(int8_attention and kernels is not None and kernels.chunk_attn_int8(head_dim))

    def prepare(self, work: AttnWork) -> BackendPlan:
        """Tails as one call (row r of a tail with p earlier keys sees p + r + 1 keys); the shared
        segments in the order given (a segment nested in another comes after it), each run of
        consecutive segments with disjoint rows as one call (``_segment_calls``).
        Raises ValueError under a sliding window."""
        if work.window is not None:
            raise ValueError("batch-invariant attention does not take a sliding window")
        tails = []
        t = work.tails
        if t is not None:
            rows = [torch.arange(s, s + n) for s, n in zip(t.starts, t.new)]
            limits = [torch.arange(p + 1, p + n + 1) for p, n in zip(t.past, t.new)]
            tails.append(ChunkCall(_offsets([int(s.numel()) for s in t.slots]), torch.cat(t.slots),
                                   _offsets(list(t.new)), torch.cat(rows), torch.cat(limits)))
        return BackendPlan(tails, _segment_calls(work.segments))

    def covers_batch(self, plan: BackendPlan, num_tokens: int) -> bool:
        return bool(plan.tails) and int(plan.tails[0].rows.numel()) == num_tokens

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        if len(plan.tails) == 1 and self._one_call:
            # the segments and the tail in one kernel call (its own state buffers; the same bits)
            calls = [(c.key_offsets, c.slots, c.row_offsets, c.rows, c.limits) for c in plan.segments + plan.tails]
            self.kernels.chunk_attn_layer(q, kc, vc, calls, self.scale, out, int8_attention=self.int8_attention)
            return out
        state = None
        if plan.segments:
            T, H, D = q.shape
            state = (torch.full((T, H), float("-inf")), torch.zeros(T, H), torch.zeros(T, H, D))
            for c in plan.segments:
                self._call(q, kc, vc, c, None, state, True)
        for c in plan.tails:
            self._call(q, kc, vc, c, out, state, False)
        return out

    #: whether forward may hand a layer's calls to ``chunk_attn_layer`` at once (the kernels' own arithmetic)
    _one_call = True

    def _call(self, q, kc, vc, c: ChunkCall, out, state, store: bool) -> None:
        self.kernels.chunk_attn(q, kc, vc, c.key_offsets, c.slots, c.row_offsets, c.rows, c.limits, self.scale,
                                out, state, store, self.int8_attention)


@dataclass
class GatheredPlan(BackendPlan):
    """``QuantizedKVChunkedAttention``'s plan: the calls with their slots renumbered into ``slots``
    (int64 [U]: the distinct pool slots the step's calls read, ascending)."""

    slots: torch.Tensor = None


class QuantizedKVChunkedAttention(ChunkedAttention):
    """``ChunkedAttention`` over a quantised KV pool (int8 / fp8 codes with float32 scales,
    ``idleless.quant.kv.QuantizedKV``); a row's output is a function of its query and keys alone, whatever
    its batch, as with any pool. Where the kernels read the pool (``chunk_attn_q8``: the AVX-512 BF16 pair
    paths) they take the codes in place: each row decoded as it is gathered into its exact bfloat16 values,
    the scales applied as ``decode_attn_q8`` applies them (a key's to its scores, a value's to the
    probabilities before they are rounded for P.V). Elsewhere ``prepare`` collects the distinct slots the
    step's calls read and renumbers the calls into them, and ``forward`` dequantises those rows of the
    layer once (``QuantizedKV.index_select``) and runs the kernel on them: bit for bit ``ChunkedAttention``
    over a cache holding the dequantised values (the buffer holds one layer's keys of one step, gone after
    the call). kernels: the ``CpuKernels`` of the model dtype."""

    def __init__(self, kernels, num_heads: int, head_dim: int, int8_attention: bool = False):
        super().__init__(kernels, num_heads, head_dim, int8_attention)
        #: whether the kernels read the codes in place (else the step's rows are dequantised per layer)
        self.in_place = kernels.chunk_attn_q8(head_dim)

    def prepare(self, work: AttnWork) -> BackendPlan:
        plan = super().prepare(work)
        calls = plan.segments + plan.tails
        if self.in_place or not calls:
            return plan
        slots, inverse = torch.unique(torch.cat([c.slots for c in calls]), return_inverse=True)
        pieces = inverse.split([int(c.slots.numel()) for c in calls])
        renumbered = [ChunkCall(c.key_offsets, s, c.row_offsets, c.rows, c.limits) for c, s in zip(calls, pieces)]
        n_seg = len(plan.segments)
        return GatheredPlan(renumbered[n_seg:], renumbered[:n_seg], slots)

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        if isinstance(plan, GatheredPlan):
            kc, vc = kc.index_select(0, plan.slots), vc.index_select(0, plan.slots)
        return super().forward(q, kc, vc, layer_id, plan, out, lse)


class TorchChunkedAttention(ChunkedAttention):
    """``ChunkedAttention``'s algorithm in PyTorch ops (no kernels of ours): per item and chunk of CHUNK
    keys (padded to CHUNK, padding masked), float32 scores as an elementwise product summed over the
    head dimension, chunk max / exp / sum, the fold into the state. Any device PyTorch runs on."""

    _one_call = False

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__(None, num_heads, head_dim)

    def _call(self, q, kc, vc, c: ChunkCall, out, state, store: bool) -> None:
        T, H, D = q.shape
        grp = H // kc.shape[1]
        ko, ro = c.key_offsets.tolist(), c.row_offsets.tolist()
        for i in range(len(ko) - 1):
            rows = c.rows[ro[i]:ro[i + 1]]
            if rows.numel() == 0:
                continue
            slots = c.slots[ko[i]:ko[i + 1]]
            nkeys = int(slots.numel())
            lim = c.limits[ro[i]:ro[i + 1]] if c.limits is not None else torch.full((rows.numel(),), nkeys)
            qf = q.index_select(0, rows).float()  # [R, H, D]
            if state is not None:
                m, l, acc = state[0][rows], state[1][rows], state[2][rows]
            else:
                m = torch.full((rows.numel(), H), float("-inf"))
                l, acc = torch.zeros(rows.numel(), H), torch.zeros(rows.numel(), H, D)
            for c0 in range(0, int(lim.max()), CHUNK):
                idx = torch.arange(c0, c0 + CHUNK)
                valid = idx < nkeys
                sl = slots[idx.clamp(max=nkeys - 1)]
                k = kc.index_select(0, sl).float().repeat_interleave(grp, 1)  # [CHUNK, H, D]
                v = vc.index_select(0, sl).float().repeat_interleave(grp, 1)
                s = (qf[:, :, None, :] * k.transpose(0, 1)[None]).sum(-1) * self.scale  # [R, H, CHUNK]
                seen = (idx[None, :] < lim[:, None]) & valid[None, :]  # [R, CHUNK]
                s = s.masked_fill(~seen[:, None, :], float("-inf"))
                mc = s.amax(-1)  # [R, H]; -inf for a row that sees no key of this chunk
                live = mc > float("-inf")
                p = torch.exp(s - torch.where(live, mc, 0.0)[..., None])
                lc = p.sum(-1)
                ac = (p[..., None] * v.transpose(0, 1)[None]).sum(-2)  # [R, H, D]
                mn = torch.maximum(m, mc)
                a = torch.where(m > float("-inf"), torch.exp(m - mn), 0.0)
                b = torch.where(live, torch.exp(mc - mn), 0.0)
                l = l * a + lc * b
                acc = acc * a[..., None] + ac * b[..., None]
                m = torch.where(live, mn, m)
            if store:
                state[0][rows], state[1][rows], state[2][rows] = m, l, acc
            else:
                o = torch.where(l[..., None] > 0, acc / l.clamp(min=1e-38)[..., None], 0.0)
                out[rows] = o.to(out.dtype)
