"""The router's per-engine token index (idleless/router/index.py) and the KV event stream
(idleless/router/events.py) against brute force.

The reference is the set of held prefixes (tuples) built from the event stream itself: ``stored``
adds every prefix of its tokens, ``removed`` deletes the prefixes longer than ``start``,
``cleared`` empties it; the longest held prefix of a query is the largest i with query[:i] in the
set. Hypothesis drives a real RadixCache (inserts that force evictions, resets) with a listener
attached, so the events are the tree's own; the index must equal the brute force and the tree's
``peek_prefix_len`` (page_size 1) after every operation. A stream with dropped batches must ask for a
snapshot and, once given the publisher's snapshot, converge to the same answers.
"""

from __future__ import annotations

import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idleless.cache.kv_pool import KVPool
from idleless.cache.radix_cache import RadixCache
from idleless.router.events import KVEventStream, apply_events
from idleless.router.index import TokenIndex

_STEMS = [[0] * 6, [0, 1] * 3, [0, 0, 1, 1], [2, 1], [1] * 5]
seqs = st.one_of(st.lists(st.integers(0, 2), min_size=1, max_size=12),
                 st.tuples(st.sampled_from(_STEMS), st.lists(st.integers(0, 2), max_size=5)).map(lambda t: t[0] + t[1]))


class Recorder:
    """A radix-tree listener that keeps the events as the wire lists."""

    def __init__(self):
        self.events = []

    def on_stored(self, tokens, start):
        self.events.append(["stored", start, list(tokens)])

    def on_removed(self, tokens, start):
        self.events.append(["removed", start, list(tokens)])

    def on_cleared(self):
        self.events.append(["cleared"])


class BruteForce:
    def __init__(self):
        self.held: set[tuple] = set()

    def apply(self, ev):
        if ev[0] == "stored":
            t = tuple(ev[2])
            self.held.update(t[:i] for i in range(1, len(t) + 1))
        elif ev[0] == "removed":
            t = tuple(ev[2])
            self.held.difference_update(t[:i] for i in range(ev[1] + 1, len(t) + 1))
        else:
            self.held.clear()

    def match(self, q):
        q = tuple(q)
        return max((i for i in range(len(q) + 1) if q[:i] in self.held or i == 0), default=0)


def _cache(num_slots=24):
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_slots=num_slots, dtype=torch.float32, page_size=1)
    cache = RadixCache(pool)
    rec = Recorder()
    cache.listener = rec
    return pool, cache, rec


def _insert(pool, cache, seq):
    """What the engine does with a finished request: match, take slots for the rest (evicting when
    the pool is short), insert, free duplicates."""
    h = cache.match_prefix(seq)
    cache.lock(h)
    need = len(seq) - h.cached_len
    if pool.num_free_slots < need:
        cache.evict(need - pool.num_free_slots)
    cache.unlock(h)
    if pool.num_free_slots < need:
        return
    new = pool.alloc(0, 0, need)
    slots = torch.cat([h.slots, new])
    res = cache.insert(seq, slots)
    if res.prefix_len > h.cached_len:
        pool.free(slots[h.cached_len:res.prefix_len])


ops = st.lists(st.one_of(st.tuples(st.just("insert"), seqs), st.tuples(st.just("evict"), st.integers(1, 8)),
                         st.tuples(st.just("reset"), st.none())), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, queries=st.lists(seqs, min_size=1, max_size=6))
def test_index_follows_the_radix_tree_events(ops, queries):
    pool, cache, rec = _cache()
    index, brute = TokenIndex(), BruteForce()
    for op, arg in ops:
        if op == "insert":
            _insert(pool, cache, arg)
        elif op == "evict":
            cache.evict(arg)
        else:
            cache.reset()
        apply_events(index, rec.events)
        for ev in rec.events:
            brute.apply(ev)
        rec.events.clear()
        assert index.num_tokens == cache.total_size == len(brute.held)
        for q in queries + [arg] if op == "insert" else queries:
            assert index.match(q) == brute.match(q) == cache.peek_prefix_len(q)
    # a snapshot (the leaves' paths) rebuilds the same index
    rebuilt = TokenIndex()
    for p in index.paths():
        rebuilt.stored(p)
    assert rebuilt.num_tokens == index.num_tokens
    for q in queries:
        assert rebuilt.match(q) == index.match(q)


