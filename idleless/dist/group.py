"""The tensor-parallel process group: a private torch.distributed group (gloo on CPU, NCCL on CUDA)
built from a TCP store that rank 0 hosts, so an engine in a process that already uses
torch.distributed (a trainer) keeps its own default group. Every collective runs under the group's
timeout: a hung peer ends in an error, never a hang; a dead peer (closed connection) errors at once.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, failed to start, or a collective failed: the engine cannot go on."""


#: how long one collective (or the group's rendezvous) may wait for the other ranks, seconds
COLLECTIVE_TIMEOUT_S = 120.0


def host_store(size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on 127.0.0.1 at a free port (``store.port``) for ``size`` ranks."""
    return dist.TCPStore("127.0.0.1", 0, size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TPGroup:
    """One rank's view of the tensor-parallel group: ``rank`` in [0, ``size``). Made unconnected (the
    model can be sharded and loaded first); ``connect`` joins the other ranks. Collectives work on
    tensors of any float dtype the backend supports (gloo: float32, bfloat16, float16)."""

    def __init__(self, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        self.rank, self.size = rank, size
        self.pg: Optional[dist.ProcessGroup] = None

    def connect(self, store: dist.Store, device: str = "cpu", timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Join the group through ``store`` (``host_store``'s on rank 0, a client of it elsewhere);
        blocks until every rank joined. Raises RuntimeError (a rank missing after ``timeout_s``)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore("idleless-tp", store)
        if device.startswith("cuda"):  # untested here (no GPU on the 2-core CPU machine)
            torch.cuda.set_device(torch.device(device))
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``. Raises TensorParallelError when a rank is
        gone or does not join within the timeout."""
        try:
            self.pg.allreduce([t]).wait()
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel all_reduce failed (a rank died or timed out): {e}") from e
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` [R, C] side by side along the last dim: [R, size * C], rank order. Raises
        TensorParallelError as ``all_reduce``."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        try:
            self.pg.allgather([parts], [t]).wait()
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel all_gather failed (a rank died or timed out): {e}") from e
        return torch.cat(parts, dim=-1)
