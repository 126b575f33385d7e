"""The KV pool's one-owner invariant, checked on a live scheduler (shared by the engine, scheduling
and step-plan tests)."""

from __future__ import annotations

import torch


def tree_nodes(cache):
    """Every node of a radix cache (none for a cache that keeps nothing)."""
    root = getattr(cache, "root", None)
    stack = list(root.children.values()) if root is not None else []
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def check_ownership(sched) -> None:
    """Every KV page is owned by exactly one of: the free list, the prefix cache, one running
    request (the part of its slot table after ``num_tree_tokens``). A running request's cached part
    is exactly the slots on its locked handle's path. kv_usage() agrees: free + cached + in_use ==
    total. Waiting requests hold nothing."""
    pool, cache = sched.pool, sched.cache
    ps = pool.page_size
    owners: dict[int, str] = {}

    def own(pages, who):
        for p in pages:
            assert p not in owners, f"page {p} owned by {owners[p]} and {who}"
            owners[p] = who

    own(pool._free_pages[: pool._num_free_pages].tolist(), "free")
    tree_tokens = 0
    for node in tree_nodes(cache):
        v = node.value
        assert len(v) % ps == 0 and len(v) == len(node.key)
        tree_tokens += len(v)
        if ps > 1:
            assert torch.equal(v.view(-1, ps) - v.view(-1, ps)[:, :1], torch.arange(ps).expand(len(v) // ps, ps))
        own((v[::ps] // ps).tolist(), "tree")
    assert tree_tokens == cache.total_size
    for r in sched.running:
        assert r.slots is not None and r.num_tree_tokens % ps == 0
        assert len(r.slots) >= r.num_computed
        mine = r.slots[r.num_tree_tokens:]
        own(torch.unique(mine // ps).tolist(), f"request {r.rid}")
        path, node = [], r.cache_handle.node
        while node is not None and node is not getattr(cache, "root", None):
            path.insert(0, node.value)
            node = node.parent
        path_slots = torch.cat(path) if path else torch.empty(0, dtype=torch.int64)
        assert torch.equal(r.slots[: r.num_tree_tokens], path_slots), f"request {r.rid}: table != cache path"
    for r in sched.waiting:
        assert r.slots is None and r.cache_handle is None, f"waiting request {r.rid} holds KV"
    assert sorted(owners) == list(range(pool.num_pages)), "a page has no owner (leaked)"
    kv = sched.kv_usage()
    assert kv["free"] + kv["cached"] + kv["in_use"] == kv["total"] == pool.num_slots, kv
    assert kv["cached"] == cache.total_size
