"""Tensor parallelism (DESIGN.md section 7: parallel linear methods + a rank-0 scheduler broadcasting
the plan).

``tp``: the module transformation applied to a built model (column-/row-parallel linear methods,
vocabulary-parallel embedding and lm_head, attention and KV heads split across ranks) and the loader of
each rank's checkpoint shard; ``group``: the ranks' process group and its collectives; ``worker``: rank
0's handle on the worker processes (start, per-step plan, liveness) and the loop of ranks 1..N-1.
"""
