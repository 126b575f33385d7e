"""Weight updates of a running engine core, applied between two steps (SGLang's update_weights_* verbs).

``WeightUpdater`` is attached to an ``EngineCore`` and owns its weight version (SGLang's
``weight_version``, "default" until an update names one). An update is:

1. read and check everything (``read_checkpoint`` for a directory; ``WeightUpdater.check``: the by-name
   loader's first half checks every name, shape and dtype), so a bad update leaves the old weights serving;
2. write them through the by-name loader's second half (``weights.write_weights``), which then
   re-processes every linear method (re-packed copies follow the new weights);
3. empty the prefix cache unless ``flush_cache=False`` (KV computed with the old weights is never reused).

A self-draft (the ``draft`` proposer drafting with the target model's own weights at a lower precision,
``--speculative-draft-weight-dtype`` without a draft path) gets the same tensors, checked and written
alongside (its quantised copies re-made), and its own prefix cache emptied with the target's: it keeps
drafting the served policy (a stale draft would only lower the acceptance rate).

The caller picks the moment: the engine-core loop and the offline ``Engine`` run an update only while
no step is in progress, and with ``flush_cache`` only once the core is idle (``abort_all`` empties it
first). Nothing here touches the scheduler's queues except through ``EngineCore.abort``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional

import torch

from idleless.errors import RequestError
from idleless.model.weights import WeightWrites, plan_weight_writes, write_weights

# ModelConfig fields two checkpoints must share for one to replace the other's weights in place
_SAME_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                      "attention_bias", "rms_norm_eps", "rope_theta", "rope_scaling", "sliding_window",
                      "hidden_act")


class WeightUpdateError(RequestError):
    """A refused weight update (the caller's fault: unreadable path, missing or unknown tensor, wrong
    shape or dtype, a model of another shape). Nothing was written: the old weights keep serving."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message, param=param, code="invalid_weight_update")


class PlannedWrites(NamedTuple):
    """A checked update: the target model's writes and, for a self-draft, the draft model's (else None);
    ``release``: called once they are written (the source tensors' ``release``, e.g. a received
    update's staging buffer given back to its group), else None."""

    target: WeightWrites
    draft: Optional[WeightWrites]
    release: Optional[Callable[[], None]] = None


def self_draft(core):
    """``core``'s draft proposer (``idleless.spec.draft.DraftModelProposer``, unwrapped from the adaptive
    wrapper) when it drafts with the target's own weights (no draft model path), else None."""
    proposer = getattr(core, "proposer", None)
    proposer = getattr(proposer, "inner", proposer)
    cfg = getattr(proposer, "config", None)
    if getattr(proposer, "name", None) != "draft" or cfg is None or cfg.speculative_draft_model_path:
        return None
    return proposer


@dataclass(frozen=True)
class UpdateResult:
    """What an applied update reports: the weight version now, tensors written, whether the prefix
    cache was emptied, requests aborted for it, and the seconds spent writing and re-processing."""

    weight_version: str
    num_tensors: int
    flushed_cache: bool
    num_aborted: int
    seconds: float

    def as_dict(self) -> dict:
        return {"success": True, "message": f"updated {self.num_tensors} tensors", "weight_version":
                self.weight_version, "num_tensors": self.num_tensors, "flushed_cache": self.flushed_cache,
                "num_aborted_requests": self.num_aborted, "seconds": round(self.seconds, 6)}


