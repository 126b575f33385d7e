"""Tensor parallelism as a module transformation (the shape of gpt-fast's ``tp.py``; Megatron-LM's
column/row split, Shoeybi et al., arXiv 1909.08053): ``shard_model`` takes a built
``LlamaForCausalLM`` and gives this rank its part of every layer, leaving the model file unchanged:

* q/k/v and gate/up: column-parallel (each rank holds H/N query heads, Hkv/N KV heads, I/N of the MLP's
  intermediate features): ``ColumnParallelMethod``, no communication;
* o_proj and down_proj: row-parallel (the matching input features) + one all_reduce of the partial
  sums: ``RowParallelMethod``;
* the embedding: ``VocabParallelEmbedding`` (rows of the vocabulary, the others zero, all_reduce);
  the lm_head: ``GatheredColumnMethod`` (its vocabulary rows, then an all_gather of the logits, so
  every rank holds the whole [R, vocab] and samples the same way);
* each attention module's head counts are this rank's, so the attention backend and the KV pool built
  with ``local_heads`` hold this rank's KV heads only.

The parallel methods wrap the linear method chosen at load (``LinearMethod`` interface:
``create_weights`` makes the local parameters, ``process_after_load`` and ``apply`` are the wrapped
method's). Each sharded parameter's ``weight_loader`` is a ``ShardedLoader``: ``take`` cuts this rank's
piece from a whole checkpoint tensor (``checkpoint_shards``), ``view`` says where it goes, so the
by-name loader (``weights.load_weights``) loads shards like whole tensors.

Numerics: a row-parallel sum is the sum of N partial sums, so logits differ from one rank's in the
last bits (float32: ~1e-6 relative); the embedding is exact (one rank adds a non-zero row).
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from idleless.dist.group import TPGroup
from idleless.model.linear import Linear, LinearMethod, StackedShards


def check_shardable(mc, size: int) -> None:
    """Raise ValueError unless ``size`` ranks divide the model ``mc`` (a ``ModelConfig``):
    num_attention_heads, num_key_value_heads and intermediate_size must be multiples of ``size``."""
    bad = [f"{name} = {getattr(mc, name)}" for name in ("num_attention_heads", "num_key_value_heads",
                                                         "intermediate_size") if getattr(mc, name) % size]
    if bad:
        raise ValueError(f"--tp-size {size} must divide the model's {', '.join(bad)} (each rank holds "
                         f"1/{size} of the attention heads, the KV heads and the MLP)")


class ShardedLoader:
    """Per-parameter loader of a parameter split along ``dim`` into ``size`` equal pieces, rank
    ``rank`` holding one. stacked: the fused checkpoint tensors (whole sizes along dim 0, e.g. q, k, v),
    each split on its own, so the local parameter stacks this rank's q, k, v pieces. rows: the local
    size along ``dim`` when it is padded (the vocabulary: ceil(V / size), the last rank's tail zero).

    ``take(tensor, shard)`` -> this rank's piece of a whole checkpoint tensor; ``view(param, shard)`` ->
    where it goes in the local parameter (ValueError for a shard id it does not hold)."""

    def __init__(self, dim: int, rank: int, size: int, stacked: Optional[dict[Hashable, int]] = None,
                 rows: Optional[int] = None):
        self.dim, self.rank, self.size, self.rows = dim, rank, size, rows
        self.local = StackedShards({k: n // size for k, n in stacked.items()}) if stacked else None

    @property
    def shards(self) -> tuple:
        return self.local.shards if self.local else (None,)

    def view(self, param: torch.Tensor, shard: Optional[Hashable]) -> torch.Tensor:
        if self.local is not None:
            return self.local.view(param, shard)
        if shard is not None:
            raise ValueError(f"shard {shard!r} given for a parameter loaded whole")
        return param.data

    def take(self, tensor: torch.Tensor, shard: Optional[Hashable]) -> torch.Tensor:
        n = tensor.shape[self.dim]
        per = self.rows if self.rows is not None else n // self.size
        start = min(self.rank * per, n)
        piece = tensor.narrow(self.dim, start, min(per, n - start))
        if piece.shape[self.dim] < per:  # the vocabulary's padded tail
            pad = [0, 0] * (tensor.dim() - 1 - self.dim) + [0, per - piece.shape[self.dim]]
            piece = F.pad(piece, pad)
        return piece


class ColumnParallelMethod(LinearMethod):
    """Output features split across ranks: the local weight is [out / N, in] (fused shards split each
    on its own), bias [out / N]; ``apply`` is ``base``'s on it: x [T, in] -> [T, out / N]."""

    def __init__(self, base: LinearMethod, group: TPGroup):
        self.base, self.group = base, group

    def create_weights(self, layer, in_features, out_features, bias, shard_sizes=None, weight=None):
        g = self.group
        local = {k: n // g.size for k, n in shard_sizes.items()} if shard_sizes else None
        self.base.create_weights(layer, in_features, -(-out_features // g.size), bias, local, weight)
        if weight is None:  # a shared (tied) weight keeps its owner's loader
            layer.weight.weight_loader = ShardedLoader(0, g.rank, g.size, shard_sizes,
                                                       rows=None if shard_sizes else layer.weight.shape[0])
        if bias:
            layer.bias.weight_loader = ShardedLoader(0, g.rank, g.size, shard_sizes)

    def process_after_load(self, layer):
        return self.base.process_after_load(layer)

    def apply(self, layer, x):
        return self.base.apply(layer, x)


class GatheredColumnMethod(ColumnParallelMethod):
    """The lm_head: column-parallel over the vocabulary (ceil(V / N) rows each, padded), then the
    ranks' logits gathered: x [R, hidden] -> [R, V] on every rank."""

    def __init__(self, base: LinearMethod, group: TPGroup, vocab_size: int):
        super().__init__(base, group)
        self.vocab_size = vocab_size

    def apply(self, layer, x):
        return self.group.all_gather(self.base.apply(layer, x))[:, : self.vocab_size]


class RowParallelMethod(LinearMethod):
    """Input features split across ranks: the local weight is [out, in / N]; ``apply`` sums the
    ranks' partial products (all_reduce): x [T, in / N] -> [T, out]. A bias is refused (it would be
    added N times)."""

    def __init__(self, base: LinearMethod, group: TPGroup):
        self.base, self.group = base, group

    def create_weights(self, layer, in_features, out_features, bias, shard_sizes=None, weight=None):
        if bias or shard_sizes or weight is not None:
            raise ValueError("a row-parallel linear takes neither a bias, fused shards nor a shared weight")
        g = self.group
        self.base.create_weights(layer, in_features // g.size, out_features, False)
        layer.weight.weight_loader = ShardedLoader(1, g.rank, g.size)

    def process_after_load(self, layer):
        return self.base.process_after_load(layer)

    def apply(self, layer, x):
        return self.group.all_reduce(self.base.apply(layer, x))


class VocabParallelEmbedding(nn.Module):
    """The token embedding split by vocabulary rows: this rank holds rows [rank * P, (rank + 1) * P) of
    the padded table (P = ceil(vocab_size / N)), looks up the ids it holds, zeros for the others, and the
    ranks' rows are summed: input_ids int64 [T] -> [T, hidden] in the weight's dtype (exact: one rank
    contributes each row)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        super().__init__()
        self.group = group
        self.rows = -(-vocab_size // group.size)
        self.start = group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = ShardedLoader(0, group.rank, group.size, rows=self.rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0))


def _reshard(layer: Linear, method: LinearMethod, weight: Optional[nn.Parameter] = None) -> None:
    """Give ``layer`` the parameters ``method`` makes for its whole shape (the built ones are dropped)."""
    out_features, in_features = layer.weight.shape
    stacked = getattr(layer.weight, "weight_loader", None)
    shard_sizes = stacked.sizes if isinstance(stacked, StackedShards) else None
    bias = layer.bias is not None
    del layer.weight, layer.bias
    layer.method = method
    method.create_weights(layer, in_features, out_features, bias, shard_sizes, weight)


def shard_model(model: nn.Module, group: TPGroup) -> None:
    """Turn a built, not yet loaded ``LlamaForCausalLM`` into this rank's shard, in place (see the
    module docstring). Run before ``model.to(dtype)`` and before loading weights (through
    ``checkpoint_shards``). Raises ValueError when ``group.size`` does not divide the heads
    (``check_shardable``)."""
    cfg, n = model.cfg, group.size
    check_shardable(cfg, n)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        base = attn.qkv_proj.method
        _reshard(attn.qkv_proj, ColumnParallelMethod(base, group))
        _reshard(attn.o_proj, RowParallelMethod(base, group))
        _reshard(mlp.gate_up_proj, ColumnParallelMethod(base, group))
        _reshard(mlp.down_proj, RowParallelMethod(base, group))
        attn.num_heads //= n
        attn.num_kv_heads //= n
        attn.q_size //= n
        attn.kv_size //= n
    model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
    tied = model.embed_tokens.weight if cfg.tie_word_embeddings else None
    _reshard(model.lm_head, GatheredColumnMethod(model.lm_head.method, group, cfg.vocab_size), tied)


def checkpoint_shards(model: nn.Module, named_tensors):
    """(checkpoint name, whole tensor) pairs -> (name, this rank's piece) for the by-name loader: the
    piece each sharded parameter's ``ShardedLoader.take`` cuts; other tensors (norms) pass whole, and
    names the model does not know pass unchanged for the loader to refuse."""
    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        target = model.checkpoint_target(name)
        param = params.get(target[0]) if target is not None else None
        loader = getattr(param, "weight_loader", None)
        if isinstance(loader, ShardedLoader) and isinstance(tensor, torch.Tensor):
            tensor = loader.take(tensor, target[1])
        yield name, tensor
