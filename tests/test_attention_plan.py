"""The attention backends' batch plan: shared-segment discovery against brute force, the composite's
split of a batch between kernel families against the torch-native reference and a float64 softmax, and
the packed shared segments the AMX path keeps across decode steps.

``find_shared_segments`` walks the requests' slot tables like the radix tree they came from; here the
tables are random trees of shared stretches (a system prompt, documents, sub-documents, some shorter
than a segment's minimum) and the result is checked against properties computed pair by pair.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from idleless.cache.kv_pool import KVPool
from idleless.model import cpu_kernels
from idleless.model.attention import (
    MIN_SHARED_TOKENS,
    CompositeAttention,
    FusedDecodeAttention,
    PaddedFlashAttention,
    RaggedAmxAttention,
    TorchNativeAttention,
    find_shared_segments,
)


@st.composite
def slot_trees(draw):
    """Requests' slot tables drawn as paths in a random tree of stretches (fresh slots per stretch)."""
    counter = iter(range(10**6))

    def stretch(n):
        return [next(counter) for _ in range(n)]

    lengths = st.integers(0, 40)
    children: dict = {}  # (root, depth so far, level, branch) -> stretch: requests taking it share it
    roots = [stretch(draw(lengths)) for _ in range(draw(st.integers(1, 3)))]
    tables = []
    for _ in range(draw(st.integers(2, 12))):
        path = list(draw(st.sampled_from(roots)))
        depth = draw(st.integers(0, 2))
        for level in range(depth):
            k = draw(st.integers(0, 1))
            key = (tuple(path[:1]), len(path), level, k)
            if key not in children:
                children[key] = stretch(draw(lengths))
            path += children[key]
        path += stretch(draw(st.integers(1, 5)))  # every request ends with its own tokens
        tables.append(path)
    return tables


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(slot_trees())
def test_segments_tile_each_shared_prefix(tables):
    prefix_lens = [len(t) - 1 for t in tables]  # the last token is the new one
    segs, shared = find_shared_segments(prefix_lens, [torch.tensor(t) for t in tables])
    covered = {i: [] for i in range(len(tables))}
    for reqs, a, b in segs:
        assert len(reqs) >= 2 and b - a >= MIN_SHARED_TOKENS and len(set(reqs)) == len(reqs)
        for i in reqs:
            assert b <= prefix_lens[i]
            assert tables[i][a:b] == tables[reqs[0]][a:b]  # the same KV slots: one read serves all
            covered[i].append((a, b))
    for i, spans in covered.items():
        spans.sort()
        pos = 0
        for a, b in spans:  # segments of a request tile [0, shared[i]) in order, no gap or overlap
            assert a == pos
            pos = b
        assert pos == shared[i]
        if prefix_lens[i] < MIN_SHARED_TOKENS:
            assert shared[i] == 0
            continue
        # nothing shareable is left out but a remainder shorter than a segment
        best = max((min(lcp(tables[i], tables[j]), prefix_lens[i], prefix_lens[j])
                    for j in range(len(tables)) if j != i and prefix_lens[j] >= MIN_SHARED_TOKENS),
                   default=0)
        assert shared[i] <= best
        assert shared[i] >= best - (MIN_SHARED_TOKENS - 1)


