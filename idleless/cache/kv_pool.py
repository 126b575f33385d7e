"""KV memory: a fixed pool of token slots with per-layer K/V tensors, in the model dtype, bfloat16, or a
quantised format (``--kv-cache-dtype``): int8 with a scale per token and KV head, or fp8 (e4m3 / e5m2) with
a static scale per layer, K or V, and KV head (``idleless.quant.kv``, ``idleless.quant.kv_scales``).

Every slot is owned by exactly one of: the free list, a running request, the radix tree.
Slots are handed out in pages of ``page_size`` consecutive slots; a request's slot table fills
the rest of its last page before taking a new one (as in SGLang's paged allocator).
"""

from __future__ import annotations

import torch

from idleless.quant.kv import _UNSET, KV_STORAGE, STATIC_SCALE_FORMATS, QuantizedKV


def _storage(dtype: torch.dtype, cache_dtype: str | None) -> tuple[torch.dtype, bool]:
    """(element dtype of the K/V tensors, whether it is a quantised format with scales)."""
    if cache_dtype in (None, "auto"):
        return dtype, False
    if cache_dtype == "bf16":
        return torch.bfloat16, False
    if cache_dtype in KV_STORAGE:
        return KV_STORAGE[cache_dtype], True
    raise ValueError(f"kv cache dtype must be auto, bf16, {', '.join(KV_STORAGE)}, got {cache_dtype!r}")


def _check_scales(kv_scales, num_layers: int, num_kv_heads: int, cache_dtype: str, device) -> tuple:
    """kv_scales (k, v) -> two float32 [num_layers, num_kv_heads] tensors on ``device``; ValueError when
    missing, of another shape, or not positive and finite."""
    if kv_scales is None:
        raise ValueError(f"--kv-cache-dtype {cache_dtype} needs static K/V scales per layer and KV head (the "
                         "calibration pass or --quantization-param-path, idleless.quant.kv_scales); no default "
                         "scale exists")
    out = []
    for name, t in zip(("k", "v"), kv_scales):
        t = torch.as_tensor(t, dtype=torch.float32).to(device)
        if t.shape != (num_layers, num_kv_heads):
            raise ValueError(f"{name} scales must be [{num_layers}, {num_kv_heads}] (layers, KV heads), got "
                             f"{tuple(t.shape)}")
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"{name} scales must be positive and finite, got {t.tolist()}")
        out.append(t.contiguous())
    return tuple(out)


