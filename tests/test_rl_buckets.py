"""The distributed weight push's wire format and receive buffer (idleless.rl.distributed): the bucket plan
against hand-worked partitions, and a real two-process gloo group in which a trainer broadcasts updates
of mixed dtypes per tensor and in flattened buckets of several sizes; the engine side must get the very
bits sent (the independent reference: the trainer's tensors, rebuilt from the same seed), reuse its
staging buffer only once an update was released (an update held unreleased keeps its values while the
next one arrives), and end in a RuntimeError, not a hang, when the trainer dies mid-update.
"""

from __future__ import annotations

import multiprocessing
import os
import queue

import pytest
import torch

from idleless.rl.distributed import Bucket, GroupSpec, StagingBuffer, WeightsUpdateGroup, plan_buckets
from idleless.rl.shm import dtype_name
from idleless.rl.trainer import free_port

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TIMEOUT_S = 30.0  # every collective and the rendezvous; the process joins wait a little longer


def test_plan_buckets_by_hand():
    dtypes = [F32, F32, F32, BF16, BF16, F32]
    shapes = [(4, 2), (3,), (100,), (2, 2), (5,), ()]
    # 0 bytes: the per-tensor wire, one broadcast each
    assert [(b.start, b.stop) for b in plan_buckets(dtypes, shapes, 0)] == [(i, i + 1) for i in range(6)]
    # 48 bytes: 8 + 3 float32 = 44 bytes fit, the 400-byte tensor is alone, bfloat16 4 + 5 = 18 bytes, the
    # last float32 scalar starts a bucket of its own (dtype change)
    assert plan_buckets(dtypes, shapes, 48) == [Bucket(F32, 0, 2, (8, 3)), Bucket(F32, 2, 3, (100,)),
                                                Bucket(BF16, 3, 5, (4, 5)), Bucket(F32, 5, 6, (1,))]
    # everything fits: one bucket per run of one dtype (SGLang's single flattened tensor for one dtype)
    assert [(b.dtype, b.start, b.stop) for b in plan_buckets(dtypes, shapes, 1 << 40)] == [
        (F32, 0, 3), (BF16, 3, 5), (F32, 5, 6)]
    assert plan_buckets([F32, F32], [(0,), (2,)], 8) == [Bucket(F32, 0, 2, (0, 2))]
    assert plan_buckets([], [], 8) == []
    assert Bucket(BF16, 3, 5, (4, 5)).nbytes == 18
    for bad in (lambda: plan_buckets([F32], [(2,)], -1), lambda: plan_buckets([F32], [(2, -1)], 8),
                lambda: plan_buckets([F32], [], 8)):
        with pytest.raises(ValueError):
            bad()


def test_staging_buffer_is_lent_once():
    s = StagingBuffer()
    a = s.take(100)
    b = s.take(10)  # a is lent: a new buffer
    assert b.data_ptr() != a.data_ptr() and b.numel() == 10
    s.give_back(a)  # no longer the buffer: nothing happens
    assert s.lent
    s.give_back(b)
    assert s.take(8).data_ptr() == b.data_ptr()  # free and large enough: reused
    s.give_back(b)
    assert s.take(11).numel() == 11  # too small: replaced
    s.drop()
    assert s.buf is None and not s.lent


def update(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A trainer's update: mixed dtypes, a non-contiguous tensor, a zero-size one, a scalar."""
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(6, 5, generator=g)), ("b", torch.randn(33, generator=g)),
            ("c", torch.randn(4, 8, generator=g).to(BF16)), ("d", torch.randn(3, 7, generator=g).t()),
            ("e", torch.randn(0, 3, generator=g)), ("f", torch.randn(5, generator=g).half()),
            ("g", torch.randn((), generator=g)), ("h", torch.randn(300, generator=g))]


# (seed, bucket_bytes, released by the engine before the next one)
ROUNDS = [(1, 0, True), (2, 0, True), (3, 128, False), (4, 128, True), (5, 1 << 30, True), (6, 64, True)]
LAST_SEED = 7  # the trainer posts about half of it and dies


def _spec(port: int, rank: int) -> GroupSpec:
    return GroupSpec("127.0.0.1", port, rank, 2, timeout_s=TIMEOUT_S)


def _trainer(port: int) -> None:
    torch.set_num_threads(1)
    group = WeightsUpdateGroup.join(_spec(port, 0))
    for seed, bucket_bytes, _ in ROUNDS:
        group.broadcast(update(seed), bucket_bytes)
    items = update(LAST_SEED)
    group.broadcast(items[:4], 0)  # 4 of 8 per-tensor broadcasts, then the trainer dies
    os._exit(0)


def _engine(port: int, out) -> None:
    torch.set_num_threads(1)
    group = WeightsUpdateGroup.join(_spec(port, 1))
    results, held = [], None
    for seed, bucket_bytes, release in ROUNDS:
        ref = update(seed)
        got = group.receive([n for n, _ in ref], [dtype_name(t.dtype) for _, t in ref],
                            [list(t.shape) for _, t in ref], bucket_bytes)
        exact = [n == m and t.dtype == r.dtype and t.shape == r.shape and torch.equal(t, r)
                 for (n, t), (m, r) in zip(got, ref)]
        results.append((seed, all(exact) and len(got) == len(ref), group.staging.buf.data_ptr()))
        if held is not None:  # the update held unreleased is intact after the next receive
            results.append(("held", all(torch.equal(t, r) for (_, t), (_, r) in zip(*held)), 0))
            held = None
        if release:
            got.release()
        else:
            held = (got, ref)
    ref = update(LAST_SEED)
    try:
        group.receive([n for n, _ in ref], [dtype_name(t.dtype) for _, t in ref], [list(t.shape) for _, t in ref])
        results.append(("death", "no error", 0))
    except RuntimeError as e:
        results.append(("death", "RuntimeError" if "broadcast failed" in str(e) else str(e), 0))
    out.put(results)
    group.destroy()


def test_two_processes_round_trip_buckets_and_a_trainer_dying():
    ctx = multiprocessing.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(port,)), ctx.Process(target=_engine, args=(port, out))]
    for p in procs:
        p.start()
    try:
        results = out.get(timeout=3 * TIMEOUT_S + 60)
    except queue.Empty:
        pytest.fail("the engine side did not report within its timeouts")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    by_round = [r for r in results if isinstance(r[0], int)]
    assert [(seed, ok) for seed, ok, _ in by_round] == [(seed, True) for seed, _, _ in ROUNDS]
    ptrs = [ptr for _, _, ptr in by_round]
    # staging layouts (64-byte aligned buckets): 1856 bytes per tensor and in 128- or 64-byte buckets, 1728 in
    # one bucket per dtype run. Released rounds hand their buffer on; round 3 is held, so round 4 needs a new one
    assert ptrs[1] == ptrs[0] and ptrs[2] == ptrs[1] and ptrs[3] != ptrs[2] and ptrs[4] == ptrs[3] == ptrs[5]
    assert ("held", True, 0) in results
    assert results[-1] == ("death", "RuntimeError", 0)
