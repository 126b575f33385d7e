"""Padded flash attention: tails and shared segments padded into groups of similar size and run through
PyTorch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``), which also returns
the log-sum-exp. Torch-native (no kernels of ours needed; the cascade merge may use ``cpu_kernels.merge``),
and the only family that handles a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan, Tails

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for an int64 index of any shape: [*index.shape, *t.shape[1:]]. index_select copies
    whole rows (memcpy), faster than advanced indexing for the KV pool's short rows."""
    return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])


@dataclass
class TailGroup:
    """Requests' tails padded together. token_index [B, E] and kv_index [B, L] int64 (padding
    points at row/slot 0); mask [B, 1, E*G, L] additive float (0 = attend, -inf = not), rows
    repeated G times for grouped-query heads, None when every row sees every key (decode rows of
    equal length); valid [B*E] bool marks real query rows, whose batch rows are out_rows [n_valid].
    causal: a lone request with no earlier keys (a plain prefill, E == L): the kernel's own causal
    mode, which skips the upper triangle, on K/V expanded to the query heads; mask is None then."""

    token_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor
    out_rows: torch.Tensor
    causal: bool = False


@dataclass
class SegmentGroup:
    """Shared KV stretches attended in one kernel call: S stretches, each shared by several requests
    and fully visible to all their query rows, with pairwise disjoint rows, padded to Rmax rows and
    Lmax keys. q_index [S, Rmax] batch rows (padding -> row 0); kv_index [S, Lmax] slots (padding ->
    slot 0), or None when S == 1 and the slots are the ascending run first_slot .. first_slot+Lmax-1
    (a prompt prefilled in one piece usually is), read as a view of the pool instead of a copy;
    mask [S, 1, Rmax*G, Lmax] additive, None when nothing is padded; valid [S*Rmax] bool marks real
    rows, whose batch rows are out_rows [n_valid] (distinct), at rows src_rows of the padded output."""

    q_index: torch.Tensor
    kv_index: torch.Tensor | None
    first_slot: int
    num_keys: int
    mask: torch.Tensor | None
    valid: torch.Tensor
    out_rows: torch.Tensor
    src_rows: torch.Tensor  # [n_valid] rows of the padded kernel output that are real (valid.nonzero())


