"""The engine side of KV events: ``EngineCore`` with ``kv_events_config`` publishes its radix tree's
changes after every step, and a router's ``KVEventSubscriber`` that joins late (snapshot) and then
follows the stream ends with an index equal to the tree (brute force: ``peek_prefix_len`` of the
tree for every prompt and its prefixes), through evictions in a small KV pool and a cache flush.
The model is the scripted runner of test_step_plan (no weights)."""

from __future__ import annotations

import asyncio
import json
import time

from test_step_plan import greedy, make_core, run

from idleless.engine.request import Request
from idleless.router.subscriber import KVEventSubscriber

CFG = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*", "heartbeat_s": 0.05})


async def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_core_publishes_and_subscriber_follows_the_tree():
    core = make_core(num_slots=48, kv_events_config=CFG)
    pub = core.kv_events
    prompts = [[5, 6, 7, 8, 9, 10] + [i] * 6 for i in range(11, 21)] + [[5, 6, 7, 1, 2, 3, 4]]

    async def main():
        run(core, [Request("warm", prompts[0], greedy(2))])  # before the subscriber exists: via snapshot
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
        sub.start()
        await _wait(lambda: sub.synced and sub.stream.seq == pub.seq)
        for i, p in enumerate(prompts):
            run(core, [Request(f"r{i}", p, greedy(3))])
            await asyncio.sleep(0)
        tree = core.scheduler.cache
        assert tree.num_evicted > 0  # the pool is small enough that the tree evicted

        def converged():  # the publisher's thread sends asynchronously: wait for the answers to agree
            idx = sub.stream.index
            return idx.num_tokens == tree.total_size and all(
                idx.match(p[:n] + [99]) == tree.peek_prefix_len(p[:n] + [99])
                for p in prompts for n in range(len(p) + 1))

        await _wait(converged)
        await _wait(lambda: sub.stream.load is not None and sub.stream.load["num_running"] == 0)
        assert core.flush_cache()
        await _wait(lambda: sub.stream.index.num_tokens == 0)
        assert sub.stream.snapshots == 1  # joined late once, never lost a batch after
        await sub.stop()

    try:
        asyncio.run(main())
    finally:
        pub.close()


def test_load_report_counts_queued_prompt_tokens():
    core = make_core(num_slots=256, max_running_requests=1)
    core.add_request(Request("a", list(range(10, 20)), greedy(4)))
    core.add_request(Request("b", list(range(30, 37)), greedy(4)))
    rep = core.load_report()
    assert (rep["num_running"], rep["num_waiting"], rep["queued_prefill_tokens"], rep["kv_usage"]) == (0, 2, 17, 0.0)
    core.step()  # a is prefilled (10 tokens, 1 sampled), b waits (max_running_requests=1)
    rep = core.load_report()
    assert (rep["num_running"], rep["num_waiting"], rep["queued_prefill_tokens"]) == (1, 1, 7)
    assert rep["kv_usage"] > 0
