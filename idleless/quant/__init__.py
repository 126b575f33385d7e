"""Precision of weights, activations and the KV cache, each chosen on its own flag (issue 14).

``spec``: the flags and which combinations run; ``formats``: quantise / dequantise (int8 and fp8 per
output channel, Q4_0 / Q4_1 blocks of 32, KV rows per token and head); ``methods``: the quantised
linear methods; ``kv``: a quantised KV layer as the attention backends read it; ``build``: a
ModelRunner with the three flags applied.
"""
