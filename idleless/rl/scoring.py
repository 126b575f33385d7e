"""The trainer's recomputation of rollout logprobs: the log-probability of each given completion token,
computed by one plain forward of the whole sequence with the engine's own model code, kernels and
logprob function, in a scratch KV pool of its own.

With deterministic inference (the default in bfloat16) the engine's logits of a position depend only on the tokens
before it and the weights (batch-, chunk- and cache-invariant: DESIGN.md section 7, "Numerics"), so a
lone forward of prompt + completion gives, bit for bit, the logprobs the engine returned when it sampled
those tokens in whatever batch, chunks, cache hits or retractions (``max |train - rollout| == 0``, the
issue's "true on-policy" condition). Without it, or with a KV cache stored in another format than the
model's dtype, the two may differ in the last bits: measure it with ``max_abs_diff``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from idleless.cache.kv_pool import KVPool
from idleless.model.attention import CompositeAttention
from idleless.model.sampler import token_logprobs


class SequenceScorer:
    """Scores token sequences with ``runner``'s model (a ``ModelRunner``: the engine's, or the trainer's
    own with the same config and weights). Needs no room in the runner's KV pool."""

    def __init__(self, runner):
        self.runner = runner

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> torch.Tensor:
        """Raw log-softmax log-probabilities (before penalties, temperature and truncation: what the
        engine returns) of ``completion_ids`` given ``prompt_ids`` and the completion tokens before
        each: float32 [len(completion_ids)]. Raises ValueError for an empty prompt or ids outside the
        vocabulary."""
        return self.score([(prompt_ids, completion_ids)])[0]

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """``logprobs`` of many (prompt ids, completion ids) pairs in one forward (each sequence its own
        extend from an empty cache; with deterministic inference the bits do not depend on the batch):
        one float32 tensor [len(completion)] per pair. Raises ValueError as ``logprobs``."""
        r = self.runner
        mc = r.model_config
        page = r.pool.page_size
        ids, ext, tables, rows, targets = [], [], [], [], []
        slot = row = 0
        for prompt, completion in pairs:
            if not prompt:
                raise ValueError("the prompt must have at least one token")
            if any(not 0 <= t < mc.vocab_size for t in list(prompt) + list(completion)):
                raise ValueError(f"token ids must be in [0, {mc.vocab_size})")
            seq = list(prompt) + list(completion)[:-1] if completion else list(prompt)
            n = len(seq)
            ids.extend(seq)
            ext.append(n)
            tables.append(torch.arange(slot, slot + n, dtype=torch.int64))
            if completion:
                rows.extend(range(row + len(prompt) - 1, row + n))
                targets.extend(completion)
            slot += -(-n // page) * page  # each sequence starts on a page of its own
            row += n
        if not targets:
            return [torch.empty(0, dtype=torch.float32) for _ in pairs]
        pool = KVPool(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, slot, r.dtype, r.config.device, page)
        backend = CompositeAttention(pool, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                                     getattr(mc, "sliding_window", None), r.kernels,
                                     deterministic=r.deterministic,
                                     int8_attention=r.config.activation_dtype == "int8")
        meta = backend.prepare(ext, [0] * len(ext), tables)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in ext])
        h = r.model.hidden_states(torch.tensor(ids, dtype=torch.int64), positions, backend, meta, torch.cat(tables),
                                  torch.tensor(rows, dtype=torch.int64))
        values, _, _ = token_logprobs(r.model.compute_logits(h), torch.tensor(targets), [0] * len(targets))
        flat = torch.tensor(values, dtype=torch.float32)
        return list(flat.split([len(c) for _, c in pairs]))


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max |a - b| over two logprob lists of one length (0.0 for empty ones): the train/rollout
    mismatch to log per step. Raises ValueError for different lengths."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} logprobs against {len(b)}")
    if not len(a):
        return 0.0
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())
