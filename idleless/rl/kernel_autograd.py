"""Autograd functions whose forward is the engine's inference kernel and whose backward is written out.

A trainer that differentiates its own eager forward computes the rollout tokens' log-probabilities with
other kernels and summation orders than the engine that sampled them, so they differ in the last bits
and the importance ratio of an on-policy step is not exactly 1 (the "true on-policy" problem). Here
each op of the engine's forward is one ``torch.autograd.Function``: ``forward`` calls the very
implementation the engine runs (a linear method's ``apply``, an ``Ops`` backend's glue, the attention
backend, the sampler's ``token_logprobs``), so with the deterministic (batch-invariant) numerics the
trainer's values equal the rollout's bit for bit; ``backward`` is the op's gradient in plain PyTorch
(its reductions need not be batch-invariant: only the values the loss sees must match).

Every function takes the implementation of its forward as an argument, so the same backward is checked
by ``torch.autograd.gradcheck`` in float64 with the eager reference (PyTorch ops) as the forward; the C
kernels exist in float32 / bfloat16 only.

Shapes: x [T, in], W [out, in], b [out] (linear); x, residual [T, hidden], w [hidden] (RMSNorm); gate_up
[T, 2I] (SwiGLU); qk [T, heads, D] with cos, sin [T, 1, D] (rotary, HF's rotate-half layout); q [T, H, D],
k, v [T, Hkv, D] (causal attention, sequences packed one after the other); ids int64 [T] and table
[V, hidden] (embedding); logits [R, V] and token ids int64 [R] (log-softmax gathered). References:
RMSNorm (Zhang & Sennrich, arXiv 1910.07467), RoPE (Su et al., arXiv 2104.09864), SwiGLU (Shazeer,
arXiv 2002.05202), softmax attention's backward as in FlashAttention (Dao et al., arXiv 2205.14135, eq. in
section 3.1: dS = P * (dP - rowsum(dP * P))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LinearFn(torch.autograd.Function):
    """y = x W^T (+ b) by ``method.apply(layer, x)`` (``layer.weight`` is ``weight``, ``layer.bias`` is
    ``bias``); backward dx = dy W, dW = dy^T x, db = sum over rows of dy."""

    @staticmethod
    def forward(ctx, x, weight, bias, method, layer):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return method.apply(layer, x)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def _rms_norm_backward(s: torch.Tensor, w: torch.Tensor, eps: float, dy: torch.Tensor):
    """Gradients of y = w * s / sqrt(mean(s^2) + eps) (rows of s [T, h]) -> (ds, dw), in float32 at
    least (float64 stays float64), cast back to s's and w's dtypes."""
    ct = torch.promote_types(s.dtype, torch.float32)
    s, w, dy = s.to(ct), w.to(ct), dy.to(ct)
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    n = s * r
    dn = dy * w
    ds = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    return ds, (dy * n).sum(0)


class RMSNormFn(torch.autograd.Function):
    """norm(x) = w * x / sqrt(mean(x^2) + eps) by ``ops.rms_norm(x, w, eps)``."""

    @staticmethod
    def forward(ctx, x, weight, eps, ops):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return ops.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = _rms_norm_backward(x, weight, ctx.eps, dy)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None


class AddRMSNormFn(torch.autograd.Function):
    """(norm(x + residual), x + residual) by ``ops.add_rms_norm`` (given a copy of ``residual``: the
    kernels add in place). The sum's incoming gradient and the norm's both flow to x and residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, ops):
        y, s = ops.add_rms_norm(x, residual.clone(), weight, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps = eps
        return y, s

    @staticmethod
    def backward(ctx, dy, ds_out):
        s, weight = ctx.saved_tensors
        ds, dw = _rms_norm_backward(s, weight, ctx.eps, dy)
        if ds_out is not None:
            ds = ds + ds_out
        ds = ds.to(s.dtype)
        return ds, ds, dw.to(weight.dtype), None, None


class SiluMulFn(torch.autograd.Function):
    """silu(gate) * up of gate_up = [gate | up] by ``ops.silu_mul``; backward d gate = dy * up *
    sig(g) * (1 + g * (1 - sig(g))), d up = dy * silu(g)."""

    @staticmethod
    def forward(ctx, gate_up, ops):
        ctx.save_for_backward(gate_up)
        return ops.silu_mul(gate_up)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        g, u = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        sig = torch.sigmoid(g)
        dg = dy * u * sig * (1 + g * (1 - sig))
        du = dy * g * sig
        return torch.cat([dg, du], dim=-1), None


class RopeFn(torch.autograd.Function):
    """Rotary embedding y = x cos + rotate_half(x) sin by ``ops.rope`` on a copy of qk (the kernels
    rotate in place) with ``state`` (``ops.rope_state``); cos, sin [T, 1, D] the same angles, for the
    backward, a rotation by the opposite angle: dx = dy cos + rotate_half^T(dy sin)."""

    @staticmethod
    def forward(ctx, qk, cos, sin, ops, state):
        ctx.save_for_backward(cos, sin)
        return ops.rope(qk.clone(memory_format=torch.contiguous_format), state)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        z = dy * sin
        z1, z2 = z.chunk(2, dim=-1)
        return dy * cos + torch.cat([z2, -z1], dim=-1), None, None, None, None


class CausalAttentionFn(torch.autograd.Function):
    """Causal softmax attention of packed sequences (``seq_lens`` rows each; a row sees its own
    sequence's rows up to itself), grouped-query (H a multiple of Hkv), scale D^-0.5, by
    ``attend(q, k, v)`` (the engine's attention backend). Backward per sequence in q's dtype: P =
    softmax(S), dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = dS K s, dK = dS^T Q s, with
    the K / V gradients of the heads sharing a KV head summed."""

    @staticmethod
    def forward(ctx, q, k, v, attend, seq_lens):
        ctx.save_for_backward(q, k, v)
        ctx.seq_lens = list(seq_lens)
        return attend(q, k, v)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        T, H, D = q.shape
        hkv = k.shape[1]
        grp = H // hkv
        scale = D ** -0.5
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        start = 0
        for n in ctx.seq_lens:
            sl = slice(start, start + n)
            qs = q[sl].transpose(0, 1)  # [H, n, D]
            ks = k[sl].repeat_interleave(grp, 1).transpose(0, 1)
            vs = v[sl].repeat_interleave(grp, 1).transpose(0, 1)
            dos = do[sl].transpose(0, 1)
            s = (qs @ ks.transpose(1, 2)) * scale
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            p = torch.softmax(s, -1)
            dp = dos @ vs.transpose(1, 2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True))
            dq[sl] = ((ds @ ks) * scale).transpose(0, 1)
            dk[sl] = ((ds.transpose(1, 2) @ qs) * scale).view(hkv, grp, n, D).sum(1).transpose(0, 1)
            dv[sl] = (p.transpose(1, 2) @ dos).view(hkv, grp, n, D).sum(1).transpose(0, 1)
            start += n
        return dq, dk, dv, None, None


