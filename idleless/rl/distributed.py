"""The weights-update process group: a trainer broadcasts new weights from its rank 0 into the engine
(SGLang's ``init_weights_update_group`` / ``update_weights_from_distributed`` /
``destroy_weights_update_group``), with torch.distributed's gloo backend on CPU (NCCL between GPUs is
not built yet: refused).

The engine joins as rank ``rank_offset`` of a ``world_size`` group whose rank 0 is the trainer and
whose store is at ``master_address:master_port`` (rank 0 hosts it). Every collective is bounded by the
group's timeout, and a peer that dies mid-broadcast makes the receive fail (gloo: the connection
closes): the engine then reports the error, keeps its old weights and drops the broken group.

Wire format of one update (``names``, ``dtypes``, ``shapes`` announced first, in this order):

* per tensor (``bucket_bytes`` 0, SGLang's default): one broadcast per tensor, of its dtype and shape;
* flattened buckets (``bucket_bytes`` > 0, SGLang's ``load_format="flattened_bucket"`` split into
  several broadcasts): ``plan_buckets`` groups consecutive tensors of one dtype into buckets of at
  most ``bucket_bytes`` (a larger tensor alone), and each bucket is one broadcast of a 1-D tensor of
  that dtype holding its tensors' elements back to back, in order, without padding. Both sides compute
  the same plan from the announcement. A bucket of everything (``bucket_bytes`` at least the total) is
  SGLang's single flattened tensor.

Both sides post every broadcast at once (``async_op``) and then wait for all, so no broadcast waits
for the previous one's round trip, and the trainer flattens bucket i+1 while bucket i is on the wire.
The engine receives into one reused staging buffer (``StagingBuffer``: no fresh pages to fault in for
each push), handed out with the received tensors and given back by ``ReceivedTensors.release`` once
they are written into the model; the trainer flattens into its own reused buffer.

The group is torch.distributed's default group of the engine-core process (the engine itself runs no
collective), so one group at a time.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

import torch

from idleless.rl.shm import parse_dtype

ALIGN = 64  # byte alignment of every bucket in a staging buffer


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


class Bucket(NamedTuple):
    """One broadcast: tensors ``start`` to ``stop - 1`` of the update, all of ``dtype``, flattened back
    to back; ``numels`` are their element counts (the bucket holds ``sum(numels)`` elements)."""

    dtype: torch.dtype
    start: int
    stop: int
    numels: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.numels) * self.dtype.itemsize


def plan_buckets(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], bucket_bytes: int) -> list[Bucket]:
    """The broadcasts of an update (the wire format above): consecutive tensors of one dtype share a
    bucket while it stays within ``bucket_bytes`` (a tensor larger than that gets a bucket of its own);
    ``bucket_bytes`` 0 gives one bucket per tensor. ValueError for a negative ``bucket_bytes`` or
    dimension, or lists of different lengths."""
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    if len(dtypes) != len(shapes):
        raise ValueError(f"{len(dtypes)} dtypes for {len(shapes)} shapes")
    buckets: list[Bucket] = []
    start, numels, total = 0, [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"tensor {i} has a negative dimension: {list(shape)}")
        n = math.prod(int(d) for d in shape)
        if numels and not (dtype == dtypes[start] and (total + n) * dtype.itemsize <= bucket_bytes):
            buckets.append(Bucket(dtypes[start], start, i, tuple(numels)))
            start, numels, total = i, [], 0
        numels.append(n)
        total += n
    if numels:
        buckets.append(Bucket(dtypes[start], start, len(dtypes), tuple(numels)))
    return buckets


def _offsets(buckets: Sequence[Bucket]) -> tuple[list[int], int]:
    """Each bucket's byte offset in a staging buffer (``ALIGN``-aligned) and the buffer's size."""
    offsets, end = [], 0
    for b in buckets:
        offsets.append(end)
        end += -(-b.nbytes // ALIGN) * ALIGN
    return offsets, end


class StagingBuffer:
    """One reusable uint8 CPU buffer, lent to one update at a time. ``take(n)`` lends the buffer when
    it is free and large enough, else a new one of ``n`` bytes becomes the buffer (one still lent stays
    with its borrower, who may keep it); ``give_back`` makes it free again, ``drop`` forgets it."""

    def __init__(self):
        self.buf: Optional[torch.Tensor] = None
        self.lent = False

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.lent or self.buf.numel() < nbytes:
            self.buf = None  # let a free one go before allocating its successor
            self.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.lent = True
        return self.buf

    def give_back(self, buf: torch.Tensor) -> None:
        if buf is self.buf:
            self.lent = False

    def drop(self) -> None:
        self.buf, self.lent = None, False


class ReceivedTensors(list):
    """The (name, tensor) pairs of one received update: views of a staging buffer. Call ``release()``
    once nothing reads them any more (written into the model, or refused), so the next update may
    receive into the same buffer; until then the next one gets a new buffer."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], staging: StagingBuffer, buf: torch.Tensor):
        super().__init__(pairs)
        self._staging, self._buf = staging, buf

    def release(self) -> None:
        if self._buf is not None:
            self._staging.give_back(self._buf)
            self._buf = None


