"""Attention backends behind one interface.

``TorchNativeAttention`` is the reference backend for CPU (and the one GPU backends are tested
against). It reads K/V from the KV pool through each request's slot table, so any mix of requests
(different prefix lengths, any number of new tokens each) runs in one batch:

* **Shared segments (cascade attention).** When several requests in the batch hold the same KV
  slots for a stretch of their prefix (a system prompt or document served from the radix cache),
  that stretch is read once and attended by all their query rows together, instead of being
  gathered once per request. Each request's own remainder (its *tail*: the unshared prefix and
  its new tokens, causal) is attended separately, and the partial results are merged with their
  log-sum-exp. This is the shared-prefix decomposition of Hydragen (Juravsky et al., arXiv
  2402.05099) and FlashInfer's cascade inference (Ye et al., arXiv 2501.01005).
* **Tails** are padded into groups of similar size and run through PyTorch's CPU flash-attention
  kernel (``_scaled_dot_product_flash_attention_for_cpu``), which also returns the log-sum-exp.
  With the fused CPU kernels (``cpu_kernels``), the tails of decode rows (one new token each) are
  attended by the decode kernel straight from the pool (no gather, no padding), KV writes and the
  log-sum-exp merges are kernels too.
* **AMX (bfloat16 on CPUs with AMX tiles).** Shared segments and multi-token tails both run in the
  ragged kernel (``cpu_kernels.ragged_attn``): no padding, no masks, no gathers, one call for all
  tails and one per set of segments with distinct rows, each row's causal limit given as a number.
  The kernel packs keys into the tile layout; a segment's packing is kept across forwards
  (a system prompt is packed at the first decode step, not at every one) until the pool frees a slot.

Interface: ``meta = backend.prepare(extend_lens, prefix_lens, slot_tables)`` once per forward,
then ``backend.forward(q, k, v, layer_id, meta, out_cache_loc)`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idleless.cache.kv_pool import KVPool

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for an int64 index of any shape: [*index.shape, *t.shape[1:]]. index_select copies
    whole rows (memcpy), 3-7x faster here than advanced indexing for the KV pool's 384-byte rows."""
    return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])

# A stretch shared by several requests becomes its own segment when it is at least this long (tokens);
# shorter ones stay in the requests' tails (a segment costs a kernel launch per layer).
MIN_SHARED_TOKENS = 16


@dataclass
class TailGroup:
    """Requests' tails padded together. token_index [B, E] and kv_index [B, L] int64 (padding
    points at row/slot 0); mask [B, 1, E*G, L] additive float (0 = attend, -inf = not), rows
    repeated G times for grouped-query heads, None when every row sees every key (decode rows of
    equal length); valid [B*E] bool marks real query rows, whose batch rows are out_rows [n_valid].
    causal: a lone request with no earlier keys (a plain prefill, E == L): the kernel's own causal
    mode, which skips the upper triangle, on K/V expanded to the query heads; mask is None then."""

    token_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor
    out_rows: torch.Tensor
    causal: bool = False


@dataclass
class DecodeGroup:
    """Requests with one new token each, attended by the fused decode kernel (cpu_kernels) straight
    from the pool: request b's query and output row is rows[b], its keys the slots
    slots[offsets[b]:offsets[b+1]] (its tail; all visible). rows [B], offsets [B+1], slots int64."""

    rows: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor


# Packed shared segments kept across forwards (bytes, all layers together): a decode step's system
# prompt and documents are packed once, at their first step, not once per step.
PACK_CACHE_BYTES = 512 << 20


@dataclass
class PackedKeys:
    """A ragged call's keys in the kernel's tile layout: per layer a uint8 [work_bytes] buffer, None
    until that layer's call packs it. One small buffer per layer rather than one large block: glibc
    maps blocks over 32 MiB afresh each time, and first touches of fresh pages cost ~1.4 ms/MiB here."""

    bufs: list[torch.Tensor | None]


