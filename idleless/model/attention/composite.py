"""The composite attention backend: writes the new tokens' K/V into the pool, cuts a batch into tails
and shared segments, and routes each part to the kernel family that runs it best.

* **Shared segments (cascade attention).** When several requests in the batch hold the same KV slots
  for a stretch of their prefix (a system prompt or document served from the radix cache), that
  stretch is read once and attended by all their query rows together, instead of being gathered once
  per request. Each request's own remainder (its *tail*: the unshared prefix and its new tokens,
  causal) is attended separately, and the partial results are merged with their log-sum-exp. This is
  the shared-prefix decomposition of Hydragen (Juravsky et al., arXiv 2402.05099) and FlashInfer's
  cascade inference (Ye et al., arXiv 2501.01005).
* **Routing**, fixed at construction from the kernels available: tails of up to 16 new tokens (decode rows)
  to the fused decode kernel (``decode.FusedDecodeAttention``), else padded flash; tails of several
  new tokens and the segments to the AMX ragged kernel (``ragged.RaggedAmxAttention``: bfloat16 on
  CPUs with AMX tiles), else padded flash (``flash.PaddedFlashAttention``). A batch in which a sliding
  window is in force goes wholly to padded flash (no segments then).

``TorchNativeAttention`` is the composite with padded flash alone and PyTorch ops for KV writes and
merges: the device-agnostic reference the kernels are tested against.

Interface: ``meta = backend.prepare(extend_lens, prefix_lens, slot_tables)`` once per forward, then
``backend.forward(q, k, v, layer_id, meta, out_cache_loc)`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.cache.kv_pool import KVPool
from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan, Tails
from idleless.model.attention.decode import FusedDecodeAttention
from idleless.model.attention.flash import PaddedFlashAttention
from idleless.model.attention.invariant import ChunkedAttention, QuantizedKVChunkedAttention, TorchChunkedAttention
from idleless.model.attention.ragged import RaggedAmxAttention

# A stretch shared by several requests becomes its own segment when it is at least this long (tokens);
# shorter ones stay in the requests' tails (a segment costs a kernel launch per layer).
MIN_SHARED_TOKENS = 16


def find_shared_segments(prefix_lens: list[int], slot_tables: list[torch.Tensor]
                         ) -> tuple[list[tuple[list[int], int, int]], list[int]]:
    """Find stretches of KV slots shared by two or more requests within their prefixes (whatever
    their number of new tokens: a long extend over a shared prefix reads it unmasked, which the flash
    kernel does faster than inside the padded, masked tail; figures in benchmarks/README.md).

    Returns (segments, shared): each segment is (request indices, start, end) meaning those
    requests all hold the same slots at positions [start, end) (>= MIN_SHARED_TOKENS long);
    shared[i] is where request i's tail begins (all positions before it are covered by segments).
    Recursive longest-common-prefix partitioning, like walking the radix tree those slots came from."""
    B = len(prefix_lens)
    shared = [0] * B
    cand = [i for i in range(B) if prefix_lens[i] >= MIN_SHARED_TOKENS]
    segments: list[tuple[list[int], int, int]] = []
    if len(cand) < 2:
        return segments, shared
    # [len(cand), L + 1] slots, -1 past each prefix (the extra column ends every row with -1); the walk
    # below does ~30 small array ops per step, in numpy (a microsecond each, not ~10 as tensor ops)
    pad = torch.nn.utils.rnn.pad_sequence([slot_tables[i][: prefix_lens[i]] for i in cand]
                                          + [torch.empty(max(prefix_lens[i] for i in cand) + 1, dtype=torch.int64)],
                                          batch_first=True, padding_value=-1)[:-1].numpy()
    stack = [(list(range(len(cand))), 0, 0)]  # (rows of pad, first position not yet in a segment, LCP so far)
    while stack:
        rows, seg_start, off = stack.pop()
        if len(rows) == 1:
            shared[cand[rows[0]]] = seg_start
            continue
        sub = pad[rows, off:]
        differs = ((sub != sub[:1]).any(0) | (sub[0] < 0)).nonzero()[0]  # the -1 column guarantees one
        end = off + int(differs[0])
        if end - seg_start >= MIN_SHARED_TOKENS:
            segments.append(([cand[r] for r in rows], seg_start, end))
            seg_start = end
        by_next: dict[int, list[int]] = {}
        for r, v in zip(rows, pad[rows, end].tolist()):
            if v < 0:
                shared[cand[r]] = seg_start
            else:
                by_next.setdefault(v, []).append(r)
        for sub_rows in by_next.values():
            stack.append((sub_rows, seg_start, end))
    return segments, shared


def align_segments(segments: list[tuple[list[int], int, int]], shared: list[int], align: int
                   ) -> tuple[list[tuple[list[int], int, int]], list[int]]:
    """``find_shared_segments``' result with every boundary rounded down to a multiple of ``align``
    (segments left empty dropped): a request's segments and tail still tile its keys, and every piece
    starts at an aligned position (what a backend that reduces keys in aligned chunks needs)."""
    out = [(reqs, a // align * align, b // align * align) for reqs, a, b in segments]
    return [s for s in out if s[2] > s[1]], [x // align * align for x in shared]


@dataclass
class AttnMetadata:
    """One batch's plan: parts (backend, its plan), tail-only backends first and the segments' backend
    last (every tail is written before a segment merges into it). alone: one part covering the batch
    (its output is the layer's, no copy); merged: outputs in float32 with the log-sum-exp (segments,
    or a backend that writes only so), else written straight in the model dtype."""

    parts: list[tuple[AttentionBackend, BackendPlan]]
    num_tokens: int
    alone: bool
    merged: bool

    @property
    def tails(self) -> list:
        """Every part's tail groups (for inspection)."""
        return [g for _, p in self.parts for g in p.tails]

    @property
    def segments(self) -> list:
        """Every part's segment groups (for inspection)."""
        return [g for _, p in self.parts for g in p.segments]


