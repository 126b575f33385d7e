"""Building blocks of Llama-family models: RMSNorm, rotary embedding, linear, gated MLP.

Linear layers hold a plain weight tensor and call ``F.linear`` so that a quantized linear (later)
can replace one without touching the model code. On CPU in bfloat16 they can also hold a copy of the
weight pre-packed into oneDNN's blocked layout (``Linear.prepack``): ``F.linear`` re-packs the weight on
every call, which at decode (few rows, every weight read once per step) costs about as much as the
product itself; the packed copy gives bit-identical results in 0.6-0.8x the time. On CPUs with AMX
tiles they also hold a copy in ``cpu_kernels.amx_linear``'s layout (``Linear.pack_amx``) for batches of
up to 64 rows (decode steps), where oneDNN's per-call cost is high: 120 SmolLM2 layers at 64 rows in
15 ms against 21 ms.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, arXiv 1910.07467) computed in float32, as HF Llama does.

    ``norm(x)``: x [T, hidden] any float dtype -> same shape and dtype. ``norm(x, residual)``: the
    residual add before the norm fused in (vLLM's fused_add_rms_norm): returns (norm(x + residual),
    x + residual), the sum rounded to the dtype as HF's ``residual + hidden``; with ``kernels`` set
    (cpu_kernels) the sum is written into ``residual`` in place."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.kernels = None  # CpuKernels of the model dtype, or None for the eager path

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.kernels is not None:
            out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self.weight * F.rms_norm(residual, self.weight.shape, eps=self.eps), residual
        # F.rms_norm accumulates in float32 and rounds once to x's dtype: HF's float32 normalisation,
        # then the cast, then the weight in x's dtype (checked bit-exact against the unfused ops)
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


def can_prepack(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``Linear.prepack`` applies: bfloat16 on a CPU build with oneDNN."""
    return (device == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    """y = x W^T (+ b). x: [T, in_features] -> [T, out_features], model dtype.
    weight: [out_features, in_features] (a shared Parameter is allowed: a tied lm_head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 weight: Optional[nn.Parameter] = None):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(out_features, in_features),
                                                                     requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: Optional[torch.Tensor] = None  # oneDNN-blocked copy of weight (prepack), not a parameter
        self.amx: Optional[torch.Tensor] = None  # amx_linear's copy of weight (pack_amx), not a parameter
        self.kernels = None  # the cpu_kernels.CpuKernels that runs self.amx

    def prepack(self) -> None:
        """Keep a oneDNN-packed copy of the current weight (same bytes again) and use it in forward.
        Call again after the weight changes. Requires ``can_prepack(weight.dtype)``."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PREPACK_ROWS_HINT)

    def pack_amx(self, kernels) -> int:
        """Keep a copy of the current weight in ``kernels.amx_linear``'s layout and run batches of 1 to
        ``AMX_LINEAR_MAX_ROWS`` rows there (larger ones stay on oneDNN / F.linear). Call again after
        the weight changes. Returns the bytes held: 0 where it does not apply (no AMX, a dimension
        not a multiple of 32)."""
        self.amx = kernels.amx_pack_weight(self.weight.detach())
        self.kernels = kernels if self.amx is not None else None
        return 0 if self.amx is None else self.amx.numel() * self.amx.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and 0 < x.shape[0] <= self.kernels.AMX_LINEAR_MAX_ROWS:
            return self.kernels.amx_linear(x, self.amx, self.weight.shape[0], self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# Row-count hint for the packed layout; the result is the same for any number of rows (checked bit-exact
# against F.linear for 1..2048 rows), only speed differs, and this hint was the best overall here.
PREPACK_ROWS_HINT = 2048


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
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one [2I, H] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.kernels = None  # CpuKernels (fused silu * up) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
