"""bi_q80_linear (issue 15/14): GGUF Q8_0 weights x bfloat16 activations on AVX-512 BF16, the bundled model's
lm_head. Per output element one chain for any number of rows (a VDPBF16PS chain per block of 32 features, then
fma(d, that, acc)), whether the rows run on the register decode (up to 3 rows) or on the decoded panel buffer
with its 7 x 2 register tiles, shorter strips and prefetches: every row equals the same row computed alone, in
any batch, at any offset, under 1 and 2 threads, with strided rows; unit rows read back the held weights
(d * code) rounded once to bfloat16; products stay within float32's summation bound of a float64 product with
the dequantised weights. Without AVX-512 BF16 (the portable build) there is no such kernel and the methods keep
``q80_linear``, whose bits are unchanged (tests/test_kernels_gguf.py, tests/test_kernels_portable.py)."""

import pytest
import torch

from idleless.model import cpu_kernels
from idleless.quant.formats import dequantize_q8_0, quantize_q8_0
from kernel_builds import native_and_portable

KERN = cpu_kernels.load(torch.bfloat16)
pytestmark = pytest.mark.skipif(KERN is None or not KERN.has_bi_q80,
                                reason="bi_q80_linear needs bfloat16 kernels built with AVX-512 BF16")


def _case(n, k, rows, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    q, d = quantize_q8_0(torch.randn(n, k, generator=g) * k ** -0.5)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = (torch.randn(rows, k, generator=g) * 2).to(torch.bfloat16)
    return q, d, KERN.bi_q80_pack(q, d), dequantize_q8_0(q, d, torch.float64), b, x


def _within_bound(out, x, held, b, k):
    """|out - float64 ref| <= k 2^-23 sum|x w| (float32 sums) + 2^-8 |ref| (one bf16 rounding)"""
    xs = x.double()
    ref = xs @ held.T + (b.double() if b is not None else 0)
    bound = k * 2.0 ** -23 * (xs.abs() @ held.abs().T) + 2.0 ** -8 * ref.abs() + 1e-30
    return bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (37, 64, True), (200, 96, True)])
def test_rows_alone_equal_rows_in_any_batch_and_float64(n, k, bias):
    q, d, packed, held, b, x = _case(n, k, 300, seed=n + k, bias=bias)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = KERN.bi_q80_linear(x, packed, n, b)
        assert torch.equal(full, torch.cat([KERN.bi_q80_linear(x[i:i + 1], packed, n, b) for i in range(300)]))
        r0 = 0
        for size in [1, 2, 3, 4, 5, 6, 7, 8, 13, 64] * 3:  # register decode, strips of every height, at many offsets
            assert torch.equal(KERN.bi_q80_linear(x[r0:r0 + size], packed, n, b), full[r0:r0 + size]), (r0, size)
            r0 += size
        perm = torch.randperm(300, generator=torch.Generator().manual_seed(9))
        assert torch.equal(KERN.bi_q80_linear(x[perm], packed, n, b), full[perm])
        torch.set_num_threads(2)
        assert torch.equal(KERN.bi_q80_linear(x, packed, n, b), full)
        for m in (1, 2, 7, 64):
            assert torch.equal(KERN.bi_q80_linear(x[:m], packed, n, b), full[:m]), m
    finally:
        torch.set_num_threads(saved)
    for m in (1, 7, 64, 300):
        assert _within_bound(full[:m], x[:m], held, b, k), m


def test_large_batch_row_blocks_keep_the_bits():
    """1500 rows at K 576: several row blocks of bi_q41_linear's sizing, each task prefetching the next group"""
    n, k = 300, 576
    _, _, packed, held, b, x = _case(n, k, 1500, seed=5)
    full = KERN.bi_q80_linear(x, packed, n, b)
    for r in (0, 340, 341, 342, 1499):
        assert torch.equal(KERN.bi_q80_linear(x[r:r + 1], packed, n, b), full[r:r + 1]), r
    assert torch.equal(KERN.bi_q80_linear(x[500:], packed, n, b), full[500:])
    assert _within_bound(full, x, held, b, k)


