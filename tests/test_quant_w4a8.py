"""W4A8: GGUF Q4_1 weights (and the Q8_0 output layer) times activations quantised to int8 per block of
32 features, multiplied as integers (llama.cpp's Q8_1 scheme; cpu_kernels.c, "8-bit activations").

The kernels are checked against a float64 reference built from an activation quantiser written here
(d = max|x| / 127 per block, codes round-half-even(x / d), s = d * sum(codes)), so the integer sums are
the same on both sides and only the float32 scaling and accumulation differ (tight tolerance); against a
portable build of the same source (no AVX2: the scalar loops) bit for bit; and for batch invariance
(a row's bits alone equal its bits in any batch). Then the linear method end to end on a tiny model
against its PyTorch fallback, and the precision flags that select it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TEST_THREADS, make_tiny_model
from kernel_builds import avx2_only, native_and_portable
from idleless.config import EngineConfig
from idleless.model.linear import Linear, select_linear_method
from idleless.quant.formats import interleave_q4_1, interleave_q8_0, quantize_q4_1, quantize_q8_0, unpack_q4
from idleless.quant.methods import Q8_0A8LinearMethod, W4A8LinearMethod, quantized_linear_method
from idleless.quant.spec import check_precision

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
FORMATS = pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
BATCHES = (1, 7, 64, 300)


BUILDS = native_and_portable()
AVX2 = avx2_only()  # on an AVX-512 CPU: the AVX2 paths the native build replaces ({} elsewhere)
needs_kernels = pytest.mark.skipif(not BUILDS, reason="no C compiler for the CPU kernels")


def _ref_quantize(x: torch.Tensor):
    """Independent activation quantiser, float64 where exact: x [M, K] -> (codes [M, K/32, 32] int64,
    d [M, K/32] float32, s [M, K/32] float32)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = (xb.abs().amax(-1) / 127).float()                       # float32 division, as the kernel
    div = torch.where(d == 0, torch.ones_like(d), d)
    codes = torch.round(xb / div[..., None]).clamp(-127, 127).long()  # float32 x / d, half to even
    s = (d * codes.sum(-1).float()).float()
    return codes, d, s


def _weight(fmt, n, k, seed=0):
    """(the kernel's product function (kern, x, bias) -> y, a float64 reference function (x, bias) -> y)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    nb = k // 32
    if fmt == "q4_1":
        qs, d, m = quantize_q4_1(w)
        codes_w, dw, mw = unpack_q4(qs).long().reshape(n, nb, 32), d.float(), m.float()

        def ref(x, bias):
            cx, dx, sx = _ref_quantize(x)
            isum = torch.einsum("rbi,cbi->rcb", cx, codes_w).double()  # exact integer sums per block
            y = (isum * (dw[None].double() * dx[:, None].double())).sum(-1) \
                + (mw[None].double() * sx[:, None].double()).sum(-1)
            return y if bias is None else y + bias.double()

        codes = interleave_q4_1(qs)
        return (lambda kern, x, b: kern.q41_a8_linear(x, codes, d, m, b)), ref
    q, d = quantize_q8_0(w)
    codes_w, dw = q.long(), d.float()

    def ref(x, bias):
        cx, dx, _ = _ref_quantize(x)
        isum = torch.einsum("rbi,cbi->rcb", cx, codes_w).double()
        y = (isum * (dw[None].double() * dx[:, None].double())).sum(-1)
        return y if bias is None else y + bias.double()

    codes = interleave_q8_0(q)
    return (lambda kern, x, b: kern.q80_a8_linear(x, codes, d, b)), ref


def _x(m, k, dtype, seed=1, stride_pad=0):
    """x [m, k] in dtype with rows k + stride_pad apart (strided when stride_pad > 0); row 0's first block
    all zero (d = 0) and an outlier in its second block."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(m, k + stride_pad, generator=g) * 2).to(dtype)
    x = full[:, :k]
    x[0, :32] = 0
    x[0, 40] = 50.0
    return x


@needs_kernels
@DTYPES
def test_quantizer_matches_independent_reference(dtype):
    x = _x(9, 96, dtype, stride_pad=5)
    codes, d, s = _ref_quantize(x)
    for kern in (*BUILDS[dtype], *AVX2.values()):
        if kern.dtype != dtype:
            continue
        q, dk, sk = kern.a8_quantize(x)
        assert torch.equal(q.reshape(codes.shape).long(), codes)
        assert torch.equal(dk, d) and torch.equal(sk, s)


