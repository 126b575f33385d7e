"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Qwen2, Mistral) with our attention over
the KV pool. The model never knows about requests: it sees flat token rows and attention metadata.

Built with the backends chosen once at start-up: ``ops`` (the glue between matmuls, ``ops.select_ops``)
and a linear method (``linear.select_linear_method``). Weights come in by checkpoint name through
``weights.load_weights``, which asks ``checkpoint_target`` where each tensor goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from idleless.model.attention import AttnMetadata, CompositeAttention
from idleless.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from idleless.model.linear import Linear, LinearMethod
from idleless.model.loader import ModelConfig
from idleless.model.ops import EAGER, Ops


@dataclass
class StepContext:
    """What every layer reads in one forward: rope, the ops' rope state for this batch's positions
    (``ops.rope_state``); the attention backend and its metadata for this batch; out_cache_loc int64 [T]."""

    rope: Any
    backend: CompositeAttention
    meta: AttnMetadata
    out_cache_loc: torch.Tensor


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV projection ([(H + 2*Hkv) * D, hidden], checkpoint shards q, k, v)
    and optional bias."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ops: Ops, method: Optional[LinearMethod]):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               method=method, shard_sizes={"q": self.q_size, "k": self.kv_size, "v": self.kv_size})
        self.o_proj = Linear(self.q_size, cfg.hidden_size, method=method)
        self.ops = ops

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        nqk = self.num_heads + self.num_kv_heads  # q and k heads rotated in one pass
        qk = qkv[:, : self.q_size + self.kv_size].view(T, nqk, self.head_dim)
        qk = self.ops.rope(qk, ctx.rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        o = ctx.backend.forward(q, k, v, self.layer_id, ctx.meta, ctx.out_cache_loc)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """One decoder layer, residual carried beside the hidden state (vLLM's layout): takes the previous
    layer's MLP output h and the residual stream (None at the first layer, where h is the embedding),
    returns this layer's MLP output and the residual stream, so each residual add fuses into a norm."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ops: Ops, method: Optional[LinearMethod]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, layer_id, ops, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ops, method)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], ctx: StepContext):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# checkpoint name pieces fused into one of our parameters: (checkpoint piece, our piece, shard id)
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, ...) -> logits [len(sample_rows), vocab] float32,
    which is ``compute_logits(hidden_states(...))``: a caller that wants the logits of many rows (prompt
    logprobs) takes the hidden states and computes the logits block by block.

    ops: the glue backend (default eager PyTorch); method: the linear method of every linear layer
    (default plain ``F.linear``; the lm_head takes its ``head_method`` when it has one). Parameters are
    created uninitialised: load them with ``weights.load_weights``."""

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: Optional[Ops] = None,
                 method: Optional[LinearMethod] = None):
        super().__init__()
        ops = ops if ops is not None else EAGER
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ops, method) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # a tied lm_head shares the embedding's Parameter (its linear method still packs its own copy)
        # a quantised method may name another for the output layer (kept at 8 bits under int4 weights)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, method=getattr(method, "head_method", method),
                              weight=self.embed_tokens.weight if cfg.tie_word_embeddings else None)

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend, meta, out_cache_loc, sample_rows):
        return self.compute_logits(self.hidden_states(input_ids, positions, backend, meta, out_cache_loc,
                                                      sample_rows))

    @torch.inference_mode()
    def hidden_states(self, input_ids, positions, backend, meta, out_cache_loc, rows) -> torch.Tensor:
        """Run every layer over the T rows (writing their K/V) and return the final-normed hidden states
        of ``rows`` (int64 [R] indices into T): [R, hidden] in the model's dtype."""
        h = self.embed_tokens(input_ids)
        ctx = StepContext(self.ops.rope_state(self.rope, positions, h.dtype), backend, meta, out_cache_loc)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, ctx)
        h, _ = self.norm(h[rows], residual[rows])
        return h

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The lm_head over final hidden states h [R, hidden]: float32 logits [R, vocab]."""
        return self.lm_head(h).float()

    def checkpoint_target(self, name: str) -> Optional[tuple[str, Optional[object]]]:
        """Where the HF checkpoint tensor ``name`` goes: (our parameter name, shard id or None), or None
        for a tensor the model does not use (rotary ``inv_freq`` buffers of old checkpoints;
        ``lm_head.weight`` when the embeddings are tied: the head is the embedding, as in
        transformers). Raises ValueError for a name outside HF's layout (``model.*`` and ``lm_head.weight``);
        a name inside it that names no parameter is left to the loader to refuse."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        if name == "lm_head.weight":
            return name, None
        if not name.startswith("model."):
            raise ValueError(f"unknown weight {name!r}: not an HF checkpoint name of this model")
        name = name[len("model."):]
        for theirs, ours, shard in _STACKED:
            piece = f".{theirs}."
            if piece in name:
                return name.replace(piece, f".{ours}."), shard
        return name, None
