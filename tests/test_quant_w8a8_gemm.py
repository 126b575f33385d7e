"""W8A8 on a packed weight (``cpu_kernels.w8a8_gemm``, vpdpbusd register tiles on AVX512-VNNI CPUs):

- the packing by hand (``w8a8_pack``: panels of 16 columns x groups of 4 input features, q + 128);
- the same bits as the other W8A8 paths — the small-batch kernel ``w8a8_linear`` and the method's torch
  path (float32 products of the integer codes, ``W8A8LinearMethod._product``) — for M = 1 .. 1100, on this
  CPU's build, the portable build (scalar loops) and, on an AVX-512 CPU, the AVX2 build, with k not a
  multiple of 4 and n not a multiple of 16;
- against a float64 reference (exact integer sums, then the float32 scaling);
- batch invariance, the method keeping only the packed copy, ``apply_into``, and bad layouts refused.
"""

from __future__ import annotations

import pytest
import torch

from kernel_builds import avx2_only, native_and_portable
from idleless.model.linear import Linear
from idleless.quant.formats import quantize_rows
from idleless.quant.methods import W8A8LinearMethod

BUILDS = native_and_portable()
AVX2 = avx2_only()
needs_kernels = pytest.mark.skipif(not BUILDS, reason="no C compiler for the CPU kernels")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(n, k, generator=g) / 10, torch.int8)


def _x(m, k, dtype, seed=1):
    """x [m, k] with rows k + 3 apart; row 0 all zero (scale 0), row 1 with an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k + 3, generator=g) * 2).to(dtype)[:, :k]
    x[0] = 0
    if m > 1:
        x[1, 3] = 80.0
    return x


def _ref(x, q, scale, bias):
    """float64: activation codes by hand (float32 amax / 127 and division, half to even), exact integer
    sums, then the scales."""
    xf = x.float()
    sx = xf.abs().amax(-1) / 127
    codes = torch.round(xf / torch.where(sx == 0, torch.ones_like(sx), sx)[:, None]).clamp(-127, 127)
    y = (codes.double() @ q.double().t()) * sx.double()[:, None] * scale.double()
    return y if bias is None else y + bias.double()


def _torch_path(x, q, scale, bias):
    """W8A8LinearMethod's path without kernels (float32 products of the codes in exact chunks)."""
    method = W8A8LinearMethod()
    layer = Linear(q.shape[1], q.shape[0], bias=bias is not None, method=method)
    layer.quant = {"q": q, "scale": scale}
    with torch.no_grad():
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return method._product(layer, x)


@needs_kernels
def test_pack_layout_by_hand():
    kern = BUILDS[torch.float32][0]
    # 5 panels (the last 2 columns wide): a run of 3 and a run of 2; two groups of 4 features (the second
    # half empty); a run is [group][panel of the run][16 columns][4 features]
    n, k = 66, 6
    q = (torch.arange(n * k).reshape(n, k) % 255 - 127).to(torch.int8)
    wp = kern.w8a8_pack(q)
    assert wp.shape == (5 * 2 * 64,)
    runs = [wp[:3 * 2 * 64].reshape(2, 3, 16, 4).int(), wp[3 * 2 * 64:].reshape(2, 2, 16, 4).int()]
    for c in range(80):
        for i in range(8):
            expect = (int(q[c, i]) if c < n and i < k else 0) + 128
            p = c // 16
            assert int(runs[p // 3][i // 4, p % 3, c % 16, i % 4]) == expect, (c, i)


@needs_kernels
@DTYPES
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300, 1100])
@pytest.mark.parametrize("n,k", [(75, 162), (300, 576)])
def test_same_bits_as_every_w8a8_path(dtype, m, n, k):
    native, portable = BUILDS[dtype]
    q, scale = _weight(n, k)
    x = _x(m, k, dtype)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    for b in (bias, None):
        y = native.w8a8_gemm(x, native.w8a8_pack(q), scale, b)
        assert y.dtype == dtype and y.shape == (m, n)
        builds = (portable, AVX2[dtype]) if AVX2 else (portable,)
        for kern in builds:
            assert torch.equal(y, kern.w8a8_gemm(x, kern.w8a8_pack(q), scale, b))
        assert torch.equal(y, native.w8a8_linear(x, q, scale, b))
        assert torch.equal(y, _torch_path(x, q, scale, b))
        ref = _ref(x, q, scale, b)
        # int32 -> float32 (2^-24), two float32 products and the bias add, then the output rounding
        tol = 4e-7 if dtype == torch.float32 else 2 ** -8
        assert ((y.double() - ref).abs() <= tol * (ref.abs() + 1)).all()
    assert torch.equal(y[0], torch.zeros(n, dtype=dtype))  # a zero row: scale 0


@needs_kernels
def test_rows_alone_equal_rows_in_any_batch():
    kern = BUILDS[torch.bfloat16][0]
    q, scale = _weight(100, 200, seed=3)
    wp = kern.w8a8_pack(q)
    x = _x(70, 200, torch.bfloat16, seed=4)
    alone = torch.cat([kern.w8a8_gemm(x[i:i + 1], wp, scale) for i in range(70)])
    for m, start in ((70, 0), (9, 5), (33, 37)):
        assert torch.equal(kern.w8a8_gemm(x[start:start + m], wp, scale), alone[start:start + m])


@needs_kernels
@DTYPES
def test_method_keeps_only_the_packed_weight_on_vnni(dtype):
    kern = BUILDS[dtype][0]
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(90, 64, generator=g), torch.randn(90, generator=g).to(dtype)
    method = W8A8LinearMethod(kernels=kern)
    layer = Linear(64, 90, method=method)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    method.process_after_load(layer)
    q, scale = quantize_rows(w, torch.int8)
    x = _x(40, 64, dtype)
    y = layer(x)
    assert torch.equal(y, _torch_path(x, q, scale, bias))
    if kern.has_vnni:
        assert set(layer.quant) == {"packed", "scale"}
        out = torch.empty(40, 90, dtype=dtype)
        method.apply_into(layer, x.contiguous(), out)
        assert torch.equal(out, y)
    else:
        assert "q" in layer.quant


@needs_kernels
def test_refuses_bad_layouts():
    kern = BUILDS[torch.float32][0]
    q, scale = _weight(20, 32)
    wp = kern.w8a8_pack(q)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="layout"):
        kern.w8a8_gemm(x, wp[:-64], scale)
    with pytest.raises(ValueError, match="layout"):
        kern.w8a8_gemm(torch.randn(3, 36), wp, scale)
    with pytest.raises(ValueError):
        kern.w8a8_gemm(x, wp, scale, out=torch.empty(3, 21))
    with pytest.raises(ValueError):
        kern.w8a8_gemm(x.bfloat16(), wp, scale)
    with pytest.raises(ValueError, match="int8"):
        kern.w8a8_pack(q.float())
