"""Deterministic inference with GGUF weights (``--enable-deterministic-inference --weight-dtype int4``):
the Q4_1 layers and their Q8_0 lm_head give a row the same bits whatever batch it sits in, on the C
kernels for every batch size (``q41_linear`` / ``q80_linear``) and on row tiles without them, and
equal the float64 product of the dequantised weights they hold."""

import pytest
import torch

from idleless.model import cpu_kernels
from idleless.model.linear import Linear
from idleless.quant.formats import dequantize_q4_1, dequantize_q8_0
from idleless.quant.methods import KERNEL_MAX_ROWS, quantized_linear_method

DTYPES = (torch.float32, torch.bfloat16)
BATCHES = (1, 7, 16, 17, 64, 300)


def _kernels(dtype):
    k = cpu_kernels.load(dtype)
    if k is None:
        pytest.skip("no C compiler: the kernels are off")
    return k


def _layer(head: bool, dtype, kernels, n=96, k=160, seed=0):
    """A deterministic int4 layer (Q4_1) or its lm_head (Q8_0) with random weights and bias, and the
    float64 weight it holds, dequantised by ``formats``."""
    method = quantized_linear_method("int4", deterministic=True, kernels=kernels)
    if head:
        method = method.head_method
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=True, method=method)
    lin.weight.data = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    lin.bias.data = torch.randn(n, generator=g).to(dtype)
    method.process_after_load(lin)
    qt = lin.quant
    wd = dequantize_q8_0(qt["q"], qt["d"], torch.float64) if head else \
        dequantize_q4_1(qt["qs"], qt["d"], qt["m"], torch.float64)
    return lin, wd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", [False, True], ids=["q4_1", "q8_0-head"])
@pytest.mark.parametrize("kind", ["kernel", "tiled"])
def test_row_bits_do_not_depend_on_the_batch(dtype, head, kind):
    kern = _kernels(dtype) if kind == "kernel" else None
    lin, wd = _layer(head, dtype, kern)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(BATCHES), lin.weight.shape[1], generator=g).to(dtype)
    alone = [lin(x[i:i + 1]) for i in range(max(BATCHES))]
    for m in BATCHES:
        for start in {0, max(BATCHES) - m}:
            y = lin(x[start:start + m])
            for i in range(m):
                assert torch.equal(y[i:i + 1], alone[start + i]), (m, start, i)
    # against the float64 product of the held weight: float32 sums of 160 products (tight); in
    # bfloat16, bf16 inputs and an output rounding (half an ulp: 2^-9 relative, with margin)
    ref = x.double() @ wd.t() + lin.bias.double()
    y = lin(x).double()
    scale = float((x.double().abs() @ wd.abs().t()).max() + lin.bias.double().abs().max())
    tol = 1e-5 * scale if dtype == torch.float32 else 2.0 ** -8 * scale
    assert float((y - ref).abs().max()) <= tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", [False, True], ids=["q4_1", "q8_0-head"])
def test_large_batches_run_on_the_kernel(dtype, head):
    """Past KERNEL_MAX_ROWS the deterministic method still gives the kernel's own bits (the default
    method dequantises tiles into the GEMM library there)."""
    kern = _kernels(dtype)
    lin, _ = _layer(head, dtype, kern)
    x = torch.randn(3 * KERNEL_MAX_ROWS + 5, lin.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    qt, method = lin.quant, lin.method
    if head:  # the kernel the method runs: bi_q80_linear / bi_q41_linear on AVX-512 BF16 for bfloat16
        direct = kern.bi_q80_linear(x, qt["bi"], qt["d"].shape[0], lin.bias) if method.use_bi_q80 else \
            kern.q80_linear(x, qt["q"], qt["d"], lin.bias)
    else:
        direct = kern.bi_q41_linear(x, qt["bi"], qt["d"].shape[0], lin.bias) if method.use_bi_q41 else \
            kern.q41_linear(x, qt["qs"], qt["d"], qt["m"], lin.bias)
    assert torch.equal(lin(x), direct)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_rows_do_not_depend_on_the_batch(dtype):
    """Deterministic int8 weights (bfloat16 activations) on the kernels for every batch: in bfloat16 where the
    kernels have q8p_linear, on the packed weight (register-decoded rows up to 4, buffered above); a row's bits
    are its bits alone at every batch size and position, within the bound of the float64 product."""
    from idleless.quant.formats import unpack_q8

    kern = _kernels(dtype)
    method = quantized_linear_method("int8", deterministic=True, kernels=kern)
    g = torch.Generator().manual_seed(5)
    n, k = 200, 160
    lin = Linear(k, n, bias=True, method=method)
    lin.weight.data = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    lin.bias.data = torch.randn(n, generator=g).to(dtype)
    method.process_after_load(lin)
    qt = lin.quant
    assert ("packed" in qt) == (dtype == torch.bfloat16 and kern.has_q8p)
    q = unpack_q8(qt["packed"], n) if "packed" in qt else qt["q"]
    wd = q.double() * qt["scale"].double()[:, None]
    x = torch.randn(max(BATCHES), k, generator=g).to(dtype)
    alone = [lin(x[i:i + 1]) for i in range(max(BATCHES))]
    for m in BATCHES + (2, 3, 4, 5):
        for start in {0, max(BATCHES) - m}:
            y = lin(x[start:start + m])
            for i in range(m):
                assert torch.equal(y[i:i + 1], alone[start + i]), (m, start, i)
    ref = x.double() @ wd.t() + lin.bias.double()
    scale = float((x.double().abs() @ wd.abs().t()).max() + lin.bias.double().abs().max())
    tol = 1e-5 * scale if dtype == torch.float32 else 2.0 ** -8 * scale
    assert float((lin(x).double() - ref).abs().max()) <= tol
