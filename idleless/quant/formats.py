"""Quantised number formats: quantise and dequantise, torch ops only (any device).

* int8 per output channel, symmetric: ``q = round(w / s)``, ``s = max|w_row| / 127`` (vLLM's and SGLang's
  W8A8 int8 weights; Xiao et al., SmoothQuant, arXiv 2211.10438, for the per-token activation side).
* fp8 e4m3 per output channel: ``q = fp8(w / s)``, ``s = max|w_row| / 448`` (vLLM's per-channel fp8).
* GGUF Q4_0 / Q4_1 blocks of 32 along the input features (ggml's ``block_q4_0`` / ``block_q4_1``):
  Q4_1 holds a float16 step ``d`` and minimum ``m`` per block and 4-bit codes ``c`` in 0..15, value
  ``m + d * c``; Q4_0 a float16 step ``d``, value ``d * (c - 8)``. Codes are packed two per byte as
  ggml does: byte j of a block holds element j in its low nibble and element j + 16 in its high one.
* GGUF Q8_0 blocks of 32 (ggml's ``block_q8_0``): a float16 step ``d = max|w_block| / 127`` and int8
  codes ``round(w / d)``, value ``d * code``.
* int8 KV rows: one scale per (token, KV head), ``s = max|x| / 127`` (``quantize_rows``), computed when
  the row is written: dynamic, never a default. The fp8 KV formats (e4m3, fmax 448; e5m2, 57344) have
  no per-token scale: one static scale per (layer, K or V, KV head), calibrated at start-up or read from
  a scale file (``idleless.quant.kv_scales``), values beyond ``fmax * s`` saturating
  (``idleless.quant.kv``).

A scale of 0 (an all-zero row or block) dequantises to zeros.
"""

from __future__ import annotations

from typing import Optional

import torch

Q4_BLOCK = 32
#: the largest finite magnitude of each 8-bit format, the value max|x| is mapped to
FMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s != 0, s, torch.ones_like(s))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantisation with one scale per row of the last dimension.

    x [..., K] float -> (q [..., K] in ``dtype`` (int8, float8_e4m3fn or float8_e5m2), scale [...] float32),
    scale = max|x| / FMAX[dtype] over the last dimension; x ~= q * scale. int8 rounds half to even
    (torch.round) and clamps to [-127, 127]; fp8 rounds to nearest in the format. Raises KeyError for
    another dtype."""
    fmax = FMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1) / fmax
    y = xf / _safe(scale)[..., None]
    q = y.round().clamp_(-fmax, fmax).to(dtype) if dtype == torch.int8 else y.clamp_(-fmax, fmax).to(dtype)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``quantize_rows``' inverse: q [..., K] (int8 / fp8), scale [...] float32 -> q * scale in ``dtype``
    (the product taken in float32, rounded once)."""
    return (q.float() * scale[..., None]).to(dtype)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % Q4_BLOCK:
        raise ValueError(f"Q4 blocks need in_features divisible by {Q4_BLOCK}, got {k}")
    return w.float().reshape(n, k // Q4_BLOCK, Q4_BLOCK)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, B, 32] in 0..15 -> ggml's packing, uint8 [N, B, 16]."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """ggml-packed nibbles uint8 [N, B, 16] -> codes uint8 [N, B, 32] (element j low nibble of byte j,
    element j + 16 its high nibble)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (ggml ``quantize_row_q4_1_ref``): w [N, K] float, K % 32 == 0 -> (qs uint8 [N, K/32, 16],
    d float16 [N, K/32], m float16 [N, K/32]); per block m = min, d = (max - min) / 15, code =
    round((w - m) / d) clamped to 0..15 (from the float16-rounded d and m, so the codes fit the stored
    step). Raises ValueError when K is not a multiple of 32."""
    b = _blocks(w)
    lo, hi = b.amin(-1), b.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    codes = ((b - m.float()[..., None]) / _safe(d.float())[..., None]).round().clamp_(0, 15).to(torch.uint8)
    return _pack(codes), d, m


def dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q4_1 blocks (``quantize_q4_1``' layout) -> w [N, K] in ``dtype``: m + d * code, in float32."""
    c = unpack_q4(qs).float()
    w = m.float()[..., None] + d.float()[..., None] * c
    return w.reshape(w.shape[0], -1).to(dtype)


#: output columns per group of the W4A8 kernels' layouts: Q4_1 (``interleave_q4_1``), Q8_0 (``interleave_q8_0``)
A8_GROUP_Q4_1, A8_GROUP_Q8_0 = 8, 4


def _interleave(units: torch.Tensor, group: int) -> torch.Tensor:
    """units [N, U, 32] (1-byte dtype) -> [N * U * 32]: output columns in groups of ``group`` (the last group
    the N % group left), a group's units in order, each unit holding every column of the group in order."""
    n, u, _ = units.shape
    words = units.contiguous().view(torch.int64)  # a unit as 4 words: the reorder copies 8x fewer elements
    full = n // group * group
    parts = [words[:full].reshape(-1, group, u, 4).transpose(1, 2).reshape(-1)]
    if full < n:
        parts.append(words[full:].transpose(0, 1).reshape(-1))
    return torch.cat(parts).view(units.dtype)


