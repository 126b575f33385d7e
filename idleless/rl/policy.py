"""The trainer's model: the engine's own ``LlamaForCausalLM`` in training, every op an autograd function
around the engine's inference kernel (``idleless.rl.kernel_autograd``), so the log-probabilities it
computes for a rollout are the ones the engine reported when it sampled it, bit for bit, and their
gradient is that of exactly this computation.

``KernelPolicy(config)`` loads the model as the engine does (``ModelRunner``: the same kernels, linear
method and attention backend, chosen by the same rules) and transforms it in place (gpt-fast style: the
model file is untouched): each module's ``ops`` becomes a ``KernelOps`` around it, each linear's method a
``KernelLinearMethod`` around it, the attention a ``CausalAttentionFn`` around the deterministic
backend, the embedding an ``EmbeddingFn``, the sampler's log-softmax a ``TokenLogprobFn``; every
parameter requires grad.

With deterministic inference (the default in bfloat16) the engine's logits of a position depend only on the tokens
before it and the weights (DESIGN.md section 7, "Numerics"), so ``logprobs`` of (prompt, completion)
pairs equal the rollout's logprobs (``max |train - rollout| == 0``) whatever batching, chunked prefill,
prefix-cache hits or retraction the rollout went through. A rollout sampled with a quantised KV cache
differs: measure it per step (``scoring.max_abs_diff``).

Quantised weights (``--weight-dtype`` int8 / int4 / fp8, the bundled GGUF's native Q4_1) have no float
master copy to differentiate or update: refused here (train on the float checkpoint, ``prepare_model_dir``).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch
from torch import nn

from idleless.config import EngineConfig
from idleless.model.attention.base import AttnWork, Tails
from idleless.model.linear import Linear
from idleless.model.llama import StepContext
from idleless.model.loader import native_weight_dtype
from idleless.model.runner import ModelRunner
from idleless.rl.kernel_autograd import (CausalAttentionFn, EmbeddingFn, KernelLinearMethod, KernelOps,
                                         TokenLogprobFn, engine_token_logprobs)


class _Attention:
    """The ``StepContext.backend`` of a training forward: ``forward(q, k, v, layer_id, meta, _)`` with
    meta = (attend, seq_lens) -> ``CausalAttentionFn`` [T, H, D]."""

    def forward(self, q, k, v, layer_id, meta, out_cache_loc):
        attend, seq_lens = meta
        return CausalAttentionFn.apply(q, k, v, attend, seq_lens)


_ATTENTION = _Attention()


def make_trainable(model: nn.Module) -> nn.Module:
    """Transform an engine ``LlamaForCausalLM`` in place for training (module docstring): its ops and
    linear methods wrapped, every parameter requiring grad. Returns the model."""
    wrapped = {}
    for m in model.modules():
        if isinstance(m, Linear) and not isinstance(m.method, KernelLinearMethod):
            m.method = KernelLinearMethod(m.method)
            m.method.process_after_load(m)
        ops = getattr(m, "ops", None)
        if ops is not None and not isinstance(ops, KernelOps):
            m.ops = wrapped.setdefault(id(ops), KernelOps(ops))
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def hf_named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face checkpoint names (what the engine's by-name loader and
    SGLang's weight-update routes take): fused q/k/v and gate/up split back into their shards (views, no
    copy), ``model.`` prefixed, a tied lm_head once, as the embedding. Detached tensors."""
    shard_names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}
    out = []
    for name, p in model.named_parameters():
        loader = getattr(p, "weight_loader", None)
        full = name if name.startswith("lm_head.") else "model." + name
        if loader is None:
            out.append((full, p.detach()))
            continue
        fused = full.split(".")[-2]
        for shard in loader.shards:
            out.append((full.replace(f".{fused}.", f".{shard_names[shard]}."), loader.view(p, shard).detach()))
    return out