@dataclass
class RaggedGroup:
    """Items attended by the AMX ragged kernel (cpu_kernels.ragged_attn) straight from the pool, no
    padding: item i's keys are slots[key_offsets[i]:key_offsets[i+1]], its query rows
    rows[row_offsets[i]:row_offsets[i+1]] (distinct across items); row entry j sees its item's first
    limits[j] keys (the causal tails of multi-token extends) or all of them (limits None: shared
    segments). merge: fold into the tails' results (segments) rather than write (tails).
    work_bytes: the packing buffer the call needs. Index tensors int64."""

    key_offsets: torch.Tensor
    slots: torch.Tensor
    row_offsets: torch.Tensor
    rows: torch.Tensor
    limits: torch.Tensor | None
    merge: bool
    work_bytes: int
    packed: PackedKeys | None = None  # kept across forwards (shared segments), else the shared work buffer


@dataclass
class SegmentGroup:
    """Shared KV stretches attended in one kernel call: S stretches, each shared by several requests
    and fully visible to all their query rows, with pairwise disjoint rows, padded to Rmax rows and
    Lmax keys. q_index [S, Rmax] batch rows (padding -> row 0); kv_index [S, Lmax] slots (padding ->
    slot 0), or None when S == 1 and the slots are the ascending run first_slot .. first_slot+Lmax-1
    (a prompt prefilled in one piece usually is), read as a view of the pool instead of a copy;
    mask [S, 1, Rmax*G, Lmax] additive, None when nothing is padded; valid [S*Rmax] bool marks real
    rows, whose batch rows are out_rows [n_valid] (distinct), at rows src_rows of the padded output."""

    q_index: torch.Tensor
    kv_index: torch.Tensor | None
    first_slot: int
    num_keys: int
    mask: torch.Tensor | None
    valid: torch.Tensor
    out_rows: torch.Tensor
    src_rows: torch.Tensor  # [n_valid] rows of the padded kernel output that are real (valid.nonzero())


@dataclass
class AttnMetadata:
    tails: list[TailGroup | DecodeGroup | RaggedGroup]
    segments: list[SegmentGroup | RaggedGroup]
    num_tokens: int
    identity: bool  # one tail group whose valid rows are the batch rows in order, and no segment


