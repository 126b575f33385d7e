"""Precision of weights, activations and the KV cache, each chosen on its own flag (issue 14).

``spec``: the flags and which combinations run; ``formats``: quantise / dequantise (int8 and fp8 per
output channel, Q4_0 / Q4_1 blocks of 32, int8 KV rows per token and head); ``methods``: the quantised
linear methods; ``kv``: a quantised KV layer as the attention backends read it (int8 with per-token
scales, fp8 with static per-(layer, K/V, KV head) ones); ``kv_scales``: the fp8 KV cache's static
scales, calibrated at start-up or read from ``--quantization-param-path``; ``accuracy`` and ``gate``:
the accuracy measurement and the start-up gate. The model runner applies the three flags at load.
"""