@needs_kernels
@DTYPES
@FORMATS
@pytest.mark.parametrize("m", BATCHES)
def test_kernel_against_float64_and_portable(dtype, fmt, m):
    """Strided rows, bias; n = 75 leaves partial register tiles and column tasks."""
    n, k = 75, 160
    native, portable = BUILDS[dtype]
    lin, ref = _weight(fmt, n, k)
    x = _x(m, k, dtype, stride_pad=3)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    y = lin(native, x, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert torch.equal(y, lin(portable, x, bias))
    if AVX2:
        assert torch.equal(y, lin(AVX2[dtype], x, bias))
    expect = ref(x, bias.float())
    # float32 scaling and accumulation of exact integer sums: a few ulps of the terms' magnitude
    tol = 2e-5 if dtype == torch.float32 else 2 ** -8
    err = (y.double() - expect).abs() / (expect.abs() + 1)
    assert err.max() < tol, err.max()
    y_nobias = lin(native, x, None)
    assert torch.allclose(y_nobias.double(), ref(x, None), rtol=tol, atol=tol)


@needs_kernels
@FORMATS
@pytest.mark.parametrize("n,k", [(75, 160), (96, 576)])
def test_rows_alone_equal_rows_in_any_batch(fmt, n, k):
    kern = BUILDS[torch.float32][0]
    lin, _ = _weight(fmt, n, k, seed=3)
    x = _x(max(BATCHES), k, torch.float32, seed=4)
    alone = torch.cat([lin(kern, x[i:i + 1], None) for i in range(x.shape[0])])
    for m in BATCHES:
        for start in sorted({0, 5, x.shape[0] - m} & set(range(x.shape[0] - m + 1))):
            assert torch.equal(lin(kern, x[start:start + m], None), alone[start:start + m]), (m, start)


@pytest.mark.parametrize("n,nb", [(75, 5), (16, 18), (5, 1), (13, 4)])
def test_interleave_places_every_unit(n, nb):
    """The W4A8 layouts against their definition, byte by byte: column c's unit i at 32 * (g * nu + i * w +
    c - g) for its group start g = G * (c // G) and width w = min(G, n - g); Q4_1 (G = 8): unit p = blocks
    2p, 2p + 1 (zeros past nb), Q8_0 (G = 4): unit b = block b."""
    g_ = torch.Generator().manual_seed(n)
    qs = torch.randint(0, 256, (n, nb, 16), dtype=torch.uint8, generator=g_)
    q8 = torch.randint(-127, 128, (n, nb, 32), dtype=torch.int8, generator=g_)
    pad = torch.zeros(16, dtype=torch.uint8)
    for out, group, units in ((interleave_q4_1(qs), 8, [[torch.cat([qs[c, 2 * p], qs[c, 2 * p + 1] if 2 * p + 1 < nb
                                                                    else pad]) for p in range((nb + 1) // 2)]
                                                          for c in range(n)]),
                              (interleave_q8_0(q8), 4, [[q8[c, b] for b in range(nb)] for c in range(n)])):
        nu = len(units[0])
        assert out.shape == (n * nu * 32,) and out.dtype == units[0][0].dtype
        for c in range(n):
            g = c // group * group
            w = min(group, n - g)
            for i in range(nu):
                at = 32 * (g * nu + i * w + c - g)
                assert torch.equal(out[at:at + 32], units[c][i]), (group, c, i)


@needs_kernels
def test_kernel_refuses_bad_layouts():
    kern = BUILDS[torch.float32][0]
    qs, d, m = quantize_q4_1(torch.randn(8, 64))
    with pytest.raises(ValueError, match="layout"):
        kern.q41_a8_linear(torch.randn(2, 96), interleave_q4_1(qs), d, m)
    with pytest.raises(ValueError, match="layout"):  # GGUF's own [N, K/32, 16], not the W4A8 layout
        kern.q41_a8_linear(torch.randn(2, 64), qs, d, m)
    q, d8 = quantize_q8_0(torch.randn(8, 64))
    with pytest.raises(ValueError, match="layout"):
        kern.q80_a8_linear(torch.randn(2, 64), q, d8)
    with pytest.raises(ValueError, match="multiple of 32"):
        kern.a8_quantize(torch.randn(2, 40))


# ---- the linear method and the flags that select it ----

@needs_kernels
@DTYPES
@pytest.mark.parametrize("head", [False, True], ids=["q4_1", "q8_0-head"])
def test_method_kernel_against_its_fallback(dtype, head):
    """The method on the kernels (every batch size) against its PyTorch fallback (dequantised activation
    codes and weights, float32 products): the same integer codes, so only float32 rounding differs."""
    kern = BUILDS[dtype][0]
    layer = Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 96 ** -0.5, generator=torch.Generator().manual_seed(6))
        layer.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    fast, slow = (W4A8LinearMethod(kernels=k) for k in (kern, None))
    if head:
        fast, slow = fast.head_method, slow.head_method
    slow_layer = copy.deepcopy(layer)  # the kernel's codes are in its own layout (formats.interleave_q4_1)
    fast.process_after_load(layer)
    slow.process_after_load(slow_layer)
    assert fast.apply(layer, torch.zeros(0, 96, dtype=dtype)).shape == (0, 40)
    for m in BATCHES:
        x = _x(m, 96, dtype, seed=m)
        y = fast.apply(layer, x)
        expect = slow.apply(slow_layer, x)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(y.float(), expect.float(), rtol=tol, atol=tol)


def _config(path, w, a, **kw):
    return EngineConfig(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS,
                        weight_dtype=w, activation_dtype=a, skip_quantization_gate=True, **kw)


def _logits(runner, ids):
    """Next-token logits of a prefill of ids[:-4], then 4 batch-1 decode steps -> [len(ids), vocab]."""
    from idleless.model.runner import ForwardBatch

    pool = runner.pool
    slots = pool.alloc(0, 0, len(ids))
    out, prefill = [], len(ids) - 4
    for start, n in [(0, prefill)] + [(p, 1) for p in range(prefill, len(ids))]:
        batch = ForwardBatch(torch.tensor(ids[start:start + n]), torch.arange(start, start + n),
                             slots[start:start + n], [n], [start], [slots[:start + n]], torch.arange(n))
        out.append(runner.forward(batch))
    pool.free(slots)
    return torch.cat(out)


@needs_kernels
def test_tiny_model_end_to_end(tmp_path):
    """W4A8 on a tiny random Llama: the methods attached (also in the deterministic mode, on the same
    kernels), the kernels' logits match the fallback's and stay near the float model (KL bound: int4
    weights' own bound in test_quant_model; the activations add little)."""
    from idleless.model.runner import ModelRunner

    path = make_tiny_model(tmp_path, seed=3)
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = ModelRunner(_config(path, "int4", "int8"))
    assert isinstance(runner.model.layers[0].mlp.down_proj.method, W4A8LinearMethod)
    assert isinstance(runner.model.lm_head.method, Q8_0A8LinearMethod)
    logits = _logits(runner, ids)
    det = ModelRunner(_config(path, "int4", "int8", enable_deterministic_inference=True))
    assert isinstance(det.model.layers[0].self_attn.qkv_proj.method, W4A8LinearMethod)
    assert det.model.lm_head.method.kernels is not None
    fallback = _logits(ModelRunner(_config(path, "int4", "int8", disable_cpu_kernels=True)), ids)
    torch.testing.assert_close(logits, fallback, rtol=1e-4, atol=1e-4)
    ref = _logits(ModelRunner(_config(path, "bf16", "bf16")), ids)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert 0 < float(kl.mean()) < 0.04
    # the start-up accuracy gate measures the combination like any other
    gated = ModelRunner(EngineConfig(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS,
                                     weight_dtype="int4", activation_dtype="int8")).precision
    assert gated["gate"] == "passed" and gated["activation_dtype"] == "int8" and 0 < gated["kl"] < 0.04


def test_flags_accept_w4a8_and_refuse_the_rest(tmp_path):
    assert check_precision("int4", "int8", "fp8") == "fp8_e4m3"
    assert check_precision("auto", "int8", "auto") == "auto"  # checked again at load, see below
    assert isinstance(quantized_linear_method("int4", "int8"), W4A8LinearMethod)
    assert quantized_linear_method("int4", "int8", deterministic=True).row_tile is not None
    assert isinstance(select_linear_method(torch.float32, "cpu", False, None, weight_dtype="int4",
                                           activation_dtype="int8").head_method, Q8_0A8LinearMethod)
    for w in ("bf16", "fp8"):
        with pytest.raises(ValueError, match=f"--weight-dtype {w} --activation-dtype int8 is not supported.*W4A8"):
            EngineConfig(weight_dtype=w, activation_dtype="int8")
    # auto on a float checkpoint resolves to its float weights: refused at load, naming why
    from idleless.model.runner import ModelRunner

    with pytest.raises(ValueError, match="int8 activations need .*'bf16'.*GGUF file of Q4_1"):
        ModelRunner(_config(make_tiny_model(tmp_path), "auto", "int8"))