def _group_requests(extend_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Bucket requests so that padding wastes little: one-token requests together, longer ones by
    similar size (a group grows while its padded area stays within 1.5x its real area + 4096)."""
    single = [i for i, e in enumerate(extend_lens) if e == 1]
    multi = sorted((i for i, e in enumerate(extend_lens) if e > 1), key=lambda i: (extend_lens[i], kv_lens[i]))
    groups = [single] if single else []
    cur: list[int] = []
    real = 0
    for i in multi:
        e, s = extend_lens[i], kv_lens[i]
        cand = cur + [i]
        max_e = max(extend_lens[j] for j in cand)
        max_s = max(kv_lens[j] for j in cand)
        if cur and len(cand) * max_e * max_s > 1.5 * (real + e * s) + 4096:
            groups.append(cur)
            cur, real = [i], e * s
        else:
            cur, real = cand, real + e * s
    if cur:
        groups.append(cur)
    return groups


def find_shared_segments(prefix_lens: list[int], slot_tables: list[torch.Tensor]
                         ) -> tuple[list[tuple[list[int], int, int]], list[int]]:
    """Find stretches of KV slots shared by two or more requests within their prefixes (whatever
    their number of new tokens: a long extend over a shared prefix reads it unmasked, which the flash
    kernel does faster than inside the padded, masked tail: for 8 requests x 300 new tokens over 621
    shared tokens, 9.1 ms segment + 5.6 ms tails against 17.7 ms as masked 921-key tails).

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


class TorchNativeAttention:
    """Reference attention over the KV pool: causal within each request, grouped-query aware,
    with shared-prefix (cascade) decomposition. Tensors: q [T, H, D], k/v [T, Hkv, D]."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, kernels=None):
        self.pool = pool
        self._k_layers = list(pool.k_cache)  # per-layer views [num_slots, Hkv, D], made once (not per call)
        self._v_layers = list(pool.v_cache)
        # cpu_kernels.CpuKernels of the pool dtype: KV writes, decode rows and cascade merges fused
        self.kernels = kernels if kernels is not None and kernels.dtype == pool.dtype else None
        self.sliding_window = sliding_window  # Mistral: a query sees only the last `sliding_window` keys
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.use_segments = True
        # AMX tiles (bfloat16): shared segments and multi-token tails by the ragged kernel, no padding
        self.use_ragged = (self.kernels is not None and self.kernels.has_amx and head_dim % 32 == 0
                           and head_dim <= 256)
        self._work = torch.empty(0, dtype=torch.uint8)  # the ragged kernel's K/V packing buffer, grown
        # shared segments' packed K/V by their slots; valid while no slot was freed (pool.free_epoch)
        self._packs: dict[bytes, PackedKeys] = {}
        self._packs_epoch = -1

    def prepare(self, extend_lens: list[int], prefix_lens: list[int],
                slot_tables: list[torch.Tensor]) -> AttnMetadata:
        """Build the index tensors shared by all layers. slot_tables[i]: int64
        [prefix_lens[i] + extend_lens[i]], the request's KV slots with the new tokens' included."""
        B = len(extend_lens)
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        seg_list, shared = [], [0] * B
        window = self.sliding_window
        if window is not None and max(p + e for p, e in zip(prefix_lens, extend_lens)) <= window:
            window = None  # nothing in this batch is old enough to fall out of the window
        if self.use_segments and B > 1 and window is None:
            seg_list, shared = find_shared_segments(prefix_lens, slot_tables)
        ragged = self.use_ragged and window is None
        seg_rows = [(torch.tensor([r for i in reqs for r in range(starts[i], starts[i] + extend_lens[i])]),
                     slot_tables[reqs[0]][a:b]) for reqs, a, b in seg_list]
        segments = self._ragged_segments(seg_rows) if ragged else self._segment_groups(seg_rows)
        if ragged:
            self._keep_packed(segments)
        # tails: positions [shared[i], seq_len) of each request, causal for its new tokens
        kv_lens = [p + e - s for p, e, s in zip(prefix_lens, extend_lens, shared)]
        G = self.group
        dtype = self.pool.dtype
        tails = []
        if ragged and any(e > 1 for e in extend_lens):  # multi-token tails: one ragged call, causal limits
            multi = [i for i, e in enumerate(extend_lens) if e > 1]
            pre = [prefix_lens[i] - shared[i] for i in multi]
            tails.append(self._ragged_group(
                [slot_tables[i][shared[i]:] for i in multi],
                [torch.arange(starts[i], starts[i] + extend_lens[i]) for i in multi],
                torch.cat([torch.arange(p + 1, p + 1 + extend_lens[i]) for p, i in zip(pre, multi)]), merge=False))
            extend_lens = [e if e == 1 else 0 for e in extend_lens]  # the rest: decode rows only
        for idx in _group_requests(extend_lens, kv_lens):
            nb = len(idx)
            E = max(extend_lens[i] for i in idx)
            if E == 1 and self.kernels is not None and window is None:
                tails.append(DecodeGroup(
                    torch.tensor([starts[i] for i in idx]),
                    torch.cat([slot_tables[i][shared[i]:] for i in idx]),
                    torch.tensor([0] + [kv_lens[i] for i in idx]).cumsum(0)))
                continue
            L = max(kv_lens[i] for i in idx)
            ext = torch.tensor([extend_lens[i] for i in idx])
            pre = torch.tensor([prefix_lens[i] - shared[i] for i in idx])
            st = torch.tensor([starts[i] for i in idx])
            ar_e = torch.arange(E)
            valid2d = ar_e[None, :] < ext[:, None]  # [nb, E]
            token_index = torch.where(valid2d, st[:, None] + ar_e[None, :], 0)
            kv_index = torch.zeros(nb, L, dtype=torch.int64)
            for b, i in enumerate(idx):
                kv_index[b, : kv_lens[i]] = slot_tables[i][shared[i]: shared[i] + kv_lens[i]]
            # query j of a tail sits at tail position pre+j and sees tail keys k <= pre+j
            qpos = (pre[:, None] + ar_e[None, :])[:, :, None]
            allowed = torch.arange(L)[None, None, :] <= qpos
            if window is not None:  # no segments then, so tail positions are absolute positions
                allowed &= torch.arange(L)[None, None, :] > qpos - window
            allowed[:, :, 0] |= ~valid2d  # padded query rows attend to one key (no NaN rows)
            causal = nb == 1 and E == L and E > 1 and window is None and int(pre[0]) == 0
            mask = None
            if not causal and not bool(allowed.all()):
                mask = torch.zeros(nb, E, L, dtype=dtype).masked_fill_(~allowed, float("-inf"))
                mask = mask[:, :, None, :].expand(nb, E, G, L).reshape(nb, 1, E * G, L)
            valid = valid2d.reshape(-1)
            tails.append(TailGroup(token_index, kv_index, mask, valid, token_index.reshape(-1)[valid], causal))
        t0 = tails[0]
        identity = (not segments and len(tails) == 1 and not isinstance(t0, RaggedGroup)
                    and torch.equal(t0.rows if isinstance(t0, DecodeGroup) else t0.out_rows, torch.arange(acc))
                    and (isinstance(t0, DecodeGroup) or bool(t0.valid.all())))
        need = max([g.work_bytes for g in tails + segments if isinstance(g, RaggedGroup) and g.packed is None],
                   default=0)
        if need > self._work.numel():
            self._work = torch.empty(need, dtype=torch.uint8)
        return AttnMetadata(tails, segments, acc, identity)

    def _keep_packed(self, groups: list[RaggedGroup]) -> None:
        """Give the segment calls their packing from earlier forwards (or a new one to fill), keyed by
        their slots. A shared prefix's slots hold the same K/V while any request holds them, and slots
        are rewritten only after being freed, so every pack is dropped when the pool frees a slot, and
        packs of segments absent from this forward are dropped too (at most PACK_CACHE_BYTES kept)."""
        if self.pool.free_epoch != self._packs_epoch:
            self._packs, self._packs_epoch = {}, self.pool.free_epoch
        kept, total = {}, 0
        for g in groups:
            size = len(self._k_layers) * g.work_bytes
            if total + size > PACK_CACHE_BYTES:
                continue  # packed per call in the shared work buffer instead
            key = g.key_offsets.numpy().tobytes() + g.slots.numpy().tobytes()
            g.packed = kept[key] = self._packs.get(key) or PackedKeys([None] * len(self._k_layers))
            total += size
        self._packs = kept

    def _ragged_group(self, slots: list[torch.Tensor], rows: list[torch.Tensor], limits: torch.Tensor | None,
                      merge: bool) -> RaggedGroup:
        """One ragged kernel call over items (slots[i] [L_i], rows[i] [R_i]); limits [sum R_i] or None."""
        lens = [t.numel() for t in slots]
        return RaggedGroup(torch.tensor([0] + lens).cumsum(0), torch.cat(slots),
                           torch.tensor([0] + [r.numel() for r in rows]).cumsum(0), torch.cat(rows), limits, merge,
                           self.kernels.ragged_work_bytes(lens, self.num_kv_heads, self.head_dim))

    def _ragged_segments(self, segs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[RaggedGroup]:
        """Shared segments (rows [R], slots [L]) as ragged calls that merge into the tails' results:
        a call takes a segment whose rows it does not hold yet (each row is merged once per call), so
        a system prompt shared by all and the documents shared by groups of them make two calls."""
        calls: list[tuple[list, set]] = []
        for rows, slots in segs:
            rset = set(rows.tolist())
            call = next((c for c in calls if not (c[1] & rset)), None)
            if call is None:
                calls.append(([], set()))
                call = calls[-1]
            call[0].append((rows, slots))
            call[1].update(rset)
        return [self._ragged_group([sl for _, sl in c], [r for r, _ in c], None, merge=True) for c, _ in calls]

    def _segment_groups(self, segs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[SegmentGroup]:
        """Pack segments (rows [R], slots [L]) into kernel calls: by length, a group takes a segment
        whose rows it does not hold yet while its padded area stays within 1.5x its real area + 4096
        (the merge after the call writes each row once, so a group's rows must be distinct)."""
        groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        cur, cur_rows, real = [], set(), 0
        for rows, slots in sorted(segs, key=lambda s: s[1].numel()):
            r, l = rows.numel(), slots.numel()
            max_r = max([r] + [x.numel() for x, _ in cur])
            max_l = max([l] + [y.numel() for _, y in cur])
            rset = set(rows.tolist())
            if cur and (rset & cur_rows or (len(cur) + 1) * max_r * max_l > 1.5 * (real + r * l) + 4096):
                groups.append(cur)
                cur, cur_rows, real = [], set(), 0
            cur.append((rows, slots))
            cur_rows |= rset
            real += r * l
        if cur:
            groups.append(cur)
        G, dtype = self.group, self.pool.dtype
        out = []
        for grp in groups:
            S = len(grp)
            Rm = max(rows.numel() for rows, _ in grp)
            Lm = max(slots.numel() for _, slots in grp)
            q_index = torch.zeros(S, Rm, dtype=torch.int64)
            kv_index = torch.zeros(S, Lm, dtype=torch.int64)
            rlen = torch.tensor([rows.numel() for rows, _ in grp])
            llen = torch.tensor([slots.numel() for _, slots in grp])
            for j, (rows, slots) in enumerate(grp):
                q_index[j, : rows.numel()] = rows
                kv_index[j, : slots.numel()] = slots
            valid2d = torch.arange(Rm)[None, :] < rlen[:, None]  # [S, Rm]
            mask = None
            if bool((rlen < Rm).any() or (llen < Lm).any()):
                allowed = (torch.arange(Lm)[None, None, :] < llen[:, None, None]).expand(S, Rm, Lm).clone()
                allowed[:, :, 0] |= ~valid2d  # padded query rows attend to one key (no NaN rows)
                mask = torch.zeros(S, Rm, Lm, dtype=dtype).masked_fill_(~allowed, float("-inf"))
                mask = mask[:, :, None, :].expand(S, Rm, G, Lm).reshape(S, 1, Rm * G, Lm)
            first, view = int(kv_index[0, 0]), False
            if S == 1:
                sl = grp[0][1]
                view = int(sl[-1]) - first == Lm - 1 and bool((sl.diff() == 1).all())
            valid = valid2d.reshape(-1)
            out.append(SegmentGroup(q_index, None if view else kv_index, first, Lm, mask, valid,
                                    q_index.reshape(-1)[valid], valid.nonzero().reshape(-1)))
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttnMetadata, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens, rotated; rows may be strided views) -> output
        [T, H, D] in q's dtype. Writes k/v into the pool at out_cache_loc [T] first."""
        kc = self._k_layers[layer_id]
        vc = self._v_layers[layer_id]
        kern = self.kernels
        if kern is not None:
            kern.kv_write(kc, k, out_cache_loc)
            kern.kv_write(vc, v, out_cache_loc)
        else:
            kc.index_copy_(0, out_cache_loc, k.to(kc.dtype))
            vc.index_copy_(0, out_cache_loc, v.to(vc.dtype))
        T, H, D = q.shape
        if meta.identity:
            g = meta.tails[0]
            if isinstance(g, DecodeGroup):
                out = torch.empty(T, H, D, dtype=q.dtype)
                kern.decode_attn(q, g.rows, kc, vc, g.slots, g.offsets, self.scale, out, g.rows)
                return out
            return self._tail(q, kc, vc, g)[0]
        ragged = any(isinstance(g, RaggedGroup) for g in meta.tails + meta.segments)
        if not meta.segments and not ragged:
            out = torch.empty(T, H, D, dtype=q.dtype)
            for g in meta.tails:
                if isinstance(g, DecodeGroup):
                    kern.decode_attn(q, g.rows, kc, vc, g.slots, g.offsets, self.scale, out, g.rows)
                else:
                    o, _ = self._tail(q, kc, vc, g)
                    out[g.out_rows] = o[g.valid]
            return out
        out = torch.empty(T, H, D, dtype=torch.float32)
        lse = torch.empty(T, H, dtype=torch.float32)
        for g in meta.tails:
            if isinstance(g, DecodeGroup):
                kern.decode_attn(q, g.rows, kc, vc, g.slots, g.offsets, self.scale, out, g.rows, lse)
                continue
            if isinstance(g, RaggedGroup):
                self._ragged(q, kc, vc, g, layer_id, out, lse)
                continue
            o, l = self._tail(q, kc, vc, g)
            out[g.out_rows] = o[g.valid].float()
            lse[g.out_rows] = l[g.valid]
        for s in meta.segments:
            if isinstance(s, RaggedGroup):
                self._ragged(q, kc, vc, s, layer_id, out, lse)
                continue
            o, l = self._segment(q, kc, vc, s)
            if kern is not None:  # o, l: the padded kernel output, real rows at s.src_rows
                kern.merge(out, lse, o, l, s.src_rows, s.out_rows)
                continue
            if s.mask is not None:
                o, l = o[s.valid], l[s.valid]
            rows = s.out_rows
            prev_l = lse[rows]
            new_l = torch.logaddexp(prev_l, l)
            out[rows] = out[rows] * torch.exp(prev_l - new_l)[..., None] + o.float() * torch.exp(l - new_l)[..., None]
            lse[rows] = new_l
        return out.to(q.dtype)

    def _ragged(self, q, kc, vc, g: RaggedGroup, layer_id: int, out, lse) -> None:
        p, done = g.packed, False
        work = self._work
        if p is not None:
            done = p.bufs[layer_id] is not None
            work = p.bufs[layer_id] if done else torch.empty(g.work_bytes, dtype=torch.uint8)
        self.kernels.ragged_attn(q, kc, vc, g.key_offsets, g.slots, g.row_offsets, g.rows, g.limits, self.scale,
                                 out, lse, g.merge, work, done)
        if p is not None:
            p.bufs[layer_id] = work

    def _tail(self, q, kc, vc, g: TailGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [B*E, H, D], lse [B*E, H]) for a padded tail group."""
        if g.causal:  # [1, H, E, D] against K/V repeated to H heads (q head h reads kv head h // G)
            E, G, H, D = g.token_index.shape[1], self.group, self.num_heads, self.head_dim
            qh = _rows(q, g.token_index).view(1, E, H, D).transpose(1, 2)
            kh = _rows(kc, g.kv_index).to(q.dtype).repeat_interleave(G, dim=2).transpose(1, 2)
            vh = _rows(vc, g.kv_index).to(q.dtype).repeat_interleave(G, dim=2).transpose(1, 2)
            o, lse = _flash(qh, kh, vh, is_causal=True, scale=self.scale)
            return o.transpose(1, 2).reshape(E, H, D), lse.transpose(1, 2).reshape(E, H)
        kg = _rows(kc, g.kv_index).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        vg = _rows(vc, g.kv_index).permute(0, 2, 1, 3)
        return self._grouped_flash(q, g.token_index, kg, vg, g.mask)

    def _grouped_flash(self, q, row_index, k, v, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """One flash call for B padded sets of query rows. row_index [B, E] batch rows of q;
        k, v [B or 1, Hkv, L, D]; mask [B, 1, E*G, L] or None. The G query heads of each KV head are
        folded into the row axis (rows e*G + g), so K/V are read once per KV head, not per query head.
        -> (out [B*E, H, D], lse [B*E, H] float32)."""
        B, E = row_index.shape
        Hkv, G, D = self.num_kv_heads, self.group, self.head_dim
        qg = _rows(q, row_index).view(B, E, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, E * G, D)
        o, lse = _flash(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=None if mask is None else mask.to(q.dtype),
                        scale=self.scale)
        o = o.view(B, Hkv, E, G, D).permute(0, 2, 1, 3, 4).reshape(B * E, Hkv * G, D)
        lse = lse.view(B, Hkv, E, G).permute(0, 2, 1, 3).reshape(B * E, Hkv * G)
        return o, lse

    def _segment(self, q, kc, vc, g: SegmentGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [S*Rmax, H, D], lse [S*Rmax, H]) of a segment group's padded rows against its keys
        (the real rows are g.valid / g.src_rows)."""
        if g.kv_index is None:  # a view: the kernel reads strided keys, nothing is copied
            end = g.first_slot + g.num_keys
            ks = kc[g.first_slot:end].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, D]
            vs = vc[g.first_slot:end].permute(1, 0, 2).unsqueeze(0)
        else:
            ks = _rows(kc, g.kv_index).permute(0, 2, 1, 3)  # [S, Hkv, Lmax, D]
            vs = _rows(vc, g.kv_index).permute(0, 2, 1, 3)
        return self._grouped_flash(q, g.q_index, ks, vs, g.mask)
