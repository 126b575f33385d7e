"""The accuracy gate at start-up (issue 14, item 4): the precision combination a model runner was
loaded with, measured against the unquantised model on the built-in text (``accuracy``), before the
engine serves anything.

The reference is the same checkpoint with unquantised weights in ``--dtype``, unquantised
activations and the KV cache in the model dtype: a second ``ModelRunner`` with a KV pool just large
enough for the text, loaded, run once and dropped (it never stays in memory after the gate). For a
GGUF file the weights as stored, dequantised to float, are that reference: the converter
(``loader.convert_gguf_to_hf_dir``) writes them out as float, so the gate compares the chosen
combination with the file's own values. A runner at the reference's own precision needs no gate:
unquantised weights with the KV cache in the model dtype, or the checkpoint's native format (the
bundled SmolLM2's Q4_1 blocks held bit for bit) with that KV cache.

``precision_report(runner)`` is what the model runner calls: the precision fields shown in
``/server_info`` and ``/metrics``, the gate's KL and top-1 agreement where it ran; it raises
``QuantizationGateError`` when the mean KL exceeds ``--max-quantization-kl`` and
``--allow-accuracy-loss`` is not given. ``--skip-quantization-gate`` skips the measurement.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import replace
from typing import Optional

import torch

from idleless.quant.accuracy import CHUNK, compare, next_token_logits, text_token_ids

log = logging.getLogger(__name__)

#: fewest of the text's tokens the gate measures (a KV pool holding less is refused at start-up): over the
#: first few positions alone W8A8 measured 0.12-0.35 nats against ~0.04 over the whole text
MIN_GATE_TOKENS = 64


class QuantizationGateError(ValueError):
    """A precision combination whose mean KL against the unquantised model exceeds the limit."""


def linear_weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the linear layers' forward reads, number of weights of those layers): the quantised
    copies of a quantised method (``layer.quant``), else the float weight; a tied weight counts once."""
    from idleless.model.linear import Linear

    nbytes, nweights, seen = 0, 0, set()
    for m in model.modules():
        if not isinstance(m, Linear) or m.weight.data_ptr() in seen:
            continue
        seen.add(m.weight.data_ptr())
        nweights += m.weight.numel()
        quant = getattr(m, "quant", None)
        nbytes += sum(t.numel() * t.element_size() for t in (quant.values() if quant is not None else [m.weight]))
    return nbytes, nweights


def native_weight_dtype_of(model: Optional[str]) -> Optional[str]:
    """``loader.native_weight_dtype`` of the file ``model`` names, or of the GGUF a converted model
    directory came from (its ``idleless_conversion.json``: the server hands the engine core the
    converted directory); None for float checkpoints or when the source file is gone."""
    from idleless.model.loader import native_weight_dtype, resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "idleless_conversion.json")) as f:
                path = json.load(f)["source"]
        except (OSError, KeyError, ValueError):
            return None
        if not os.path.isfile(path):
            return None
    return native_weight_dtype(path)


def needs_gate(runner) -> bool:
    """Whether ``runner`` (a ``ModelRunner``) differs from its reference: quantised weights other than
    the checkpoint's native format, int8 activations, or a KV cache stored in another dtype than the
    model's."""
    cfg = runner.config
    kv_exact = runner.pool.dtype == runner.dtype
    weights_exact = runner.weight_dtype == "bf16" or runner.weight_dtype == native_weight_dtype_of(cfg.model)
    return not (kv_exact and weights_exact and cfg.activation_dtype == "bf16")


def reference_runner(runner, num_tokens: int):
    """The unquantised ``ModelRunner`` of ``runner``'s checkpoint, with a KV pool of ``num_tokens``
    tokens (plus a page) in the model dtype."""
    from idleless.cache.kv_pool import KVPool
    from idleless.model.runner import ModelRunner

    mc, cfg = runner.model_config, runner.config
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, runner.dtype)
    # the reference's KV is in the model dtype: a static fp8 scale file is not its to read
    ref_cfg = replace(cfg, weight_dtype="bf16", activation_dtype="bf16", kv_cache_dtype="auto",
                      quantization_param_path=None,
                      # the served runner's numerics mode (its log line then says the same)
                      enable_deterministic_inference=getattr(runner, "deterministic", False),
                      kv_cache_memory=per_token * (num_tokens + cfg.page_size))
    return ModelRunner(ref_cfg)


def measure(runner, chunk: int = CHUNK) -> dict:
    """``accuracy.compare`` of ``runner``'s next-token logits on the built-in text against the
    reference model's (``reference_runner``, dropped before returning), plus ``tokens`` (the text's
    tokens measured: all of them, or as many as the runner's free KV pages hold) and ``gate_seconds``
    (wall time of the whole measurement, reference load included). Raises MemoryError when the pool's free
    pages hold fewer than ``MIN_GATE_TOKENS`` of the text's tokens."""
    t0 = time.perf_counter()
    cfg = runner.config
    ids = text_token_ids(cfg.tokenizer or runner.model_dir, runner.model_config.vocab_size)
    fits = runner.pool.num_free_slots // cfg.page_size * cfg.page_size  # a KV pool smaller than the text
    if fits < min(len(ids), MIN_GATE_TOKENS):
        raise MemoryError(f"the KV pool holds {fits} tokens; the accuracy gate needs {MIN_GATE_TOKENS} of its text "
                          "(the first positions alone say little): raise --kv-cache-memory, or pass "
                          "--skip-quantization-gate")
    if fits < len(ids):
        log.warning("accuracy gate over the text's first %d of %d tokens: the KV pool holds no more",
                    fits, len(ids))
        ids = ids[:fits]
    ref = reference_runner(runner, len(ids))
    ref_logits = next_token_logits(ref, ids, chunk)
    del ref
    gc.collect()
    logits = next_token_logits(runner, ids, chunk)
    out = compare(logits, ref_logits)
    return {**out, "tokens": len(ids), "gate_seconds": time.perf_counter() - t0}


