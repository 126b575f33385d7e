"""Weights loaded by name: any iterable of (checkpoint name, tensor) into a model's parameters.

The source does not matter (safetensors shards, a GGUF conversion, tensors from a trainer); start-up
and every later weight update go through ``load_weights`` (or its two halves: ``plan_weight_writes``
checks, ``write_weights`` writes, so an update can be checked now and written between two steps). The model maps each checkpoint name to one
of its parameters and a shard (``model.checkpoint_target(name)``: fused q/k/v and gate/up take their
pieces as shards, a tied lm_head is skipped); the parameter's own loader (``param.weight_loader``, e.g.
``linear.StackedShards``; by default the whole parameter) says which part of it a shard fills, as
nano-vllm's per-parameter ``weight_loader``. Every name and shape is checked before anything is
written, and after the write every linear method re-processes its layer (``process_linear_methods``),
so packed copies always follow the weights.
"""

from __future__ import annotations

from typing import Hashable, Iterable, NamedTuple, Optional

import torch
from torch import nn

from idleless.model.linear import process_linear_methods


class WholeParameter:
    """The default per-parameter loader: one checkpoint tensor fills the whole parameter."""

    shards = (None,)

    @staticmethod
    def view(param: torch.Tensor, shard: Optional[Hashable]) -> torch.Tensor:
        if shard is not None:
            raise ValueError(f"shard {shard!r} given for a parameter loaded whole")
        return param.data


class WeightWrites(NamedTuple):
    """A checked weight change: (destination view of a parameter, source tensor) pairs, ready to write."""

    writes: list[tuple[torch.Tensor, torch.Tensor]]

    def __len__(self) -> int:
        return len(self.writes)


def plan_weight_writes(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       require_all: bool = False) -> WeightWrites:
    """Check (checkpoint name, tensor) pairs against ``model`` and say where each goes, writing nothing.

    Args:
        model: a module with ``checkpoint_target(name) -> (parameter name, shard id) | None`` (None: a
            tensor the model does not use, skipped), e.g. ``LlamaForCausalLM``.
        named_tensors: HF-named floating-point tensors of the parameters' shapes (any dtype and
            device: cast on the write). A subset is fine (a partial update); all of them are held until
            written, so an iterator over shards is read whole first.
        require_all: also require every parameter (every shard of a fused one) to be given (start-up,
            a whole checkpoint).

    Returns:
        WeightWrites for ``write_weights``.

    Raises:
        ValueError: a name the model has no parameter for, a name given twice, a tensor that is not
            floating point or whose shape differs from its target's, or (require_all) parameters left
            unset. The message names the tensor.
    """
    params = dict(model.named_parameters())  # a shared (tied) parameter appears once
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[str] = set()
    filled: set[tuple[str, Hashable]] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"weight {name!r} given twice")
        seen.add(name)
        target = model.checkpoint_target(name)
        if target is None:
            continue
        pname, shard = target
        param = params.get(pname)
        if param is None:
            raise ValueError(f"unknown weight {name!r}: the model has no parameter for it")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"weight {name!r} must be a floating-point tensor, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        dest = getattr(param, "weight_loader", WholeParameter).view(param, shard)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(dest.shape)}")
        writes.append((dest, tensor))
        filled.add((pname, shard))
    if require_all:
        missing = [f"{p}" + ("" if s is None else f"[{s}]") for p, param in params.items()
                   for s in getattr(param, "weight_loader", WholeParameter).shards if (p, s) not in filled]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"weights missing for parameters {missing[:5]}{more}")
    return WeightWrites(writes)


def write_weights(model: nn.Module, planned: WeightWrites) -> int:
    """Write a checked change (``plan_weight_writes``) into ``model``'s parameters (cast to their dtype),
    then re-process every linear method. Returns the bytes the linear methods hold beyond the
    parameters (packed copies)."""
    with torch.no_grad():
        for dest, tensor in planned.writes:
            dest.copy_(tensor)
    return process_linear_methods(model)


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 require_all: bool = False) -> int:
    """Copy (checkpoint name, tensor) pairs into ``model`` by name, then re-process every linear method:
    ``write_weights(model, plan_weight_writes(model, named_tensors, require_all))``.

    Returns the bytes the linear methods hold beyond the parameters (packed copies). Raises ValueError
    as ``plan_weight_writes`` does, before anything is written: the model then keeps its weights.
    """
    return write_weights(model, plan_weight_writes(model, named_tensors, require_all))
