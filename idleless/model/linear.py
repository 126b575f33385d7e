"""Linear layers and their linear methods: how a layer holds its weight and computes y = x W^T (+ b).

A ``LinearMethod`` (the shape of vLLM's ``QuantizeMethodBase``) is chosen once, at load
(``select_linear_method``), and shared by every ``Linear`` of a model:

* ``create_weights(layer, ...)`` makes the layer's parameters (the checkpoint's tensors) and their
  per-parameter loaders (``StackedShards`` for fused q/k/v and gate/up);
* ``process_after_load(layer)`` derives what ``apply`` reads from those parameters (packed copies;
  later, quantized blocks). ``process_linear_methods`` runs it for every linear of a model and is the
  one function a weight change goes through (``weights.load_weights`` calls it after every write),
  so no derived copy can go stale;
* ``apply(layer, x)`` computes the product.

Methods here: ``PlainLinearMethod`` (``F.linear``, any device and dtype); ``OneDnnLinearMethod``
(bfloat16 on CPU: ``F.linear`` re-packs the weight into oneDNN's blocked layout on every call, which at
decode, where every weight is read once per step, costs about as much as the product; a copy packed once
gives bit-identical results faster); ``AmxLinearMethod`` (CPUs with AMX tiles: batches of
up to ``CpuKernels.AMX_LINEAR_MAX_ROWS`` rows, i.e. decode steps, in ``cpu_kernels.amx_linear`` from a
tile-layout copy, where oneDNN's per-call cost is high; larger batches stay on oneDNN). For
deterministic inference, where a row's result must not depend on the other rows of the batch (a GEMM
library picks another kernel, hence another summation order, for another number of rows):
``InvariantLinearMethod`` (``cpu_kernels.bi_linear``: one float32 chain per output element, any
number of rows: fused multiply-adds, or VDPBF16PS over pairs of the input features in bfloat16 on AVX-512
BF16 CPUs) and, without the kernels, ``TiledLinearMethod`` (``F.linear`` on fixed 16-row tiles).
``SmallBatchLinearMethod`` (float32 with the kernels): ``bi_linear`` for batches of up to
``SMALL_BATCH_ROWS`` rows, where the GEMM library's small-M kernels read the weight less efficiently
(a 2- to 8-row speculative verify would otherwise cost two decode steps), the library above.
A quantized weight format is a new method, not a branch in these.
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Row-count hint for oneDNN's packed layout; the result is the same for any number of rows (checked
# bit-exact against F.linear for 1..2048 rows), only speed differs, and this hint was the best overall.
PREPACK_ROWS_HINT = 2048

_PREPACK_OK: dict[tuple[torch.dtype, str], bool] = {}


def can_prepack(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``OneDnnLinearMethod`` applies: bfloat16 on a CPU build with oneDNN whose bfloat16
    reorder runs on this CPU (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT; on AVX2-only CPUs it raises,
    so it is tried once on a small weight and the answer kept)."""
    key = (dtype, device)
    if key not in _PREPACK_OK:
        ok = (device == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        if ok:
            try:
                torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=dtype), PREPACK_ROWS_HINT)
            except RuntimeError:
                ok = False
        _PREPACK_OK[key] = ok
    return _PREPACK_OK[key]


class StackedShards:
    """Per-parameter loader of a fused parameter: checkpoint tensors (shards) stacked along dim 0 in the
    order given, e.g. {"q": H*D, "k": Hkv*D, "v": Hkv*D} for a fused q/k/v weight [(H+2Hkv)*D, in] or
    its bias. ``view(param, shard)`` -> the rows of ``param`` that shard fills (a view; shard None: the
    whole parameter). Raises ValueError for a shard id it does not hold. (nano-vllm's ``weight_loader``
    per parameter, split into where-to-write and the write, so a loader can check every shape first.)"""

    def __init__(self, sizes: dict[Hashable, int]):
        self.sizes = dict(sizes)
        self.offsets, acc = {}, 0
        for shard, n in self.sizes.items():
            self.offsets[shard] = acc
            acc += n

    @property
    def shards(self) -> tuple:
        return tuple(self.sizes)

    def view(self, param: torch.Tensor, shard: Optional[Hashable]) -> torch.Tensor:
        if shard is None:
            return param.data
        if shard not in self.sizes:
            raise ValueError(f"no shard {shard!r} in a parameter stacked from {list(self.sizes)}")
        return param.data.narrow(0, self.offsets[shard], self.sizes[shard])


