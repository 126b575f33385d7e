"""The autograd functions around the engine's kernels (idleless.rl.kernel_autograd): their written-out
backwards against finite differences (``torch.autograd.gradcheck``, float64, with PyTorch's eager op as the
forward: the C kernels exist in float32 / bfloat16 only), against autograd through PyTorch's eager op in
float64 when the forward is the float32 C kernel, and the whole model's gradient (the trainer's kernel
policy) against plain autograd through the eager float64 model (PyTorch ops, ``F.linear``).
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model

from idleless.config import EngineConfig
from idleless.model import cpu_kernels
from idleless.model.layers import RotaryEmbedding
from idleless.model.linear import PLAIN, InvariantLinearMethod
from idleless.model.llama import LlamaForCausalLM, StepContext
from idleless.model.loader import load_model_config, load_state_dict
from idleless.model.ops import EAGER, CpuKernelOps
from idleless.model.weights import load_weights
from idleless.rl.kernel_autograd import (AddRMSNormFn, CausalAttentionFn, EmbeddingFn, LinearFn, RMSNormFn, RopeFn,
                                         SiluMulFn, TokenLogprobFn)
from idleless.rl.policy import KernelPolicy, make_trainable, pair_logprobs

F64 = torch.float64


def eager_causal_attention(q, k, v, seq_lens):
    """Reference causal grouped-query softmax attention of packed sequences in PyTorch ops, scale D^-0.5."""
    grp = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in seq_lens:
        sl = slice(start, start + n)
        qs = q[sl].transpose(0, 1)
        ks = k[sl].repeat_interleave(grp, 1).transpose(0, 1)
        vs = v[sl].repeat_interleave(grp, 1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


class EagerAttention:
    """An attention backend (prepare / forward) in PyTorch ops over the batch's own K/V, any dtype."""

    def prepare(self, work):
        return list(work.tails.new)

    def forward(self, q, kc, vc, layer_id, plan, out, lse):
        return eager_causal_attention(q, kc, vc, plan)


def log_softmax_at(logits, ids):
    return torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)


def r64(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=F64, requires_grad=requires_grad)


# --------------------------------------------------------------------------------------------------
# gradcheck in float64 (the forward: PyTorch's eager op)
# --------------------------------------------------------------------------------------------------
def test_gradcheck_linear():
    torch.manual_seed(0)
    x, w, b = r64(5, 7), r64(3, 7), r64(3)
    layer = types.SimpleNamespace(weight=w, bias=b)  # the same tensors gradcheck perturbs
    assert torch.autograd.gradcheck(lambda x, w, b: LinearFn.apply(x, w, b, PLAIN, layer), (x, w, b))
    nobias = types.SimpleNamespace(weight=w, bias=None)
    assert torch.autograd.gradcheck(lambda x, w: LinearFn.apply(x, w, None, PLAIN, nobias), (x, w))


def test_gradcheck_rms_norms():
    torch.manual_seed(1)
    x, res, w = r64(4, 6), r64(4, 6), r64(6)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFn.apply(x, w, 1e-5, EAGER), (x, w))
    assert torch.autograd.gradcheck(lambda x, r, w: AddRMSNormFn.apply(x, r, w, 1e-5, EAGER), (x, res, w))


def test_gradcheck_silu_mul_and_rope():
    torch.manual_seed(2)
    assert torch.autograd.gradcheck(lambda g: SiluMulFn.apply(g, EAGER), (r64(3, 8),))
    rope = RotaryEmbedding(8, 32, 10000.0, None)
    cos, sin = rope.tables(torch.tensor([0, 3, 7, 31]), F64)
    assert torch.autograd.gradcheck(lambda qk: RopeFn.apply(qk, cos, sin, EAGER, (cos, sin)), (r64(4, 3, 8),))


def test_gradcheck_causal_attention_grouped_query_two_sequences():
    torch.manual_seed(3)
    lens = [3, 5]
    q, k, v = r64(8, 4, 6), r64(8, 2, 6), r64(8, 2, 6)
    def fn(q, k, v):
        return CausalAttentionFn.apply(q, k, v, lambda *a: eager_causal_attention(*a, lens), lens)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_embedding_and_token_logprobs():
    torch.manual_seed(4)
    ids = torch.tensor([2, 0, 2, 4])  # a repeated id: its rows' gradients add up
    assert torch.autograd.gradcheck(lambda t: EmbeddingFn.apply(ids, t), (r64(5, 3),))
    targets = torch.tensor([1, 4, 0])
    assert torch.autograd.gradcheck(lambda z: TokenLogprobFn.apply(z, targets, log_softmax_at), (r64(3, 6),))


