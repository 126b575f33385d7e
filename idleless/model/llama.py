"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Qwen2, Mistral) with our attention over
the KV pool. The model never knows about requests: it sees flat token rows and attention metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from idleless.model.attention import AttnMetadata, TorchNativeAttention
from idleless.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from idleless.model.loader import ModelConfig


@dataclass
class StepContext:
    """What every layer reads in one forward: positions / out_cache_loc int64 [T]; rope_cs the
    (cos, sin) tables [T, 1, head_dim] of the eager path (None when the fused kernels rotate from
    the rope module's float32 tables); the attention backend and its metadata for this batch."""

    positions: torch.Tensor
    rope: RotaryEmbedding
    rope_cs: Optional[tuple[torch.Tensor, torch.Tensor]]
    backend: TorchNativeAttention
    meta: AttnMetadata
    out_cache_loc: torch.Tensor


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV projection ([(H + 2*Hkv) * D, hidden]) and optional bias."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.kernels = None  # CpuKernels (rope in place) or None

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        nqk = self.num_heads + self.num_kv_heads  # q and k heads rotated in one pass
        qk = qkv[:, : self.q_size + self.kv_size].view(T, nqk, self.head_dim)
        if self.kernels is not None:
            self.kernels.rope(qk, ctx.positions, ctx.rope.cos, ctx.rope.sin)
        else:
            qk = RotaryEmbedding.apply(qk, *ctx.rope_cs)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        o = ctx.backend.forward(q, k, v, self.layer_id, ctx.meta, ctx.out_cache_loc)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """One decoder layer, residual carried beside the hidden state (vLLM's layout): takes the previous
    layer's MLP output h and the residual stream (None at the first layer, where h is the embedding),
    returns this layer's MLP output and the residual stream, so each residual add fuses into a norm."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], ctx: StepContext):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, ...) -> logits [len(sample_rows), vocab] float32."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # a tied lm_head shares the embedding's Parameter (so it may still be prepacked on its own)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size,
                              weight=self.embed_tokens.weight if cfg.tie_word_embeddings else None)
        self.kernels = None

    def use_kernels(self, kernels) -> None:
        """Run the layer glue (norms, rope, SwiGLU) through ``kernels`` (a cpu_kernels.CpuKernels of
        the model dtype), or through eager PyTorch ops with None."""
        self.kernels = kernels
        for m in self.modules():
            if isinstance(m, (RMSNorm, GatedMLP, LlamaAttention)):
                m.kernels = kernels

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend, meta, out_cache_loc, sample_rows):
        h = self.embed_tokens(input_ids)
        if self.kernels is not None:  # the rope kernel reads its table unchecked: one bound check here
            if positions.numel() and int(positions.max()) >= self.rope.cos.shape[0]:
                raise IndexError(f"position {int(positions.max())} is past the rope table "
                                 f"({self.rope.cos.shape[0]} positions, the context length)")
        rope_cs = None if self.kernels is not None else self.rope.tables(positions, h.dtype)
        ctx = StepContext(positions, self.rope, rope_cs, backend, meta, out_cache_loc)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, ctx)
        h, _ = self.norm(h[sample_rows], residual[sample_rows])
        return self.lm_head(h).float()

    def prepack_weights(self) -> int:
        """Pre-pack every linear's weight (``Linear.prepack``); returns the extra bytes held."""
        extra = 0
        for m in self.modules():
            if isinstance(m, Linear):
                m.prepack()
                extra += m.weight.numel() * m.weight.element_size()
        return extra

    def pack_amx(self, kernels) -> int:
        """Give every linear an AMX copy of its weight for decode-sized batches (``Linear.pack_amx``);
        returns the extra bytes held."""
        return sum(m.pack_amx(kernels) for m in self.modules() if isinstance(m, Linear))

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises KeyError naming a missing tensor."""

        def get(name):
            if name not in state_dict:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state_dict[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
            self.norm.weight.copy_(get("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                self.lm_head.weight.copy_(get("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = layer.self_attn
                a.qkv_proj.weight.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if a.qkv_proj.bias is not None:
                    a.qkv_proj.bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                a.o_proj.weight.copy_(get(p + "self_attn.o_proj.weight"))
                layer.mlp.gate_up_proj.weight.copy_(
                    torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
                layer.mlp.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
