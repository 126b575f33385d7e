"""Quantised weights: formats against hand-computed values, and each quantised linear method against a
float64 product of the same quantised weights (issue 14)."""

import pytest
import torch
from torch import nn

from idleless.config import EngineConfig
from idleless.model.linear import Linear, select_linear_method
from idleless.quant.formats import (dequantize_q4_0, dequantize_q4_1, dequantize_q8_0, dequantize_rows,
                                    quantize_q4_0, quantize_q4_1, quantize_q8_0, quantize_rows, unpack_q4,
                                    unpack_q8)
from idleless.quant.methods import (Fp8LinearMethod, Int8LinearMethod, Q4LinearMethod, Q8_0LinearMethod,
                                    W8A8LinearMethod, quantized_linear_method)
from idleless.quant.spec import check_precision
from kernel_builds import avx2_only, native_and_portable


def test_int8_rows_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-127.0, 63.5, 1.0, 0.2]])
    q, s = quantize_rows(w, torch.int8)
    assert s.tolist() == pytest.approx([2 / 127, 0.0, 1.0])
    assert q[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds half to even -> 64; 15.875 -> 16 -> 32 for 0.5
    assert q[1].tolist() == [0, 0, 0, 0]
    assert q[2].tolist() == [-127, 64, 1, 0]  # 63.5 -> 64 (half to even), 0.2 -> 0
    back = dequantize_rows(q, s)
    assert back[1].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dtype,rel", [(torch.int8, 0.5), (torch.float8_e4m3fn, 2.0 ** -4),
                                       (torch.float8_e5m2, 2.0 ** -3)])