class LinearMethod:
    """Base of the linear methods (see the module docstring). Stateless apart from what a method is
    built with (e.g. its kernels); per-layer state lives on the layer."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool,
                       shard_sizes: Optional[dict[Hashable, int]] = None,
                       weight: Optional[nn.Parameter] = None) -> None:
        """Give ``layer`` its parameters: ``weight`` [out_features, in_features] (or the Parameter given,
        shared, e.g. a tied lm_head's embedding) and ``bias`` [out_features] or None. shard_sizes: the
        fused checkpoint tensors stacked in the weight (sizes along dim 0, summing to out_features),
        loaded through a ``StackedShards`` set as each parameter's ``weight_loader``."""
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            if shard_sizes:
                weight.weight_loader = StackedShards(shard_sizes)
        layer.weight = weight
        layer.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        if bias and shard_sizes:
            layer.bias.weight_loader = StackedShards(shard_sizes)

    def process_after_load(self, layer: "Linear") -> int:
        """Derive what ``apply`` reads from the layer's current parameters; returns the bytes it holds
        beyond them. Runs after every weight change (through ``process_linear_methods``)."""
        return 0

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] in the model dtype -> [T, out_features]."""
        raise NotImplementedError

    def apply_into(self, layer: "Linear", x: torch.Tensor, out: torch.Tensor) -> None:
        """``apply`` written into ``out`` [T, out_features] (contiguous, the model dtype), bitwise the
        same values; used by ``decode_graph`` over its preallocated buffers. A method whose kernel can
        write into a given buffer overrides this to skip the copy."""
        out.copy_(self.apply(layer, x))


class PlainLinearMethod(LinearMethod):
    """``F.linear`` on the weight as stored: any device and dtype."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class OneDnnLinearMethod(LinearMethod):
    """bfloat16 on CPU (``can_prepack``): a copy of the weight packed once into oneDNN's blocked layout
    (``layer.packed``, the same bytes again), the same GEMM as ``F.linear`` without its per-call re-pack."""

    def process_after_load(self, layer: "Linear") -> int:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PREPACK_ROWS_HINT)
        return layer.weight.numel() * layer.weight.element_size()

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


