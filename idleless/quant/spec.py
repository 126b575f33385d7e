"""The three precisions a served model runs at, each on its own flag (issue 14): weights
(``--weight-dtype``), activations feeding the linears (``--activation-dtype``) and the KV cache
(``--kv-cache-dtype``; SGLang's and vLLM's names). ``check_precision`` is the one place that says
which combinations run; the engine refuses the others at start-up, naming the combination.

Torch-free on purpose: ``config.EngineConfig`` validates with it before anything heavy is imported.
"""

from __future__ import annotations

WEIGHT_DTYPES = ("auto", "bf16", "int8", "int4", "fp8")
ACTIVATION_DTYPES = ("bf16", "int8")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
# vLLM's and SGLang's other spellings of the same KV formats
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "bfloat16": "bf16"}

SUPPORTED = ("weights auto|bf16|int8|int4|fp8 with bf16 activations; int8 activations with int8 weights "
             "(W8A8), int4 weights (W4A8: Q4_1 blocks, activations per block of 32) or auto on a GGUF file of "
             "Q4_1 linears; any KV cache dtype with any of these")
#: weight dtypes int8 activations run with (``auto`` only where the checkpoint is GGUF Q4_1: checked at load)
INT8_ACTIVATION_WEIGHTS = ("int8", "int4", "auto")


def check_precision(weight_dtype: str, activation_dtype: str, kv_cache_dtype: str) -> str:
    """Validate one combination; returns the KV cache dtype in its canonical name.

    weight_dtype: ``auto`` (as stored; float checkpoints stay in ``--dtype``), ``bf16`` (unquantised, in
    ``--dtype``), ``int8`` (per output channel, symmetric), ``int4`` (GGUF Q4_1 blocks of 32), ``fp8``
    (e4m3, per output channel). activation_dtype: ``bf16`` (the model dtype) or ``int8`` (dynamic; per
    token with int8 weights, per block of 32 with int4 weights; integer dot products). kv_cache_dtype:
    ``auto`` (the model dtype), ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``, ``int8`` (scales per token and head).

    Raises ValueError naming the combination and what is supported."""
    kv = KV_CACHE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    for name, value, allowed in (("weight_dtype", weight_dtype, WEIGHT_DTYPES),
                                 ("activation_dtype", activation_dtype, ACTIVATION_DTYPES),
                                 ("kv_cache_dtype", kv, KV_CACHE_DTYPES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if activation_dtype == "int8" and weight_dtype not in INT8_ACTIVATION_WEIGHTS:
        raise ValueError(f"--weight-dtype {weight_dtype} --activation-dtype int8 is not supported: int8 "
                         f"activations run with int8 weights (W8A8) or int4 / native GGUF Q4_1 weights (W4A8). "
                         f"Supported: {SUPPORTED}")
    return kv