class EmbeddingFn(torch.autograd.Function):
    """table[ids] (``F.embedding``, what the engine's ``nn.Embedding`` runs); backward scatters the rows'
    gradients into the table's rows (summed for repeated ids)."""

    @staticmethod
    def forward(ctx, ids, table):
        ctx.save_for_backward(ids)
        ctx.shape = table.shape
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        return None, dy.new_zeros(ctx.shape).index_add_(0, ids, dy)


def engine_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The sampler's logprob computation (``idleless.model.sampler.token_logprobs``, the one behind every
    logprob the engine reports) of logits [R, V] at token_ids int64 [R]: float32 [R]."""
    from idleless.model.sampler import token_logprobs
    values, _, _ = token_logprobs(logits, token_ids, [0] * len(token_ids))
    return torch.tensor(values, dtype=torch.float32)


class TokenLogprobFn(torch.autograd.Function):
    """log_softmax(logits)[r, token_ids[r]] by ``fn(logits, token_ids)`` (default: the sampler's,
    ``engine_token_logprobs``); backward d logits = g (onehot - softmax(logits)), in logits' dtype."""

    @staticmethod
    def forward(ctx, logits, token_ids, fn):
        ctx.save_for_backward(logits, token_ids)
        return fn(logits, token_ids)

    @staticmethod
    def backward(ctx, g):
        logits, ids = ctx.saved_tensors
        d = -torch.softmax(logits, -1) * g.to(logits.dtype)[:, None]
        d[torch.arange(len(ids)), ids] += g.to(logits.dtype)
        return d, None, None


class KernelOps:
    """An ``Ops`` (idleless.model.ops) whose every op is one of the functions above around ``base`` (the
    engine's glue backend: ``CpuKernelOps`` or ``EagerOps``): the same values, differentiable."""

    def __init__(self, base):
        self.base = base

    def rms_norm(self, x, weight, eps):
        return RMSNormFn.apply(x, weight, eps, self.base)

    def add_rms_norm(self, x, residual, weight, eps):
        return AddRMSNormFn.apply(x, residual, weight, eps, self.base)

    def silu_mul(self, gate_up):
        return SiluMulFn.apply(gate_up.contiguous(), self.base)

    def rope_state(self, rope, positions, dtype):
        """(the base's state, cos, sin [T, 1, D] in ``dtype`` for the backward)."""
        return (self.base.rope_state(rope, positions, dtype), *rope.tables(positions, dtype))

    def rope(self, qk, state):
        base_state, cos, sin = state
        return RopeFn.apply(qk, cos, sin, self.base, base_state)


class KernelLinearMethod:
    """A linear method (idleless.model.linear) computing ``base.apply`` through ``LinearFn``. ``base``'s
    derived copies (packed panels) are re-made whenever the weight changed in place since they were
    made (an optimiser step bumps the tensor's version counter), and by ``process_after_load``."""

    def __init__(self, base):
        self.base = base

    def process_after_load(self, layer) -> int:
        extra = self.base.process_after_load(layer)
        layer.kernel_weight_version = layer.weight._version
        return extra

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "kernel_weight_version", None) != layer.weight._version:
            self.process_after_load(layer)
        return LinearFn.apply(x, layer.weight, layer.bias, self.base, layer)