def test_row_round_trip_bound(dtype, rel):
    """|w - deq(q(w))| <= half a step: scale / 2 = absmax/127/2 for int8; half an ulp (relative 2^-4 for e4m3's 3
    mantissa bits, 2^-3 for e5m2) of each value, plus the float32 rounding of the scale."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 200, generator=g) * torch.rand(33, 1, generator=g) * 10
    q, s = quantize_rows(w, dtype)
    assert torch.equal(s, w.abs().amax(1) / {torch.int8: 127, torch.float8_e4m3fn: 448,
                                             torch.float8_e5m2: 57344}[dtype])
    err = (dequantize_rows(q, s, torch.float64) - w.double()).abs()
    if dtype == torch.int8:
        bound = s.double()[:, None] * rel * 1.0001
    else:
        bound = w.double().abs() * rel * 1.0001 + s.double()[:, None] * 2.0 ** -9  # subnormal floor
    assert bool((err <= bound).all())


def test_q4_1_by_hand():
    w = torch.arange(64, dtype=torch.float32).reshape(1, 64) * 0.5  # block 0: 0..15.5, block 1: 16..31.5
    qs, d, m = quantize_q4_1(w)
    assert torch.equal(d, torch.full((1, 2), 15.5 / 15).half())  # float16, as ggml stores it
    assert m.float().tolist() == [[0.0, 16.0]]
    codes = unpack_q4(qs)
    assert codes[0, 0, 0] == 0 and codes[0, 0, 31] == 15 and codes[0, 1, 31] == 15
    assert qs[0, 0, 0] == (0 | (codes[0, 0, 16] << 4))  # ggml packing: element j and j + 16 share byte j
    back = dequantize_q4_1(qs, d, m, torch.float64)
    assert (back - w.double()).abs().max() <= d.double().max() / 2 + 1e-6


def test_q8_0_by_hand():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([2.54, -1.27, 0.01, 0.005])
    q, d = quantize_q8_0(w)
    assert d.dtype == torch.float16 and torch.equal(d, torch.tensor([[2.54 / 127]]).half())
    step = d.float()[0, 0]
    assert q[0, 0, :4].tolist() == [round(2.54 / float(step)), round(-1.27 / float(step)), 0, 0]
    assert bool(((dequantize_q8_0(q, d, torch.float64) - w.double()).abs() <= float(step) / 2 + 1e-7).all())


def test_q4_bounds_random():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 128, generator=g)
    blocks = w.reshape(16, 4, 32)
    qs, d, m = quantize_q4_1(w)
    err = (dequantize_q4_1(qs, d, m, torch.float64) - w.double()).reshape(16, 4, 32).abs()
    step = (blocks.amax(-1) - blocks.amin(-1)).double() / 15
    assert bool((err <= step[..., None] * 0.5 + step[..., None] * 2e-3 + 1e-3).all())  # + float16 d and m
    qs0, d0 = quantize_q4_0(w)
    err0 = (dequantize_q4_0(qs0, d0, torch.float64) - w.double()).reshape(16, 4, 32).abs()
    amax = blocks.abs().amax(-1).double()
    assert bool((err0 <= amax[..., None] / 8 + 1e-3).all())  # one step (the clamp at +8 steps costs up to one)
    # the element of largest magnitude maps to code 0 exactly
    idx = blocks.abs().argmax(-1)
    assert bool((unpack_q4(qs0).gather(-1, idx[..., None]) == 0).all())


def _reference(method, w, x, bias):
    """float64 product of the weights the method actually holds (dequantised by hand from its tensors)."""
    layer = Linear(w.shape[1], w.shape[0], bias=bias is not None, method=method)
    with torch.no_grad():
        layer.weight.copy_(w)
        if bias is not None:
            layer.bias.copy_(bias)
    method.process_after_load(layer)
    qt = layer.quant
    if isinstance(method, W8A8LinearMethod):
        xq, sx = quantize_rows(x, torch.int8)
        q = qt["q"] if "q" in qt else quantize_rows(w, torch.int8)[0]  # VNNI kernels keep only a packed copy
        wq = q.double() * qt["scale"].double()[:, None]
        ref = (xq.double() * sx.double()[:, None]) @ wq.t()
    else:
        if isinstance(method, Q8_0LinearMethod):
            wd = dequantize_q8_0(qt["q"], qt["d"], torch.float64)
        elif isinstance(method, Q4LinearMethod):
            wd = dequantize_q4_1(qt["qs"], qt["d"], qt["m"], torch.float64) if method.layout == "q4_1" else \
                dequantize_q4_0(qt["qs"], qt["d"], torch.float64)
        else:
            q = unpack_q8(qt["packed"], w.shape[0]) if "packed" in qt else qt["q"]  # bf16 q8p kernels: packed only
            wd = q.double() * qt["scale"].double()[:, None]
        ref = x.double() @ wd.t()
    if bias is not None:
        ref += bias.double()
    return layer, ref


METHODS = [lambda: Int8LinearMethod(), lambda: Q8_0LinearMethod(), lambda: Fp8LinearMethod(), lambda: Q4LinearMethod(),
           lambda: Q4LinearMethod(layout="q4_0"), lambda: W8A8LinearMethod(), lambda: Int8LinearMethod(16),
           lambda: Q4LinearMethod(16)]


@pytest.mark.parametrize("make", METHODS)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_quantized_linear_vs_float64(make, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(2100, 96, generator=g) / 10  # more than COL_TILE outputs: two tiles
    bias = torch.randn(2100, generator=g)
    x = torch.randn(rows, 96, generator=g)
    method = make()
    layer, ref = _reference(method, w, x, bias)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 2100)
    # float32 sums of 96 products: relative error ~ 96 * 2^-24 of the absolute sum
    scale = (x.double().abs() @ w.double().abs().t()).max() + bias.abs().max()
    assert (y.double() - ref).abs().max() <= 1e-5 * scale


def test_w8a8_integer_sums_exact():
    """Integer-valued x with max|x_row| = 127 and w with max|w_row| = 127 have scales 1: the product is
    the exact int32 sum."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-127, 128, (40, 64), generator=g).float()
    w[:, 0] = 127
    x = torch.randint(-127, 128, (5, 64), generator=g).float()
    x[:, 0] = -127
    m = W8A8LinearMethod()
    layer = Linear(64, 40, method=m)
    with torch.no_grad():
        layer.weight.copy_(w)
    m.process_after_load(layer)
    assert torch.equal(layer(x).double(), x.double() @ w.double().t())


@pytest.mark.parametrize("make", [lambda: Int8LinearMethod(16), lambda: Q4LinearMethod(16), W8A8LinearMethod])
def test_deterministic_rows_do_not_depend_on_batch(make):
    g = torch.Generator().manual_seed(4)
    m = make()
    layer = Linear(64, 200, method=m)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 64, generator=g))
    m.process_after_load(layer)
    x = torch.randn(37, 64, generator=g)
    full = layer(x)
    for n in (1, 5, 16, 17):
        assert torch.equal(layer(x[:n]), full[:n])


