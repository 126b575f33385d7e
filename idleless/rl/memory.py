"""Memory hand-off to a trainer on the same machine (SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``): the engine gives back the memory of its KV cache and/or its weights
while the trainer needs it, and takes it again before serving.

``MemoryOccupation(core).release(tags)`` frees the storage of every tensor of a tag in place
(``UntypedStorage.resize_(0)``): the tensors, and every view of them the attention backends and
kernels keep, stay the same objects, so nothing has to be rebuilt; ``resume(tags)`` gives each storage
its bytes back, zero-filled. Tags: ``kv_cache`` (the KV pool, scales included; the prefix cache is
emptied first) and ``weights`` (every parameter and what the linear methods derived from it:
prepacked, quantised copies). After resuming ``weights`` they are zeros: the trainer pushes the
weights again (as in SGLang), which also rebuilds the derived copies.

While a tag is released the engine runs no step (``EngineCoreLoop`` holds arriving requests), and
a weight update is refused while ``weights`` is released.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from idleless.errors import RequestError

TAGS = ("kv_cache", "weights")
#: attributes of a module that hold a weight or a copy derived from it (linear methods' prepacking)
_WEIGHT_ATTRS = ("weight", "bias", "packed", "amx", "bi")


class MemoryOccupationError(RequestError):
    """A release or resume that cannot be done now (requests in flight, an unknown tag): nothing changed."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message, code="invalid_request", param=param)


def check_tags(tags: Optional[Iterable[str]]) -> list[str]:
    """The tags asked for, in ``TAGS`` order; None or empty means all. MemoryOccupationError for an unknown one."""
    if not tags:
        return list(TAGS)
    tags = list(tags)
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise MemoryOccupationError(f"unknown tags {unknown}: the tags are {list(TAGS)}", param="tags")
    return [t for t in TAGS if t in tags]


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (st, st.nbytes())
    return list(seen.values())


class MemoryOccupation:
    """Release / resume of one ``EngineCore``'s KV cache and weights (module docstring).
    ``released``: the tags released now."""

    def __init__(self, core):
        self.core = core
        self._held: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}

    @property
    def released(self) -> frozenset:
        return frozenset(self._held)

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        if tag == "kv_cache":
            pool = self.core.runner.pool
            return [t for t in (pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale) if t is not None]
        out = []
        for m in self.core.runner.model.modules():
            out += [t for t in (getattr(m, a, None) for a in _WEIGHT_ATTRS) if isinstance(t, torch.Tensor)]
            quant = getattr(m, "quant", None)
            if isinstance(quant, dict):
                out += [t for t in quant.values() if isinstance(t, torch.Tensor)]
        return out

    def release(self, tags: Optional[Iterable[str]] = None) -> int:
        """Free the memory of ``tags`` (default all; a tag released already is skipped). Returns the bytes
        freed. MemoryOccupationError (nothing freed) while requests wait or run in the core."""
        tags = check_tags(tags)
        sched = self.core.scheduler
        if sched.running or sched.waiting or self.core.kv_connector.has_work():
            raise MemoryOccupationError("requests are in flight: let them finish, or pause_generation with "
                                        "mode abort or retract, before releasing memory")
        freed = 0
        for tag in tags:
            if tag in self._held:
                continue
            if tag == "kv_cache":
                sched.cache.reset()  # its KV is about to go
                self.core.runner.pool.free_epoch += 1  # kept packed segments of the old contents are stale
            storages = _unique_storages(self._tensors(tag))
            for st, n in storages:
                st.resize_(0)
                freed += n
            self._held[tag] = storages
        return freed

    def resume(self, tags: Optional[Iterable[str]] = None) -> int:
        """Give ``tags`` (default all; one not released is skipped) their memory back, zero-filled.
        Returns the bytes taken. Weights are zeros until the next weight update."""
        taken = 0
        for tag in check_tags(tags):
            for st, n in self._held.pop(tag, []):
                st.resize_(n)
                st.fill_(0)
                taken += n
        return taken