# --------------------------------------------------------------------------------------------------
# the float32 C kernels as forward: values are the kernel's, gradients those of the float64 eager op
# --------------------------------------------------------------------------------------------------
KERNELS = cpu_kernels.load(torch.float32)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C kernels did not build here")


def grads_vs_float64(kernel_fn, eager_fn, inputs, tol=2e-5):
    """Run kernel_fn (float32 inputs) and eager_fn (the same inputs in float64) with one random cotangent;
    their input gradients must agree to ``tol`` relative to the largest."""
    xs = [t.clone().requires_grad_(True) for t in inputs]
    out = kernel_fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    cot = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, xs, cot)
    ys = [t.detach().to(F64).requires_grad_(True) for t in inputs]
    ref_out = eager_fn(*ys)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    want = torch.autograd.grad(ref_outs, ys, [c.to(F64) for c in cot])
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.allclose(g.to(F64), w, rtol=tol, atol=tol * float(w.abs().max())), float((g - w).abs().max())
    return outs


@needs_kernels
def test_kernel_linear_values_and_gradient():
    torch.manual_seed(5)
    x, w = torch.randn(9, 64), torch.randn(48, 64) / 8
    method = InvariantLinearMethod(KERNELS)
    layer = types.SimpleNamespace(weight=w, bias=None)
    method.process_after_load(layer)
    (y,) = grads_vs_float64(lambda x, w: LinearFn.apply(x, w, None, method, layer), lambda x, w: x @ w.t(), [x, w])
    assert torch.equal(y.detach(), method.apply(layer, x))


@needs_kernels
def test_kernel_glue_values_and_gradients():
    torch.manual_seed(6)
    ops = CpuKernelOps(KERNELS)
    x, res, w = torch.randn(7, 64), torch.randn(7, 64), 1 + 0.1 * torch.randn(64)
    (y,) = grads_vs_float64(lambda x, w: RMSNormFn.apply(x, w, 1e-5, ops), lambda x, w: EAGER.rms_norm(x, w, 1e-5),
                            [x, w])
    assert torch.equal(y.detach(), KERNELS.rms_norm(x, w, 1e-5))
    y, s = grads_vs_float64(lambda x, r, w: AddRMSNormFn.apply(x, r, w, 1e-5, ops),
                            lambda x, r, w: EAGER.add_rms_norm(x, r, w, 1e-5), [x, res, w])
    r2 = res.clone()
    assert torch.equal(y.detach(), KERNELS.rms_norm(x, w, 1e-5, r2)) and torch.equal(s.detach(), r2)
    gu = torch.randn(5, 2 * 48)
    (y,) = grads_vs_float64(lambda g: SiluMulFn.apply(g, ops), EAGER.silu_mul, [gu])
    assert torch.equal(y.detach(), KERNELS.silu_mul(gu))
    rope = RotaryEmbedding(16, 128, 10000.0, None)
    pos = torch.tensor([0, 5, 64, 127, 9])
    state = ops.rope_state(rope, pos, torch.float32)
    cos, sin = rope.tables(pos, torch.float32)
    qk = torch.randn(5, 6, 16)
    (y,) = grads_vs_float64(lambda t: RopeFn.apply(t, cos, sin, ops, state),
                            lambda t: RotaryEmbedding.apply(t, *rope.tables(pos, F64)), [qk])
    assert torch.equal(y.detach(), ops.rope(qk.clone(), state))


@needs_kernels
def test_kernel_attention_values_and_gradient():
    from idleless.model.attention.base import AttnWork, Tails
    from idleless.model.attention.invariant import ChunkedAttention
    torch.manual_seed(7)
    lens = [70, 9]  # the first past one 64-key chunk
    T = sum(lens)
    backend = ChunkedAttention(KERNELS, 4, 16)
    plan = backend.prepare(AttnWork(Tails([0, 70], lens, [0, 0], [torch.arange(70), torch.arange(70, T)])))
    attend = lambda q, k, v: backend.forward(q, k.contiguous(), v.contiguous(), 0, plan, None, None)  # noqa: E731
    q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
    (y,) = grads_vs_float64(lambda q, k, v: CausalAttentionFn.apply(q, k, v, attend, lens),
                            lambda q, k, v: eager_causal_attention(q, k, v, lens), [q, k, v])
    assert torch.equal(y.detach(), attend(q, k, v))
    assert torch.allclose(y.detach().to(F64), eager_causal_attention(q.to(F64), k.to(F64), v.to(F64), lens),
                          atol=1e-5)