def group_requests(extend_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Bucket requests so that padding wastes little: one-token requests together, longer ones by
    similar size (a group grows while its padded area stays within 1.5x its real area + 4096)."""
    single = [i for i, e in enumerate(extend_lens) if e == 1]
    multi = sorted((i for i, e in enumerate(extend_lens) if e > 1), key=lambda i: (extend_lens[i], kv_lens[i]))
    groups = [single] if single else []
    cur: list[int] = []
    real = 0
    for i in multi:
        e, s = extend_lens[i], kv_lens[i]
        cand = cur + [i]
        max_e = max(extend_lens[j] for j in cand)
        max_s = max(kv_lens[j] for j in cand)
        if cur and len(cand) * max_e * max_s > 1.5 * (real + e * s) + 4096:
            groups.append(cur)
            cur, real = [i], e * s
        else:
            cur, real = cand, real + e * s
    if cur:
        groups.append(cur)
    return groups


class PaddedFlashAttention(AttentionBackend):
    """Tails and segments in PyTorch's CPU flash kernel, padded (any tail, any segment, any window).

    dtype: the KV pool's (masks are made in it). kernels: a CpuKernels of that dtype for the cascade
    merge, or None (merged with PyTorch ops)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kernels=None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.dtype = dtype
        self.kernels = kernels
        self._merge = self._merge_kernel if kernels is not None else self._merge_torch  # chosen once

    # ------------------------------------------------------------------ plan

    def prepare(self, work: AttnWork) -> BackendPlan:
        tails = [] if work.tails is None else self._tail_groups(work.tails, work.window)
        return BackendPlan(tails, self._segment_groups(work.segments))

    def covers_batch(self, plan: BackendPlan, num_tokens: int) -> bool:
        if plan.segments or len(plan.tails) != 1:
            return False
        g = plan.tails[0]
        return torch.equal(g.out_rows, torch.arange(num_tokens)) and bool(g.valid.all())

    def _tail_groups(self, t: Tails, window: int | None) -> list[TailGroup]:
        kv_lens = [p + n for p, n in zip(t.past, t.new)]
        G = self.group
        out = []
        for idx in group_requests(t.new, kv_lens):
            nb = len(idx)
            E = max(t.new[j] for j in idx)
            L = max(kv_lens[j] for j in idx)
            ext = torch.tensor([t.new[j] for j in idx])
            pre = torch.tensor([t.past[j] for j in idx])
            st = torch.tensor([t.starts[j] for j in idx])
            ar_e = torch.arange(E)
            valid2d = ar_e[None, :] < ext[:, None]  # [nb, E]
            token_index = torch.where(valid2d, st[:, None] + ar_e[None, :], 0)
            kv_index = torch.zeros(nb, L, dtype=torch.int64)
            for b, j in enumerate(idx):
                kv_index[b, : kv_lens[j]] = t.slots[j]
            # query j of a tail sits at tail position pre+j and sees tail keys k <= pre+j
            qpos = (pre[:, None] + ar_e[None, :])[:, :, None]
            allowed = torch.arange(L)[None, None, :] <= qpos
            if window is not None:  # no segments then, so tail positions are absolute positions
                allowed &= torch.arange(L)[None, None, :] > qpos - window
            allowed[:, :, 0] |= ~valid2d  # padded query rows attend to one key (no NaN rows)
            causal = nb == 1 and E == L and E > 1 and window is None and int(pre[0]) == 0
            mask = None
            if not causal and not bool(allowed.all()):
                mask = torch.zeros(nb, E, L, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
                mask = mask[:, :, None, :].expand(nb, E, G, L).reshape(nb, 1, E * G, L)
            valid = valid2d.reshape(-1)
            out.append(TailGroup(token_index, kv_index, mask, valid, token_index.reshape(-1)[valid], causal))
        return out

    def _segment_groups(self, segs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[SegmentGroup]:
        """Pack segments (rows [R], slots [L]) into kernel calls: by length, a group takes a segment
        whose rows it does not hold yet while its padded area stays within 1.5x its real area + 4096
        (the merge after the call writes each row once, so a group's rows must be distinct)."""
        groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        cur, cur_rows, real = [], set(), 0
        for rows, slots in sorted(segs, key=lambda s: s[1].numel()):
            r, l = rows.numel(), slots.numel()
            max_r = max([r] + [x.numel() for x, _ in cur])
            max_l = max([l] + [y.numel() for _, y in cur])
            rset = set(rows.tolist())
            if cur and (rset & cur_rows or (len(cur) + 1) * max_r * max_l > 1.5 * (real + r * l) + 4096):
                groups.append(cur)
                cur, cur_rows, real = [], set(), 0
            cur.append((rows, slots))
            cur_rows |= rset
            real += r * l
        if cur:
            groups.append(cur)
        G, dtype = self.group, self.dtype
        out = []
        for grp in groups:
            S = len(grp)
            Rm = max(rows.numel() for rows, _ in grp)
            Lm = max(slots.numel() for _, slots in grp)
            q_index = torch.zeros(S, Rm, dtype=torch.int64)
            kv_index = torch.zeros(S, Lm, dtype=torch.int64)
            rlen = torch.tensor([rows.numel() for rows, _ in grp])
            llen = torch.tensor([slots.numel() for _, slots in grp])
            for j, (rows, slots) in enumerate(grp):
                q_index[j, : rows.numel()] = rows
                kv_index[j, : slots.numel()] = slots
            valid2d = torch.arange(Rm)[None, :] < rlen[:, None]  # [S, Rm]
            mask = None
            if bool((rlen < Rm).any() or (llen < Lm).any()):
                allowed = (torch.arange(Lm)[None, None, :] < llen[:, None, None]).expand(S, Rm, Lm).clone()
                allowed[:, :, 0] |= ~valid2d  # padded query rows attend to one key (no NaN rows)
                mask = torch.zeros(S, Rm, Lm, dtype=dtype).masked_fill_(~allowed, float("-inf"))
                mask = mask[:, :, None, :].expand(S, Rm, G, Lm).reshape(S, 1, Rm * G, Lm)
            first, view = int(kv_index[0, 0]), False
            if S == 1:
                sl = grp[0][1]
                view = int(sl[-1]) - first == Lm - 1 and bool((sl.diff() == 1).all())
            valid = valid2d.reshape(-1)
            out.append(SegmentGroup(q_index, None if view else kv_index, first, Lm, mask, valid,
                                    q_index.reshape(-1)[valid], valid.nonzero().reshape(-1)))
        return out

    # ------------------------------------------------------------------ run

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        if out is None:  # covers_batch: the one group's output is the batch's
            return self._tail(q, kc, vc, plan.tails[0])[0]
        for g in plan.tails:
            o, l = self._tail(q, kc, vc, g)
            if lse is None:
                out[g.out_rows] = o[g.valid]
            else:
                out[g.out_rows] = o[g.valid].float()
                lse[g.out_rows] = l[g.valid]
        for s in plan.segments:
            o, l = self._segment(q, kc, vc, s)
            self._merge(out, lse, o, l, s)
        return out

    def _merge_kernel(self, out, lse, o, l, s: SegmentGroup) -> None:
        self.kernels.merge(out, lse, o, l, s.src_rows, s.out_rows)  # o, l: the padded kernel output

    @staticmethod
    def _merge_torch(out, lse, o, l, s: SegmentGroup) -> None:
        if s.mask is not None:
            o, l = o[s.valid], l[s.valid]
        rows = s.out_rows
        prev_l = lse[rows]
        new_l = torch.logaddexp(prev_l, l)
        out[rows] = out[rows] * torch.exp(prev_l - new_l)[..., None] + o.float() * torch.exp(l - new_l)[..., None]
        lse[rows] = new_l

    def _tail(self, q, kc, vc, g: TailGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [B*E, H, D], lse [B*E, H]) for a padded tail group."""
        if g.causal:  # [1, H, E, D] against K/V repeated to H heads (q head h reads kv head h // G)
            E, G, H, D = g.token_index.shape[1], self.group, self.num_heads, self.head_dim
            qh = _rows(q, g.token_index).view(1, E, H, D).transpose(1, 2)
            kh = _rows(kc, g.kv_index).to(q.dtype).repeat_interleave(G, dim=2).transpose(1, 2)
            vh = _rows(vc, g.kv_index).to(q.dtype).repeat_interleave(G, dim=2).transpose(1, 2)
            o, lse = _flash(qh, kh, vh, is_causal=True, scale=self.scale)
            return o.transpose(1, 2).reshape(E, H, D), lse.transpose(1, 2).reshape(E, H)
        kg = _rows(kc, g.kv_index).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        vg = _rows(vc, g.kv_index).permute(0, 2, 1, 3)
        return self._grouped_flash(q, g.token_index, kg, vg, g.mask)

    def _grouped_flash(self, q, row_index, k, v, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """One flash call for B padded sets of query rows. row_index [B, E] batch rows of q;
        k, v [B or 1, Hkv, L, D]; mask [B, 1, E*G, L] or None. The G query heads of each KV head are
        folded into the row axis (rows e*G + g), so K/V are read once per KV head, not per query head.
        -> (out [B*E, H, D], lse [B*E, H] float32)."""
        B, E = row_index.shape
        Hkv, G, D = self.num_kv_heads, self.group, self.head_dim
        qg = _rows(q, row_index).view(B, E, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, E * G, D)
        o, lse = _flash(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=None if mask is None else mask.to(q.dtype),
                        scale=self.scale)
        o = o.view(B, Hkv, E, G, D).permute(0, 2, 1, 3, 4).reshape(B * E, Hkv * G, D)
        lse = lse.view(B, Hkv, E, G).permute(0, 2, 1, 3).reshape(B * E, Hkv * G)
        return o, lse

    def _segment(self, q, kc, vc, g: SegmentGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [S*Rmax, H, D], lse [S*Rmax, H]) of a segment group's padded rows against its keys
        (the real rows are g.valid / g.src_rows)."""
        if g.kv_index is None:  # a view: the kernel reads strided keys, nothing is copied
            end = g.first_slot + g.num_keys
            ks = kc[g.first_slot:end].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, D]
            vs = vc[g.first_slot:end].permute(1, 0, 2).unsqueeze(0)
        else:
            ks = _rows(kc, g.kv_index).permute(0, 2, 1, 3)  # [S, Hkv, Lmax, D]
            vs = _rows(vc, g.kv_index).permute(0, 2, 1, 3)
        return self._grouped_flash(q, g.q_index, ks, vs, g.mask)
