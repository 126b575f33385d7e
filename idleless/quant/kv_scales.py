"""Static scales of an fp8 KV cache (issue 14): one float32 per (layer, K or V, KV head), value = code *
scale, from a calibration pass at start-up or a scale file; never a default of 1.0.

Calibration (``calibrate``): the model runs the built-in text of the accuracy gate
(``accuracy.TEXT``, ~280 tokens with SmolLM2's tokenizer) in extends of ``accuracy.CHUNK`` tokens over
a temporary KV pool in the model dtype; per layer and KV head, amax = max |x| over every token and
dimension of the K (after rotary embedding, as stored) and V rows written, and

    scale = amax * CALIBRATION_HEADROOM / fmax        (fmax: 448 for e4m3, 57344 for e5m2)

The headroom is there because other text moves further than the calibration text: on SmolLM2-135M the
shared-prefix workload's chat-formatted prompts reached 1.66x the text's K amax and 2.30x its V amax
(layer 7), so a scale of amax / fmax would saturate them. With 4x, values up to 4x the calibration amax
are stored exactly as the format rounds them; beyond that they saturate (clamped to +-fmax when written:
``QuantizedKV.quantize`` and ``kv_write_q8``). The cost is two binades at the bottom of e4m3's 17-binade
normal range (values under amax * 4 / 448 * 2^-6 ~= 1.4e-4 amax become subnormal), none for e5m2.

Scale file (``load_scale_file``, ``--quantization-param-path``, vLLM's and SGLang's flag for a KV-cache
scales JSON; their schema, ``kv_cache.scaling_factor`` keyed by tensor-parallel rank then layer):

    {"kv_cache": {"dtype": "float8_e4m3fn",
                  "scaling_factor": {"0": {"0": 0.0213,
                                           "1": {"k": [0.011, 0.02, 0.017], "v": [0.004, 0.003, 0.009]},
                                           ...}}}}

Rank "0" only (a quantised KV cache runs without tensor parallelism). Every layer 0..L-1 must be
present: a number (vLLM's and SGLang's form: the layer's one scale for K, V and every head) or an
object with "k" and "v" lists of one scale per KV head. Scales are what multiplies a stored code (the
value / code ratio, as vLLM's k_scale), positive and finite. "dtype" (float8_e4m3fn / float8_e5m2, or
fp8_e4m3 / fp8_e5m2) must name the format chosen with --kv-cache-dtype when given. Anything missing or
malformed raises ``KVScaleError`` naming it; ``save_scale_file`` writes the per-head form.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Optional

import torch

from idleless.quant.formats import FMAX
from idleless.quant.kv import KV_STORAGE, STATIC_SCALE_FORMATS

log = logging.getLogger(__name__)

#: calibrated scale = amax over the calibration text * CALIBRATION_HEADROOM / fmax (module docstring)
CALIBRATION_HEADROOM = 4.0
#: the scale file's "dtype" names of each format
FILE_DTYPES = {"fp8_e4m3": ("float8_e4m3fn", "fp8_e4m3", "fp8", "float8_e4m3"),
               "fp8_e5m2": ("float8_e5m2", "fp8_e5m2")}


class KVScaleError(ValueError):
    """A KV scale file that is missing a layer or head, malformed, or for another format."""


def scales_from_amax(k_amax: torch.Tensor, v_amax: torch.Tensor, cache_dtype: str,
                     headroom: float = CALIBRATION_HEADROOM) -> tuple[torch.Tensor, torch.Tensor]:
    """k_amax, v_amax float [L, Hkv] (max |x| per layer and KV head) -> (k, v) scales float32 [L, Hkv] =
    amax * headroom / fmax of ``cache_dtype``'s format. Raises ValueError for a format without static
    scales, a negative / non-finite amax, or an amax of 0 (a head that saw nothing but zeros: no scale can
    be derived for it; pass a scale file)."""
    if cache_dtype not in STATIC_SCALE_FORMATS:
        raise ValueError(f"{cache_dtype} has no static KV scales (only {', '.join(STATIC_SCALE_FORMATS)})")
    fmax = FMAX[KV_STORAGE[cache_dtype]]
    out = []
    for name, amax in (("K", k_amax), ("V", v_amax)):
        a = amax.double()
        if not bool((torch.isfinite(a) & (a >= 0)).all()):
            raise ValueError(f"{name} amax must be finite and >= 0, got {amax.tolist()}")
        if not bool((a > 0).all()):
            raise ValueError(f"KV calibration: {name} of layer/head {(a == 0).nonzero().tolist()} saw only zeros on "
                             "the calibration text; no scale can be derived (pass --quantization-param-path)")
        s = a * headroom / fmax
        out.append(s.float())
    return out[0], out[1]


@torch.inference_mode()
def calibration_amax(model, kernels, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     ids: list[int], chunk: int, sliding_window: Optional[int] = None,
                     device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` (a ``LlamaForCausalLM``) over ``ids`` in extends of ``chunk`` tokens with a temporary
    KV pool in ``dtype`` (K/V as the model computes them, unquantised) and return (k_amax, v_amax), float32
    [num_layers, num_kv_heads]: max |x| over every token and dimension written to that layer and head.
    The pool is dropped before returning. Raises ValueError for empty ids."""
    from idleless.cache.kv_pool import KVPool
    from idleless.model.attention import CompositeAttention

    n = len(ids)
    if n == 0:
        raise ValueError("KV calibration needs at least one token")
    num_layers = len(model.layers)
    pool = KVPool(num_layers, num_kv_heads, head_dim, n, dtype, device)
    backend = CompositeAttention(pool, num_heads, num_kv_heads, head_dim, sliding_window, kernels)
    slots = torch.arange(n, dtype=torch.int64)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        meta = backend.prepare([b - a], [a], [slots[:b]])
        model.hidden_states(torch.tensor(ids[a:b], dtype=torch.int64), torch.arange(a, b), backend, meta,
                            slots[a:b], torch.tensor([b - a - 1]))
    k_amax = pool.k_cache[:, :n].float().abs().amax(dim=(1, 3))
    v_amax = pool.v_cache[:, :n].float().abs().amax(dim=(1, 3))
    return k_amax, v_amax