class KernelPolicy:
    """The trainer's policy (module docstring). config: an ``EngineConfig`` with the rollout engine's
    model, dtype and kernels (its KV budget only sizes an unused pool: keep it small). Raises ValueError
    when ``enable_deterministic_inference`` is off (set False, or the float32 default) or with quantised
    weights or activations."""

    def __init__(self, config: EngineConfig):
        if config.enable_deterministic_inference is False:
            raise ValueError("the kernel policy needs enable_deterministic_inference (its values must not "
                             "depend on the batch)")
        weights = config.weight_dtype if config.weight_dtype != "auto" else native_weight_dtype(config.model)
        if weights not in (None, "bf16") or config.activation_dtype != "bf16":
            raise ValueError(f"quantised weights ({weights}) or activations ({config.activation_dtype}) have "
                             "no float master copy to train")
        self.runner = ModelRunner(config)
        if not self.runner.deterministic:  # the default resolved it off (float32, a sliding window)
            raise ValueError(f"the kernel policy needs enable_deterministic_inference, off by default in "
                             f"{self.runner.dtype} (set it, or run bfloat16)")
        self.model = make_trainable(self.runner.model)
        self.attention = self.runner.backend.extend_backend  # the deterministic composite's one backend

    def parameters(self):
        return self.model.parameters()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``hf_named_tensors`` of the model: what to push into the engine."""
        return hf_named_tensors(self.model)

    def load_weights(self, named_tensors) -> None:
        """Write HF-named tensors into the model (``ModelRunner.load_weights``; the same errors)."""
        self.runner.load_weights(named_tensors)

    def logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """``pair_logprobs`` with this policy's model and the engine's deterministic attention backend."""
        return pair_logprobs(self.model, self.attention, pairs)


def pair_logprobs(model: nn.Module, attention, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                  logprob_fn=engine_token_logprobs) -> list[torch.Tensor]:
    """The log-probability of every completion token given the prompt and the completion tokens before
    it, for each (prompt ids, completion ids) pair, by one forward of ``model`` (a ``make_trainable``
    model) over all the sequences, each its own causal attention: one tensor [len(completion)] per
    pair (float32 with the engine's ``logprob_fn``), differentiable w.r.t. the parameters when grad is
    enabled. attention: an attention backend (``prepare(AttnWork)``, ``forward(q, kc, vc, layer_id,
    plan, out, lse)``) run over the batch's own K/V (row t's keys are slots of the batch's rows).
    Raises ValueError for an empty prompt or ids outside the vocabulary."""
    vocab = model.cfg.vocab_size
    ids, lens, rows, targets = [], [], [], []
    row = 0
    for prompt, completion in pairs:
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        if any(not 0 <= t < vocab for t in list(prompt) + list(completion)):
            raise ValueError(f"token ids must be in [0, {vocab})")
        seq = list(prompt) + list(completion)[:-1] if completion else list(prompt)
        ids.extend(seq)
        lens.append(len(seq))
        if completion:
            rows.extend(range(row + len(prompt) - 1, row + len(seq)))
            targets.extend(completion)
        row += len(seq)
    if not targets:
        return [torch.empty(0) for _ in pairs]
    starts = [end - n for end, n in zip(accumulate(lens), lens)]
    slots = [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lens)]
    plan = attention.prepare(AttnWork(Tails(starts, lens, [0] * len(lens), slots)))

    def attend(q, k, v):
        return attention.forward(q, k.contiguous(), v.contiguous(), 0, plan, None, None)

    # LlamaForCausalLM.hidden_states' loop (which runs under inference_mode: no graph), on the wrapped ops
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    h = EmbeddingFn.apply(torch.tensor(ids, dtype=torch.int64), model.embed_tokens.weight)
    ctx = StepContext(model.ops.rope_state(model.rope, positions, h.dtype), _ATTENTION, (attend, lens), None)
    residual = None
    for layer in model.layers:
        h, residual = layer(h, residual, ctx)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    h, _ = model.norm(h[rows_t], residual[rows_t])
    logits = model.lm_head(h).to(torch.promote_types(h.dtype, torch.float32))  # the engine's .float()
    lp = TokenLogprobFn.apply(logits, torch.tensor(targets, dtype=torch.int64), logprob_fn)
    return list(lp.split([len(c) for _, c in pairs]))