def test_unit_rows_read_the_held_weights():
    """x = e_i gives column c's weight d * code (exact in float32) rounded once to bf16: every code from -127 to
    127 at every position of a block and every column of a panel (n 40: a partial last panel), float16 steps
    with a subnormal and a zero; on the register decode (1 row) and the buffer (32 rows)."""
    n, k = 40, 64
    codes = (torch.arange(n * k) % 255 - 127).reshape(n, k // 32, 32)
    q = codes[torch.randperm(n, generator=torch.Generator().manual_seed(1))].to(torch.int8).contiguous()
    d = (torch.rand(n, k // 32, generator=torch.Generator().manual_seed(2)) + 0.5).to(torch.float16)
    d[0, 0], d[3, 1] = 1e-7, 0.0
    packed = KERN.bi_q80_pack(q, d)
    want = dequantize_q8_0(q, d, torch.float64).to(torch.bfloat16)  # [n, k]: one rounding of an exact value
    eye = torch.eye(k, dtype=torch.bfloat16)
    for i in range(k):
        assert torch.equal(KERN.bi_q80_linear(eye[i:i + 1], packed, n), want[:, i:i + 1].T), i
    for r0 in (0, 32):
        assert torch.equal(KERN.bi_q80_linear(eye[r0:r0 + 32], packed, n), want[:, r0:r0 + 32].T)


def test_hand_computed_block_strided_rows_and_pack_in_place():
    """Codes 1..32 with step 0.5 against x = 1: 0.5 * 528 = 264; rows ldx apart give the contiguous rows' bits;
    re-packing into the same tensor writes the same bytes; the portable build has no such kernel (raises)."""
    q = torch.arange(1, 33, dtype=torch.int8).reshape(1, 1, 32)
    d = torch.tensor([[0.5]], dtype=torch.float16)
    packed = KERN.bi_q80_pack(q, d)
    for rows in (1, 9):
        assert torch.equal(KERN.bi_q80_linear(torch.ones(rows, 32, dtype=torch.bfloat16), packed, 1),
                           torch.full((rows, 1), 264.0, dtype=torch.bfloat16))
    assert KERN.bi_q80_linear(torch.ones(0, 32, dtype=torch.bfloat16), packed, 1).shape == (0, 1)
    q, d, packed, _, b, x = _case(48, 160, 40, seed=3)
    wide = torch.zeros(40, 224, dtype=torch.bfloat16)
    wide[:, 32:192] = x
    full = KERN.bi_q80_linear(x, packed, 48, b)
    for r0, size in ((0, 40), (0, 3), (5, 1), (30, 10)):
        assert torch.equal(KERN.bi_q80_linear(wide[r0:r0 + size, 32:192], packed, 48, b), full[r0:r0 + size])
    assert torch.equal(KERN.bi_q80_pack(q, d, out=packed), packed)
    builds = native_and_portable()
    portable = builds[torch.bfloat16][1]
    assert not portable.has_bi_q80 and not builds[torch.float32][0].has_bi_q80
    with pytest.raises(ValueError):
        portable.bi_q80_linear(x, packed, 48, b)


def test_methods_run_the_kernel_up_to_its_limit(monkeypatch):
    """Q4_1's Q8_0 head (default and deterministic) packs the weight and runs bi_q80_linear for batches up to
    BI_Q80_KERNEL_MAX_ROWS (the same bits in both modes), the default one dequantising into the GEMM library
    above; W4A8's head keeps its integer kernel."""
    from idleless.model.linear import Linear
    from idleless.quant.methods import BI_Q80_KERNEL_MAX_ROWS, quantized_linear_method

    g = torch.Generator().manual_seed(11)
    w = (torch.randn(40, 64, generator=g) / 8).to(torch.bfloat16)
    lins = {}
    for det in (False, True):
        method = quantized_linear_method("int4", deterministic=det, kernels=KERN).head_method
        assert method.use_bi_q80
        lin = Linear(64, 40, method=method)
        lin.weight.data = w.clone()
        method.process_after_load(lin)
        assert torch.equal(lin.quant["bi"], KERN.bi_q80_pack(lin.quant["q"], lin.quant["d"]))
        lins[det] = lin
    assert not quantized_linear_method("int4", "int8", kernels=KERN).head_method.use_bi_q80
    calls = []
    real = KERN.bi_q80_linear
    monkeypatch.setattr(KERN, "bi_q80_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x = torch.randn(BI_Q80_KERNEL_MAX_ROWS + 1, 64, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lins[False](x[:BI_Q80_KERNEL_MAX_ROWS]), lins[True](x[:BI_Q80_KERNEL_MAX_ROWS]))
        assert calls == [BI_Q80_KERNEL_MAX_ROWS] * 2
        lins[False](x)
        assert calls == [BI_Q80_KERNEL_MAX_ROWS] * 2  # above the limit: dequantised into the GEMM library
        lins[True](x)
        assert calls[-1] == BI_Q80_KERNEL_MAX_ROWS + 1
