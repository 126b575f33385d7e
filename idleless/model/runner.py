"""ModelRunner: owns the model, the KV pool and the attention backend; turns a ForwardBatch into logits."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from idleless.cache.kv_pool import KVPool
from idleless.quant import kv_scales
from idleless.config import EngineConfig
from idleless.model import cpu_kernels
from idleless.model.attention import CompositeAttention
from idleless.model.decode_graph import DecodeGraph
from idleless.model.linear import select_linear_method
from idleless.model.llama import LlamaForCausalLM
from idleless.model.ops import select_ops
from idleless.engine.request import PromptLogprob
from idleless.engine.threads import ThreadGovernor
from idleless.model.sampler import SamplingRow, sample, token_logprobs
from idleless.model.loader import load_model_config, load_state_dict, native_weight_dtype, prepare_model_dir
from idleless.model.weights import load_weights
from idleless.structured.grammar import TokenMasks

log = logging.getLogger(__name__)


# Prompt-logprob rows are turned into logits this many at a time (a block is [rows, vocab] float32:
# 50 MB for a 49152-token vocabulary), so a long prompt never holds all its logits at once.
PROMPT_LOGITS_BLOCK = 256


@dataclass
class ForwardBatch:
    """One step's work, flattened over requests (T new tokens in all).

    input_ids, positions, out_cache_loc: int64 [T]; extend_lens / prefix_lens: per request, new
    tokens this step and tokens whose KV already exists; slot_tables[i]: int64 [prefix+extend]
    KV slots of request i; sample_rows: int64 [N] rows of T whose logits are wanted: the sampled
    rows (the last new token of each request that samples this step, one more per proposed token),
    then the prompt-logprob rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_lens: list[int]
    prefix_lens: list[int]
    slot_tables: list[torch.Tensor]
    sample_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def forward_batch_of(plan) -> tuple[ForwardBatch, list[SamplingRow], list[tuple[int, object]]]:
    """A ``StepPlan``'s model inputs: the flattened ForwardBatch, one sampler row per sampled logits
    row, and (plan index, ``PromptLogprobRows``) per request with prompt-logprob rows, in the order of
    those rows (they follow the sampled rows in ``sample_rows``). A request that samples with k
    proposed tokens has k + 1 sampled rows (its last k + 1 positions); the j-th sees the proposed
    tokens before it as generated, for penalties and min_new_tokens."""
    ids, pos, locs, ext, pre, tables, rows, sampling = [], [], [], [], [], [], [], []
    scored_rows: list[int] = []
    scored: list[tuple[int, object]] = []
    row = 0
    for i, r in enumerate(plan.requests):
        n = r.num_tokens
        ids.extend(r.token_ids)
        pos.extend(range(r.start, r.start + n))
        locs.append(r.out_slots)
        ext.append(n)
        pre.append(r.start)
        tables.append(r.slot_table)
        if r.sampling is not None:
            rows.extend(range(row + r.num_known - 1, row + n))
            sampling.append(r.sampling)
            for j in range(1, r.num_sampled):
                sampling.append(replace(r.sampling, output_ids=list(r.sampling.output_ids) + r.proposed[:j]))
        p = r.prompt_logprobs
        if p is not None:
            scored_rows.extend(range(row + p.first, row + p.first + len(p.targets)))
            scored.append((i, p))
        row += n
    batch = ForwardBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                         torch.cat(locs), ext, pre, tables, torch.tensor(rows + scored_rows, dtype=torch.int64))
    return batch, sampling, scored


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` -> bfloat16 when the CPU has native bf16 matmul (AMX / AVX512-BF16), else float32."""
    if name == "auto":
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            flags = ""
        fast_bf16 = torch.cuda.is_available() or "amx_bf16" in flags or "avx512_bf16" in flags
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_deterministic(setting: Optional[bool], dtype: torch.dtype, sliding_window: Optional[int],
                          weight_dtype: str = "bf16", activation_dtype: str = "bf16", has_q8p: bool = False) -> bool:
    """Whether the batch-invariant kernels run (``enable_deterministic_inference``): True / False as set;
    None (the default) -> on in bfloat16, where the other GEMMs change their summation order with the batch
    and a greedy answer would change with the traffic beside it; off in float32 (its cost was measured
    high on AVX2-only CPUs) and float16 (no fp16 kernels: the mode's torch fallback is slow); and off,
    with a log line, for a sliding-window model, which has no batch-invariant attention yet (set
    explicitly, the attention backend raises ValueError for it), and for fp8 weights with bf16
    activations, and int8 ones without ``q8p_linear`` (``has_q8p``: bfloat16 kernels with AVX-512 BF16 +
    VBMI), whose invariant path is their GEMV kernel at every batch size (prefill 3.3x slower:
    benchmarks/README.md, "Issue 14 after the deterministic default"). With ``q8p_linear`` int8 runs the
    same kernel in both modes, and the mode's attention is the faster one: on."""
    if setting is not None:
        return setting
    if dtype != torch.bfloat16:
        return False
    if (weight_dtype == "fp8" or (weight_dtype == "int8" and not has_q8p)) and activation_dtype == "bf16":
        log.info("deterministic inference off: %s weights with bf16 activations have no batch-invariant "
                 "prefill kernel yet (--enable-deterministic-inference runs their decode kernel for every batch)",
                 weight_dtype)
        return False
    if sliding_window is not None:
        log.info("deterministic inference off: sliding-window attention has no batch-invariant backend yet "
                 "(a greedy answer may change with the batch)")
        return False
    return True


class ModelRunner:
    """Loads the model named by ``config.model`` and sizes the KV pool from ``config.kv_cache_memory``.

    The backends are chosen once, here, from the dtype, the device and the config flags: ``kernels``
    (cpu_kernels, or None), ``ops`` (the glue between matmuls), ``linear_method`` (plain, oneDNN- or
    AMX-packed) and the composite attention ``backend``. Raises FileNotFoundError / ValueError from the
    loader (missing files, unsupported architecture) and ValueError if the KV budget holds no page."""

    def __init__(self, config: EngineConfig, tp=None, kv_scales_override=None):
        # kv_scales_override: (k, v) float32 [L, Hkv] static fp8 KV scales to use instead of resolving them
        # (a self-draft reads its target's, so the K/V bytes it copies mean the same values)
        t0 = time.perf_counter()
        self.model_dir = prepare_model_dir(config.model)
        self.model_config = mc = load_model_config(self.model_dir)
        # tensor parallelism (idleless.dist): rank 0 (tp None) checks the set-up and starts ranks 1..N-1, which
        # pass their own ``tp``; each rank's config has the KV budget in bytes and its share of the threads
        self.tp = tp
        if tp is None and config.tensor_parallel_size > 1:
            from idleless.dist.worker import TensorParallel
            self.tp = TensorParallel.start(config, mc, config.weight_dtype if config.weight_dtype != "auto" else
                                           native_weight_dtype(config.model) or "bf16")
        config = self.tp.config if self.tp is not None else config
        torch.set_num_threads(config.resolved_threads())
        # issue 15: with adaptive_threads (serve's default) the threads follow the cores other processes leave free
        self.thread_governor = ThreadGovernor(config.resolved_threads()) \
            if config.adaptive_threads and self.tp is None and config.device == "cpu" else None
        self.config = config
        self.dtype = resolve_dtype(config.dtype)
        self.context_length = config.context_length or mc.max_position_embeddings
        self.kernels = None if config.disable_cpu_kernels else cpu_kernels.load(self.dtype, config.device)
        self.ops = select_ops(self.kernels)
        # precision (issue 14): --weight-dtype auto is the checkpoint's own format (native Q4_1 for the
        # bundled GGUF), --activation-dtype, --kv-cache-dtype; quantised methods are chosen here too
        self.weight_dtype = config.weight_dtype if config.weight_dtype != "auto" else (
            native_weight_dtype(config.model) or "bf16")
        # issue 11: batch-invariant numerics by default in bfloat16 (``resolve_deterministic``)
        self.deterministic = det = resolve_deterministic(config.enable_deterministic_inference, self.dtype,
                                                         getattr(mc, "sliding_window", None), self.weight_dtype,
                                                         config.activation_dtype,
                                                         getattr(self.kernels, "has_q8p", False))
        self.linear_method = select_linear_method(self.dtype, config.device, config.disable_weight_prepack,
                                                  self.kernels, deterministic=det, weight_dtype=self.weight_dtype,
                                                  activation_dtype=config.activation_dtype)
        self.model = LlamaForCausalLM(mc, self.context_length, self.ops, self.linear_method)
        if self.tp is not None:
            self.tp.shard(self.model)  # this rank's heads, MLP features and vocabulary rows (dist.tp)
        self.model.to(self.dtype)
        self.model.rope.cos = self.model.rope.cos.float()
        self.model.rope.sin = self.model.rope.sin.float()
        self.model.eval()
        self.prepacked_bytes = 0  # bytes the linear method holds beyond the weights (packed copies)
        self.load_weights(load_state_dict(self.model_dir, self.dtype).items(), require_all=True)
        heads, kv_heads = mc.num_attention_heads, mc.num_key_value_heads
        if self.tp is not None:  # this rank's heads: its KV pool holds its KV heads only
            heads, kv_heads = self.tp.local_heads(heads), self.tp.local_heads(kv_heads)
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, kv_heads, mc.head_dim, self.dtype,
                                           config.kv_cache_dtype)
        num_slots = int(config.kv_cache_bytes() // per_token)
        # an fp8 KV cache's static scales per layer and KV head: --quantization-param-path's, or calibrated
        # here on the gate's built-in text (idleless.quant.kv_scales); None for the other formats
        self.kv_scales = kv_scales_override if kv_scales_override is not None else \
            kv_scales.resolve(self, heads, kv_heads)
        self.pool = KVPool(mc.num_hidden_layers, kv_heads, mc.head_dim, num_slots,
                           self.dtype, config.device, config.page_size, cache_dtype=config.kv_cache_dtype,
                           kv_scales=self.kv_scales, kernels=self.kernels)  # --disable-cpu-kernels: none
        self.backend = CompositeAttention(self.pool, heads, kv_heads, mc.head_dim,
                                          getattr(mc, "sliding_window", None), self.kernels, deterministic=det,
                                          int8_attention=config.activation_dtype == "int8")
        # small batches (decode, verify) skip the module tree: the same calls over preallocated buffers
        self.decode_graph = None if config.disable_decode_graph else DecodeGraph.build(self.model, self.backend)
        # structured outputs: per-request grammar matchers -> the sampler's token masks (the grammar engine
        # and the vocabulary load in a worker thread from here on)
        self.token_masks = TokenMasks(config.tokenizer or self.model_dir, mc.vocab_size)
        if self.tp is not None:
            self.tp.connect()  # rank 0: the workers have loaded; every rank joins the process group
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded %s (%s, %d layers) in %.1f s; weights %s, activations %s; KV pool %d tokens in %s "
                 "(%.2f GiB); deterministic inference %s", self.model_dir, self.dtype, mc.num_hidden_layers,
                 self.load_seconds, self.weight_dtype, config.activation_dtype, self.pool.num_slots,
                 config.kv_cache_dtype, self.pool.num_slots * per_token / 1024**3, "on" if det else "off")
        # accuracy gate (issue 14): the precision combination against the unquantised model on a built-in
        # text; raises QuantizationGateError past --max-quantization-kl (idleless.quant.gate)
        from idleless.quant.gate import precision_report
        self.precision = precision_report(self)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on the batch; returns float32 logits [len(sample_rows), vocab]."""
        return self.model.compute_logits(self._hidden(batch))

    def _hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The final-normed hidden states of ``batch.sample_rows`` ([N, hidden]); writes the K/V."""
        meta = self.backend.prepare(batch.extend_lens, batch.prefix_lens, batch.slot_tables)
        graph = self.decode_graph
        if graph is not None and graph.can_run(batch.num_tokens):
            return graph.hidden_states(batch.input_ids, batch.positions, meta, batch.out_cache_loc,
                                       batch.sample_rows)
        return self.model.hidden_states(batch.input_ids, batch.positions, self.backend, meta, batch.out_cache_loc,
                                        batch.sample_rows)

    def load_weights(self, named_tensors, require_all: bool = False) -> None:
        """Write HF-named tensors ((name, tensor) pairs: a checkpoint's, a trainer's) into the model by
        name and re-process every linear method (re-pack), so the next forward uses the new weights
        everywhere (``weights.load_weights``). A subset updates those parameters only; require_all
        (start-up) requires every one. Raises ValueError (unknown name, wrong shape, not floating
        point, a name twice, missing with require_all) before writing anything: the weights are then
        unchanged. The KV pool and the prefix cache still hold K/V of the old weights: call between
        steps and flush the cache for outputs of the new weights alone."""
        if self.tp is not None:  # each rank loads its piece; later updates would reach rank 0 alone
            if hasattr(self, "pool"):
                raise ValueError("weight updates are not supported with --tp-size > 1")
            named_tensors = self.tp.checkpoint_shards(self.model, named_tensors)
        self.prepacked_bytes = load_weights(self.model, named_tensors, require_all=require_all)

    @torch.inference_mode()
    def execute(self, plan):
        """Execute a ``StepPlan`` (idleless.engine.plan): build the tensors, run the forward, sample
        every sampled row (``plan.eos_ids`` for min_new_tokens) and compute the prompt logprobs of the
        plan's prompt-logprob rows. Rows of requests with a ``structured_output`` are masked by their
        grammars (``token_masks``, which forgets the plan's ``finished_ids``). Returns a ``StepResult``
        with one entry per scheduled request, in plan order."""
        from idleless.engine.plan import StepResult
        if self.thread_governor is not None:
            self.thread_governor.update()
        if self.tp is not None:
            self.tp.send_plan(plan)  # rank 0: the workers run this plan with it (their collectives join ours)
        self.token_masks.drop(plan.finished_ids)
        self.token_masks.begin(plan)
        observer = getattr(self, "step_observer", None)  # e.g. PD's layer-wise KV sender (idleless.disagg.layerwise)
        if observer is not None:
            observer.begin(plan)
        batch, rows, scored = forward_batch_of(plan)
        h = self._hidden(batch)
        sampled, lps, tops = [], [], []
        masks = self.token_masks.masks(plan)
        if rows:
            out = sample(self.model.compute_logits(h[:len(rows)]), rows, plan.eos_ids, masks)
        i = 0
        for r in plan.requests:
            k = r.num_sampled
            sampled.append(out.next_ids[i:i + k] if k else [])
            lps.append(out.logprobs[i:i + k] if k else [])
            tops.append(out.top_logprobs[i:i + k] if k else [])
            i += k
        prompt = self._prompt_logprobs(h[len(rows):], scored, len(plan.requests)) if scored else []
        return StepResult(sampled, lps, tops, prompt)

    def _prompt_logprobs(self, h: torch.Tensor, scored, num_requests: int) -> list[list[PromptLogprob]]:
        """PromptLogprob entries of the prompt-logprob rows (h: their hidden states [P, hidden], in the
        order of ``scored``), per plan index. The logits are made PROMPT_LOGITS_BLOCK rows at a time
        and reduced by ``sampler.token_logprobs`` (the sampler's own function) to the entries."""
        targets = [t for _, p in scored for t in p.targets]
        num_top = [p.num_top for _, p in scored for _ in p.targets]
        entries: list[PromptLogprob] = []
        for a in range(0, len(targets), PROMPT_LOGITS_BLOCK):
            b = min(a + PROMPT_LOGITS_BLOCK, len(targets))
            tok = torch.tensor(targets[a:b], dtype=torch.int64, device=h.device)
            values, tops, ranks = token_logprobs(self.model.compute_logits(h[a:b]), tok, num_top[a:b],
                                                 with_rank=True)
            entries.extend(map(PromptLogprob, targets[a:b], values, ranks, tops))
        out: list[list[PromptLogprob]] = [[] for _ in range(num_requests)]
        a = 0
        for i, p in scored:
            out[i] = entries[a:a + len(p.targets)]
            a += len(p.targets)
        return out
