"""The ``draft`` proposer: a smaller model with the target's tokenizer guesses the next tokens.

Speculative decoding as in Leviathan et al. (arXiv 2211.17192) and Chen et al. (arXiv 2302.01318):
a cheap draft model runs k autoregressive steps, the target model checks all k guesses in one
forward. Here the guesses are the draft's greedy argmax, a point-mass proposal, so the scheduler's
accept-while-equal commit is the papers' rejection rule exactly (see ``idleless.spec.proposer``).

The draft is a smaller model with the target's tokenizer, or the target model itself loaded at a
lower weight precision (``--speculative-draft-weight-dtype int4``: the issue-14 linear methods, GGUF
Q4_1 blocks; a self-draft as in Draft & Verify, arXiv 2309.08168, with quantisation instead of
skipped layers). It runs in its own ``ModelRunner`` (own KV pool, attention backend, the target's
dtype and kernels) and this proposer is a small scheduler over it: per request it keeps the tokens whose
draft KV is computed and their slot table (a ``DraftSeq``), with its own prefix cache (the radix
tree, through ``RequestKV``), so a prompt shared by requests is computed once in the draft too.
``propose`` first truncates each request's draft KV to the longest common prefix with the target's
tokens (guesses past the accepted ones are stale), then runs one batched catch-up extend (the whole
prompt the first time, chunked by ``chunked_prefill_size``; later the last accepted guess and the
target's own token) that samples the first guess, then k-1 batched one-token decode steps. A full
draft pool never fails the target's step: the request proposes nothing and its draft KV goes back.

A self-draft shares the target's KV instead of catching up: its layers have the target's shapes, so
the K/V the target computed for a request's tokens (its prompt, its accepted tokens) are copied into
the draft's slots rather than recomputed at the draft's precision (a 4-bit prefill of a prompt costs
more than the target's float one). The draft then computes only its own guesses; what it attends to
for the rest is the target's more exact K/V, which changes only which tokens it guesses, never
what the target accepts. With an fp8 KV cache the draft's pool holds the target's static per-head
scales (handed to its runner rather than calibrated on the draft's weights), so the copied bytes mean the
same values; pools whose scales differ anyway are not shared (the draft catches up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch

from idleless.cache import make_prefix_cache
from idleless.config import EngineConfig
from idleless.engine.kv_manager import RequestKV
from idleless.engine.plan import ScheduledRequest, StepPlan
from idleless.model.loader import load_model_config, prepare_model_dir
from idleless.model.runner import ModelRunner
from idleless.model.sampler import SamplingRow
from idleless.sampling_params import SamplingParams
from idleless.spec.proposer import Proposer

# the draft's sampler row: greedy argmax, no penalties (a point-mass proposal)
GREEDY = SamplingRow(SamplingParams(temperature=0.0), None, (), ())


def _weight_bytes(model) -> int:
    """Bytes of weights a forward of ``model`` reads: each parameter once (tied ones too), a
    quantised linear's held blocks (``layer.quant``, issue 14's methods) instead of its float weight."""
    quantised = {id(m.weight): m.quant for m in model.modules() if getattr(m, "quant", None) is not None}
    return sum(sum(t.numel() * t.element_size() for t in quantised[id(p)].values()) if id(p) in quantised
               else p.numel() * p.element_size() for p in model.parameters())


def _same_layout(a, b) -> bool:
    """Whether two ``KVPool``s hold K/V of the same layers, heads, dims and stored dtype, and (fp8) the
    same static per-head scales: bytes copied from one read as the same values in the other."""
    if not (a.k_cache.shape[0] == b.k_cache.shape[0] and a.k_cache.shape[2:] == b.k_cache.shape[2:]
            and a.dtype == b.dtype and a.quantized == b.quantized):
        return False
    ka, kb = getattr(a, "k_head_scale", None), getattr(b, "k_head_scale", None)
    if ka is None or kb is None:
        return ka is None and kb is None
    return torch.equal(ka, kb) and torch.equal(a.v_head_scale, b.v_head_scale)


def _target_scales(config: EngineConfig, target_runner) -> Optional[tuple]:
    """For a self-draft over an fp8 KV cache whose target calibrated its static scales: the target's
    (k, v) scales, float32 [L, Hkv], for the draft's pool (its own calibration with lower-precision
    weights would differ and mis-scale the K/V copied from the target). None otherwise (no static
    scales, or they came from a file the draft's config names too)."""
    pool = getattr(target_runner, "pool", None)
    if getattr(pool, "k_head_scale", None) is None or config.quantization_param_path:
        return None
    return pool.k_head_scale.cpu(), pool.v_head_scale.cpu()


def check_self_draft(draft_weight_dtype: str, target_weight_dtype: Optional[str]) -> None:
    """A self-draft (the target model as its own draft at ``draft_weight_dtype``) must read fewer
    bytes than the target: ValueError when the target already runs at that precision
    (``target_weight_dtype``: the target runner's resolved weight dtype, e.g. ``int4`` for the
    bundled GGUF's Q4_1 blocks under ``--weight-dtype auto``)."""
    if draft_weight_dtype == target_weight_dtype:
        native = " (--weight-dtype auto keeps a GGUF's own blocks: the bundled SmolLM2 file is Q4_1, int4)" \
            if draft_weight_dtype == "int4" else ""
        raise ValueError(f"--speculative-draft-weight-dtype {draft_weight_dtype}: the target model already runs "
                         f"with {target_weight_dtype} weights{native}, so the self-draft would be the target "
                         "itself; start the target at a higher precision, e.g. --weight-dtype bf16")


@dataclass(eq=False)
class DraftSeq:
    """The draft side of one request, in the fields ``RequestKV`` uses.

    all_ids: token ids, the first ``num_computed`` of them with draft KV in ``slots`` (int64, at least
    ``num_computed`` long); ``confirmed``: leading tokens known to be the target's (never stale);
    ``cache_handle``: the locked draft-cache handle covering ``slots[:num_tree_tokens]``."""

    rid: str
    all_ids: list[int]
    slots: Optional[torch.Tensor] = None
    cache_handle: object = None
    num_computed: int = 0
    confirmed: int = 0

    @property
    def num_tree_tokens(self) -> int:
        return self.cache_handle.cached_len if self.cache_handle is not None else 0


#: a draft's activation dtype per draft weight dtype (the rest: the model dtype)
DRAFT_ACTIVATION_DTYPE = {"int4": "int8"}


class DraftModelProposer(Proposer):
    """Guesses with the draft model ``config.speculative_draft_model_path`` (see the module docstring),
    or without one, with the target model itself at ``config.speculative_draft_weight_dtype`` (a
    self-draft: int4 reads about a quarter of bf16's weight bytes per step).

    ``target_runner``: the target's ModelRunner (``model_config.vocab_size``, ``context_length``,
    ``weight_dtype``). The draft runner is built from ``config`` with the draft's path (the target's
    ``config.model`` for a self-draft), ``speculative_draft_kv_cache_memory`` and, when given, the
    draft weight dtype (activations int8 per block for int4, W4A8; else bf16). Raises ValueError when neither a draft path nor a draft
    weight dtype is set, the path does not exist, the draft's vocab_size differs from the target's,
    or a self-draft's weight dtype is the target's own (``check_self_draft``); ValueError from the
    loader for a draft it cannot load."""

    name = "draft"

    def __init__(self, config: EngineConfig, target_runner):
        path, weight_dtype = config.speculative_draft_model_path, config.speculative_draft_weight_dtype
        if not path and weight_dtype is None:
            raise ValueError("the draft proposer needs speculative_draft_model_path (a smaller model with the "
                             "target's tokenizer) or speculative_draft_weight_dtype (the target itself at a lower "
                             "weight precision)")
        if path:
            try:
                draft_dir = prepare_model_dir(path)
            except FileNotFoundError as e:
                raise ValueError(f"speculative_draft_model_path {path!r}: {e}") from e
            vocab, target_vocab = load_model_config(draft_dir).vocab_size, target_runner.model_config.vocab_size
            if vocab != target_vocab:
                raise ValueError(f"the draft model {path!r} has vocab_size {vocab}, the target model {target_vocab}: "
                                 "a draft must share the target's tokenizer")
        else:
            draft_dir = config.model
            check_self_draft(weight_dtype, getattr(target_runner, "weight_dtype", None))
        # int4 drafts run as llama.cpp runs 4-bit files, activations in int8 per block (W4A8, integer dot
        # products): a draft step then costs a fraction of a target step; int8 / fp8 drafts keep float activations
        precision = {} if weight_dtype is None else {
            "weight_dtype": weight_dtype, "activation_dtype": DRAFT_ACTIVATION_DTYPE.get(weight_dtype, "bf16")}
        self.config = config
        # the draft runner's config: no speculation of its own (the speculative_* fields at their defaults,
        # so it logs no "set without --speculative-algorithm" warning)
        plain = {f.name: f.default for f in fields(EngineConfig) if f.name.startswith("speculative_")}
        # a self-draft copies the target's fp8 K/V bytes: its pool must read them with the target's scales
        self.runner = ModelRunner(replace(config, **plain, model=draft_dir,
                                          kv_cache_memory=config.speculative_draft_kv_cache_memory,
                                          context_length=target_runner.context_length,
                                          skip_quantization_gate=True,  # its accuracy is its acceptance rate
                                          **precision),
                                  kv_scales_override=None if path else _target_scales(config, target_runner))
        self.pool = self.runner.pool
        # a draft step reads the draft's weights as a target step reads the target's: their ratio in bytes
        # (a self-draft at int4: about a quarter), 1 (pessimistic) for a target runner without a model
        target = getattr(target_runner, "model", None)
        self.cost_hint = _weight_bytes(self.runner.model) / max(1, _weight_bytes(target)) if target is not None else 1.0
        self.kv = RequestKV(self.pool, make_prefix_cache(config, self.pool))
        tp = getattr(target_runner, "pool", None)  # a self-draft shares the target's KV (module docstring)
        self.target_pool = tp if not path and tp is not None and _same_layout(tp, self.pool) else None
        self.seqs: dict[str, DraftSeq] = {}  # rid -> draft state, for requests proposed for and not finished
        self.forward_s = 0.0
        self.num_tokens = 0

    def propose(self, requests: Sequence, max_tokens: Sequence[int]) -> list[list[int]]:
        """Greedy draft guesses, ``max_tokens[i]`` for request i, or [] for a request whose prompt is
        still being caught up (chunked), that the step's token budget (``max_prefill_tokens``) left out,
        or that the draft pool cannot hold. Runs 1 + (max k - 1) draft forwards."""
        out: list[list[int]] = [[] for _ in requests]
        self.last_catchup_s, self.last_catchup_tokens = 0.0, 0
        chunk = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else None
        budget = self.config.max_prefill_tokens
        work = []  # (index, seq, catch-up tokens, guesses wanted: 0 while not caught up)
        for i, (rec, k) in enumerate(zip(requests, max_tokens)):
            if k <= 0 or budget <= 0:
                continue
            seq = self._sync(rec)
            shared = self._shared_tokens(rec, seq)
            n = min(len(seq.all_ids) - seq.num_computed - shared, chunk or budget, budget)
            k = k if seq.num_computed + shared + n == len(seq.all_ids) else 0
            if self.kv.grow(seq, shared + n + max(k - 1, 0)) is None:
                self._release(rec.rid)
                continue
            if shared:
                self._copy_target_kv(rec, seq, shared)
                if shared > 1:
                    self.kv.cache_computed(seq)  # a copied prompt is shared with later requests too
            budget -= n
            work.append((i, seq, n, k))
        if not work:
            return out
        plan = [ScheduledRequest(s.rid, s.all_ids[s.num_computed:s.num_computed + n], n, s.num_computed,
                                 s.slots[:s.num_computed + n], GREEDY if k else None) for _, s, n, k in work]
        t0 = time.perf_counter()
        first = self._execute(plan)
        # a first forward that also caught a prompt up (more than the 1-2 tokens the target last
        # accepted) is no draft step: its seconds are reported apart (Proposer.last_catchup_s)
        if max(n for _, _, n, _ in work) > 2:
            self.last_catchup_s = time.perf_counter() - t0
            self.last_catchup_tokens = sum(n for _, _, n, _ in work)
        for (i, seq, n, k), toks in zip(work, first):
            seq.num_computed += n
            if n > 1:
                self.kv.cache_computed(seq)  # share the prompt with later requests at once
            out[i] = toks
        live = [(i, seq, k) for i, seq, _, k in work if k > 1]
        for j in range(1, max((k for _, _, k in live), default=1)):
            live = [w for w in live if w[2] > j]
            for i, seq, _ in live:
                seq.all_ids.append(out[i][-1])
            plan = [ScheduledRequest(s.rid, [s.all_ids[-1]], 1, s.num_computed, s.slots[:s.num_computed + 1], GREEDY)
                    for _, s, _ in live]
            for (i, seq, _), toks in zip(live, self._execute(plan)):
                seq.num_computed += 1
                out[i] += toks
        return out

    def catchup_tokens(self, requests: Sequence) -> list[int]:
        """Per request, the tokens ``propose``'s first forward would compute for it when more than
        the 1-2 a request needs after a verify (its prompt, or tokens it fell behind on), else 0.
        A new request counts its whole prompt (the draft's prefix cache is not consulted); a
        self-draft copies what the target computed (module docstring), so it has none."""
        out = []
        for rec in requests:
            seq, ids = self.seqs.get(rec.rid), rec.all_ids
            have = 0 if seq is None else min(self._kept(seq, ids), len(ids) - 1)
            if self.target_pool is not None:
                have = max(have, min(rec.num_computed, len(ids) - 1))
            out.append(len(ids) - have if len(ids) - have > 2 else 0)
        return out

    def finish(self, request) -> None:
        """Release ``request``'s draft KV: its tokens the target confirmed go into the draft's radix
        tree, its stale guesses' slots back to the pool."""
        if request.rid in self.seqs:
            self._truncate(self.seqs[request.rid], request.all_ids)
            self._release(request.rid)

    def stats(self) -> dict:
        """``draft_forward_s``: seconds in the draft model's forwards (sampling included);
        ``draft_tokens``: tokens the draft model computed."""
        return {"draft_forward_s": self.forward_s, "draft_tokens": self.num_tokens}

    def kv_usage(self) -> dict:
        """The draft pool's slot ownership in tokens: free + cached (tree) + in_use (requests') == total."""
        return {"total": self.pool.num_slots, "free": self.pool.num_free_slots, "cached": self.kv.cache.total_size,
                "in_use": sum(self.kv.own_tokens(s) for s in self.seqs.values())}

    def _sync(self, rec) -> DraftSeq:
        """``rec``'s draft state with its KV cut to the longest common prefix with ``rec.all_ids``
        (at most all tokens but the last, whose logits give the first guess); ``all_ids`` becomes the
        target's tokens. A new request starts from the draft cache's longest cached prefix."""
        target = rec.all_ids
        seq = self.seqs.get(rec.rid)
        if seq is None:
            seq = self.seqs[rec.rid] = DraftSeq(rec.rid, list(target))
            self.kv.attach_prefix(seq, len(target) - 1)
        else:
            self._truncate(seq, target)
            if seq.num_computed == len(target):
                self.kv.truncate(seq, len(target) - 1)
                seq.num_computed -= 1
            seq.all_ids = list(target)
        seq.confirmed = len(target)
        return seq

    @staticmethod
    def _kept(seq: DraftSeq, target: list[int]) -> int:
        """The length of ``seq``'s computed tokens' longest common prefix with ``target``."""
        keep = min(seq.confirmed, seq.num_computed)  # the tokens before it were the target's already
        while keep < seq.num_computed and keep < len(target) and seq.all_ids[keep] == target[keep]:
            keep += 1
        return keep

    def _truncate(self, seq: DraftSeq, target: list[int]) -> None:
        """Cut ``seq``'s draft KV to its longest common prefix with ``target`` (the target's tokens)."""
        keep = self._kept(seq, target)
        self.kv.truncate(seq, keep)
        seq.num_computed = keep
        del seq.all_ids[keep:]

    def _shared_tokens(self, rec, seq: DraftSeq) -> int:
        """Tokens after ``seq``'s computed ones whose K/V the target holds (a self-draft only): up to
        the target's computed tokens, all but the last token (whose forward gives the first guess)."""
        if self.target_pool is None:
            return 0
        return max(0, min(rec.num_computed, len(seq.all_ids) - 1) - seq.num_computed)

    def _copy_target_kv(self, rec, seq: DraftSeq, count: int) -> None:
        """Copy the target's K/V (and scales) of ``count`` tokens after ``seq``'s computed ones from
        ``rec.slots`` into ``seq.slots`` (already grown), every layer at once; they count as computed.
        Per-token scales (int8) are copied with the rows; static ones (fp8) are equal in both pools
        (``_same_layout``: the draft takes the target's, ``_target_scales``) and stay."""
        a, b = seq.num_computed, seq.num_computed + count
        src, dst = rec.slots[a:b], seq.slots[a:b]
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            t = getattr(self.target_pool, name)
            if t is not None:
                getattr(self.pool, name)[:, dst] = t[:, src]
        seq.num_computed = b

    def _release(self, rid: str) -> None:
        """Drop ``rid``'s draft state: computed whole pages into the draft tree, the rest freed."""
        self.kv.release(self.seqs.pop(rid))

    def _execute(self, requests: list[ScheduledRequest]) -> list[list[int]]:
        """One draft forward over ``requests``; the sampled tokens per request."""
        t0 = time.perf_counter()
        sampled = self.runner.execute(StepPlan(requests)).sampled
        self.forward_s += time.perf_counter() - t0
        self.num_tokens += sum(r.num_tokens for r in requests)
        return sampled
