"""A ModelRunner at the precisions of ``--weight-dtype`` / ``--activation-dtype`` / ``--kv-cache-dtype``.

``build_runner(config)`` builds the float runner (weights in ``--dtype``, unpacked when they are to be
quantised: the float parameters are then the master copy only) and attaches the precisions at their
named points (DESIGN section 7): the quantised linear method on every linear (the lm_head its
``head_method``), re-processed once; a KV pool of the chosen format sized from the same
``--kv-cache-memory`` (an 8-bit format holds about twice the tokens) with the attention backend over it.
``--weight-dtype auto`` is the checkpoint's own format: the bundled SmolLM2 GGUF (Q4_1 linears, a Q8_0
tied embedding) runs on its own blocks, which re-quantising the loaded float copy reproduces exactly.
"""

from __future__ import annotations

import dataclasses
import logging

from idleless.cache.kv_pool import KVPool
from idleless.config import EngineConfig
from idleless.model.attention import CompositeAttention
from idleless.model.linear import Linear, process_linear_methods, select_linear_method
from idleless.model.loader import native_weight_dtype

log = logging.getLogger(__name__)


def resolve_weight_dtype(config: EngineConfig) -> str:
    """``--weight-dtype`` with ``auto`` resolved to how the checkpoint stores its weights
    (``loader.native_weight_dtype``: ``int4`` for a Q4_1 GGUF file such as the bundled SmolLM2, else
    float in ``--dtype``, spelled ``bf16``)."""
    if config.weight_dtype != "auto":
        return config.weight_dtype
    return native_weight_dtype(config.model) or "bf16"


def build_runner(config: EngineConfig):
    """A ``ModelRunner`` for ``config`` with its precision flags applied (``auto`` weights resolved by
    ``resolve_weight_dtype``). Raises what ModelRunner raises, and ValueError for weights a method
    cannot quantise (e.g. Q4 with in_features % 32)."""
    from idleless.model.runner import ModelRunner

    config = dataclasses.replace(config, weight_dtype=resolve_weight_dtype(config))
    quant_w = config.weight_dtype != "bf16" or config.activation_dtype != "bf16"
    runner = ModelRunner(dataclasses.replace(config, disable_weight_prepack=True) if quant_w else config)
    det = config.enable_deterministic_inference
    if quant_w:
        method = select_linear_method(runner.dtype, config.device, True, runner.kernels, deterministic=det,
                                      weight_dtype=config.weight_dtype, activation_dtype=config.activation_dtype)
        for m in runner.model.modules():
            if isinstance(m, Linear):
                m.method = method
        runner.model.lm_head.method = method.head_method
        runner.linear_method = method
        runner.prepacked_bytes = process_linear_methods(runner.model)
    if config.kv_cache_dtype != "auto":
        mc = runner.model_config
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, runner.dtype,
                                           config.kv_cache_dtype)
        runner.pool = KVPool(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                             int(config.kv_cache_bytes() // per_token), runner.dtype, config.device,
                             config.page_size, cache_dtype=config.kv_cache_dtype)
        runner.backend = CompositeAttention(runner.pool, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                                            getattr(mc, "sliding_window", None), runner.kernels, deterministic=det)
    log.info("precision: weights %s, activations %s, KV cache %s (%d tokens, %d bytes per token)",
             config.weight_dtype, config.activation_dtype, config.kv_cache_dtype, runner.pool.num_slots,
             KVPool.bytes_per_token(runner.model_config.num_hidden_layers, runner.model_config.num_key_value_heads,
                                    runner.model_config.head_dim, runner.dtype, config.kv_cache_dtype))
    return runner
