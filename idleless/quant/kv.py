"""One layer's K or V of a quantised KV pool as the attention backends read it.

The pool stores int8 or fp8 values [num_slots, Hkv, D] and float32 scales, value = code * scale:

* int8: a scale per (slot, KV head), ``s = max|x| / 127`` over head_dim when the slot is written (a
  dynamic scale, as SGLang's int8 KV cache; ``formats.quantize_rows``).
* fp8 (e4m3, e5m2): one static scale per (layer, K or V, KV head) for every slot, from the calibration
  pass at start-up or a scale file (``idleless.quant.kv_scales``); values beyond ``fmax * scale``
  saturate to +-fmax when written. Nothing is stored per slot: one byte per element, half of bfloat16.

``QuantizedKV.scale`` is [num_slots, Hkv] float32 in both cases (for fp8 a stride-0 view of the per-head
scales over the slots), so readers index it alike. ``QuantizedKV`` answers the two reads the PyTorch
backends make, ``index_select(0, slots)`` (gathered rows) and a slice of consecutive slots, with those
rows alone dequantised into the model dtype (by ``cpu_kernels.kv_read_q8`` where the kernels are built,
else PyTorch ops, the same bits): no dequantised copy of the cache exists.
"""

from __future__ import annotations

from typing import Optional

import torch

from idleless.quant.formats import FMAX, quantize_rows

#: ``--kv-cache-dtype`` name -> storage dtype of the quantised formats
KV_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: the formats with static per-head scales (the others' are per token, written with the row)
STATIC_SCALE_FORMATS = ("fp8_e4m3", "fp8_e5m2")
#: (mantissa bits, exponent bias) of the fp8 formats (OCP 8-bit floating point: E4M3 bias 7, E5M2 bias 15)
FP8_BITS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}

_UNSET = object()


class QuantizedKV:
    """data [num_slots, Hkv, D] int8 / float8 (a view of the pool's tensor); scale [num_slots, Hkv]
    float32: a view of the pool's per-slot scales (int8), or the per-head scales [Hkv] expanded over
    the slots with stride 0 (fp8: ``static``); out_dtype: the dtype rows are dequantised into (the
    model's); kernels: the ``cpu_kernels.CpuKernels`` of out_dtype that read rows (``kv_read_q8``), None
    for PyTorch ops alone (``--disable-cpu-kernels``), or unset: ``cpu_kernels.load(out_dtype)`` on first
    use. Raises ValueError for a scale of another shape."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, kernels=_UNSET):
        if scale.dtype != torch.float32 or scale.shape != data.shape[:2] or scale.stride(-1) != 1:
            raise ValueError(f"KV scales must be float32 [{data.shape[0]}, {data.shape[1]}] with contiguous heads, "
                             f"got {scale.dtype} {tuple(scale.shape)}")
        self.data = data
        self.scale = scale
        #: whether the scales are per head for every slot (stride 0 over slots), read only
        self.static = scale.stride(0) == 0
        self.out_dtype = out_dtype
        self._bits = data.view(torch.uint8)  # copies and gathers by bytes (fp8 has no index kernels on CPU)
        #: float32 [256]: the value of each byte pattern of the format (what the C decode kernel reads)
        self.lut = torch.arange(256, dtype=torch.uint8).view(data.dtype).float()
        self.fmax = FMAX[data.dtype]
        #: (mantissa bits, exponent bias) of an fp8 format, (0, 0) for int8 (the C writer's format code)
        self.mbits, self.bias = FP8_BITS.get(data.dtype, (0, 0))
        self._kernels = kernels if kernels is None or kernels is _UNSET or kernels.dtype == out_dtype else None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def kernels(self):
        """The kernels that read rows: the constructor's, or ``cpu_kernels.load(out_dtype)`` (None without a
        compiler or off CPU) loaded on first use."""
        if self._kernels is _UNSET:
            from idleless.model import cpu_kernels

            self._kernels = cpu_kernels.load(self.out_dtype, self.data.device.type)
        return self._kernels

    def _dequant(self, bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # int8 converts directly; fp8 through the table (PyTorch's float8 cast on CPU is far slower)
        vals = bits.view(torch.int8).float() if self.data.dtype == torch.int8 else self.lut[bits.int()]
        return (vals * scale[..., None]).to(self.out_dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64 [n]) dequantised: [n, Hkv, D] in out_dtype. dim must be 0."""
        if dim != 0:
            raise ValueError("a quantised KV layer is read by slot (dim 0)")
        kern = self.kernels
        if kern is not None and index.dtype == torch.int64:
            return kern.kv_read_q8(self, index.contiguous())
        return self._dequant(self._bits.index_select(0, index), self.scale.index_select(0, index))

    def __getitem__(self, sl: slice) -> torch.Tensor:
        """Consecutive slots ``sl`` dequantised: [len, Hkv, D] in out_dtype."""
        if not isinstance(sl, slice):
            raise TypeError("a quantised KV layer is sliced by a range of slots or read by index_select")
        start, stop, step = sl.indices(self.data.shape[0])
        kern = self.kernels
        if kern is not None and step == 1:
            return kern.kv_read_q8(self, None, start, max(0, stop - start))
        return self._dequant(self._bits[sl], self.scale[sl])

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [n, Hkv, D] (any float dtype) -> (codes [n, Hkv, D] in the stored dtype, per-row scales
        [n, Hkv] float32, or None with static scales): ``formats.quantize_rows`` for per-slot scales;
        x / scale clamped to +-fmax (saturation) and converted with the format's rounding for static ones."""
        if not self.static:
            return quantize_rows(x, self.data.dtype)
        s = self.scale[0]
        y = x.float() / torch.where(s != 0, s, torch.ones_like(s))[:, None]
        return y.clamp_(-self.fmax, self.fmax).to(self.data.dtype), None

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantise x [n, Hkv, D] (any float dtype; rows may be strided) and store it at ``slots`` (int64
        [n]): with per-slot scales, one scale per (row, head) computed and stored too; with static ones,
        the layer's per-head scales applied (``quantize``)."""
        q, s = self.quantize(x)
        self._bits.index_copy_(0, slots, q.view(torch.uint8))
        if s is not None:
            self.scale.index_copy_(0, slots, s)
