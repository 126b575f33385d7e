"""bi_q41_linear's tiling at prefill sizes (issue 11/15): a batch of hundreds to thousands of rows is cut into
row blocks (sized by K, more of them for idle threads), BQ_MR-row register strips (shorter strips at the end)
and panel tiles of 2 or 4; none of that may change an output element's chain. Every row must equal the same
row computed alone, under 1 and 2 threads, with strided rows, and stay within float32's summation bound of a
float64 product with the held weights (d q + m); the default Q4_1 method runs the kernel up to its own row
limit (then it has the deterministic bits) and dequantises into the GEMM library above it."""

import pytest
import torch

from idleless.model import cpu_kernels
from idleless.quant.formats import quantize_q4_1, unpack_q4

KERN = cpu_kernels.load(torch.bfloat16)
pytestmark = pytest.mark.skipif(KERN is None or not KERN.has_bi_q41,
                                reason="bi_q41_linear needs bfloat16 kernels built with AVX-512 BF16")


def _case(n, k, rows, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    qs, d, m = quantize_q4_1(torch.randn(n, k, generator=g) * k ** -0.5)
    held = (d.double()[..., None] * unpack_q4(qs).double() + m.double()[..., None]).reshape(n, k)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = (torch.randn(rows, k, generator=g) * 2).to(torch.bfloat16)
    return KERN.bi_q41_pack(qs, d, m), held, b, x


def _threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    return saved


@pytest.mark.parametrize("n,k,rows", [(576, 576, 1500), (200, 1536, 700), (37, 96, 4100)])
def test_large_batches_keep_every_rows_bits(n, k, rows):
    """Row blocks of ~341 (K 576) / 128 (K 1536) / 2048 (K 96) rows, 7-row strips, 2- and 4-panel tiles and a
    last partial panel (n 37, 200): the whole batch under 1 and 2 threads equals pieces of 1 to 13 rows at
    every offset and single rows, and the float64 product within float32's bound plus one bf16 rounding."""
    packed, held, b, x = _case(n, k, rows, seed=n + k)
    saved = _threads(1)
    try:
        full = KERN.bi_q41_linear(x, packed, n, b)
        torch.set_num_threads(2)
        assert torch.equal(KERN.bi_q41_linear(x, packed, n, b), full)
        torch.set_num_threads(1)
        r0 = 0
        for size in [1, 2, 3, 4, 5, 6, 7, 8, 13] * 4:  # strips of every height, and their tiles, at many offsets
            assert torch.equal(KERN.bi_q41_linear(x[r0:r0 + size], packed, n, b), full[r0:r0 + size]), (r0, size)
            r0 += size
        for r in (0, 340, 341, 342, rows - 1):  # around a row block's edge
            assert torch.equal(KERN.bi_q41_linear(x[r:r + 1], packed, n, b), full[r:r + 1]), r
        assert torch.equal(KERN.bi_q41_linear(x[rows // 3:], packed, n, b), full[rows // 3:])
    finally:
        torch.set_num_threads(saved)
    xs = x.double()
    ref = xs @ held.T + b.double()
    bound = k * 2.0 ** -23 * (xs.abs() @ held.abs().T) + 2.0 ** -8 * ref.abs() + 1e-30
    assert ((full.double() - ref).abs() <= bound).all()


def test_strided_rows_and_block_sums_tail():
    """Rows ldx apart (a column slice of a wider tensor) give the contiguous rows' bits; 3 x 5 blocks (not a
    multiple of the 16 block sums taken at once) and the lone row's scalar sums agree."""
    packed, _, b, x = _case(48, 160, 600, seed=3)
    wide = torch.zeros(600, 224, dtype=torch.bfloat16)
    wide[:, 32:192] = x
    full = KERN.bi_q41_linear(x, packed, 48, b)
    assert torch.equal(KERN.bi_q41_linear(wide[:, 32:192], packed, 48, b), full)
    for r0, size in ((0, 3), (5, 1), (597, 3)):
        assert torch.equal(KERN.bi_q41_linear(x[r0:r0 + size], packed, 48, b), full[r0:r0 + size])


def test_block_sums_hand_computed():
    """A block's sum is 0 + x0 + x1 + ... + x31 in float32 in that order: with x = [2^24, 1, 1, ..., 1] every 1 is
    lost to rounding (2^24 + 1 ties to 2^24), where adding the ones first would keep 30 or 32 of them. One column
    of codes 0, d 0, m 1 and bias -2^24 outputs sum - 2^24: exactly 0 for every row, on the 16-blocks-at-once
    path (rows 0..31 of 40) and the scalar one (the last 8 blocks)."""
    qs = torch.zeros(1, 1, 16, dtype=torch.uint8)
    d, m = torch.zeros(1, 1, dtype=torch.float16), torch.ones(1, 1, dtype=torch.float16)
    packed = KERN.bi_q41_pack(qs, d, m)
    x = torch.ones(40, 32)
    x[:, 0] = 2.0 ** 24
    bias = torch.tensor([-2.0 ** 24], dtype=torch.bfloat16)
    out = KERN.bi_q41_linear(x.to(torch.bfloat16), packed, 1, bias)
    assert torch.equal(out.float(), torch.zeros(40, 1))
    x[:, 0], x[:, 31] = 1.0, 2.0 ** 24  # the big value last: the 31 ones are summed first (31, exact)
    out = KERN.bi_q41_linear(x.to(torch.bfloat16), packed, 1, bias)
    assert torch.equal(out.float(), torch.full((40, 1), 32.0))  # 31 + 2^24 rounds to 2^24 + 32 (ties to even)


def test_default_method_uses_the_kernel_up_to_its_bi_q41_limit(monkeypatch):
    """Default (not deterministic) Q4_1 on bi_q41_linear: batches up to BI_Q41_KERNEL_MAX_ROWS rows run the
    kernel (so they have the deterministic method's bits), larger ones the dequantised GEMM."""
    from idleless.model.linear import Linear
    from idleless.quant.methods import BI_Q41_KERNEL_MAX_ROWS, quantized_linear_method

    g = torch.Generator().manual_seed(11)
    w = (torch.randn(40, 64, generator=g) / 8).to(torch.bfloat16)
    lins = {}
    for det in (False, True):
        method = quantized_linear_method("int4", deterministic=det, kernels=KERN)
        assert method.use_bi_q41
        lin = Linear(64, 40, method=method)
        lin.weight.data = w.clone()
        method.process_after_load(lin)
        lins[det] = lin
    calls = []
    real = KERN.bi_q41_linear
    monkeypatch.setattr(KERN, "bi_q41_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x = (torch.randn(BI_Q41_KERNEL_MAX_ROWS + 1, 64, generator=g)).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lins[False](x[:BI_Q41_KERNEL_MAX_ROWS]), lins[True](x[:BI_Q41_KERNEL_MAX_ROWS]))
        assert calls == [BI_Q41_KERNEL_MAX_ROWS] * 2
        lins[False](x)
        assert calls == [BI_Q41_KERNEL_MAX_ROWS] * 2  # above the limit: dequantised into the GEMM library
        lins[True](x)
        assert calls[-1] == BI_Q41_KERNEL_MAX_ROWS + 1