@pytest.mark.skipif(not getattr(cpu_kernels.load(torch.bfloat16), "has_amx", False), reason="no AMX tiles on this CPU")
def test_packed_segments_follow_the_pool_contents():
    """Two decode rows sharing a 40-token prefix: the segment's packed K/V is made at the first step
    and reused at the next; when the prefix's slots are freed and handed out again with other K/V
    (a new prompt in the same slots), the next step packs again. Each step's output is checked against
    a float64 softmax over the pool's contents at that step (a stale pack would attend the old keys)."""
    H, Hkv, D = 4, 2, 64
    pool = KVPool(1, Hkv, D, 128, torch.bfloat16)
    backend = CompositeAttention(pool, H, Hkv, D, kernels=cpu_kernels.load(torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    prefix, own = pool.alloc(0, 0, 40), [pool.alloc(0, 0, 1), pool.alloc(0, 0, 1)]

    def fill(slots):
        pool.k_cache[0, slots] = torch.randn(len(slots), Hkv, D, generator=g).bfloat16()
        pool.v_cache[0, slots] = torch.randn(len(slots), Hkv, D, generator=g).bfloat16()

    def step():
        tables = [torch.cat([prefix, own[i]]) for i in range(2)]
        meta = backend.prepare([1, 1], [40, 40], tables)
        (seg,) = meta.segments
        reused = seg.packed.bufs[0] is not None
        q = torch.randn(2, H, D, generator=g).bfloat16()
        k, v = (torch.randn(2, Hkv, D, generator=g).bfloat16() for _ in range(2))
        out = backend.forward(q, k, v, 0, meta, torch.cat(own))
        for i in range(2):
            keys, vals = pool.k_cache[0, tables[i]].double(), pool.v_cache[0, tables[i]].double()
            s = torch.einsum("hd,lhd->hl", q[i].double(), keys.repeat_interleave(H // Hkv, 1)) * D ** -0.5
            ref = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vals.repeat_interleave(H // Hkv, 1))
            torch.testing.assert_close(out[i].double(), ref, rtol=0, atol=2 ** -6)
        return reused

    fill(prefix)
    assert not step()  # packed now
    assert step()  # the same prefix slots at the next step: the pack is reused
    pool.free(prefix)
    again = pool.alloc(0, 0, 40)
    assert set(again.tolist()) == set(prefix.tolist())  # the same slots (kept in the old order: the same key)
    fill(prefix)  # another prompt's K/V in the same slots
    assert not step()


def brute_force(q, pool, layer, table, num_new, window=None):
    """float64 causal softmax attention of a request's new rows q [E, H, D] over its slot table [L]
    (the new tokens' K/V last) -> [E, H, D]; window: each row sees its last `window` keys."""
    E, H, D = q.shape
    keys, vals = pool.k_cache[layer, table].double(), pool.v_cache[layer, table].double()
    G = H // keys.shape[1]
    s = torch.einsum("ehd,lhd->hel", q.double(), keys.repeat_interleave(G, 1)) * D ** -0.5
    L = table.numel()
    pos = torch.arange(L - E, L)[:, None]
    allowed = torch.arange(L)[None, :] <= pos
    if window is not None:
        allowed &= torch.arange(L)[None, :] > pos - window
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hel,lhd->ehd", torch.softmax(s, -1), vals.repeat_interleave(G, 1))


def _mixed_batch(pool, g):
    """Slot tables of a mixed batch: a 40-token system prompt held by five requests, a 20-token document
    held by two of them, decode rows, extends over shared and own prefixes, a plain prefill."""
    def take(n):
        return pool.alloc(0, 0, n)

    system, doc = take(40), take(20)
    own = {  # request -> (shared part, own earlier tokens, new tokens)
        "decode-sys": (system, 5, 1), "decode-doc": (torch.cat([system, doc]), 3, 1),
        "extend-doc": (torch.cat([system, doc]), 0, 6), "extend-sys": (system, 2, 30), "decode-sys2": (system, 0, 1),
        "prefill": (torch.empty(0, dtype=torch.int64), 0, 25), "decode-own": (torch.empty(0, dtype=torch.int64), 50, 1),
        "extend-own": (torch.empty(0, dtype=torch.int64), 17, 3),
    }
    extend_lens, prefix_lens, tables = [], [], []
    for shared, past, new in own.values():
        tables.append(torch.cat([shared, take(past + new)]))
        extend_lens.append(new)
        prefix_lens.append(shared.numel() + past)
    used = torch.cat(tables).unique()
    pool.k_cache[0, used] = torch.randn(used.numel(), *pool.k_cache.shape[2:], generator=g).to(pool.dtype)
    pool.v_cache[0, used] = torch.randn(used.numel(), *pool.v_cache.shape[2:], generator=g).to(pool.dtype)
    return list(own), extend_lens, prefix_lens, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.skipif(cpu_kernels.load(torch.float32) is None, reason="no C compiler for the CPU kernels")
def test_composite_split_matches_the_torch_native_reference(dtype):
    """The composite with the CPU kernels splits a mixed batch: tails of up to ``decode_max_new`` new tokens
    to the decode kernel (one decode row per new token), the other tails and the shared segments to padded flash (or all of them to the AMX ragged kernel), the
    segments' backend last; its output agrees with the torch-native reference (padded flash alone) and
    both with a float64 softmax per request. A row attended twice, a segment not merged or a tail routed
    to two backends moves outputs by O(1)."""
    H, Hkv, D = 4, 2, 64
    g = torch.Generator().manual_seed(3)
    pools = [KVPool(1, Hkv, D, 512, dtype) for _ in range(2)]
    names, ext, pre, tables = _mixed_batch(pools[0], g)
    _mixed_batch(pools[1], torch.Generator().manual_seed(3))  # the same slots and K/V
    kern = cpu_kernels.load(dtype)
    comp = CompositeAttention(pools[0], H, Hkv, D, kernels=kern)
    ref = TorchNativeAttention(pools[1], H, Hkv, D)
    meta, ref_meta = comp.prepare(ext, pre, tables), ref.prepare(ext, pre, tables)

    starts = torch.tensor([0] + ext).cumsum(0).tolist()
    rows_of = {n: set(range(starts[i], starts[i] + ext[i])) for i, n in enumerate(names)}
    backends = [b for b, _ in meta.parts]
    assert len(set(map(id, backends))) == len(backends) and backends[-1] is comp.segment_backend
    ragged = RaggedAmxAttention.supports(kern, D)
    assert isinstance(comp.decode_backend, FusedDecodeAttention)
    assert isinstance(comp.segment_backend, RaggedAmxAttention if ragged else PaddedFlashAttention)
    decode_plan = next(p for b, p in meta.parts if b is comp.decode_backend)
    (dg,) = decode_plan.tails
    short = [n for n in names if ext[names.index(n)] <= comp.decode_max_new]  # one row per new token
    assert set(dg.rows.tolist()) == set().union(*(rows_of[n] for n in short)) and len(dg.rows) == sum(
        ext[names.index(n)] for n in short)
    assert meta.segments and not meta.alone and meta.merged
    assert [type(b) for b, _ in ref_meta.parts] == [PaddedFlashAttention] and ref_meta.segments

    T = sum(ext)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    loc = torch.cat([t[-e:] for t, e in zip(tables, ext)])
    out = comp.forward(q, k, v, 0, meta, loc)
    want = ref.forward(q, k, v, 0, ref_meta, loc)
    assert out.dtype == dtype and out.shape == (T, H, D)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), want.double(), rtol=0, atol=tol)
    for i, n in enumerate(names):
        exact = brute_force(q[starts[i]:starts[i] + ext[i]], pools[0], 0, tables[i], ext[i])
        torch.testing.assert_close(out[starts[i]:starts[i] + ext[i]].double(), exact, rtol=0, atol=tol, msg=n)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_composite_alone_and_window_routes(kernels):
    """A lone prefill runs in one padded flash call whose output is the layer's (no copy); a batch of
    decode rows alone in the decode kernel; a batch past the sliding window wholly in padded flash with
    window masks (no segments), matching a float64 windowed softmax."""
    kern = cpu_kernels.load(torch.float32) if kernels else None
    if kernels and kern is None:
        pytest.skip("no C compiler for the CPU kernels")
    H, Hkv, D, W = 4, 2, 32, 8
    g = torch.Generator().manual_seed(5)
    pool = KVPool(1, Hkv, D, 256, torch.float32)
    comp = CompositeAttention(pool, H, Hkv, D, sliding_window=W, kernels=kern)
    prefill = pool.alloc(0, 0, 20)  # longer than the decode kernel's tails (and the window)
    meta = comp.prepare([20], [0], [prefill])
    assert meta.alone and meta.parts[0][0] is comp.flash
    decodes = [pool.alloc(0, 0, 5), pool.alloc(0, 0, 3)]
    meta = comp.prepare([1, 1], [4, 2], decodes)
    assert meta.alone and meta.parts[0][0] is comp.decode_backend
    assert (comp.decode_backend is comp.flash) == (not kernels)

    long = pool.alloc(0, 0, 30)  # 30 keys > window 8: flash with window masks for every row
    short = pool.alloc(0, 0, 2)
    tables, ext, pre = [long, short], [1, 2], [29, 0]
    used = torch.cat(tables)
    pool.k_cache[0, used] = torch.randn(used.numel(), Hkv, D, generator=g)
    pool.v_cache[0, used] = torch.randn(used.numel(), Hkv, D, generator=g)
    meta = comp.prepare(ext, pre, tables)
    assert [b for b, _ in meta.parts] == [comp.flash] and not meta.segments
    q = torch.randn(3, H, D, generator=g)
    out = comp.forward(q, pool.k_cache[0, torch.tensor([long[-1], short[0], short[1]])],
                       pool.v_cache[0, torch.tensor([long[-1], short[0], short[1]])], 0, meta,
                       torch.tensor([long[-1], short[0], short[1]]))
    torch.testing.assert_close(out[:1].double(), brute_force(q[:1], pool, 0, long, 1, W), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1:].double(), brute_force(q[1:], pool, 0, short, 2, W), rtol=0, atol=1e-5)
