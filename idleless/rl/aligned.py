"""Trainer logprobs whose values are the engine's, bit for bit, and whose gradient is autograd's.

A trainer differentiates its own forward (transformers' or any eager PyTorch model): its log-probabilities
of the sampled tokens differ from the ones the engine reported when it sampled them in the last bits
(other kernels, other summation orders), so the importance ratio of an on-policy step is not exactly 1
and the mismatch grows with training (the "true on-policy" problem of RL post-training).

``aligned_logprobs(autograd_logp, engine_logp, mask)`` is one autograd function: its forward returns the
engine's values where ``mask`` is set (computed by ``SequenceScorer`` with the engine's own model code and
deterministic kernels on the same weights, which equal the rollout's logprobs bitwise, DESIGN.md section 7
"Numerics") and the autograd values elsewhere; its backward hands the incoming gradient to the autograd
values unchanged. So the loss is evaluated on exactly the rollout's numbers (``max |train - rollout| ==
0``) and the gradient is the trainer's eager one at the same weights (a straight-through estimator: the
eager activations the gradient is taken at differ from the kernels' by rounding only).
"""

from __future__ import annotations

import torch


class _EngineValues(torch.autograd.Function):
    """forward(autograd_values, engine_values, mask) -> engine values where mask, autograd values elsewhere;
    backward: the gradient flows to ``autograd_values`` as the identity (none to the others)."""

    @staticmethod
    def forward(ctx, autograd_values: torch.Tensor, engine_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, engine_values.to(autograd_values.dtype), autograd_values.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def aligned_logprobs(autograd_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The trainer's logprobs with the engine's values (module docstring).

    autograd_logp: float [B, L], the trainer's forward (requires grad); engine_logp: float32 [B, L], the
    engine kernels' logprobs of the same tokens (``SequenceScorer.score`` placed at their positions);
    mask: [B, L], bool or 0/1, where the engine's values are used (the completion tokens). Returns
    [B, L] in autograd_logp's dtype. Raises ValueError when the shapes differ."""
    if autograd_logp.shape != engine_logp.shape or autograd_logp.shape != mask.shape:
        raise ValueError(f"shapes differ: autograd {tuple(autograd_logp.shape)}, engine {tuple(engine_logp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    return _EngineValues.apply(autograd_logp, engine_logp, mask.bool())
