"""EngineConfig: every engine knob in one dataclass.

The same field names are accepted by ``Engine(**kwargs)``, ``idleless generate`` and
``idleless serve`` (as ``--kebab-case`` flags, generated from the fields by ``add_cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Optional, get_type_hints


MAX_RAM_FRACTION = 0.9
SPECULATIVE_ALGORITHMS = ("ngram", "draft")


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


@dataclass
class EngineConfig:
    """All engine settings. Units: tokens unless said otherwise."""

    model: Optional[str] = None  # GGUF file or HF directory; None = the bundled SmolLM2-135M-Instruct
    tokenizer: Optional[str] = None  # defaults to the model's own
    dtype: str = "auto"  # float32 | bfloat16 | auto (bfloat16 when the CPU has native bf16)
    device: str = "cpu"
    disable_weight_prepack: bool = False  # bf16 on CPU: keep oneDNN- (and AMX-) packed weights (faster linears, weights x2-3 RAM)
    disable_cpu_kernels: bool = False  # CPU: eager PyTorch ops instead of the fused C kernels (norm, rope, decode attention)
    enable_deterministic_inference: bool = False  # batch-invariant kernels: a position's logits depend on its tokens only
    seed: int = 0
    context_length: Optional[int] = None  # defaults to the model's max_position_embeddings
    kv_cache_memory: str = "2GiB"  # bytes ("2GiB") or a fraction of available RAM ("0.2")
    page_size: int = 1
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # token budget of one step: prefill chunks + decode tokens
    chunked_prefill_size: int = 2048  # a long prompt is prefilled in chunks of at most this many; <= 0: off
    max_queued_requests: int = 4096
    schedule_policy: str = "lpm"  # fcfs | lpm | dfs-weight (see idleless.engine.policy)
    schedule_fallback_threshold: int = 128  # lpm / dfs-weight fall back to fcfs above this many waiting
    max_queue_delay: float = 30.0  # seconds; a request waiting longer goes before cache-ordered ones
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # lru | gdsf (value-aware)
    max_pinned_tokens: Optional[int] = None  # cap on pinned prefix tokens; default a quarter of the pool
    num_threads: int = 0  # torch intra-op threads; 0 = all cores offline, all but one for `idleless serve`
    trace_file: Optional[str] = None
    log_level: str = "info"
    served_model_name: Optional[str] = None
    # speculative decoding (idleless.spec); SGLang's flag names
    speculative_algorithm: Optional[str] = None  # ngram | draft (SGLang's NGRAM / STANDALONE); None: off
    speculative_num_draft_tokens: int = 6  # most draft tokens per request per step
    speculative_draft_model_path: Optional[str] = None  # the draft model of `draft` (same tokenizer)
    speculative_draft_kv_cache_memory: str = "512MiB"  # the draft model's own KV pool
    speculative_ngram_min_match_window_size: int = 1  # ngram: shortest suffix matched, tokens
    speculative_ngram_max_match_window_size: int = 12  # ngram: longest suffix matched, tokens
    speculative_disable_adaptive: bool = False  # fixed draft length, never switched off by the cost model

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
        self._check_speculative()

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        algo = {"standalone": "draft", "suffix": "ngram"}.get(algo.lower(), algo.lower())
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} "
                             f"(or SGLang's NGRAM / STANDALONE), got {self.speculative_algorithm!r}")
        self.speculative_algorithm = algo
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")
        if algo == "draft" and not self.speculative_draft_model_path:
            raise ValueError("speculative_algorithm 'draft' needs speculative_draft_model_path (a smaller model "
                             "with the same tokenizer)")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError("the ngram match window must satisfy 1 <= min <= max, "
                             f"got min {lo}, max {hi}")

    def kv_cache_bytes(self) -> float:
        return parse_memory(self.kv_cache_memory)

    def resolved_threads(self) -> int:
        return self.num_threads or (os.cpu_count() or 1)


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--kebab-case`` flag per EngineConfig field (booleans become store_true flags)."""
    hints = get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        typ = hints[f.name]
        if typ is bool:
            parser.add_argument(flag, action="store_true", default=default)
        else:
            base = int if typ in (int, Optional[int]) else float if typ in (float, Optional[float]) else str
            parser.add_argument(flag, type=base, default=default, dest=f.name)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from a namespace filled by ``add_cli_args``."""
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
