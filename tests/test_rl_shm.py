"""The tensor path's shared-memory file (idleless.rl.shm) and the update group's argument checks: a round
trip gives back the very bits written (every weight dtype), a rewrite in place replaces them, and every
handle that does not describe the file (another path, a misaligned or out-of-range tensor, an unknown
dtype) is refused before anything is read."""

from __future__ import annotations

import os

import pytest
import torch

from idleless.rl.distributed import GroupSpec
from idleless.rl.shm import SharedTensors, TensorSpec, open_shared, shm_dir


def test_round_trip_and_rewrite_keep_the_bits():
    g = torch.Generator().manual_seed(0)
    items = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.randn(2, 2, generator=g, dtype=torch.float64)), ("d", torch.randn(1, generator=g).half()),
             ("e", torch.randn(4, 6, generator=g)[:, ::2])]  # not contiguous
    with SharedTensors.create(items) as shared:
        got = open_shared(shared.path, shared.specs)
        assert [n for n, _ in got] == [n for n, _ in items]
        for (_, x), (_, y) in zip(items, got):
            assert x.dtype == y.dtype and torch.equal(x, y)
        new = [(n, t + 1) for n, t in items]
        assert shared.matches(new) and not shared.matches(new[:-1])
        shared.write(new)
        for (_, x), (_, y) in zip(new, open_shared(shared.path, shared.specs)):
            assert torch.equal(x, y)
        with pytest.raises(ValueError):
            shared.write([(n, t.float()) for n, t in items])  # other dtypes
        path = shared.path
    assert not os.path.exists(path)


def test_bad_handles_are_refused():
    with SharedTensors.create([("w", torch.ones(16))]) as shared:
        spec = shared.specs[0]
        for bad in (TensorSpec("w", "float32", (16,), 4),  # misaligned
                    TensorSpec("w", "float32", (17,), 0),  # past the end
                    TensorSpec("w", "int64", (8,), 0),  # not a weight dtype
                    TensorSpec("w", "float32", (-1,), 0)):
            with pytest.raises(ValueError):
                open_shared(shared.path, [bad])
        for path in ("/etc/passwd", os.path.join(shm_dir(), "idleless-shm-missing"),
                     os.path.join(shm_dir(), "..", os.path.basename(shared.path))):
            with pytest.raises(ValueError):
                open_shared(path, [spec])
    with pytest.raises(ValueError):
        SharedTensors.create([("i", torch.ones(2, dtype=torch.int32))])


@pytest.mark.parametrize("kw", [dict(rank=2), dict(rank=-1), dict(master_port=0), dict(backend="nccl"),
                                dict(timeout_s=0.0)])
def test_group_spec_checks(kw):
    args = dict(master_address="127.0.0.1", master_port=29500, rank=1, world_size=2)
    GroupSpec(**args).check()
    with pytest.raises(ValueError):
        GroupSpec(**{**args, **kw}).check()
