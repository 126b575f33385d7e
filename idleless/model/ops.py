"""The glue between a layer's matmuls (RMSNorm with the residual add, rotary embedding, SwiGLU), one
implementation per backend, chosen once at start-up (``select_ops``) and given to the norms, the MLPs
and the attention layers at construction; the hot path tests no flag.

``EagerOps``: PyTorch ops, any device and dtype (the reference). ``CpuKernelOps``: the fused C kernels of
``cpu_kernels`` (CPU, float32 / bfloat16), which round where the eager ops round.

Interface (x, residual [T, hidden]; weight [hidden]; gate_up [T, 2I]; qk [T, heads, head_dim]):
    rms_norm(x, weight, eps) -> norm(x)
    add_rms_norm(x, residual, weight, eps) -> (norm(x + residual), x + residual)
    silu_mul(gate_up) -> silu(gate) * up  [T, I]
    rope_state(rope, positions, dtype) -> what ``rope`` reads, made once per forward for all layers
    rope(qk, state) -> qk rotated (in place or new)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from idleless.model.layers import RotaryEmbedding


class Ops(Protocol):
    """The glue interface (module docstring); implemented by EagerOps and CpuKernelOps."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope_state(self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any: ...

    def rope(self, qk: torch.Tensor, state: Any) -> torch.Tensor: ...


class EagerOps:
    """The glue in eager PyTorch, as Hugging Face computes it (RMSNorm in float32, rounded once)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # F.rms_norm accumulates in float32 and rounds once to x's dtype: HF's float32 normalisation,
        # then the cast, then the weight in x's dtype (checked bit-exact against the unfused ops)
        return weight * F.rms_norm(x, weight.shape, eps=eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        residual = x + residual  # rounded to the dtype, as HF's ``residual + hidden``
        return weight * F.rms_norm(residual, weight.shape, eps=eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def rope_state(self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin) [T, 1, head_dim] in ``dtype``; a position past the table raises IndexError."""
        return rope.tables(positions, dtype)

    def rope(self, qk: torch.Tensor, state) -> torch.Tensor:
        return RotaryEmbedding.apply(qk, *state)


class CpuKernelOps:
    """The glue in ``cpu_kernels`` (kernels: a CpuKernels of the model dtype). The residual add of
    ``add_rms_norm`` is written into ``residual`` in place; rope rotates q/k in place from the rope
    module's float32 tables."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.rms_norm = kernels.rms_norm  # the same signature: bound once, no wrapper call per norm
        self.silu_mul = kernels.silu_mul

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        return self.kernels.rms_norm(x, weight, eps, residual), residual

    def rope_state(self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        """(positions, cos, sin) for the kernel, which reads its table unchecked: positions are checked
        here, once per forward. Raises IndexError for a position past the table (the context length)."""
        if positions.numel() and int(positions.max()) >= rope.cos.shape[0]:
            raise IndexError(f"position {int(positions.max())} is past the rope table "
                             f"({rope.cos.shape[0]} positions, the context length)")
        return positions, rope.cos, rope.sin

    def rope(self, qk: torch.Tensor, state) -> torch.Tensor:
        self.kernels.rope(qk, *state)
        return qk


EAGER = EagerOps()


def select_ops(kernels) -> Ops:
    """The glue backend: the fused kernels when loaded (``cpu_kernels.load`` gave a CpuKernels), else eager."""
    return EAGER if kernels is None else CpuKernelOps(kernels)
