"""The attention backend's batch plan: shared-segment discovery against brute force.

``find_shared_segments`` walks the requests' slot tables like the radix tree they came from; here the
tables are random trees of shared stretches (a system prompt, documents, sub-documents, some shorter
than a segment's minimum) and the result is checked against properties computed pair by pair.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from idleless.model.attention import MIN_SHARED_TOKENS, find_shared_segments


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