# --------------------------------------------------------------------------------------------------
# the whole model's gradient against plain autograd through the eager float64 model
# --------------------------------------------------------------------------------------------------
PAIRS = [([5, 6, 7, 8] * 18, [9, 10, 11, 9]), ([3], [4, 5, 6, 7, 200]), ([5, 6, 7, 8] * 18, [12, 13])]


def split_grads(model) -> dict[str, torch.Tensor]:
    """The model's parameter gradients under HF names (fused q/k/v and gate/up split by their loaders)."""
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}
    out = {}
    for name, p in model.named_parameters():
        full = name if name.startswith("lm_head.") else "model." + name
        loader = getattr(p, "weight_loader", None)
        if loader is None:
            out[full] = p.grad
            continue
        fused = full.split(".")[-2]
        for shard in loader.shards:
            out[full.replace(f".{fused}.", f".{names[shard]}.")] = loader.view(p.grad, shard)
    return out


class PlainAttention:
    """A ``StepContext.backend`` for plain autograd: eager attention over the new rows (meta: seq_lens)."""

    def forward(self, q, k, v, layer_id, meta, out_cache_loc):
        return eager_causal_attention(q, k, v, meta)


def eager_reference_grads(path, coef):
    """Our model with PyTorch's eager ops and ``F.linear`` (PlainLinearMethod) in float64, differentiated by
    plain autograd (none of the functions under test): the gradient of sum(coef * logprobs)."""
    model = LlamaForCausalLM(load_model_config(path), 128, EAGER, PLAIN).to(F64)
    load_weights(model, load_state_dict(path, F64).items(), require_all=True)
    for p in model.parameters():
        p.requires_grad_(True)
    total = 0
    for (prompt, comp), c in zip(PAIRS, coef):
        seq = prompt + comp[:-1]
        h = model.embed_tokens(torch.tensor(seq))
        ctx = StepContext(EAGER.rope_state(model.rope, torch.arange(len(seq)), F64), PlainAttention(), [len(seq)],
                          None)
        residual = None
        for layer in model.layers:
            h, residual = layer(h, residual, ctx)
        rows = torch.arange(len(prompt) - 1, len(seq))
        h, _ = model.norm(h[rows], residual[rows])
        total = total + (c * log_softmax_at(model.lm_head(h), torch.tensor(comp))).sum()
    total.backward()
    return split_grads(model)


@pytest.mark.parametrize("tie", [False, True])
def test_whole_model_gradient_matches_eager_float64(tmp_path, tie):
    path = make_tiny_model(tmp_path, seed=3, tie=tie)
    torch.manual_seed(8)
    coef = [torch.randn(len(c), dtype=F64) for _, c in PAIRS]
    want = eager_reference_grads(path, coef)

    # our model with the functions around PyTorch's eager ops, float64: the backwards composed exactly
    mc = load_model_config(path)
    eager = LlamaForCausalLM(mc, 128, EAGER, PLAIN).to(F64)
    load_weights(eager, load_state_dict(path, F64).items(), require_all=True)
    make_trainable(eager)
    lps = pair_logprobs(eager, EagerAttention(), PAIRS, log_softmax_at)
    sum((c * lp).sum() for c, lp in zip(coef, lps)).backward()
    got = split_grads(eager)
    assert got.keys() == want.keys()
    for n in want:  # measured: about 2e-15 of the largest entry
        assert torch.allclose(got[n], want[n], rtol=1e-10, atol=1e-12), n

    # the trainer's policy: float32, the engine's deterministic kernels (C kernels, or their PyTorch twins)
    policy = KernelPolicy(EngineConfig(model=path, dtype="float32", kv_cache_memory="32KiB",
                                       num_threads=TEST_THREADS, enable_deterministic_inference=True))
    lps = policy.logprobs(PAIRS)
    assert all(lp.dtype == torch.float32 for lp in lps)
    sum((c.float() * lp).sum() for c, lp in zip(coef, lps)).backward()
    got = split_grads(policy.model)
    for n in want:  # float32 rounding: within 1e-5 of each gradient's largest entry (measured: about 1e-6)
        scale = float(want[n].abs().max())
        assert torch.allclose(got[n].to(F64), want[n], rtol=1e-5, atol=1e-5 * scale), \
            (n, float((got[n].to(F64) - want[n]).abs().max()), scale)