def test_q4_refuses_unaligned_features():
    layer = Linear(40, 8, method=Q4LinearMethod())
    with pytest.raises(ValueError, match="divisible by 32"):
        layer.method.process_after_load(layer)


def test_selection_and_head_method():
    assert isinstance(select_linear_method(torch.float32, "cpu", False, None, weight_dtype="int8"), Int8LinearMethod)
    m = select_linear_method(torch.float32, "cpu", False, None, weight_dtype="int4")
    assert isinstance(m, Q4LinearMethod) and isinstance(m.head_method, Q8_0LinearMethod)
    assert isinstance(select_linear_method(torch.float32, "cpu", False, None, weight_dtype="int8",
                                           activation_dtype="int8"), W8A8LinearMethod)
    assert quantized_linear_method("int8", deterministic=True).row_tile == 16
    assert not isinstance(select_linear_method(torch.float32, "cpu", False, None, weight_dtype="bf16"),
                          nn.Module)


@pytest.mark.parametrize("w,a,kv", [("fp8", "int8", "int8"), ("bf16", "int8", "fp8_e5m2")])
def test_refused_combinations_name_themselves(w, a, kv):
    with pytest.raises(ValueError, match=f"--weight-dtype {w} --activation-dtype {a} is not supported.*Supported"):
        EngineConfig(weight_dtype=w, activation_dtype=a, kv_cache_dtype=kv)


def test_flag_values_checked_and_aliases():
    assert check_precision("int8", "int8", "fp8") == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    for bad in (dict(weight_dtype="int3"), dict(activation_dtype="fp8"), dict(kv_cache_dtype="int4")):
        with pytest.raises(ValueError, match="must be one of"):
            EngineConfig(**bad)


def _kernel_builds():
    """[(build name, dtype, kernels)]: this CPU's build and the portable one, both dtypes, and on an AVX-512
    CPU the AVX2 build ([] without a C compiler)."""
    return [(name, dt, k) for dt, pair in native_and_portable().items() for name, k in zip(("native", "portable"), pair)] \
        + [("avx2", dt, k) for dt, k in avx2_only().items()]


KERNELS = _kernel_builds()


@pytest.mark.skipif(not KERNELS, reason="no C compiler: the kernels are not built")
@pytest.mark.parametrize("build", range(len(KERNELS) or 1), ids=lambda i: f"{KERNELS[i][0]}-{KERNELS[i][1]}"
                         if KERNELS else "none")
@pytest.mark.parametrize("layout", ["int8", "fp8", "q4_1", "q8_0", "w8a8"])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 300])
def test_kernel_path_vs_float64(build, layout, rows):
    """The C kernels (batches up to KERNEL_MAX_ROWS) and the torch path above, in float32 and bfloat16,
    against the float64 product of the held quantised weights: float32 sums (tight), bfloat16 inputs
    and a bfloat16 output rounding (half an ulp of the largest output, 2^-9 relative)."""
    from idleless.quant.methods import KERNEL_MAX_ROWS

    _, dtype, kern = KERNELS[build]
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 160, generator=g) / 10
    bias = torch.randn(300, generator=g).to(dtype)
    x = torch.randn(rows, 200, generator=g)[:, :160].to(dtype)  # strided rows
    method = {"int8": Int8LinearMethod, "fp8": Fp8LinearMethod, "q4_1": Q4LinearMethod, "q8_0": Q8_0LinearMethod,
              "w8a8": W8A8LinearMethod}[layout](kernels=kern)
    layer, ref = _reference(method, w, x.float(), bias.float())
    with torch.no_grad():
        layer.bias = nn.Parameter(bias, requires_grad=False)
    y = layer(x)
    assert y.dtype == dtype
    scale = float((x.double().abs() @ w.double().abs().t()).max() + bias.double().abs().max())
    tol = 1e-5 * scale if dtype == torch.float32 else 2.0 ** -8 * scale
    assert float((y.double() - ref).abs().max()) <= tol
    if rows <= KERNEL_MAX_ROWS or layout == "w8a8":  # the kernel's rows do not depend on the batch, and
        assert torch.equal(layer(x[:1]), y[:1])  # W8A8's exact sums give its torch path the kernel's bits