def _wait_all(works) -> Optional[BaseException]:
    """Wait for every posted collective (so none writes into a buffer after this returns); the first
    error, if any."""
    error = None
    for w in works:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
            error = error or e
    return error


class WeightsUpdateGroup:
    """A joined weights-update group (either side). ``join`` blocks until all ``world_size`` ranks
    joined or the timeout passes (RuntimeError then, nothing left initialised)."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.staging = StagingBuffer()  # engine: received updates; trainer: flattened buckets

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

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 0) -> None:
        """Trainer side (rank 0): send the tensors in order, one broadcast per tensor (``bucket_bytes``
        0) or per flattened bucket (``plan_buckets``). The engine must be told the same names, dtypes,
        shapes and ``bucket_bytes`` (``update_weights_from_distributed``). Tensors are sent in their
        own dtype (cast them to the served dtype first to halve a float32 -> bfloat16 push). Raises
        RuntimeError when a broadcast fails (the engine died, the timeout passed)."""
        import torch.distributed as dist
        tensors = [t.detach() for _, t in named_tensors]
        buckets = plan_buckets([t.dtype for t in tensors], [t.shape for t in tensors], bucket_bytes)
        works, flat, error = [], None, None
        if any(b.stop - b.start > 1 for b in buckets):
            offsets, size = _offsets(buckets)
            flat = self.staging.take(size)
        try:
            for k, b in enumerate(buckets):
                if b.stop - b.start == 1:
                    out = tensors[b.start].contiguous()
                else:  # flattened while the buckets before it are on the wire
                    out = flat[offsets[k]:offsets[k] + b.nbytes].view(b.dtype)
                    pos = 0
                    for t, n in zip(tensors[b.start:b.stop], b.numels):
                        out[pos:pos + n].view(t.shape).copy_(t)
                        pos += n
                works.append(dist.broadcast(out, src=0, async_op=True))
        except Exception as e:  # noqa: BLE001 - posting failed (the group is broken)
            error = e
        waited = _wait_all(works)  # every one, so none writes after this returns
        error = error or waited
        if flat is not None:
            self.staging.give_back(flat)
        if error is not None:
            raise RuntimeError(f"the weights broadcast failed: {type(error).__name__}: {error}") from None

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                bucket_bytes: int = 0) -> ReceivedTensors:
        """Engine side: receive an update sent by ``broadcast`` with the same ``bucket_bytes``, as
        (name, tensor of that dtype and shape) pairs viewing this group's staging buffer (call
        ``release()`` on the result once written). Raises ValueError for lists of different lengths, an
        unknown dtype, a negative dimension or ``bucket_bytes`` (before any receive); RuntimeError when a
        collective fails (a peer died, the timeout passed; the buffer is dropped)."""
        import torch.distributed as dist
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                             f"{len(shapes)})")
        parsed = [parse_dtype(d) for d in dtypes]
        shapes = [tuple(int(d) for d in s) for s in shapes]
        buckets = plan_buckets(parsed, shapes, int(bucket_bytes))
        offsets, size = _offsets(buckets)
        buf = self.staging.take(size)
        pairs, works, error = [], [], None
        try:
            for b, off in zip(buckets, offsets):
                flat = buf[off:off + b.nbytes].view(b.dtype)
                works.append(dist.broadcast(flat, src=0, async_op=True))
                pos = 0
                for i, n in zip(range(b.start, b.stop), b.numels):
                    pairs.append((names[i], flat[pos:pos + n].view(shapes[i])))
                    pos += n
        except Exception as e:  # noqa: BLE001 - posting failed (the group is broken)
            error = e
        waited = _wait_all(works)  # every one, so none writes after this returns
        error = error or waited
        if error is not None:
            self.staging.drop()
            raise RuntimeError(f"the weights broadcast failed: {type(error).__name__}: {error}") from None
        return ReceivedTensors(pairs, self.staging, buf)

    def destroy(self) -> None:
        """Leave the group (safe to call on a broken one) and free its staging buffer."""
        import torch.distributed as dist
        self.staging.drop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group still has to go
                pass