class KVPool:
    """K/V tensors ``[num_layers, num_slots, num_kv_heads, head_dim]`` and a page allocator.

    dtype: the model's (what attention computes in). cache_dtype: ``--kv-cache-dtype``: None / ``auto``
    (K/V stored in ``dtype``), ``bf16``, or a quantised format (values in int8 / float8, see
    ``idleless.quant.kv``): ``int8`` with ``k_scale`` / ``v_scale`` float32 [num_layers, num_slots,
    num_kv_heads], one scale per token and KV head written with the row; ``fp8_e4m3`` / ``fp8_e5m2`` with
    static scales ``kv_scales`` = (k, v), each float32 [num_layers, num_kv_heads] (positive, finite: the
    calibration pass's or a scale file's, ``idleless.quant.kv_scales``), kept as ``k_head_scale`` /
    ``v_head_scale``, with ``k_scale`` / ``v_scale`` None (nothing per slot: code that moves per-slot
    scales between pools must not treat a static pool's as such; ``layer_kv`` hands the attention
    backends stride-0 views over the slots). ``self.dtype`` is the stored element dtype,
    ``self.quantized`` says whether it is an 8-bit format read through ``QuantizedKV``,
    ``self.static_scales`` whether its scales are per head; read a layer through ``layer_kv``.
    kernels: what ``QuantizedKV`` reads rows with (its constructor's argument: a ``CpuKernels`` of
    ``dtype``, None for PyTorch ops alone, unset: loaded on first use).
    num_slots is rounded down to a multiple of page_size. Slot indices are int64 tensors.
    Raises ValueError if the pool would hold less than one page, for an unknown cache_dtype, for an fp8
    format without kv_scales (no default scale exists), for kv_scales of another shape or not positive
    and finite, and for kv_scales given to a format without static scales.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", page_size: int = 1,
                 cache_dtype: str | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 kernels=_UNSET):
        self._read_kernels = kernels
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        if self.num_pages < 1:
            raise ValueError(f"KV pool of {num_slots} slots holds no page of {page_size} tokens")
        self.num_slots = self.num_pages * page_size
        self.compute_dtype = dtype
        self.dtype, self.quantized = _storage(dtype, cache_dtype)
        self.static_scales = cache_dtype in STATIC_SCALE_FORMATS
        self.device = torch.device(device)
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k_head_scale = self.v_head_scale = None
        if self.static_scales:
            self.k_head_scale, self.v_head_scale = _check_scales(kv_scales, num_layers, num_kv_heads, cache_dtype,
                                                                 self.device)
        elif kv_scales is not None:
            raise ValueError(f"kv cache dtype {cache_dtype or 'auto'} takes no static scales (only "
                             f"{', '.join(STATIC_SCALE_FORMATS)} do)")
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_scale = self.v_scale = None
        if self.quantized and not self.static_scales:
            self.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
            self.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self._num_free_pages = self.num_pages
        # bumped whenever slots are freed (and so may be rewritten by their next owner): copies made from
        # slot contents (the attention backend's packed shared segments) hold only while it is unchanged
        self.free_epoch = 0

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        cache_dtype: str | None = None) -> int:
        """Bytes of K and V for one token across all layers, scales included: int8 adds a float32 per
        KV head to each of K and V; fp8's per-head scales are per layer, not per token, so an fp8 token
        takes exactly half a bfloat16 one. dtype, cache_dtype: as the constructor's."""
        store, quantized = _storage(dtype, cache_dtype)
        per_token_scale = quantized and cache_dtype not in STATIC_SCALE_FORMATS
        per_head = head_dim * torch.empty((), dtype=store).element_size() + (4 if per_token_scale else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def layer_kv(self, layer: int) -> tuple:
        """Layer ``layer``'s (K, V) as the attention backends read them: views [num_slots, Hkv, D] of the
        pool, or ``QuantizedKV`` views (values and scales: per slot, or a static pool's per-head scales
        expanded over the slots with stride 0) for a quantised format."""
        if not self.quantized:
            return self.k_cache[layer], self.v_cache[layer]
        if self.static_scales:
            n, h = self.num_slots, self.k_head_scale.shape[1]
            ks, vs = self.k_head_scale[layer][None, :].expand(n, h), self.v_head_scale[layer][None, :].expand(n, h)
            return (QuantizedKV(self.k_cache[layer], ks, self.compute_dtype, self._read_kernels),
                    QuantizedKV(self.v_cache[layer], vs, self.compute_dtype, self._read_kernels))
        return (QuantizedKV(self.k_cache[layer], self.k_scale[layer], self.compute_dtype, self._read_kernels),
                QuantizedKV(self.v_cache[layer], self.v_scale[layer], self.compute_dtype, self._read_kernels))

    @property
    def num_free_slots(self) -> int:
        """Free capacity in tokens (whole free pages)."""
        return self._num_free_pages * self.page_size

    def tokens_needed(self, num_have: int, num_new: int) -> int:
        """Slots (in whole pages) that growing a slot table from num_have to num_have+num_new takes."""
        ps = self.page_size
        pages = -(-(num_have + num_new) // ps) - (-(-num_have // ps))
        return pages * ps

    def alloc(self, num_have: int, last_slot: int, num_new: int) -> torch.Tensor | None:
        """Slots for ``num_new`` more tokens of a table that already holds ``num_have`` (whose last
        slot is ``last_slot``, ignored when num_have == 0). Returns an int64 tensor [num_new], or
        None if the free pages do not suffice (nothing is taken then)."""
        ps = self.page_size
        if ps == 1:
            if num_new > self._num_free_pages:
                return None
            self._num_free_pages -= num_new
            return self._free_pages[self._num_free_pages:self._num_free_pages + num_new].clone()
        in_page = (ps - num_have % ps) % ps if num_have else 0
        head = min(in_page, num_new)
        rest = num_new - head
        n_pages = -(-rest // ps)
        if n_pages > self._num_free_pages:
            return None
        parts = []
        if head:
            parts.append(torch.arange(last_slot + 1, last_slot + 1 + head, dtype=torch.int64))
        if n_pages:
            self._num_free_pages -= n_pages
            pages = self._free_pages[self._num_free_pages:self._num_free_pages + n_pages]
            slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:rest]
            parts.append(slots)
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the free list. ``slots`` must cover whole pages it starts (a table's own
        part always starts on a page boundary), so the pages touched are freed."""
        if slots.numel() == 0:
            return
        self.free_epoch += 1
        pages = slots if self.page_size == 1 else torch.unique(slots // self.page_size)
        n = pages.numel()
        self._free_pages[self._num_free_pages:self._num_free_pages + n] = pages
        self._num_free_pages += n
        assert self._num_free_pages <= self.num_pages, "KV slot freed twice"
