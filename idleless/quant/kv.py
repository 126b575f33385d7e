"""One layer's K or V of a quantised KV pool as the attention backends read it.

The pool stores int8 or fp8 values [num_slots, Hkv, D] and a float32 scale per (slot, KV head)
(``formats.quantize_rows`` over head_dim when the slot is written: a dynamic scale, as SGLang's int8 KV
cache; never a default). ``QuantizedKV`` answers the two reads the PyTorch backends make,
``index_select(0, slots)`` (gathered rows) and a slice of consecutive slots, with those rows alone
dequantised into the model dtype: no dequantised copy of the cache exists.
"""

from __future__ import annotations

import torch

from idleless.quant.formats import FMAX, quantize_rows

#: ``--kv-cache-dtype`` name -> storage dtype of the quantised formats
KV_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class QuantizedKV:
    """data [num_slots, Hkv, D] int8 / float8 (a view of the pool's tensor), scale [num_slots, Hkv]
    float32 (a view); out_dtype: the dtype rows are dequantised into (the model's)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
        self.data = data
        self.scale = scale
        self.out_dtype = out_dtype
        self._bits = data.view(torch.uint8)  # copies and gathers by bytes (fp8 has no index kernels on CPU)
        #: float32 [256]: the value of each byte pattern of the format (what the C decode kernel reads)
        self.lut = torch.arange(256, dtype=torch.uint8).view(data.dtype).float()
        self.fmax = FMAX[data.dtype]
        #: the code of the largest finite value (the positive codes 0..top increase with their value)
        self.top = int((self.lut[:128] == self.fmax).nonzero()[0]) if data.dtype != torch.int8 else 127

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def _dequant(self, bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # int8 converts directly; fp8 through the table (PyTorch's float8 cast on CPU is far slower)
        vals = bits.view(torch.int8).float() if self.data.dtype == torch.int8 else self.lut[bits.int()]
        return (vals * scale[..., None]).to(self.out_dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64 [n]) dequantised: [n, Hkv, D] in out_dtype. dim must be 0."""
        if dim != 0:
            raise ValueError("a quantised KV layer is read by slot (dim 0)")
        return self._dequant(self._bits.index_select(0, index), self.scale.index_select(0, index))

    def __getitem__(self, sl: slice) -> torch.Tensor:
        """Consecutive slots ``sl`` dequantised: [len, Hkv, D] in out_dtype."""
        if not isinstance(sl, slice):
            raise TypeError("a quantised KV layer is sliced by a range of slots or read by index_select")
        return self._dequant(self._bits[sl], self.scale[sl])

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantise x [n, Hkv, D] (any float dtype; rows may be strided) with one scale per (row, head)
        and store it at ``slots`` (int64 [n])."""
        q, s = quantize_rows(x, self.data.dtype)
        self._bits.index_copy_(0, slots, q.view(torch.uint8))
        self.scale.index_copy_(0, slots, s)
