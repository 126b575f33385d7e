"""The attention backend's batch plan: shared-segment discovery against brute force, and the packed
shared segments the AMX path keeps across decode steps.

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
from idleless.model.attention import MIN_SHARED_TOKENS, TorchNativeAttention, find_shared_segments


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
    backend = TorchNativeAttention(pool, H, Hkv, D, kernels=cpu_kernels.load(torch.bfloat16))
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
