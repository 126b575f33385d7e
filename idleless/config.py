"""EngineConfig: every engine knob in one dataclass.

The same field names are accepted by ``Engine(**kwargs)``, ``idleless generate`` and
``idleless serve`` (as ``--kebab-case`` flags, generated from the fields by ``add_cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Optional, get_type_hints

from idleless.quant.spec import check_precision


MAX_RAM_FRACTION = 0.9
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
SELF_DRAFT_WEIGHT_DTYPES = ("int4", "int8", "fp8")  # --speculative-draft-weight-dtype


def parse_memory(value: str | float | int) -> float:
    """Parse a memory budget: bytes (``2147483648``, ``2GiB``, ``512MB``) or a fraction of the
    currently available RAM (``0.2``, at most ``MAX_RAM_FRACTION``: the model, activations and the
    rest of the machine need the remainder). Returns bytes (float). Raises ValueError on bad input."""
    if isinstance(value, (int, float)):
        v = float(value)
    else:
        s = value.strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?", s, re.IGNORECASE)
        if not m:
            raise ValueError(f"cannot parse memory size {value!r} (try 2GiB, 512MB or 0.2)")
        v = float(m.group(1))
        unit = (m.group(2) or "").upper()
        if unit:
            mult = {"K": 1, "M": 2, "G": 3, "T": 4}.get(unit[0], 0)
            base = 1024 if "I" in unit else 1000
            return v * (base**mult if mult else 1)
    if 0 < v <= 1:
        if v > MAX_RAM_FRACTION:
            raise ValueError(f"memory size {value!r} reads as a fraction of the available RAM and takes more than "
                             f"{MAX_RAM_FRACTION:g} of it; give a smaller fraction or bytes with a unit (e.g. 1GiB)")
        return v * available_memory_bytes()
    if v <= 0:
        raise ValueError("memory size must be positive")
    return v


def available_memory_bytes() -> float:
    """Available RAM in bytes (MemAvailable from /proc/meminfo; 8 GiB if unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def option(default, help: str, *aliases: str, negative: Optional[str] = None):
    """An EngineConfig field whose ``--help`` text and extra flag names (the names SGLang and vLLM
    users type for the same setting) live in its metadata; ``add_cli_args`` reads them. negative: for a
    boolean whose default may be on, the flag that turns it off (``--disable-...``)."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "negative": negative})


@dataclass
class EngineConfig:
    """All engine settings. Units: tokens unless said otherwise."""

    model: Optional[str] = option(None, "GGUF file or HF model directory (default: the bundled SmolLM2-135M-Instruct)",
                                  "--model-path")
    tokenizer: Optional[str] = option(None, "tokenizer directory (default: the model's own)", "--tokenizer-path")
    dtype: str = option("auto", "float32 | bfloat16 | float16 | auto (bfloat16 when the CPU has native bf16 "
                        "matmul, else float32)")
    device: str = option("cpu", "torch device of the model and the KV pool; the fused C kernels run on cpu only")
    disable_weight_prepack: bool = option(False, "bf16 on CPU: plain F.linear (on fixed row tiles when deterministic) "
                                          "instead of the oneDNN-, AMX- or bi_linear- "
                                          "packed weights kept by default (faster linears, weights x2-3 RAM)")
    disable_cpu_kernels: bool = option(False, "CPU: eager PyTorch ops instead of the fused C kernels (norm, rope, "
                                       "decode attention)")
    disable_decode_graph: bool = option(False, "run batches of up to 64 tokens through the model's modules "
                                        "instead of the decode graph (the same calls over preallocated buffers; "
                                        "SGLang's --disable-cuda-graph, vLLM's --enforce-eager)")
    enable_deterministic_inference: Optional[bool] = option(
        None, "batch-invariant kernels: a position's logits depend on its tokens only, not on the batch, cache or "
        "chunking (default: on in bfloat16, off in float32 / float16; off with a log line for sliding-window "
        "models, which have no batch-invariant attention yet, and int8 / fp8 weights with bf16 activations)",
        negative="--disable-deterministic-inference")
    seed: int = option(0, "engine random seed (SGLang's --random-seed); a request without its own seed still "
                       "draws a random sampling key", "--random-seed")
    context_length: Optional[int] = option(None, "most tokens (prompt + output) of a request (default: the "
                                           "model's max_position_embeddings)", "--max-model-len")
    kv_cache_memory: str = option("2GiB", "KV pool size: bytes (2GiB, 512MB) or a fraction of the available RAM "
                                  "(0.2, at most 0.9); sets the KV capacity in tokens")
    page_size: int = option(1, "tokens per KV page (radix cache matches whole pages)", "--block-size")
    max_running_requests: int = option(256, "most requests in the running batch", "--max-num-seqs")
    max_prefill_tokens: int = option(8192, "token budget of one step: prefill chunks + decode tokens",
                                     "--max-num-batched-tokens")
    chunked_prefill_size: int = option(2048, "a long prompt is prefilled in chunks of at most this many tokens; "
                                       "<= 0: off")
    max_queued_requests: int = option(4096, "most requests waiting for the running batch; the server answers 503 "
                                      "beyond running + queued")
    schedule_policy: str = option("lpm", "fcfs | lpm | dfs-weight (see idleless.engine.policy)")
    schedule_fallback_threshold: int = option(128, "lpm / dfs-weight fall back to fcfs above this many waiting "
                                              "requests")
    max_queue_delay: float = option(30.0, "seconds; a request waiting longer goes before cache-ordered ones")
    disable_radix_cache: bool = option(False, "no prefix cache: every prompt is computed in full")
    radix_eviction_policy: str = option("lru", "lru | gdsf (value-aware: hits x recompute cost / size)")
    max_pinned_tokens: Optional[int] = option(None, "cap on pinned prefix tokens (default: a quarter of the KV pool)")
    num_threads: int = option(0, "torch intra-op threads; 0 = all usable cores (`idleless serve`: its "
                                   "engine core, whose OpenMP threads spin briefly, then sleep)")
    adaptive_threads: bool = option(False, "before each step, use only the cores other processes leave free, at "
                                    "most --num-threads (idleless.engine.threads; `idleless serve` turns it on "
                                    "when --num-threads is 0)")
    # tensor parallelism (idleless.dist; issue 17): its flag is added by add_cli_args with metavar N
    tensor_parallel_size: int = option(1, "tensor-parallel ranks: rank 0 runs the scheduler and starts N-1 worker "
                                       "processes, each holding 1/N of the heads, MLP and vocabulary "
                                       "(torch.distributed: gloo on CPU, NCCL on CUDA); the threads are split "
                                       "between them; N must divide the attention and KV heads",
                                       "--tp-size", "-tp")
    trace_file: Optional[str] = option(None, "append one JSON line per engine step to this file (step kind, batch, "
                                       "tokens, cache hits, time buckets)")
    log_level: str = option("info", "debug | info | warning | error")
    served_model_name: Optional[str] = option(None, "comma-separated names accepted in a request's `model` (the "
                                              "first is reported; default: the model's file or directory name)")
    # speculative decoding (idleless.spec); SGLang's flag names
    speculative_algorithm: Optional[str] = option(None, "speculative decoding: ngram | draft (SGLang's NGRAM / "
                                                  "STANDALONE); off when not given")
    speculative_num_draft_tokens: int = option(6, "most draft tokens per request per step")
    speculative_draft_model_path: Optional[str] = option(None, "the draft model of `draft` (same tokenizer as the "
                                                         "target model)")
    speculative_draft_kv_cache_memory: str = option("512MiB", "the draft model's own KV pool")
    speculative_draft_weight_dtype: Optional[str] = option(None, "draft: the draft model's weights as int4 (GGUF "
                                                           "Q4_1 blocks) | int8 | fp8; without "
                                                           "--speculative-draft-model-path the draft is the "
                                                           "target model itself at this precision")
    speculative_ngram_min_match_window_size: int = option(1, "ngram: shortest suffix matched, tokens")
    speculative_ngram_max_match_window_size: int = option(12, "ngram: longest suffix matched, tokens")
    speculative_disable_adaptive: bool = option(False, "fixed draft length, never switched off by the cost model")
    # KV events for a cache-aware router (idleless.router.events); vLLM's flag name
    kv_events_config: Optional[str] = option(None, "publish the prefix cache's stored/evicted token blocks and load "
                                             "reports over ZMQ: a JSON object, e.g. '{\"endpoint\": "
                                             "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'; off when "
                                             "not given")
    # prefill/decode disaggregation (idleless.disagg; issue 18); SGLang's flag names
    disaggregation_mode: str = option("null", "null (colocated) | prefill (serve pulls of cached prompts' KV on "
                                      "the bootstrap port) | decode (pull the KV named by a request's "
                                      "kv_transfer_params before queueing it)")
    disaggregation_transfer_backend: str = option("tcp", "KV transfer backend: tcp (ZMQ) | mooncake (the KV bytes "
                                                  "through Mooncake's transfer engine over TCP; pip install "
                                                  "mooncake-transfer-engine-non-cuda; both engines must agree)")
    disaggregation_bootstrap_host: str = option("127.0.0.1", "prefill mode: the address the KV transfer port binds; "
                                                "mooncake, both modes: the address this engine's transfer "
                                                "engine is reached at")
    disaggregation_bootstrap_port: int = option(8998, "prefill mode: the KV transfer port")
    disaggregation_timeout: float = option(30.0, "decode mode: seconds a request waits for its KV before the "
                                           "fallback; mooncake, both modes: also the most one transfer may take "
                                           "(MC_TRANSFER_TIMEOUT when unset, at least 5)")
    pd_fallback: str = option("recompute", "decode mode, when a KV transfer fails: recompute (prefill here) | "
                              "error (end the request)")
    # precision of weights, activations and KV cache, each on its own (idleless.quant; issue 14)
    weight_dtype: str = option("auto", "auto (as stored) | bf16 (unquantised, in --dtype) | int8 (per output "
                               "channel) | int4 (Q4_1 blocks of 32) | fp8 (e4m3 per output channel); quantised "
                               "at load from float checkpoints")
    activation_dtype: str = option("bf16", "bf16 (the model dtype) | int8 (dynamic: per token with int8 weights, "
                                   "W8A8; per block of 32 with int4 or native GGUF Q4_1 weights, W4A8; and the "
                                   "deterministic attention's q.k and P.V on int8 codes where the CPU has "
                                   "AVX-512 BF16 + VNNI)")
    kv_cache_dtype: str = option("auto", "auto (the model dtype) | bf16 | fp8_e4m3 | fp8_e5m2 (a static scale per "
                                 "layer and KV head: calibrated at start-up on a built-in text, or "
                                 "--quantization-param-path; exactly twice bf16's tokens) | int8 (a scale per "
                                 "token and KV head; ~1.9x bf16's tokens)")
    quantization_param_path: Optional[str] = option(None, "fp8 KV cache: a JSON file of K/V scales per layer (and "
                                                    "optionally per KV head) instead of the calibration pass; "
                                                    "vLLM's / SGLang's kv_cache.scaling_factor schema "
                                                    "(idleless.quant.kv_scales); a missing layer or head is refused")
    # the accuracy gate at start-up (idleless.quant.gate; issue 14)
    max_quantization_kl: float = option(0.1, "refuse to start when the chosen weight / activation / KV precision's "
                                        "mean KL divergence from the unquantised model on a built-in text exceeds "
                                        "this (nats)")
    allow_accuracy_loss: bool = option(False, "start anyway when the accuracy gate's KL exceeds "
                                       "--max-quantization-kl (logged as a warning)")
    skip_quantization_gate: bool = option(False, "do not measure a quantised combination against the unquantised "
                                          "model at start-up")
    # tool calls in chat replies (idleless.server.tool_calls; issue 12); vLLM's and SGLang's flag name
    tool_call_parser: Optional[str] = option(None, "how tool calls are read from a reply when tool_choice is auto: "
                                             "hermes | smollm2 | llama3_json (unset: auto is refused; required "
                                             "and named functions need no parser)")

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm", "dfs-weight"):
            raise ValueError(f"schedule_policy must be fcfs, lpm or dfs-weight, got {self.schedule_policy!r}")
        if self.radix_eviction_policy not in ("lru", "gdsf"):
            raise ValueError(f"radix_eviction_policy must be lru or gdsf, got {self.radix_eviction_policy!r}")
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_speculative()
        self._check_disaggregation()
        self.kv_cache_dtype = check_precision(self.weight_dtype, self.activation_dtype, self.kv_cache_dtype)

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError(f"disaggregation_mode must be null, prefill or decode, got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in ("tcp", "mooncake"):
            raise ValueError("disaggregation_transfer_backend must be tcp or mooncake, got "
                             f"{self.disaggregation_transfer_backend!r}")
        if self.pd_fallback not in ("recompute", "error"):
            raise ValueError(f"pd_fallback must be recompute or error, got {self.pd_fallback!r}")
        if not self.disaggregation_timeout > 0:
            raise ValueError(f"disaggregation_timeout must be > 0 seconds, got {self.disaggregation_timeout!r}")
        if not 0 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(f"disaggregation_bootstrap_port must be in 0..65535, got {self.disaggregation_bootstrap_port}")

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            given = [f.name for f in fields(self) if f.name.startswith("speculative_")
                     and f.name != "speculative_algorithm" and getattr(self, f.name) != f.default]
            if given:
                logging.getLogger("idleless").warning(
                    "%s set without --speculative-algorithm: speculative decoding stays off",
                    ", ".join("--" + g.replace("_", "-") for g in given))
            return
        algo = {"standalone": "draft", "suffix": "ngram"}.get(algo.lower(), algo.lower())
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} "
                             f"(or SGLang's NGRAM / STANDALONE), got {self.speculative_algorithm!r}")
        self.speculative_algorithm = algo
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")
        draft_dtype = self.speculative_draft_weight_dtype
        if draft_dtype is not None and draft_dtype not in SELF_DRAFT_WEIGHT_DTYPES:
            raise ValueError(f"speculative_draft_weight_dtype must be one of {', '.join(SELF_DRAFT_WEIGHT_DTYPES)}, "
                             f"got {draft_dtype!r}")
        if algo == "draft" and not self.speculative_draft_model_path and draft_dtype is None:
            raise ValueError("speculative_algorithm 'draft' needs speculative_draft_model_path (a smaller model "
                             "with the same tokenizer) or speculative_draft_weight_dtype (the target model "
                             "itself at a lower weight precision, e.g. int4)")
        if (algo == "draft" and self.speculative_draft_model_path
                and not os.path.exists(os.path.expanduser(self.speculative_draft_model_path))):
            raise ValueError(f"speculative_draft_model_path {self.speculative_draft_model_path!r} does not exist "
                             "(a .gguf file or an HF model directory)")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError("the ngram match window must satisfy 1 <= min <= max, "
                             f"got min {lo}, max {hi}")

    def kv_cache_bytes(self) -> float:
        return parse_memory(self.kv_cache_memory)

    def resolved_threads(self) -> int:
        return self.num_threads or (os.cpu_count() or 1)


def ram_fraction(value: str) -> str:
    """argparse type of ``--mem-fraction-static`` / ``--gpu-memory-utilization``: a fraction in
    (0, MAX_RAM_FRACTION], returned as the ``kv_cache_memory`` string that means that fraction of the
    available RAM. Raises argparse.ArgumentTypeError otherwise (bytes go to ``--kv-cache-memory``)."""
    try:
        v = float(value)
    except ValueError:
        v = float("nan")
    if not 0 < v <= MAX_RAM_FRACTION:
        raise argparse.ArgumentTypeError(f"{value!r} is not a fraction in (0, {MAX_RAM_FRACTION:g}]; give a KV "
                                         "pool size in bytes with --kv-cache-memory (e.g. 4GiB)")
    return repr(v)


def at_least_one(value: str, what: str = "the value") -> int:
    """argparse type of a count: ``value`` as an integer >= 1. Raises argparse.ArgumentTypeError otherwise,
    naming ``what``."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{what} must be an integer >= 1, got {value!r}")
    return n