class CompositeAttention:
    """Attention over the KV pool for any mix of requests (different prefix lengths, any number of new
    tokens each), causal within each request, grouped-query aware, with the shared-prefix (cascade)
    decomposition; each part in its kernel family (module docstring). Tensors: q [T, H, D], k/v
    [T, Hkv, D]. kernels: a cpu_kernels.CpuKernels (used when of the pool's dtype) or None.

    Routing attributes (backends): ``decode_backend`` (tails of up to ``decode_max_new`` new tokens),
    ``extend_backend`` (longer tails), ``segment_backend``; ``flash`` takes everything under a sliding window.
    ``use_segments`` False attends shared prefixes inside each tail.

    A quantised KV pool (``KVPool.quantized``) is read in place by the fused decode kernel
    (``decode_attn_q8``) and by the PyTorch backends, which dequantise only the rows they gather
    (``idleless.quant.kv``): padded flash for the rest; when deterministic, by the chunked kernel
    (``invariant.QuantizedKVChunkedAttention``: in place on AVX-512 BF16, else the step's rows
    dequantised once per layer).

    deterministic: every part goes to the batch-invariant backend (``invariant.ChunkedAttention``, or
    its PyTorch twin without kernels), with shared segments aligned to its chunks, so a row's output
    does not depend on the batch; raises ValueError for a sliding-window model then. int8_attention
    (W8A8): that backend's int8 q.k and P.V where its kernels take them (``ChunkedAttention``)."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, kernels=None, deterministic: bool = False,
                 int8_attention: bool = False):
        self.pool = pool
        # per-layer views [num_slots, Hkv, D] (or QuantizedKV views), made once (not per call)
        self._k_layers, self._v_layers = map(list, zip(*(pool.layer_kv(i) for i in range(pool.k_cache.shape[0]))))
        # the kernels read K/V stored in their own dtype, and the decode kernel a quantised pool too; other
        # storage (bf16 K/V under a float32 model) and the other parts of a quantised pool go to the
        # PyTorch backends, which read the rows they gather
        model_kern = kernels if kernels is not None and kernels.dtype == pool.compute_dtype else None
        self.kernels = kernels if kernels is not None and kernels.dtype == pool.dtype else None
        self.sliding_window = sliding_window  # Mistral: a query sees only the last `sliding_window` keys
        self.use_segments = True
        kern = self.kernels
        # the flash backend's kernels serve only its cascade merge, in the model dtype (its outputs' and
        # q's), so a quantised pool's flash merges in C too (model_kern), other pools' as before (kern)
        self.flash = PaddedFlashAttention(num_heads, num_kv_heads, head_dim, pool.compute_dtype,
                                          model_kern if pool.quantized else kern)
        decode_kern = model_kern if pool.quantized else kern
        decode = FusedDecodeAttention(decode_kern, head_dim) if decode_kern is not None else None
        ragged = (RaggedAmxAttention(pool, kern, num_kv_heads, head_dim)
                  if RaggedAmxAttention.supports(kern, head_dim) else None)
        self.decode_backend: AttentionBackend = decode or self.flash
        self.decode_max_new = decode.max_new if decode is not None else 1  # longest tail sent to decode_backend
        self.extend_backend: AttentionBackend = ragged or self.flash
        self.segment_backend: AttentionBackend = ragged or self.flash
        self.segment_align = 1
        if deterministic:
            if sliding_window is not None:
                raise ValueError("deterministic inference does not support sliding-window attention yet")
            if pool.quantized and model_kern is not None:  # the codes read in place, or the step's rows dequantised
                inv = QuantizedKVChunkedAttention(model_kern, num_heads, head_dim, int8_attention)
            elif kern is not None:
                inv = ChunkedAttention(kern, num_heads, head_dim, int8_attention)
            else:
                inv = TorchChunkedAttention(num_heads, head_dim)
            self.decode_backend = self.extend_backend = self.segment_backend = inv
            self.segment_align = inv.segment_align
        self._model_kernels = model_kern
        if pool.quantized:  # chosen once
            self._write_kv = self._write_kv_q8_kernel if model_kern is not None else self._write_kv_quantized
        else:
            self._write_kv = self._write_kv_kernel if kern is not None else self._write_kv_torch

    def prepare(self, extend_lens: list[int], prefix_lens: list[int],
                slot_tables: list[torch.Tensor]) -> AttnMetadata:
        """Plan a batch: request i has extend_lens[i] new tokens (rows in batch order) after
        prefix_lens[i] tokens whose KV is in the pool; slot_tables[i]: int64 [prefix_lens[i] +
        extend_lens[i]], its KV slots with the new tokens' included."""
        B = len(extend_lens)
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        window = self.sliding_window
        if window is not None and max(p + e for p, e in zip(prefix_lens, extend_lens)) <= window:
            window = None  # nothing in this batch is old enough to fall out of the window
        seg_list, shared = [], [0] * B
        if self.use_segments and B > 1 and window is None:
            seg_list, shared = find_shared_segments(prefix_lens, slot_tables)
            if self.segment_align > 1:
                seg_list, shared = align_segments(seg_list, shared, self.segment_align)
        segments = [(torch.tensor([r for i in reqs for r in range(starts[i], starts[i] + extend_lens[i])]),
                     slot_tables[reqs[0]][a:b]) for reqs, a, b in seg_list]
        if window is None:
            dec, ext, seg = self.decode_backend, self.extend_backend, self.segment_backend
        else:
            dec = ext = seg = self.flash
        by_backend: dict[AttentionBackend, list[int]] = {}
        for i, e in enumerate(extend_lens):
            if e:
                by_backend.setdefault(dec if e <= self.decode_max_new else ext, []).append(i)
        order = [b for b in by_backend if b is not seg] + [seg]  # the segments' backend merges last
        parts = []
        for b in order:
            idx = by_backend.get(b)
            tails = None
            if idx:
                tails = Tails([starts[i] for i in idx], [extend_lens[i] for i in idx],
                              [prefix_lens[i] - shared[i] for i in idx],
                              [slot_tables[i][shared[i]:] if shared[i] else slot_tables[i] for i in idx])
            plan = b.prepare(AttnWork(tails, segments if b is seg else [], window))
            if plan.tails or plan.segments:
                parts.append((b, plan))
        alone = len(parts) == 1 and parts[0][0].covers_batch(parts[0][1], acc)
        merged = any(p.segments or not b.writes_model_dtype for b, p in parts)
        return AttnMetadata(parts, acc, alone, merged)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttnMetadata, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens, rotated; rows may be strided views) -> output
        [T, H, D] in q's dtype. Writes k/v into the pool at out_cache_loc [T] first."""
        kc = self._k_layers[layer_id]
        vc = self._v_layers[layer_id]
        self._write_kv(kc, vc, k, v, out_cache_loc)
        if meta.alone:
            backend, plan = meta.parts[0]
            return backend.forward(q, kc, vc, layer_id, plan, None, None)
        T, H, D = q.shape
        if not meta.merged:
            out = torch.empty(T, H, D, dtype=q.dtype)
            for backend, plan in meta.parts:
                backend.forward(q, kc, vc, layer_id, plan, out, None)
            return out
        out = torch.empty(T, H, D, dtype=torch.float32)
        lse = torch.empty(T, H, dtype=torch.float32)
        for backend, plan in meta.parts:
            backend.forward(q, kc, vc, layer_id, plan, out, lse)
        return out.to(q.dtype)

    def _write_kv_kernel(self, kc, vc, k, v, loc) -> None:
        self.kernels.kv_write(kc, k, loc)
        self.kernels.kv_write(vc, v, loc)

    def _write_kv_q8_kernel(self, kc, vc, k, v, loc) -> None:
        self._model_kernels.kv_write_q8(kc, k, loc)
        self._model_kernels.kv_write_q8(vc, v, loc)

    @staticmethod
    def _write_kv_quantized(kc, vc, k, v, loc) -> None:
        kc.write(loc, k)
        vc.write(loc, v)

    @staticmethod
    def _write_kv_torch(kc, vc, k, v, loc) -> None:
        kc.index_copy_(0, loc, k.to(kc.dtype))
        vc.index_copy_(0, loc, v.to(vc.dtype))


class TorchNativeAttention(CompositeAttention):
    """The reference: padded flash attention alone, KV writes and cascade merges in PyTorch ops (no
    kernels of ours; any device PyTorch's flash kernel runs on)."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None):
        super().__init__(pool, num_heads, num_kv_heads, head_dim, sliding_window, kernels=None)