def check(result: dict, max_kl: float, allow_accuracy_loss: bool, combination: str) -> None:
    """Refuse ``result`` (``measure``'s) when its kl_mean exceeds ``max_kl``, unless
    ``allow_accuracy_loss`` (then a warning is logged). Raises QuantizationGateError naming the
    combination, the KL, the limit and the flags that let it through."""
    kl = result["kl_mean"]
    if kl <= max_kl:
        return
    msg = (f"precision {combination}: mean KL divergence {kl:.3g} nats against the unquantised model over "
           f"{result['tokens']} tokens of the built-in text exceeds --max-quantization-kl {max_kl:g} (top-1 "
           f"agreement {result['top1']:.3f})")
    if not allow_accuracy_loss:
        raise QuantizationGateError(msg + "; pass --allow-accuracy-loss to serve it anyway, or choose a "
                                    "finer --weight-dtype / --activation-dtype / --kv-cache-dtype")
    log.warning("%s; served anyway (--allow-accuracy-loss)", msg)


def precision_report(runner) -> dict:
    """The precision a ``ModelRunner`` serves at, gated: ``weight_dtype`` / ``activation_dtype`` /
    ``kv_cache_dtype`` (as resolved), ``bytes_per_weight`` (linear layers, scales included),
    ``kv_bytes_per_token`` (all layers, K and V, scales included), ``gate`` (``passed``,
    ``allowed`` (over the limit with --allow-accuracy-loss), ``skipped`` (--skip-quantization-gate)
    ``not_needed`` (the runner is its own reference) or ``not_run_tensor_parallel``), ``kl`` / ``kl_max`` / ``top1`` /
    ``gate_seconds`` / ``gate_tokens`` (None where the gate did not run) and ``max_kl``.
    Raises QuantizationGateError (``check``) and ValueError for a non-positive limit."""
    from idleless.cache.kv_pool import KVPool

    cfg, mc = runner.config, runner.model_config
    if not cfg.max_quantization_kl > 0:
        raise ValueError(f"max_quantization_kl must be > 0 nats, got {cfg.max_quantization_kl!r}")
    nbytes, nweights = linear_weight_bytes(runner.model)
    report = {"weight_dtype": runner.weight_dtype, "activation_dtype": cfg.activation_dtype,
              "kv_cache_dtype": cfg.kv_cache_dtype, "bytes_per_weight": nbytes / max(nweights, 1),
              "kv_bytes_per_token": KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                                           runner.dtype, cfg.kv_cache_dtype),
              "max_kl": cfg.max_quantization_kl, "gate": "not_needed", "kl": None, "kl_max": None, "top1": None,
              "gate_seconds": None, "gate_tokens": None}
    if not needs_gate(runner):
        return report
    if getattr(runner, "tp", None) is not None:
        # a sharded rank's forward joins collectives the other ranks run only inside a step
        log.warning("accuracy gate not run with tensor parallelism: weights %s, activations %s, KV %s are not "
                    "checked against the unquantised model", runner.weight_dtype, cfg.activation_dtype,
                    cfg.kv_cache_dtype)
        return {**report, "gate": "not_run_tensor_parallel"}
    if cfg.skip_quantization_gate:
        log.warning("accuracy gate skipped (--skip-quantization-gate, or a speculative draft model, whose accuracy "
                    "is its acceptance rate): weights %s, activations %s, KV %s are "
                    "not checked against the unquantised model", runner.weight_dtype, cfg.activation_dtype,
                    cfg.kv_cache_dtype)
        return {**report, "gate": "skipped"}
    res = measure(runner)
    combination = f"--weight-dtype {runner.weight_dtype} --activation-dtype {cfg.activation_dtype} " \
                  f"--kv-cache-dtype {cfg.kv_cache_dtype}"
    check(res, cfg.max_quantization_kl, cfg.allow_accuracy_loss, combination)
    report.update(gate="passed" if res["kl_mean"] <= cfg.max_quantization_kl else "allowed", kl=res["kl_mean"],
                  kl_max=res["kl_max"], top1=res["top1"], gate_seconds=res["gate_seconds"], gate_tokens=res["tokens"])
    log.info("accuracy gate %s: %s: mean KL %.3g nats (max %.3g, limit %g), top-1 agreement %.3f over %d tokens, "
             "%.1f s", report["gate"], combination, res["kl_mean"], res["kl_max"], cfg.max_quantization_kl,
             res["top1"], res["tokens"], res["gate_seconds"])
    return report