class AmxLinearMethod(OneDnnLinearMethod):
    """oneDNN's packed copy plus a copy in ``cpu_kernels.amx_linear``'s tile layout (``layer.amx``, None
    where a dimension is not a multiple of 32) for batches of 1 to ``AMX_LINEAR_MAX_ROWS`` rows,
    where oneDNN's per-call cost dominates (figures in benchmarks/README.md).
    kernels: a ``cpu_kernels.CpuKernels`` for bfloat16 with ``has_amx``."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.max_rows = kernels.AMX_LINEAR_MAX_ROWS

    def process_after_load(self, layer: "Linear") -> int:
        extra = super().process_after_load(layer)
        layer.amx = self.kernels.amx_pack_weight(layer.weight.detach())
        return extra + (0 if layer.amx is None else layer.amx.numel() * layer.amx.element_size())

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if layer.amx is not None and 0 < x.shape[0] <= self.max_rows:
            return self.kernels.amx_linear(x, layer.amx, layer.weight.shape[0], layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


class InvariantLinearMethod(LinearMethod):
    """Batch-invariant: ``cpu_kernels.bi_linear`` on a panel-packed copy of the weight (``layer.bi``,
    the same bytes again, in pairs for VDPBF16PS where the bfloat16 kernel uses it): every output element
    is one float32 chain over the input features in order (``CpuKernels.bi_linear``), rounded once,
    whatever the number of rows. kernels: a CpuKernels of the model dtype."""

    def __init__(self, kernels):
        self.kernels = kernels

    def process_after_load(self, layer: "Linear") -> int:
        layer.bi = self.kernels.bi_pack_weight(layer.weight.detach(), out=getattr(layer, "bi", None))
        return layer.bi.numel() * layer.bi.element_size()

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return self.kernels.bi_linear(x, layer.bi, layer.weight.shape[0], layer.bias)

    def apply_into(self, layer: "Linear", x: torch.Tensor, out: torch.Tensor) -> None:
        _bi_linear_into(self.kernels, layer, x, out)


def _bi_linear_into(kernels, layer: "Linear", x: torch.Tensor, out: torch.Tensor) -> None:
    """``bi_linear`` of x [M, K] (the kernels' dtype, contiguous rows) written into out [M, N] (contiguous):
    the kernel called by address, for the decode graph's buffers whose layout is fixed. Raises
    MemoryError when the kernel cannot allocate its row buffer."""
    n = layer.weight.shape[0]
    bias = layer.bias
    if not kernels._bi_linear(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), layer.bi.data_ptr(), n,
                              None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0)):
        raise MemoryError("bi_linear: cannot allocate the row buffer")


class SmallBatchLinearMethod(LinearMethod):
    """``cpu_kernels.bi_linear`` on a panel-packed copy of the weight (``layer.bi``, the same bytes
    again) for batches of 1 to ``max_rows`` rows, ``base`` (the method it wraps) above. Chosen for
    float32, where the measured small-batch products were faster this way (benchmarks/README.md,
    issue 13). kernels: a CpuKernels of the model dtype."""

    def __init__(self, base: LinearMethod, kernels, max_rows: int = 32):
        self.base = base
        self.kernels = kernels
        self.max_rows = max_rows

    def process_after_load(self, layer: "Linear") -> int:
        extra = self.base.process_after_load(layer)
        layer.bi = self.kernels.bi_pack_weight(layer.weight.detach(), out=getattr(layer, "bi", None))
        return extra + layer.bi.numel() * layer.bi.element_size()

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.max_rows:
            return self.kernels.bi_linear(x, layer.bi, layer.weight.shape[0], layer.bias)
        return self.base.apply(layer, x)

    def apply_into(self, layer: "Linear", x: torch.Tensor, out: torch.Tensor) -> None:
        if 0 < x.shape[0] <= self.max_rows:
            _bi_linear_into(self.kernels, layer, x, out)
        else:
            out.copy_(self.base.apply(layer, x))


class TiledLinearMethod(LinearMethod):
    """Batch invariance without our kernels: ``F.linear`` on tiles of exactly ``TILE`` rows (the last
    one zero-padded), so the GEMM library sees one shape and runs one kernel whatever the batch. This
    rests on the library computing a row's result independently of its neighbours at a fixed shape,
    which the tests check on the machine they run on (MKL / oneDNN do; they switch kernels between
    shapes, hence the tiles)."""

    TILE = 16

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = -m % self.TILE
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        out = torch.cat([F.linear(t, layer.weight, layer.bias) for t in x.split(self.TILE)])
        return out[:m] if pad else out


PLAIN = PlainLinearMethod()


def select_linear_method(dtype: torch.dtype, device: str, disable_weight_prepack: bool, kernels,
                         deterministic: bool = False, weight_dtype: str = "auto",
                         activation_dtype: str = "bf16") -> LinearMethod:
    """The linear method for a model, chosen once at load. weight_dtype int8 / int4 / fp8 (or
    activation_dtype int8): the quantised method of ``idleless.quant.methods`` (its ``head_method``
    for the lm_head). Else, weights in ``dtype``: AMX tiles (with oneDNN for large batches)
    where the CPU kernels have them, else oneDNN-packed where ``can_prepack``, else, in float32 with
    the kernels, ``SmallBatchLinearMethod`` over ``F.linear``, else plain ``F.linear``; plain whenever
    ``disable_weight_prepack``. deterministic: a batch-invariant method (the kernels'
    ``InvariantLinearMethod``, else, or with ``disable_weight_prepack``, ``TiledLinearMethod``). kernels: the model dtype's CpuKernels or None.
    Raises ValueError for a precision combination without a method."""
    if weight_dtype not in ("auto", "bf16") or activation_dtype != "bf16":
        from idleless.quant.methods import quantized_linear_method  # imports this module
        ours = kernels is not None and kernels.dtype == dtype
        return quantized_linear_method(weight_dtype, activation_dtype, deterministic, kernels if ours else None)
    ours = kernels is not None and kernels.dtype == dtype
    if deterministic:  # disable_weight_prepack: no packed copy, F.linear on fixed row tiles
        return InvariantLinearMethod(kernels) if ours and not disable_weight_prepack else TiledLinearMethod()
    if disable_weight_prepack:
        return PLAIN
    if not can_prepack(dtype, device):
        return SmallBatchLinearMethod(PLAIN, kernels) if ours and dtype == torch.float32 and device == "cpu" \
            else PLAIN
    if ours and kernels.has_amx:
        return AmxLinearMethod(kernels)
    return OneDnnLinearMethod()


class Linear(nn.Module):
    """y = x W^T (+ b) through a linear method (default ``PLAIN``). x: [T, in_features] -> [T, out_features]
    in the model dtype. weight: [out_features, in_features] (a shared Parameter is allowed: a tied
    lm_head); shard_sizes: the fused checkpoint tensors stacked in it (see ``LinearMethod.create_weights``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 weight: Optional[nn.Parameter] = None, method: Optional[LinearMethod] = None,
                 shard_sizes: Optional[dict[Hashable, int]] = None):
        super().__init__()
        self.method = method if method is not None else PLAIN  # a plain object: no nn.Module lookup per call
        self.method.create_weights(self, in_features, out_features, bias, shard_sizes, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def process_linear_methods(model: nn.Module) -> int:
    """Run every linear's ``process_after_load`` on its current weights (re-pack); returns the bytes the
    methods hold beyond the parameters. The one path from a weight change to the derived copies."""
    return sum(m.method.process_after_load(m) for m in model.modules() if isinstance(m, Linear))