def read_checkpoint(model_path: str, runner) -> dict[str, torch.Tensor]:
    """All tensors of the HF model directory (or GGUF file) ``model_path``, cast to the runner's dtype,
    after checking that its config.json describes a model of the same shape as the one served.

    Raises WeightUpdateError (param ``model_path``) for a path that cannot be read or converted, a
    checkpoint lacking tensors, or a config of another architecture or size."""
    from idleless.model.loader import load_model_config, load_state_dict, prepare_model_dir
    try:
        model_dir = prepare_model_dir(model_path)
        new = load_model_config(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise WeightUpdateError(f"cannot read the model at {model_path!r}: {e}", param="model_path") from None
    cur = runner.model_config
    diff = [f"{f}: {getattr(new, f)!r} (served: {getattr(cur, f)!r})" for f in _SAME_SHAPE_FIELDS
            if getattr(new, f, None) != getattr(cur, f, None)]
    if diff:
        raise WeightUpdateError(f"the model at {model_path!r} is not the served model's shape: " + "; ".join(diff),
                                param="model_path")
    try:
        return load_state_dict(model_dir, runner.dtype)
    except (OSError, ValueError) as e:
        raise WeightUpdateError(f"cannot read the weights at {model_path!r}: {e}", param="model_path") from None


class WeightUpdater:
    """Applies weight updates to ``core`` (an ``EngineCore``) and keeps its weight version.

    ``weight_version``: a label the caller chooses (SGLang's), "default" at start-up, replaced by each
    update that names one."""

    def __init__(self, core):
        self.core = core

    @property
    def weight_version(self) -> str:
        """The core's (``EngineCore.weight_version``, stamped on its outputs)."""
        return self.core.weight_version

    def abort_all(self) -> int:
        """Abort every waiting and running request (each reported with finish_reason ``abort`` at the
        core's next step, its KV freed now). Returns how many."""
        sched = self.core.scheduler
        rids = [r.rid for r in list(sched.waiting) + list(sched.running)]
        for rid in rids:
            self.core.abort(rid)
        return len(rids)

    def check(self, named_tensors: Iterable[tuple[str, torch.Tensor]], require_all: bool = False) -> PlannedWrites:
        """Check HF-named tensors against the served model (and a self-draft's), writing nothing
        (``plan_weight_writes``): a subset updates those parameters only; ``require_all`` requires every
        one, as a whole checkpoint must. Raises WeightUpdateError for an unknown name, a name twice, a
        tensor that is not floating point or of another shape, or (require_all) a missing tensor.

        ``named_tensors`` may have a ``release()`` (``idleless.rl.distributed.ReceivedTensors``): it is
        called on a refusal here, else by ``commit`` once written."""
        release = getattr(named_tensors, "release", None)
        try:
            return PlannedWrites(*self._plan(list(named_tensors), require_all), release)
        except BaseException:
            if release is not None:
                release()
            raise

    def _plan(self, named_tensors: list, require_all: bool) -> tuple[WeightWrites, Optional[WeightWrites]]:
        if getattr(self.core.runner, "tp", None) is not None:  # each rank holds a piece; rank 0 alone would change
            raise WeightUpdateError("weight updates are not supported with --tp-size > 1: every rank holds its own "
                                    "piece of the weights and an update reaches rank 0 only")
        draft = self_draft(self.core)
        try:
            return (plan_weight_writes(self.core.runner.model, named_tensors, require_all=require_all),
                    None if draft is None else
                    plan_weight_writes(draft.runner.model, named_tensors, require_all=require_all))
        except ValueError as e:
            raise WeightUpdateError(f"weight update refused, the old weights keep serving: {e}") from None

    def commit(self, planned: PlannedWrites, *, flush_cache: bool = True, weight_version: Optional[str] = None,
               num_aborted: int = 0) -> UpdateResult:
        """Write a checked update (``check``) and re-process every linear method, then empty the prefix
        cache unless ``flush_cache`` is False, then take ``weight_version`` if given.

        Call between steps; with ``flush_cache`` only while no request runs (the cache holds KV of
        running requests otherwise; waiting ones, never admitted or retracted, hold none):
        RuntimeError, nothing written, if requests run."""
        sched = self.core.scheduler
        if flush_cache and sched.running:
            raise RuntimeError("a weight update that flushes the cache must run while no request runs")
        t0 = time.perf_counter()
        runner = self.core.runner
        runner.prepacked_bytes = write_weights(runner.model, planned.target)
        draft = self_draft(self.core)
        if planned.draft is not None and draft is not None:
            draft.runner.prepacked_bytes = write_weights(draft.runner.model, planned.draft)
        if planned.release is not None:
            planned.release()
        if flush_cache:
            sched.cache.reset()
            if draft is not None:
                draft.kv.cache.reset()
        if weight_version is not None:
            self.core.weight_version = str(weight_version)
        return UpdateResult(self.weight_version, len(planned.target), flush_cache, num_aborted, time.perf_counter() - t0)