def tensor_parallel_size(value: str) -> int:
    """argparse type of ``--tensor-parallel-size`` / ``--tp-size`` / ``-tp``: an integer >= 1. Raises
    argparse.ArgumentTypeError otherwise (whether N divides the model's heads is checked at load)."""
    return at_least_one(value, "the tensor-parallel size")


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--kebab-case`` flag per EngineConfig field (booleans become store_true flags, plus the
    field's ``negative`` store_false flag where it has one), with
    its help and its SGLang / vLLM names from the field's metadata (``option``), plus
    ``--mem-fraction-static`` / ``--gpu-memory-utilization`` (a fraction for ``kv_cache_memory``)
    and ``--tensor-parallel-size`` / ``--tp-size`` / ``-tp`` (metavar N). Fields in ``skip`` get no flag."""
    hints = get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name in skip or f.name == "tensor_parallel_size":  # its own flag, below
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else None
        help = f.metadata.get("help", "") + ("" if default is None or default is False else f" (default: {default})")
        typ = hints[f.name]
        if typ in (bool, Optional[bool]):
            parser.add_argument(*flags, action="store_true", default=default, dest=f.name, help=help)
            if f.metadata.get("negative"):
                parser.add_argument(f.metadata["negative"], action="store_false", default=argparse.SUPPRESS,
                                    dest=f.name, help=f"turn {flags[0]} off")
        else:
            base = int if typ in (int, Optional[int]) else float if typ in (float, Optional[float]) else str
            parser.add_argument(*flags, type=base, default=default, dest=f.name, help=help)
    if "kv_cache_memory" not in skip:
        parser.add_argument("--mem-fraction-static", "--gpu-memory-utilization", type=ram_fraction,
                            dest="kv_cache_memory", default=argparse.SUPPRESS, metavar="FRACTION",
                            help="SGLang's and vLLM's memory fraction, mapped onto --kv-cache-memory FRACTION: there "
                                 "it is the share of accelerator memory for weights + KV cache, here the KV pool "
                                 "takes that share of the RAM still available after the weights are loaded "
                                 f"(at most {MAX_RAM_FRACTION:g})")
    if "tensor_parallel_size" not in skip:
        tp = next(f for f in fields(EngineConfig) if f.name == "tensor_parallel_size")
        parser.add_argument("--tensor-parallel-size", *tp.metadata["aliases"], type=tensor_parallel_size, default=1,
                            dest="tensor_parallel_size", metavar="N", help=tp.metadata["help"] + " (default: 1)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from a namespace filled by ``add_cli_args``."""
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
