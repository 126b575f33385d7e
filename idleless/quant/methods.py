"""Quantised linear methods (``linear.LinearMethod``): the weight quantised once per weight change in
``process_after_load``, read in its quantised form by ``apply``. Portable PyTorch: ``apply`` turns
``COL_TILE`` output channels at a time back into the model dtype (a tile's worth of temporary memory,
never the whole weight) and multiplies; W8A8 sums integer products exactly. With the CPU kernels
(``q8_linear``, ``lut8_linear``, ``w8a8_linear``), batches of up to ``KERNEL_MAX_ROWS`` rows (decode,
speculative verify) read the quantised weight directly instead (W8A8 on CPUs with AVX512-VNNI: every
batch, on ``w8a8_gemm``'s packed weight; int8 weights in a bfloat16 model on CPUs with AVX-512 BF16 and
VBMI: every batch, on ``q8p_linear``'s packed weight). The GGUF formats' kernels
(``q41_linear``, ``q80_linear``) have a GEMM tiling (a panel of the weight decoded once into a
cache-resident float buffer) and run batches of up to ``GGUF_KERNEL_MAX_ROWS`` rows, where they were
measured faster than dequantising into the GEMM library (benchmarks/README.md, issue 11); larger batches
have their tiles dequantised in C (``q41_dequant`` / ``q80_dequant``) into the library's GEMM. Q4_1 on
``bi_q41_linear`` (bfloat16, AVX-512 BF16) runs batches of up to ``BI_Q41_KERNEL_MAX_ROWS`` rows there, Q8_0
on ``bi_q80_linear`` (the same scheme) up to ``BI_Q80_KERNEL_MAX_ROWS``; both keep a packed copy of the
weight (``layer.quant["bi"]``, as many bytes as the blocks).

The layer keeps its float parameter (``layer.weight``, the target of loading by name and of later
weight updates, ``weights.load_weights``); the quantised copy is what the forward reads.

Formats (``formats``): ``Int8LinearMethod`` (per output channel, symmetric), ``Fp8LinearMethod`` (e4m3
per output channel), ``Q4LinearMethod`` (GGUF Q4_1 or Q4_0 blocks of 32, its output layer in
``Q8_0LinearMethod``: GGUF Q8_0 blocks), ``W8A8LinearMethod`` (int8
weights per channel, activations quantised per token at run time, exact integer sums),
``W4A8LinearMethod`` (Q4_1 blocks times activations quantised per block of 32, llama.cpp's integer
dot products; its output layer ``Q8_0A8LinearMethod``).

row_tile (deterministic inference): with the C kernels, every batch size runs on them (each output
element is one float32 sum in a fixed order for any number of rows, so a row's bits do not depend on
the batch); without them (or for a format without a kernel, Q4_0), the product runs on tiles of
exactly that many rows (the last zero-padded), so the GEMM library sees one shape whatever the batch,
as ``linear.TiledLinearMethod``. W8A8 is batch-invariant as it is (integer sums are exact).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from idleless.model.linear import LinearMethod
from idleless.quant.formats import (dequantize_q4_0, dequantize_q4_1, dequantize_q8_0, interleave_q4_1, interleave_q8_0,
                                    quantize_q4_0, quantize_q4_1, quantize_q8_0, quantize_rows, unpack_q8)

#: output channels dequantised at a time by ``apply``
COL_TILE = 2048
#: rows per tile of the batch-invariant (deterministic) path
DETERMINISTIC_ROW_TILE = 16
#: most rows a call sends to the C kernels (which read each weight row once per row of x)
KERNEL_MAX_ROWS = 16
#: most rows the default mode sends to the GGUF kernels (their panel GEMM); above, dequantising into the
#: GEMM library measured faster on an AVX2 EPYC (benchmarks/README.md, issue 11)
GGUF_KERNEL_MAX_ROWS = 256
#: most rows the default mode sends to ``bi_q41_linear`` (Q4_1 x bfloat16 on AVX-512 BF16): up to here it
#: measured at least as fast as dequantising into oneDNN's bfloat16 GEMM (benchmarks/README.md, issue 11/15 H1),
#: so these batches (a prefill chunk of up to ``chunked_prefill_size`` tokens) keep the deterministic bits
BI_Q41_KERNEL_MAX_ROWS = 2048
#: the same for Q8_0 on ``bi_q80_linear`` (the GGUF lm_head: its batches are the sampled rows, or prompt-logprob
#: blocks of ``runner.PROMPT_LOGITS_BLOCK``)
BI_Q80_KERNEL_MAX_ROWS = 2048


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class QuantizedLinearMethod(LinearMethod):
    """Base: ``quantize(weight) -> dict of tensors`` stored as ``layer.quant``; ``tile(layer, n0, n1,
    dtype)`` -> output rows n0..n1 of the weight as floats (and per-channel factors for their
    products); ``kernel_apply`` the C kernel's product. ``head_method``: the method of the model's
    lm_head (an output layer is kept at 8 bits, as llama.cpp's files keep it).
    kernels: a ``cpu_kernels.CpuKernels`` of the model dtype or None. With row_tile (deterministic)
    and kernels, every batch runs on the kernel, whose rows do not depend on the batch; row tiles are
    the path without a kernel. ``kernel_rows``: the most rows the default mode sends to the kernel."""

    kernel_rows = KERNEL_MAX_ROWS

    def __init__(self, row_tile: Optional[int] = None, kernels=None):
        self.row_tile = row_tile
        self.kernels = kernels
        self.head_method = self

    def kernel_apply(self, layer, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The C kernel's product x [M, K] (the kernels' dtype) -> [M, N], or None where the method
        has none (then it has none for any M)."""
        return None

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def tile(self, layer, n0: int, n1: int, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(w [n1 - n0, K] in dtype, per-channel scale [n1 - n0] float32 to multiply the product by,
        or None)."""
        raise NotImplementedError

    def process_after_load(self, layer) -> int:
        layer.quant = self.quantize(layer.weight.detach())
        return _nbytes(*layer.quant.values())

    def on_kernel(self, m: int) -> bool:
        """Whether a batch of m rows runs on the C kernel (when the method has one): deterministic, any
        M (a row's bits then never depend on the batch); else up to kernel_rows, larger batches being
        faster dequantised tile by tile into the GEMM library."""
        return self.kernels is not None and 0 < m and (self.row_tile is not None or m <= self.kernel_rows)

    def kernel_into(self, layer, x: torch.Tensor, out: torch.Tensor) -> bool:
        """The C kernel's product of x [M, K] written into out [M, N] (contiguous, the kernels' dtype),
        called by address (``apply_into``); False where the method has no such call."""
        return False

    def apply_into(self, layer, x: torch.Tensor, out: torch.Tensor) -> None:
        if not (self.on_kernel(x.shape[0]) and self.kernel_into(layer, x, out)):
            out.copy_(self.apply(layer, x))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.on_kernel(x.shape[0]):
            y = self.kernel_apply(layer, x)
            if y is not None:
                return y
        if self.row_tile is None:
            return self._product(layer, x)
        m, t = x.shape[0], self.row_tile
        pad = -m % t
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        out = torch.cat([self._product(layer, part) for part in x.split(t)])
        return out[:m] if pad else out

    def _product(self, layer, x: torch.Tensor) -> torch.Tensor:
        n = layer.weight.shape[0]
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, COL_TILE):
            n1 = min(n, n0 + COL_TILE)
            w, s = self.tile(layer, n0, n1, x.dtype)
            y = F.linear(x, w)
            if s is not None:
                y = (y.float() * s).to(x.dtype)
            out[:, n0:n1] = y
        if layer.bias is not None:
            out += layer.bias
        return out


class Int8LinearMethod(QuantizedLinearMethod):
    """int8 weights, one symmetric scale per output channel (max|w_row| / 127); the product of x with
    the int8 values (exact in the model dtype) scaled per channel. With bfloat16 kernels that have
    ``q8p_linear`` (``CpuKernels.has_q8p``: AVX-512 BF16 and VBMI) and input features a multiple of 4,
    the codes are kept only in ``q8_pack``'s layout (``layer.quant["packed"]``, no ``"q"``; the same
    bytes, reordered so a decode row streams them linearly), read by ``q8p_linear``; tiles for the GEMM
    library unpack them (``formats.unpack_q8``)."""

    qdtype = torch.int8
    #: whether this format's codes go to q8_pack (int8 weights with bfloat16 activations only)
    bf16_packs = True

    def _packs(self, k: int) -> bool:
        return self.bf16_packs and self.kernels is not None and getattr(self.kernels, "has_q8p", False) and k % 4 == 0

    def quantize(self, weight):
        q, s = quantize_rows(weight, self.qdtype)
        if self._packs(q.shape[1]):
            return {"packed": self.kernels.q8_pack(q), "scale": s}
        return {"q": q, "scale": s}

    def tile(self, layer, n0, n1, dtype):
        qt = layer.quant
        q = unpack_q8(qt["packed"], qt["scale"].numel(), n0, n1) if "packed" in qt else qt["q"][n0:n1]
        return q.to(dtype), qt["scale"][n0:n1]

    def on_kernel(self, m: int) -> bool:
        # packed: every batch (q8p_linear measured at least as fast as dequantised tiles into the GEMM
        # library up to 1000 rows); a layer left unpacked (K not a multiple of 4) then runs q8_linear
        return super().on_kernel(m) or (self._packs(0) and m > 0)

    def kernel_apply(self, layer, x):
        if "packed" in layer.quant:
            return self.kernels.q8p_linear(x, layer.quant["packed"], layer.quant["scale"], layer.bias)
        return self.kernels.q8_linear(x, layer.quant["q"], layer.quant["scale"], layer.bias)

    def kernel_into(self, layer, x, out):
        """q8p_linear into out, called by address (the decode graph's buffers: x [M, K] with contiguous
        rows, out [M, N] contiguous; the layout q8_pack checked at load). Raises MemoryError when the
        kernel cannot allocate its buffers."""
        qt = layer.quant
        if "packed" not in qt:
            return False
        bias = layer.bias
        if not self.kernels._q8p_linear(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), qt["packed"].data_ptr(),
                                        qt["scale"].data_ptr(), out.shape[1], None if bias is None else bias.data_ptr(),
                                        out.data_ptr(), out.stride(0)):
            raise MemoryError("q8p_linear: cannot allocate its buffers")
        return True


class Fp8LinearMethod(Int8LinearMethod):
    """fp8 e4m3 weights, one scale per output channel (max|w_row| / 448). Bytes are decoded through a
    256-entry table (``LUT``: PyTorch's own float8 -> float32 conversion of every pattern), in C for
    small batches (``cpu_kernels.lut8_linear``) and by indexing for larger ones (PyTorch's float8 cast
    on CPU is far slower)."""

    qdtype = torch.float8_e4m3fn
    bf16_packs = False
    LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()

    def tile(self, layer, n0, n1, dtype):
        codes = layer.quant["q"][n0:n1].view(torch.uint8).int()
        return self.LUT[codes].to(dtype), layer.quant["scale"][n0:n1]

    def kernel_apply(self, layer, x):
        return self.kernels.lut8_linear(x, layer.quant["q"], self.LUT, layer.quant["scale"], layer.bias)


class Q8_0LinearMethod(QuantizedLinearMethod):
    """8-bit weights in GGUF Q8_0 blocks of 32 input features (a float16 step per block; ``formats``):
    the output layer of ``Q4LinearMethod``, as llama.cpp's files keep it (the bundled SmolLM2's tied
    embedding is Q8_0). Raises ValueError at load for in_features not divisible by 32."""

    kernel_rows = GGUF_KERNEL_MAX_ROWS  # BI_Q80_KERNEL_MAX_ROWS on bi_q80_linear
    bi_q80 = True  # Q8_0 x bfloat16 on bi_q80_linear where the kernels have it (not W4A8's int8 activations)

    def __init__(self, row_tile: Optional[int] = None, kernels=None):
        super().__init__(row_tile, kernels)
        # as Q4LinearMethod's use_bi_q41: the kernel of every batch the method sends to a kernel
        self.use_bi_q80 = bool(self.bi_q80 and kernels is not None and getattr(kernels, "has_bi_q80", False))
        if self.use_bi_q80:
            self.kernel_rows = BI_Q80_KERNEL_MAX_ROWS

    def process_after_load(self, layer) -> int:
        extra = super().process_after_load(layer)
        if self.use_bi_q80:
            qt = layer.quant
            qt["bi"] = self.kernels.bi_q80_pack(qt["q"], qt["d"])
            extra += _nbytes(qt["bi"])
        return extra

    def quantize(self, weight):
        q, d = quantize_q8_0(weight)
        return {"q": q, "d": d}

    def tile(self, layer, n0, n1, dtype):
        q, d = layer.quant["q"][n0:n1], layer.quant["d"][n0:n1]
        if self.kernels is not None:
            return self.kernels.q80_dequant(q, d).to(dtype), None
        return dequantize_q8_0(q, d, dtype), None

    def kernel_apply(self, layer, x):
        qt = layer.quant
        if self.use_bi_q80:
            return self.kernels.bi_q80_linear(x, qt["bi"], qt["d"].shape[0], layer.bias)
        return self.kernels.q80_linear(x, qt["q"], qt["d"], layer.bias)


class Q4LinearMethod(QuantizedLinearMethod):
    """4-bit weights in GGUF blocks of 32 input features (``formats``): Q4_1 (step and minimum per
    block, the default) or Q4_0 (step only). The output layer runs in Q8_0 (``head_method``).
    Raises ValueError at load for in_features not divisible by 32."""

    kernel_rows = GGUF_KERNEL_MAX_ROWS  # Q4_1's (BI_Q41_KERNEL_MAX_ROWS on bi_q41_linear); Q4_0 has no kernel
    bi_q41 = True  # Q4_1 x bfloat16 on bi_q41_linear where the kernels have it (not W4A8's int8 activations)

    def __init__(self, row_tile: Optional[int] = None, layout: str = "q4_1", kernels=None):
        super().__init__(row_tile, kernels)
        if layout not in ("q4_0", "q4_1"):
            raise ValueError(f"Q4 layout must be q4_0 or q4_1, got {layout!r}")
        self.layout = layout
        self.head_method = Q8_0LinearMethod(row_tile, kernels)
        # Q4_1 on kernels with ``bi_q41_linear`` (bfloat16, AVX-512 BF16): the kernel of every batch the method
        # sends to a kernel (deterministic: all; default: up to kernel_rows, which so keep the deterministic bits)
        self.use_bi_q41 = bool(self.bi_q41 and layout == "q4_1" and kernels is not None
                               and getattr(kernels, "has_bi_q41", False))
        if self.use_bi_q41:
            self.kernel_rows = BI_Q41_KERNEL_MAX_ROWS

    def process_after_load(self, layer) -> int:
        extra = super().process_after_load(layer)
        if self.use_bi_q41:
            qt = layer.quant
            qt["bi"] = self.kernels.bi_q41_pack(qt["qs"], qt["d"], qt["m"])
            extra += _nbytes(qt["bi"])
        return extra

    def kernel_apply(self, layer, x):
        if self.layout != "q4_1":
            return None
        qt = layer.quant
        if self.use_bi_q41:
            return self.kernels.bi_q41_linear(x, qt["bi"], qt["d"].shape[0], layer.bias)
        return self.kernels.q41_linear(x, qt["qs"], qt["d"], qt["m"], layer.bias)

    def kernel_into(self, layer, x, out):
        if self.use_bi_q41:
            qt, bias = layer.quant, layer.bias
            if not self.kernels._bi_q41_linear(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), qt["bi"].data_ptr(),
                                               qt["d"].shape[0], None if bias is None else bias.data_ptr(),
                                               out.data_ptr(), out.stride(0)):
                raise MemoryError("bi_q41_linear: cannot allocate its buffers")
            return True
        return self.layout == "q4_1" and _gguf_into(self.kernels._q41_linear, layer, layer.quant["qs"], x, out)

    def quantize(self, weight):
        if self.layout == "q4_1":
            qs, d, m = quantize_q4_1(weight)
            return {"qs": qs, "d": d, "m": m}
        qs, d = quantize_q4_0(weight)
        return {"qs": qs, "d": d}

    def tile(self, layer, n0, n1, dtype):
        qt = layer.quant
        if self.layout == "q4_1":
            parts = qt["qs"][n0:n1], qt["d"][n0:n1], qt["m"][n0:n1]
            if self.kernels is not None:
                return self.kernels.q41_dequant(*parts).to(dtype), None
            return dequantize_q4_1(*parts, dtype), None
        return dequantize_q4_0(qt["qs"][n0:n1], qt["d"][n0:n1], dtype), None


class W8A8LinearMethod(Int8LinearMethod):
    """int8 weights per output channel and int8 activations per token (dynamic, symmetric:
    max|x_row| / 127), multiplied as integers with exact sums, then scaled by x's and w's scales in
    float32 (SmoothQuant's W8A8 without the smoothing, arXiv 2211.10438). Where the kernels run
    vpdpbusd (``CpuKernels.has_vnni``: AVX512-VNNI), every batch runs on ``cpu_kernels.w8a8_gemm``
    and the weight is kept only in its packed layout (``layer.quant["packed"]``, ``w8a8_pack``, once per
    weight change; no ``"q"``). Otherwise small batches in ``cpu_kernels.w8a8_linear`` (int16
    multiply-adds into int32) and larger ones as float32 products of the integer codes over chunks of
    ``EXACT_K`` input features, where every partial sum is an integer below 2^24 and so exact in any
    order, the chunks added as int32. All give the same bits, for any batch (batch-invariant without
    row tiles). Raises ValueError at load (with VNNI kernels) for more than 65536 input features."""

    #: input features per float32 product: 1024 * 127 * 127 < 2^24
    EXACT_K = 1024
    bf16_packs = False  # its own packed layout (w8a8_pack)

    def __init__(self, kernels=None):
        super().__init__(None, kernels)
        self.packed = kernels is not None and kernels.has_vnni

    def quantize(self, weight):
        qt = super().quantize(weight)
        if self.packed:
            qt = {"packed": self.kernels.w8a8_pack(qt.pop("q")), **qt}
        return qt

    def on_kernel(self, m: int) -> bool:
        return self.packed or super().on_kernel(m)  # packed: every batch (w8a8_gemm takes M = 0 too)

    def kernel_apply(self, layer, x):
        if self.packed:
            return self.kernels.w8a8_gemm(x, layer.quant["packed"], layer.quant["scale"], layer.bias)
        return self.kernels.w8a8_linear(x, layer.quant["q"], layer.quant["scale"], layer.bias)

    def kernel_into(self, layer, x, out):
        if not self.packed:
            return False
        self.kernels.w8a8_gemm(x, layer.quant["packed"], layer.quant["scale"], layer.bias, out=out)
        return True

    def tile(self, layer, n0, n1, dtype):
        if self.packed:
            raise RuntimeError("W8A8 with the VNNI kernels keeps only the packed weight: no float tiles")
        return super().tile(layer, n0, n1, dtype)

    def _product(self, layer, x: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_rows(x, torch.int8)
        xf = xq.float()
        q, scale = layer.quant["q"], layer.quant["scale"]
        n, k = q.shape
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, COL_TILE):
            n1 = min(n, n0 + COL_TILE)
            wf = q[n0:n1].float()
            acc = torch.zeros(x.shape[0], n1 - n0, dtype=torch.int32)
            for k0 in range(0, k, self.EXACT_K):
                acc += (xf[:, k0:k0 + self.EXACT_K] @ wf[:, k0:k0 + self.EXACT_K].t()).to(torch.int32)
            y = acc.float() * sx[:, None] * scale[n0:n1]
            if layer.bias is not None:
                y += layer.bias[n0:n1].float()
            out[:, n0:n1] = y.to(x.dtype)
        return out


def quantize_act_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations to int8 per block of 32 features, as ``cpu_kernels.a8_quantize`` (llama.cpp's Q8_1
    without its sums): x [M, K] (K a multiple of 32) -> (codes int8 [M, K], d float32 [M, K/32]),
    d = max|block| / 127 in float32, codes = round(x / d) half to even (zeros for an all-zero block)."""
    xb = x.float().reshape(x.shape[0], x.shape[1] // 32, 32)
    d = xb.abs().amax(-1) / 127
    codes = (xb / torch.where(d != 0, d, torch.ones_like(d))[..., None]).round_().clamp_(-127, 127)
    return codes.to(torch.int8).reshape(x.shape), d


class _BlockAct8:
    """Activations quantised to int8 per block of 32 input features (``quantize_act_blocks``) in front of
    a GGUF block-weight method (mixed in before it). With the CPU kernels every batch runs on the
    kernel (integer products, batch-invariant by construction, so also the deterministic mode's path).
    Without them: the activation codes and the weight tiles dequantised to float32 and multiplied in
    float32 (``_product``; row tiles when deterministic), which agrees with the kernel up to float32
    rounding of the products and sums (a relative 1e-5 of the output's terms in the tests)."""

    def on_kernel(self, m: int) -> bool:
        return self.kernels is not None

    def _product(self, layer, x: torch.Tensor) -> torch.Tensor:
        codes, d = quantize_act_blocks(x)
        xh = (codes.float().reshape(d.shape[0], d.shape[1], 32) * d[..., None]).reshape(x.shape)
        n = layer.weight.shape[0]
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, COL_TILE):
            n1 = min(n, n0 + COL_TILE)
            y = F.linear(xh, self.tile(layer, n0, n1, torch.float32)[0])
            if layer.bias is not None:
                y += layer.bias[n0:n1].float()
            out[:, n0:n1] = y
        return out


class Q8_0A8LinearMethod(_BlockAct8, Q8_0LinearMethod):
    """GGUF Q8_0 weights times int8 activations per block of 32 (``cpu_kernels.q80_a8_linear``: exact
    integer products per block scaled by d_w * d_x, ggml's q8_0 x q8_0 dot): the output layer of
    ``W4A8LinearMethod``. With the kernels the codes are kept only in the kernels' layout
    (``layer.quant["codes"]``, ``formats.interleave_q8_0``: 4 columns interleaved block by block); without
    them ``layer.quant`` is ``Q8_0LinearMethod``'s."""

    bi_q80 = False  # its own integer kernels

    def quantize(self, weight):
        qt = super().quantize(weight)
        if self.kernels is not None:
            qt = {"codes": interleave_q8_0(qt.pop("q")), **qt}
        return qt

    def kernel_apply(self, layer, x):
        return self.kernels.q80_a8_linear(x, layer.quant["codes"], layer.quant["d"], layer.bias)


class W4A8LinearMethod(_BlockAct8, Q4LinearMethod):
    """W4A8 as llama.cpp runs GGUF Q4_1 files: Q4_1 weights (``Q4LinearMethod``'s blocks, the GGUF file's
    own bits) times activations quantised at run time to int8 per block of 32 features (d_x =
    max|x_block| / 127, dynamic); per block (d_w d_x) sum u q_x + m_w s_x with s_x = d_x sum q_x, the
    integer sums exact (``cpu_kernels.q41_a8_linear``). With the kernels the codes are kept only in the
    kernels' layout (``layer.quant["codes"]``, ``formats.interleave_q4_1``: 8 columns interleaved pair by
    pair, repacked once per weight change; ``d`` and ``m`` as GGUF's); without them ``layer.quant`` is
    ``Q4LinearMethod``'s. The output layer in Q8_0
    with int8 activations (``Q8_0A8LinearMethod``). Raises ValueError at load for in_features not
    divisible by 32."""

    bi_q41 = False  # its own integer kernels

    def __init__(self, row_tile: Optional[int] = None, kernels=None):
        super().__init__(row_tile, "q4_1", kernels)
        self.head_method = Q8_0A8LinearMethod(row_tile, kernels)

    def quantize(self, weight):
        qt = super().quantize(weight)
        if self.kernels is not None:
            qt = {"codes": interleave_q4_1(qt.pop("qs")), **qt}
        return qt

    def kernel_apply(self, layer, x):
        qt = layer.quant
        return self.kernels.q41_a8_linear(x, qt["codes"], qt["d"], qt["m"], layer.bias)

    def kernel_into(self, layer, x, out):
        return _gguf_into(self.kernels._q41_a8_linear, layer, layer.quant["codes"], x, out)


def _gguf_into(fn, layer, codes: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> bool:
    """A Q4_1 kernel entry point (``q41_linear`` / ``q41_a8_linear``: the ctypes function) on x [M, K]
    (contiguous rows) written into out [M, N]: the layer's codes (in the layout ``fn`` reads) and
    float16 factors ``layer.quant["d"]`` / ``["m"]`` [N, K/32] passed by address, no checks or output
    tensor (the decode graph's buffers have a fixed layout). Raises MemoryError when the kernel cannot
    allocate its buffers; returns True."""
    qt, bias = layer.quant, layer.bias
    n, nb = qt["d"].shape
    if not fn(x.data_ptr(), x.shape[0], nb * 32, x.stride(0), codes.data_ptr(), qt["d"].data_ptr(),
              qt["m"].data_ptr(), n, None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0)):
        raise MemoryError("Q4_1 linear: cannot allocate the kernel's buffers")
    return True


def quantized_linear_method(weight_dtype: str, activation_dtype: str = "bf16",
                            deterministic: bool = False, kernels=None) -> QuantizedLinearMethod:
    """The method of ``--weight-dtype`` int8 | int4 | fp8 with ``--activation-dtype`` (int8 with int8
    weights: W8A8; with int4 weights: W4A8 on Q4_1 blocks). deterministic: batch-invariant, on the
    kernels for every batch where there are kernels, else on row tiles.
    kernels: a ``cpu_kernels.CpuKernels`` of the model dtype, or None. Raises ValueError for another
    combination (``spec.check_precision`` refuses them earlier, at configuration; ``auto`` weights are
    checked here, once the checkpoint's own format is known)."""
    tile = DETERMINISTIC_ROW_TILE if deterministic else None
    if activation_dtype == "int8":
        if weight_dtype == "int8":
            return W8A8LinearMethod(kernels)
        if weight_dtype == "int4":
            return W4A8LinearMethod(tile, kernels)
        raise ValueError(f"int8 activations need int8 weights (W8A8) or int4 / GGUF Q4_1 weights (W4A8), got "
                         f"weight dtype {weight_dtype!r} (with --weight-dtype auto: the checkpoint's own format, "
                         f"which is int4 only for a GGUF file of Q4_1 linears)")
    methods = {"int8": Int8LinearMethod, "fp8": Fp8LinearMethod, "int4": Q4LinearMethod}
    if weight_dtype not in methods:
        raise ValueError(f"no quantised linear method for weight dtype {weight_dtype!r} "
                         f"(quantised: {', '.join(methods)})")
    return methods[weight_dtype](tile, kernels=kernels)