def calibrate(runner, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibrated (k, v) scales float32 [L, Hkv] of a ``ModelRunner`` being built (``model``,
    ``kernels``, ``dtype``, ``model_config``, ``config``, ``model_dir`` set; its KV pool not yet made): the
    gate's built-in text (``accuracy.text_token_ids``) through ``calibration_amax``, then
    ``scales_from_amax`` for ``config.kv_cache_dtype``. Logs the amax range and the time taken."""
    from idleless.quant.accuracy import CHUNK, text_token_ids

    t0 = time.perf_counter()
    mc, cfg = runner.model_config, runner.config
    ids = text_token_ids(cfg.tokenizer or runner.model_dir, mc.vocab_size)
    k_amax, v_amax = calibration_amax(runner.model, runner.kernels, num_heads, num_kv_heads, mc.head_dim,
                                      runner.dtype, ids, CHUNK, getattr(mc, "sliding_window", None),
                                      cfg.device)
    k, v = scales_from_amax(k_amax, v_amax, cfg.kv_cache_dtype)
    log.info("KV %s scales calibrated on %d tokens of the built-in text in %.2f s: amax K %.3g..%.3g, V "
             "%.3g..%.3g, headroom %gx", cfg.kv_cache_dtype, len(ids), time.perf_counter() - t0,
             float(k_amax.min()), float(k_amax.max()), float(v_amax.min()), float(v_amax.max()),
             CALIBRATION_HEADROOM)
    return k, v


def _positive(x, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise KVScaleError(f"{where}: a scale must be a positive finite number, got {x!r}")
    return float(x)


def load_scale_file(path: str, num_layers: int, num_kv_heads: int,
                    cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) scales float32 [num_layers, num_kv_heads] of the JSON file ``path`` (module docstring's
    schema). Raises KVScaleError naming the first problem: unreadable file or JSON, no
    kv_cache.scaling_factor["0"], a layer missing (or one beyond the model's), a K or V list without one
    scale per KV head, a scale not positive and finite, a dtype other than cache_dtype's."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise KVScaleError(f"--quantization-param-path {path}: cannot read a JSON file: {e}") from e
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    if not isinstance(kv, dict) or not isinstance(kv.get("scaling_factor"), dict):
        raise KVScaleError(f"--quantization-param-path {path}: no kv_cache.scaling_factor object")
    dtype = kv.get("dtype")
    if dtype is not None and dtype not in FILE_DTYPES.get(cache_dtype, ()):
        raise KVScaleError(f"--quantization-param-path {path}: scales for {dtype!r}, the KV cache is {cache_dtype}")
    ranks = kv["scaling_factor"]
    if set(ranks) != {"0"} or not isinstance(ranks["0"], dict):
        raise KVScaleError(f"--quantization-param-path {path}: scaling_factor must hold tensor-parallel rank \"0\" "
                           f"alone (an object keyed by layer), got ranks {sorted(ranks)}")
    layers = ranks["0"]
    extra = sorted(set(layers) - {str(i) for i in range(num_layers)})
    if extra:
        raise KVScaleError(f"--quantization-param-path {path}: layers {extra} are not layers 0..{num_layers - 1} "
                           "of this model")
    k = torch.empty(num_layers, num_kv_heads, dtype=torch.float32)
    v = torch.empty(num_layers, num_kv_heads, dtype=torch.float32)
    for i in range(num_layers):
        entry = layers.get(str(i))
        where = f"--quantization-param-path {path}: layer {i}"
        if entry is None:
            raise KVScaleError(f"{where} is missing (every layer 0..{num_layers - 1} needs its scales; there is no "
                               "default)")
        if isinstance(entry, dict):
            for name, dst in (("k", k), ("v", v)):
                vals = entry.get(name)
                if not isinstance(vals, list) or len(vals) != num_kv_heads:
                    raise KVScaleError(f"{where}: \"{name}\" must list one scale per KV head ({num_kv_heads}), got "
                                       f"{vals!r}")
                dst[i] = torch.tensor([_positive(x, f"{where} {name} head {h}") for h, x in enumerate(vals)])
        else:
            k[i] = v[i] = _positive(entry, where)
    return k, v


def save_scale_file(path: str, k: torch.Tensor, v: torch.Tensor, cache_dtype: str) -> None:
    """Write (k, v) scales [L, Hkv] as a file ``load_scale_file`` reads back exactly (per-head form;
    float32 values written as their shortest round-tripping decimals)."""
    doc = {"kv_cache": {"dtype": FILE_DTYPES[cache_dtype][0], "scaling_factor": {"0": {
        str(i): {"k": [float(x) for x in k[i].tolist()], "v": [float(x) for x in v[i].tolist()]}
        for i in range(k.shape[0])}}}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def resolve(runner, num_heads: int, num_kv_heads: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The static (k, v) scales a ``ModelRunner`` being built needs for its KV pool: None for a format
    without static scales (raising ValueError when --quantization-param-path is given to one: it would be
    ignored), else the file's (``load_scale_file``) or the calibration's (``calibrate``)."""
    cfg = runner.config
    path = getattr(cfg, "quantization_param_path", None)
    if cfg.kv_cache_dtype not in STATIC_SCALE_FORMATS:
        if path:
            raise ValueError(f"--quantization-param-path holds static KV scales for fp8; --kv-cache-dtype "
                             f"{cfg.kv_cache_dtype} takes none"
                             + (" (int8 scales are per token, computed when written)" if cfg.kv_cache_dtype == "int8"
                                else " (give --kv-cache-dtype fp8_e4m3 or fp8_e5m2 with it)"))
        return None
    if path:
        k, v = load_scale_file(path, runner.model_config.num_hidden_layers, num_kv_heads, cfg.kv_cache_dtype)
        log.info("KV %s scales from %s", cfg.kv_cache_dtype, path)
        return k, v
    return calibrate(runner, num_heads, num_kv_heads)
