"""Building blocks of Llama-family models: RMSNorm, rotary embedding, gated MLP (linear layers: ``linear``).

The glue between matmuls (norm, rope, SwiGLU) runs through an ``ops`` object given at construction
(``ops.select_ops``: eager PyTorch or the fused CPU kernels), the matmuls through a linear method.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from idleless.model.linear import Linear, LinearMethod

if TYPE_CHECKING:
    from idleless.model.ops import Ops


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, arXiv 1910.07467) computed in float32, as HF Llama does.

    ``norm(x)``: x [T, hidden] any float dtype -> same shape and dtype. ``norm(x, residual)``: the
    residual add before the norm fused in (vLLM's fused_add_rms_norm): returns (norm(x + residual),
    x + residual), the sum rounded to the dtype as HF's ``residual + hidden`` (the fused kernels write
    it into ``residual`` in place). ops: the glue backend (``ops.select_ops``)."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rope scaling (Meta's reference, as in HF `_compute_llama3_parameters`)."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer, arXiv 2104.09864) in HF's rotate-half layout.

    Supports rope_scaling types: none/default, ``linear`` and ``llama3``. cos/sin tables
    [max_positions, head_dim] are float32. Per forward: ``cos, sin = rope.tables(positions [T], dtype)``
    (each [T, 1, head_dim], looked up once for all layers), then per layer
    ``RotaryEmbedding.apply(x [T, N, head_dim], cos, sin)`` -> rotated x (q and k heads together)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in ``dtype`` (HF also rotates in the activations' dtype)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @classmethod
    def apply(cls, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + cls._rotate_half(x) * sin


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one [2I, H] weight (checkpoint
    shards 0 = gate_proj, 1 = up_proj). ops: the glue backend; method: the linear method."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: Ops,
                 method: Optional[LinearMethod] = None):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, method=method,
                                   shard_sizes={0: intermediate_size, 1: intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, method=method)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
