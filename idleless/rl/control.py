"""The engine core's side of the weight-update verbs (``idleless.engine.messages``): turn a verb into a
checked update now, commit it later (between steps), and keep the weights-update group.

``WeightControl.prepare(verb)`` reads (disk), maps (shared memory) or receives (broadcast) the tensors
and checks them against the model, writing nothing: any refusal (``WeightUpdateError``) happens here,
before the caller aborts or waits for anything. ``commit(pending)`` writes them
(``WeightUpdater.commit``). The engine-core loop and the offline ``Engine`` decide when to commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from idleless.engine.messages import (DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, UpdateWeightsFromDisk,
                                      UpdateWeightsFromDistributed, UpdateWeightsFromTensor)
from idleless.rl.distributed import GroupSpec, WeightsUpdateGroup
from idleless.rl.shm import TensorSpec, open_shared
from idleless.rl.updates import PlannedWrites, UpdateResult, WeightUpdateError, WeightUpdater, read_checkpoint


@dataclass
class PendingUpdate:
    """A checked update waiting for its moment: what to write, and the verb's options."""

    planned: PlannedWrites
    flush_cache: bool
    weight_version: Optional[str]
    num_aborted: int = 0


class WeightControl:
    """Weight updates of one ``EngineCore``: its ``updater`` (weight version included) and the joined
    weights-update ``group`` (None when none)."""

    def __init__(self, core):
        self.core = core
        self.updater = WeightUpdater(core)
        self.group: Optional[WeightsUpdateGroup] = None

    @property
    def weight_version(self) -> str:
        return self.updater.weight_version

    def prepare(self, verb) -> PendingUpdate:
        """A checked update for an ``UpdateWeightsFromDisk`` (every weight required),
        ``UpdateWeightsFromTensor`` or ``UpdateWeightsFromDistributed`` verb (subsets allowed).
        Raises WeightUpdateError (nothing written) for anything that does not fit."""
        if isinstance(verb, UpdateWeightsFromDisk):
            tensors, require_all = read_checkpoint(verb.model_path, self.core.runner).items(), True
        elif isinstance(verb, UpdateWeightsFromTensor):
            try:
                specs = [s if isinstance(s, TensorSpec) else TensorSpec(**s) for s in verb.tensors]
                tensors, require_all = open_shared(verb.shm_path, specs), False
            except (TypeError, ValueError, RuntimeError) as e:
                raise WeightUpdateError(f"cannot map the shared tensors: {e}", param="shm_path") from None
        elif isinstance(verb, UpdateWeightsFromDistributed):
            tensors, require_all = self._receive(verb), False
        else:
            raise TypeError(f"not a weight update verb: {type(verb).__name__}")
        return self.check(tensors, require_all, verb.flush_cache, verb.weight_version)

    def check(self, named_tensors, require_all: bool = False, flush_cache: bool = True,
              weight_version: Optional[str] = None) -> PendingUpdate:
        """A checked update of (HF name, tensor) pairs (``WeightUpdater.check``); WeightUpdateError
        when they do not fit the model."""
        return PendingUpdate(self.updater.check(named_tensors, require_all), flush_cache, weight_version)

    def _receive(self, verb: UpdateWeightsFromDistributed):
        group = self._group(verb.group_name)
        try:
            return group.receive(verb.names, verb.dtypes, verb.shapes)
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None
        except RuntimeError as e:  # the group is broken: drop it, so a new one can be joined
            group.destroy()
            self.group = None
            raise WeightUpdateError(f"{e}; the weights-update group {verb.group_name!r} was destroyed") from None

    def commit(self, pending: PendingUpdate) -> UpdateResult:
        """Write a prepared update (between steps; with ``flush_cache`` only once no request runs)."""
        return self.updater.commit(pending.planned, flush_cache=pending.flush_cache,
                                   weight_version=pending.weight_version, num_aborted=pending.num_aborted)

    def init_group(self, verb: InitWeightsUpdateGroup) -> bool:
        """Join the trainer's group (blocks until every rank joined or the timeout). Raises
        WeightUpdateError when a group is joined already, the arguments are bad or the rendezvous fails."""
        if self.group is not None:
            raise WeightUpdateError(f"already in the weights-update group {self.group.spec.group_name!r}; "
                                    "destroy it first", param="group_name")
        spec = GroupSpec(verb.master_address, int(verb.master_port), int(verb.rank_offset), int(verb.world_size),
                         verb.group_name, verb.backend, float(verb.timeout_s))
        try:
            self.group = WeightsUpdateGroup.join(spec)
        except (ValueError, RuntimeError) as e:
            raise WeightUpdateError(str(e)) from None
        return True

    def destroy_group(self, verb: DestroyWeightsUpdateGroup) -> bool:
        """Leave the group ``verb.group_name``; WeightUpdateError when no such group is joined."""
        self._group(verb.group_name).destroy()
        self.group = None
        return True

    def _group(self, name: str) -> WeightsUpdateGroup:
        if self.group is None or self.group.spec.group_name != name:
            raise WeightUpdateError(f"no weights-update group named {name!r} (init_weights_update_group first)",
                                    param="group_name")
        return self.group