def interleave_q4_1(qs: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 codes qs uint8 [N, nb, 16] -> the W4A8 kernels' layout (``cpu_kernels.c``, ``a8_at``),
    uint8 [N * ceil(nb / 2) * 32]: output columns in groups of ``A8_GROUP_Q4_1`` (the last group holds the
    N % 8 left), a group's block pairs in order, each pair holding every column of the group in order, 32
    bytes per column: its 16 bytes of block 2p then of block 2p + 1 (zeros where nb is odd and 2p + 1 =
    nb). The same codes, reordered, so that one row times a group reads one contiguous stream (llama.cpp's
    repacked Q4_0_8x8 idea; here whole 32-byte pairs per column, so the kernels' arithmetic and bits are
    unchanged)."""
    n, nb, _ = qs.shape
    if nb % 2:
        qs = torch.cat([qs, qs.new_zeros(n, 1, 16)], 1)
    return _interleave(qs.reshape(n, -1, 32), A8_GROUP_Q4_1)


def interleave_q8_0(q: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 codes q int8 [N, nb, 32] -> the W4A8 kernels' layout for the output layer (``a8_at``),
    int8 [N * nb * 32]: output columns in groups of ``A8_GROUP_Q8_0`` (the last group the N % 4 left), a
    group's blocks in order, each block holding the 32 codes of every column of the group in order."""
    return _interleave(q, A8_GROUP_Q8_0)


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (ggml ``quantize_row_q4_0_ref``): w [N, K] float -> (qs uint8 [N, K/32, 16], d float16
    [N, K/32]); per block, with v the element of largest magnitude (sign kept), d = v / -8 and code =
    round(w / d + 8) clamped to 0..15, so v maps exactly to code 0. Raises ValueError when K % 32."""
    b = _blocks(w)
    idx = b.abs().argmax(-1, keepdim=True)
    v = b.gather(-1, idx).squeeze(-1)
    d = (v / -8).half()
    codes = (b / _safe(d.float())[..., None] + 8).round().clamp_(0, 15).to(torch.uint8)
    return _pack(codes), d


def dequantize_q4_0(qs: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q4_0 blocks -> w [N, K] in ``dtype``: d * (code - 8), in float32."""
    c = unpack_q4(qs).float() - 8
    w = d.float()[..., None] * c
    return w.reshape(w.shape[0], -1).to(dtype)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 (ggml ``quantize_row_q8_0_ref``): w [N, K] float, K % 32 == 0 -> (q int8 [N, K/32, 32],
    d float16 [N, K/32]); d = max|w_block| / 127 rounded to float16, code = round(w / d) (from the
    float16 d, clamped to +-127). Raises ValueError when K is not a multiple of 32."""
    b = _blocks(w)
    d = (b.abs().amax(-1) / 127).half()
    q = (b / _safe(d.float())[..., None]).round().clamp_(-127, 127).to(torch.int8)
    return q, d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q8_0 blocks -> w [N, K] in ``dtype``: d * code, in float32."""
    w = d.float()[..., None] * q.float()
    return w.reshape(w.shape[0], -1).to(dtype)


#: panels of 16 output columns per tile of ``CpuKernels.q8_pack``'s layout (Q8P_TP in cpu_kernels.c)
Q8P_TILE = 6


def unpack_q8(packed: torch.Tensor, n: int, n0: int = 0, n1: Optional[int] = None) -> torch.Tensor:
    """Rows n0..n1 (default all n) of the int8 weight [N, K] that ``CpuKernels.q8_pack`` laid out as packed
    (int8 [ceil(N / 16), K / 4, 64]: tiles of Q8P_TILE panels of 16 columns, each tile [K / 4] steps of its
    panels' 64-byte blocks): the codes again, [n1 - n0, K] contiguous (a new tensor)."""
    n1 = n if n1 is None else n1
    np_, kb, _ = packed.shape
    flat = packed.reshape(-1)
    full = np_ // Q8P_TILE * Q8P_TILE  # panels in whole tiles; the rest is one narrower tile
    parts = [flat[:full * kb * 64].view(-1, kb, Q8P_TILE, 64).transpose(1, 2).reshape(full, kb, 64)]
    if full < np_:
        parts.append(flat[full * kb * 64:].view(kb, np_ - full, 64).transpose(0, 1))
    blocks = torch.cat(parts)  # [panel, kb, 64]: byte 16 L + 8 h + 2 c + i = column 4 L + c, feature 4 b + 2 h + i
    w = blocks.view(np_, kb, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(np_ * 16, kb * 4)
    return w[n0:n1].contiguous()
