"""Attention backends behind one interface. ``TorchNativeAttention`` is the reference backend:
it reads K/V from the KV pool through each request's slot table and runs PyTorch's
``scaled_dot_product_attention`` on padded groups of requests, so any mix of requests (different
prefix lengths, any number of new tokens each) runs in one batch.

Interface: ``meta = backend.prepare(extend_lens, prefix_lens, slot_tables)`` once per forward,
then ``backend.forward(q, k, v, layer_id, meta)`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from idleless.cache.kv_pool import KVPool


@dataclass
class AttnGroup:
    """Requests padded together. token_index [B, E] and kv_index [B, L] are int64 (padding
    points at row/slot 0); mask [B, 1, E, L] bool (True = attend); valid [B*E] bool marks real
    query rows, whose batch rows are out_rows [n_valid]."""

    token_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    out_rows: torch.Tensor


@dataclass
class AttnMetadata:
    groups: list[AttnGroup]
    num_tokens: int
    identity: bool  # one group whose valid rows are the batch rows in order: no scatter needed


def _group_requests(extend_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Bucket requests so that padding wastes little: decodes (1 new token) together, extends by
    similar size (a group may grow while its padded area stays within 1.5x its real area + 4096)."""
    decode = [i for i, e in enumerate(extend_lens) if e == 1]
    extend = sorted((i for i, e in enumerate(extend_lens) if e > 1), key=lambda i: (extend_lens[i], seq_lens[i]))
    groups = [decode] if decode else []
    cur: list[int] = []
    real = 0
    for i in extend:
        e, s = extend_lens[i], seq_lens[i]
        cand = cur + [i]
        max_e = max(extend_lens[j] for j in cand)
        max_s = max(seq_lens[j] for j in cand)
        if cur and len(cand) * max_e * max_s > 1.5 * (real + e * s) + 4096:
            groups.append(cur)
            cur, real = [i], e * s
        else:
            cur, real = cand, real + e * s
    if cur:
        groups.append(cur)
    return groups


class TorchNativeAttention:
    """Reference attention over the KV pool (causal within each request, GQA-aware)."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int):
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def prepare(self, extend_lens: list[int], prefix_lens: list[int],
                slot_tables: list[torch.Tensor]) -> AttnMetadata:
        """Build the padded index tensors shared by all layers. slot_tables[i]: int64
        [prefix_lens[i] + extend_lens[i]] (the request's KV slots, the new tokens' included)."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        groups = []
        for idx in _group_requests(extend_lens, seq_lens):
            B = len(idx)
            E = max(extend_lens[i] for i in idx)
            L = max(seq_lens[i] for i in idx)
            ext = torch.tensor([extend_lens[i] for i in idx])
            pre = torch.tensor([prefix_lens[i] for i in idx])
            st = torch.tensor([starts[i] for i in idx])
            ar_e = torch.arange(E)
            valid2d = ar_e[None, :] < ext[:, None]  # [B, E]
            token_index = torch.where(valid2d, st[:, None] + ar_e[None, :], 0)
            kv_index = torch.zeros(B, L, dtype=torch.int64)
            for b, i in enumerate(idx):
                kv_index[b, : seq_lens[i]] = slot_tables[i][: seq_lens[i]]
            # query i of request b sits at position pre+i and sees keys j <= pre+i
            qpos = pre[:, None] + ar_e[None, :]  # [B, E]
            mask = torch.arange(L)[None, None, :] <= qpos[:, :, None]  # [B, E, L]
            mask[:, :, 0] |= ~valid2d  # padded query rows attend to one key (avoids NaN rows)
            valid = valid2d.reshape(-1)
            groups.append(AttnGroup(token_index, kv_index, mask.unsqueeze(1), valid, token_index.reshape(-1)[valid]))
        identity = (len(groups) == 1 and bool(groups[0].valid.all())
                    and torch.equal(groups[0].out_rows, torch.arange(acc)))
        return AttnMetadata(groups, acc, identity)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttnMetadata, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens, already rotated) -> output [T, H, D].
        Writes k/v into the pool at out_cache_loc [T] first."""
        kc = self.pool.k_cache[layer_id]
        vc = self.pool.v_cache[layer_id]
        kc.index_copy_(0, out_cache_loc, k.to(kc.dtype))
        vc.index_copy_(0, out_cache_loc, v.to(vc.dtype))
        if meta.identity:
            return self._group(q, kc, vc, meta.groups[0]).reshape(-1, self.num_heads, self.head_dim)
        out = torch.empty_like(q)
        for g in meta.groups:
            o = self._group(q, kc, vc, g).reshape(-1, self.num_heads, self.head_dim)
            out[g.out_rows] = o[g.valid]
        return out

    def _group(self, q, kc, vc, g: AttnGroup) -> torch.Tensor:
        B, E = g.token_index.shape
        qg = q[g.token_index].transpose(1, 2)  # [B, H, E, D]
        kg = kc[g.kv_index].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        vg = vc[g.kv_index].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2)  # [B, E, H, D]
