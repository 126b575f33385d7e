"""The weights-update process group: a trainer broadcasts new weights from its rank 0 into the engine
(SGLang's ``init_weights_update_group`` / ``update_weights_from_distributed`` /
``destroy_weights_update_group``), with torch.distributed's gloo backend on CPU (NCCL between GPUs is
not built yet: refused).

The engine joins as rank ``rank_offset`` of a ``world_size`` group whose rank 0 is the trainer and
whose store is at ``master_address:master_port`` (rank 0 hosts it). One broadcast per tensor, from
rank 0, in the order of the update's ``names``. Every collective is bounded by the group's timeout, and
a peer that dies mid-broadcast makes the receive fail (gloo: the connection closes): the engine then
reports the error, keeps its old weights and drops the broken group.

The group is torch.distributed's default group of the engine-core process (the engine itself runs no
collective), so one group at a time.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from idleless.rl.shm import parse_dtype


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to join: store address and port, this process's rank, the group's size, its name
    (an update names the group it uses), the backend (``gloo``) and the timeout of every
    collective and of the rendezvous, in seconds."""

    master_address: str
    master_port: int
    rank: int
    world_size: int
    group_name: str = "weights_update_group"
    backend: str = "gloo"
    timeout_s: float = 300.0

    def check(self) -> None:
        """ValueError for a rank outside the group, a port outside 1..65535, a backend other than gloo
        or a timeout that is not > 0."""
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")
        if not (0 < self.master_port < 65536):
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if self.backend != "gloo":
            raise ValueError(f"backend must be gloo (tensors are received on the CPU; NCCL between GPUs is not "
                             f"built yet), got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")


class WeightsUpdateGroup:
    """A joined weights-update group (either side). ``join`` blocks until all ``world_size`` ranks
    joined or the timeout passes (RuntimeError then, nothing left initialised)."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec

    @classmethod
    def join(cls, spec: GroupSpec) -> "WeightsUpdateGroup":
        import torch.distributed as dist
        spec.check()
        if dist.is_initialized():
            raise ValueError("this process is already in a weights-update group; destroy it first")
        try:
            dist.init_process_group(spec.backend, init_method=f"tcp://{spec.master_address}:{spec.master_port}",
                                    world_size=spec.world_size, rank=spec.rank,
                                    timeout=datetime.timedelta(seconds=spec.timeout_s))
        except Exception as e:  # noqa: BLE001 - rendezvous timeout, refused connection, bad address
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RuntimeError(f"could not join the weights-update group at {spec.master_address}:"
                               f"{spec.master_port}: {type(e).__name__}: {e}") from None
        return cls(spec)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Trainer side (rank 0): send each tensor, in order. The engine must be told the same names,
        dtypes and shapes (``update_weights_from_distributed``)."""
        import torch.distributed as dist
        for _, t in named_tensors:
            dist.broadcast(t.detach().contiguous(), src=0)

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
                ) -> list[tuple[str, torch.Tensor]]:
        """Engine side: receive one broadcast per name into new CPU tensors of its dtype and shape.
        Raises ValueError for lists of different lengths or an unknown dtype (before any receive);
        RuntimeError when a collective fails (a peer died, the timeout passed)."""
        import torch.distributed as dist
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                             f"{len(shapes)})")
        bufs = [(n, torch.empty(tuple(int(d) for d in s), dtype=parse_dtype(dt))) for n, dt, s in
                zip(names, dtypes, shapes)]
        try:
            for _, t in bufs:
                dist.broadcast(t, src=0)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
            raise RuntimeError(f"the weights broadcast failed: {type(e).__name__}: {e}") from None
        return bufs

    def destroy(self) -> None:
        """Leave the group (safe to call on a broken one)."""
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group still has to go
                pass
