"""``q41_linear`` / ``q80_linear`` (GGUF Q4_1 and Q8_0 weights): one arithmetic for every number of rows.

Up to a few rows the kernels decode the blocks in registers (decode); from ``GGUF_GEMM_MIN_ROWS`` rows on
they decode a panel of output columns into a float32 buffer and run a register tile over it (prefill).
Both must compute each output as the same chain (cpu_kernels.c, "GGUF block weights"), so a row's bits
equal its bits computed alone whatever batch it is in, and the product is the float32 dot product of the
dequantised weights (Q4_1: d * code + m rounded once; Q8_0: d * code), checked bitwise on unit rows and
against float64 with a stated error bound.
"""

from __future__ import annotations

import pytest
import torch

from idleless.model import cpu_kernels
from idleless.quant.formats import dequantize_q8_0, quantize_q4_1, quantize_q8_0, unpack_q4

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
FORMATS = pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
BATCHES = (1, 7, 64, 300)


def _kernels(dtype):
    k = cpu_kernels.load(dtype)
    if k is None:
        pytest.skip("no C compiler: the kernels are off")
    return k


def _weight(fmt, n, k, seed=0):
    """(blocks, float32 weight they hold [n, k], product function of the kernels). Q4_1's weight is
    d * code + m computed exactly in float64 (float16 factors, codes below 16) and rounded once."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    if fmt == "q4_1":
        qs, d, m = quantize_q4_1(w)
        held = (d.double()[..., None] * unpack_q4(qs).double() + m.double()[..., None]).reshape(n, k).float()
        return (qs, d, m), held, lambda kern, x, b: kern.q41_linear(x, qs, d, m, b)
    q, d = quantize_q8_0(w)
    return (q, d), dequantize_q8_0(q, d), lambda kern, x, b: kern.q80_linear(x, q, d, b)


@DTYPES
@FORMATS
@pytest.mark.parametrize("n,k", [(75, 160), (96, 576)])
def test_rows_alone_equal_rows_in_any_batch(dtype, fmt, n, k):
    """Rows computed one at a time (the register decode) equal the same rows in batches of 1, 7, 64 and
    300 (the panel tiling from GGUF_GEMM_MIN_ROWS rows), at every offset tried; n = 75 leaves a partial
    panel, a partial register tile and an odd column."""
    kern = _kernels(dtype)
    _, _, lin = _weight(fmt, n, k)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(max(BATCHES), k, generator=g) * 2).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    alone = torch.cat([lin(kern, x[i:i + 1], bias) for i in range(x.shape[0])])
    for m in BATCHES:
        for start in sorted({0, 3, x.shape[0] - m} & set(range(x.shape[0] - m + 1))):
            y = lin(kern, x[start:start + m], bias)
            assert torch.equal(y, alone[start:start + m]), (m, start)


@DTYPES
@FORMATS
def test_product_within_float32_bound_of_float64(dtype, fmt):
    """Against the float64 product of the float32 weights ``formats`` dequantises: each output is a sum of
    k products in 8 chains of k / 8 fused multiply-adds and a 3-level tree, so its error is below
    (k / 8 + 3) u sum_i |x_i w_i| (u = 2^-24) before the bias is added and the output rounded (one more
    float32 or bfloat16 rounding: half an ulp of the result)."""
    kern = _kernels(dtype)
    n, k = 130, 576
    _, w32, lin = _weight(fmt, n, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(40, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    wd, xd = w32.double(), x.double()
    ref = xd @ wd.t() + bias.double()
    bound = (k / 8 + 3) * 2.0 ** -24 * (xd.abs() @ wd.abs().t()) + 2.0 ** -24 * (ref.abs() + 1e-30)
    half_ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    bound = bound * (1 + half_ulp) + half_ulp * ref.abs()
    for m in (1, 40):  # the register decode and the panel tiling
        y = lin(kern, x[:m], bias).double()
        assert bool(((y - ref[:m]).abs() <= bound[:m]).all()), float(((y - ref[:m]).abs() / bound[:m]).max())


@FORMATS
def test_unit_rows_give_the_held_weights(fmt):
    """x = the identity: every output is one product 1 * w plus exact zeros, so out = W^T bitwise, in the
    register decode (one row at a time) and in the panel tiling (all rows at once)."""
    kern = _kernels(torch.float32)
    n, k = 37, 96
    _, held, lin = _weight(fmt, n, k, seed=5)
    eye = torch.eye(k)
    assert torch.equal(lin(kern, eye, None), held.t())
    assert torch.equal(torch.cat([lin(kern, eye[i:i + 1], None) for i in range(k)]), held.t())


@FORMATS
def test_zero_rows_and_hand_computed_block(fmt):
    """A hand-computed block: Q8_0 codes 1..32 with step 0.5 against x = 1 gives 0.5 * 528 = 264; Q4_1
    codes 0..15 twice with step 2 and minimum -1 gives 2 * 2 * 120 - 32 = 448; no rows gives [0, n]."""
    kern = _kernels(torch.float32)
    if fmt == "q8_0":
        q = torch.arange(1, 33, dtype=torch.int8).view(1, 1, 32)
        d = torch.tensor([[0.5]], dtype=torch.float16)
        lin, want = (lambda x: kern.q80_linear(x, q, d)), 264.0
    else:
        codes = torch.arange(16, dtype=torch.uint8)
        qs = (codes | (codes << 4)).view(1, 1, 16)
        d, m = torch.tensor([[2.0]], dtype=torch.float16), torch.tensor([[-1.0]], dtype=torch.float16)
        lin, want = (lambda x: kern.q41_linear(x, qs, d, m)), 448.0
    for rows in (1, 9):
        assert torch.equal(lin(torch.ones(rows, 32)), torch.full((rows, 1), want))
    assert lin(torch.ones(0, 32)).shape == (0, 1)


@DTYPES
@pytest.mark.parametrize("head", [False, True], ids=["q4_1", "q8_0-head"])
def test_default_method_runs_the_kernel_up_to_its_row_limit(dtype, head):
    """The default (not deterministic) Q4_1 method and its Q8_0 head run the kernel, panel GEMM
    included, for up to GGUF_KERNEL_MAX_ROWS rows: there its rows are the deterministic method's bits
    and equal each row computed alone."""
    from idleless.model.linear import Linear
    from idleless.quant.methods import GGUF_KERNEL_MAX_ROWS, quantized_linear_method

    kern = _kernels(dtype)
    x = torch.randn(GGUF_KERNEL_MAX_ROWS, 160, generator=torch.Generator().manual_seed(6)).to(dtype)
    outs = []
    for det in (False, True):
        method = quantized_linear_method("int4", deterministic=det, kernels=kern)
        method = method.head_method if head else method
        lin = Linear(160, 70, bias=True, method=method)
        g = torch.Generator().manual_seed(7)
        lin.weight.data = (torch.randn(70, 160, generator=g) / 12).to(dtype)
        lin.bias.data = torch.randn(70, generator=g).to(dtype)
        method.process_after_load(lin)
        outs.append(lin(x))
        assert torch.equal(lin(x[:53]), outs[-1][:53])
        assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(53)]), outs[-1][:53])
    assert torch.equal(outs[0], outs[1])
