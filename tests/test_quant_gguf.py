"""GGUF blocks served as stored (issue 14): the bundled SmolLM2 file's Q4_1 and Q8_0 tensors, taken
through the float copy the loader makes and quantised again, are the file's own bytes, and the
quantised linears over them give the float64 product of the gguf package's dequantisation."""

import numpy as np
import pytest
import torch

from idleless.model import cpu_kernels
from idleless.model.linear import Linear
from idleless.model.loader import native_weight_dtype
from idleless.quant.formats import quantize_q4_1, quantize_q8_0
from idleless.quant.methods import Q4LinearMethod, Q8_0LinearMethod

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def reader():
    from idleless.model.loader import _bundled_gguf_path, _open_gguf
    try:
        return _open_gguf(_bundled_gguf_path())
    except FileNotFoundError:
        pytest.skip("the bundled SmolLM2 GGUF is not installed")


def _tensor(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    return t, w


def test_auto_is_the_files_format(reader, tmp_path):
    from conftest import make_tiny_model
    assert native_weight_dtype(None) == "int4"
    assert native_weight_dtype(make_tiny_model(tmp_path)) is None  # float safetensors: float weights


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.5.ffn_down.weight", "blk.29.attn_v.weight",
                                  "token_embd.weight"])
def test_requantised_blocks_are_the_files_bytes(reader, name):
    t, w = _tensor(reader, name)
    raw = np.asarray(t.data)
    if t.tensor_type.name == "Q4_1":  # ggml block_q4_1: d f16, m f16, qs[16]
        raw = raw.reshape(w.shape[0], -1, 20)
        qs, d, m = quantize_q4_1(w)
        assert np.array_equal(d.numpy().view(np.uint8).reshape(raw[..., 0:2].shape), raw[..., 0:2])
        assert np.array_equal(m.numpy().view(np.uint8).reshape(raw[..., 2:4].shape), raw[..., 2:4])
        assert np.array_equal(qs.numpy(), raw[..., 4:])
    else:  # ggml block_q8_0: d f16, qs[32]
        assert t.tensor_type.name == "Q8_0"
        raw = raw.reshape(w.shape[0], -1, 34)
        q, d = quantize_q8_0(w)
        assert np.array_equal(d.numpy().view(np.uint8).reshape(raw[..., 0:2].shape), raw[..., 0:2])
        assert np.array_equal(q.numpy().view(np.uint8), raw[..., 2:])


@pytest.mark.parametrize("name", ["blk.3.ffn_gate.weight", "token_embd.weight"])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("kernels", [False, True])
def test_native_product_is_the_dequantised_product(reader, name, rows, kernels):
    t, w = _tensor(reader, name)
    if name == "token_embd.weight":
        w = w[:4096]  # a slice of the vocabulary keeps the test small
    kern = cpu_kernels.load(torch.float32) if kernels else None
    if kernels and kern is None:
        pytest.skip("no C compiler")
    method = Q8_0LinearMethod(kernels=kern) if t.tensor_type.name == "Q8_0" else Q4LinearMethod(kernels=kern)
    layer = Linear(w.shape[1], w.shape[0], method=method)
    with torch.no_grad():
        layer.weight.copy_(w)
    method.process_after_load(layer)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ w.double().t()
    scale = float((x.double().abs() @ w.double().abs().t()).max())
    assert float((layer(x).double() - ref).abs().max()) <= 1e-5 * scale