def test_index_hand_computed():
    idx = TokenIndex()
    idx.stored([1, 2, 3, 4])
    idx.stored([1, 2, 5], 2)
    assert (idx.match([1, 2, 3, 9]), idx.match([1, 2, 5, 5]), idx.match([7])) == (3, 3, 0)
    idx.removed([1, 2, 3, 4], 3)  # the leaf [4] after [1, 2, 3]
    assert idx.match([1, 2, 3, 4]) == 3 and idx.num_tokens == 4
    idx.removed([1, 2, 3], 2)
    assert idx.match([1, 2, 3]) == 2 and idx.match([1, 2, 5]) == 3
    assert sorted(idx.paths()) == [[1, 2, 5]]


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.tuples(seqs, st.booleans()), min_size=1, max_size=4), min_size=1, max_size=12),
       dropped=st.sets(st.integers(1, 12)), query=seqs)
def test_stream_detects_gaps_and_converges_from_a_snapshot(batches, dropped, query):
    """Numbered batches of stored/removed events, some never delivered: the stream asks for a
    snapshot exactly when it sees a gap (or a heartbeat ahead of it), and after the publisher's
    snapshot plus the batches that followed it answers as an index that saw everything."""
    truth = TokenIndex()  # the publisher's mirror
    stream = KVEventStream()
    assert stream.feed({"epoch": "e", "seq": 0, "events": [], "heartbeat": True}) is True  # first contact
    assert stream.apply_snapshot(0, [], "e") is False
    wanted = False
    for seq, batch in enumerate(batches, start=1):
        events = [["stored", 0, s] if keep else ["removed", min(len(s) - 1, 2), s] for s, keep in batch]
        apply_events(truth, events)
        if seq in dropped:
            continue
        need = stream.feed({"epoch": "e", "seq": seq, "events": events, "heartbeat": False})
        gap = stream.seq is None or wanted
        assert need == (stream.seq is None)
        if need and not wanted:
            # the first batch after a missing one triggers the request; the snapshot arrives later
            assert any(d < seq for d in dropped)
        wanted = wanted or need
        assert gap or stream.index.match(query) == truth.match(query)
    last = len(batches)
    need = stream.feed({"epoch": "e", "seq": last, "events": [], "heartbeat": True})
    if need or wanted:
        snap_paths = list(truth.paths())
        assert stream.apply_snapshot(last, snap_paths, "e") is False
    assert stream.seq == last
    assert stream.index.match(query) == truth.match(query)
    assert stream.index.num_tokens == truth.num_tokens


def test_restarted_publisher_is_a_new_epoch():
    stream = KVEventStream()
    stream.feed({"epoch": "a", "seq": 0, "events": [], "heartbeat": True})
    stream.apply_snapshot(0, [], "a")
    assert stream.feed({"epoch": "a", "seq": 1, "events": [["stored", 0, [5, 6]]]}) is False
    assert stream.index.match([5, 6]) == 2
    # the engine restarted: its first batch is seq 1 again, in a new epoch
    assert stream.feed({"epoch": "b", "seq": 1, "events": [["stored", 0, [7]]]}) is True
    assert stream.apply_snapshot(1, [[7]], "b") is False
    assert stream.index.match([5, 6]) == 0 and stream.index.match([7]) == 1


def test_publisher_publishes_numbered_batches_and_serves_snapshots():
    """The real publisher on ZMQ (ephemeral ports): a subscriber that joins late misses the first
    batch, asks for a snapshot over the replay socket and converges."""
    import json

    import zmq

    from idleless.router.events import SNAPSHOT_REQUEST, KVEventPublisher, KVEventsConfig

    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                          heartbeat_s=0.05))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    req = ctx.socket(zmq.REQ)
    try:
        pub.on_stored([1, 2, 3], 0)
        pub.end_step({"num_running": 1})  # published before anyone listens: lost
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        req.connect(pub.replay_endpoint)
        stream = KVEventStream()
        deadline = time.monotonic() + 20
        while stream.seq is None and time.monotonic() < deadline:
            if sub.poll(100):
                _, body = sub.recv_multipart()
                if stream.feed(json.loads(body)):
                    req.send(SNAPSHOT_REQUEST)
                    assert req.poll(5000)
                    snap = json.loads(req.recv())
                    stream.apply_snapshot(snap["seq"], snap["paths"], snap["epoch"])
        assert stream.seq == 1 and stream.index.match([1, 2, 3, 4]) == 3
        pub.on_stored([1, 2, 9], 2)
        pub.on_removed([1, 2, 3], 2)
        pub.end_step({"num_running": 0})
        while stream.seq == 1 and time.monotonic() < deadline:
            if sub.poll(100):
                assert stream.feed(json.loads(sub.recv_multipart()[1])) is False
        assert stream.seq == 2 and stream.load == {"num_running": 0}
        assert (stream.index.match([1, 2, 3]), stream.index.match([1, 2, 9])) == (2, 3)
    finally:
        sub.close(linger=0)
        req.close(linger=0)
        pub.close()
