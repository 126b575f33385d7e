"""``idleless bench offline``: offline throughput of the in-process ``Engine`` on a recorded workload.

    idleless bench offline --workload ../shared/workloads/shared_prefix.json --compare \\
        --decode-batch1 --output benchmarks/results/2026-11-29-shared_prefix.json

What it measures (all times are wall-clock seconds, ``time.perf_counter``):

* **Workload run**: every request of the workload file, submitted at once in a seeded shuffled
  order (``--seed``) so cache-aware ordering has something to do, greedy, eos ignored, each with
  its recorded ``max_tokens``. Prompts are the recorded ``prompt_token_ids`` (not the text: they
  were tokenized by the HF tokenizer built from the GGUF, which differs slightly from ours, so the
  ids are the only input every system sees identically). Reported: output tokens/s, total
  (prompt + output) tokens/s, prompt tokens computed vs served from the radix cache, and where the
  wall time went per ``Engine.stats()`` (model forward + sampling, scheduling, the rest =
  detokenization and Python around the loop). The engine is warmed up first (a tiny generate,
  then ``flush_cache``); the figures are differences of ``stats()`` around the timed run.
* ``--compare``: the same engine with the radix cache off, and transformers' ``generate`` on the
  same weights and dtype in static batches of ``--hf-batch-size`` (32), left-padded, greedy, eos
  ignored. ``speedup_vs_hf`` / ``speedup_vs_radix_off`` are ratios of wall times (the output
  tokens are the same, so also of output tokens/s).
* ``--decode-batch1``: one short prompt (the first ``--batch1-prompt-len`` ids of the workload's
  first request) at batch 1, for Idleless and transformers. Decode tokens/s =
  ``decode_tokens / (t(1 + decode_tokens new tokens) - t(1 new token))`` (medians over
  ``--batch1-reps``), i.e. the prefill and first token are subtracted out; MBU = decode steps/s x
  weight bytes read per step / ``--peak-mem-bw-gbs``. Prefill: the workload's first full prompt
  with 1 new token, prefill tokens/s and MFU = model FLOPs / s / ``--peak-gflops``.

Model FLOPs ~ 2 x non-embedding parameters per token run + 2 x hidden x vocab per sampled token
(the lm_head runs only where a token is sampled); attention-score FLOPs are left out, so MFU is a
slight under-estimate for long prompts. Weight bytes per decode step = the bytes the linears
and the lm_head hold as stored (a GGUF's Q4_1 / Q8_0 blocks with their scales; for transformers'
float model (non-embedding parameters + the lm_head matrix) x bytes per parameter; the embedding
lookup reads one row). The peaks
default to this machine's figures (about 25 GB/s copy bandwidth, about 1,800 GFLOP/s bf16 matmul on AMX);
pass others with the flags. Every phase records the 1-minute load average before and after it:
on a shared machine the numbers are only as quiet as the load.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKLOAD = "../shared/workloads/shared_prefix.json"
DEFAULT_PEAK_MEM_BW_GBS = 25.0  # GB/s (1e9 bytes/s), memory copy bandwidth of the bench machine
DEFAULT_PEAK_GFLOPS = 1800.0  # GFLOP/s, bf16 matmul peak of the bench machine (AMX; probed 1,700-1,960)
TOKENIZER_NOTE = ("prompts are the workload's recorded prompt_token_ids (tokenized by the HF tokenizer "
                  "built from the GGUF, slightly different from Idleless's), used as is by every system")


# --------------------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------------------
class WorkloadError(ValueError):
    """A workload file that cannot be used (bad JSON, no requests, a request without ids)."""


@dataclass
class WorkItem:
    """One request of a workload: ``prompt_ids`` (token ids) and ``max_tokens`` (new tokens)."""

    id: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Workload:
    path: str
    name: str
    items: list[WorkItem]
    temperature: float
    ignore_eos: bool
    stats: dict

    @property
    def prompt_tokens(self) -> int:
        return sum(len(it.prompt_ids) for it in self.items)

    @property
    def output_tokens(self) -> int:
        return sum(it.max_tokens for it in self.items)


def resolve_workload_path(path: str) -> Path:
    """Find a workload file: an absolute path; a path relative to the current directory or to the
    repository root (``make bench`` runs from the root); or a bare name (``random``) looked up as
    ``../shared/workloads/<name>.json`` next to the repository. Raises FileNotFoundError naming
    every place it looked."""
    p = Path(os.path.expanduser(path))
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    if not p.is_absolute() and p.parent == Path(".") and not p.suffix:
        candidates.append(REPO_ROOT.parent / "shared" / "workloads" / f"{p.name}.json")
    for c in candidates:
        if c.is_file():
            return c.resolve()
    looked = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise FileNotFoundError(f"workload file {path!r} not found (looked at: {looked})")


def load_workload(path: str) -> Workload:
    """Read a workload JSON (see ../shared/workloads/README.md): ``requests[*].prompt_token_ids``
    and ``max_tokens``; ``sampling.temperature`` / ``ignore_eos`` (defaults 0.0 / true).
    Raises FileNotFoundError or WorkloadError (bad JSON, no requests, a request without ids)."""
    resolved = resolve_workload_path(path)
    try:
        data = json.loads(resolved.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise WorkloadError(f"workload {resolved} is not valid JSON: {e}") from e
    reqs = data.get("requests") if isinstance(data, dict) else None
    if not reqs:
        raise WorkloadError(f"workload {resolved} has no 'requests'")
    sampling = data.get("sampling") or {}
    default_max = sampling.get("max_tokens", 128)
    items = []
    for i, r in enumerate(reqs):
        ids = r.get("prompt_token_ids")
        if not ids or not all(isinstance(t, int) for t in ids):
            raise WorkloadError(f"workload {resolved}: request {i} has no prompt_token_ids")
        items.append(WorkItem(str(r.get("id", i)), list(ids), int(r.get("max_tokens", default_max))))
    return Workload(str(resolved), str(data.get("name", resolved.stem)), items,
                    float(sampling.get("temperature", 0.0)), bool(sampling.get("ignore_eos", True)),
                    data.get("stats") or {})


def shuffled(items: Sequence[WorkItem], seed: int) -> list[WorkItem]:
    """The submission order: ``items`` shuffled by ``random.Random(seed)``."""
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


# --------------------------------------------------------------------------------------------------
# model cost: FLOPs and bytes
# --------------------------------------------------------------------------------------------------
@dataclass
class ModelCost:
    """What one token costs. non_embedding_params: parameters every token runs through (all but
    the input embedding and the lm_head); lm_head_params: hidden x vocab (run per sampled token);
    bytes_per_param: of the weight dtype; kv_bytes_per_token: K+V over all layers; weight_bytes:
    the bytes the linears of one decode step read as stored (quantised blocks and their scales,
    e.g. the bundled GGUF's Q4_1 layers and Q8_0 head), None when the weights are plain tensors."""

    non_embedding_params: int
    lm_head_params: int
    bytes_per_param: int
    kv_bytes_per_token: int
    weight_bytes: Optional[int] = None

    @property
    def param_bytes(self) -> int:
        """(non-embedding + lm_head params) x bytes_per_param: the decode step's weight bytes of a
        model that stores its weights in its compute dtype (transformers' model in the same run)."""
        return (self.non_embedding_params + self.lm_head_params) * self.bytes_per_param

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights read by one decode step: non-embedding weights + the lm_head matrix, as
        stored (``weight_bytes`` when known, else ``param_bytes``)."""
        return self.weight_bytes if self.weight_bytes is not None else self.param_bytes

    def flops(self, forward_tokens: float, sampled_tokens: float) -> float:
        """Model FLOPs: 2 x non-embedding params per token run + 2 x lm_head params per sampled token."""
        return 2.0 * self.non_embedding_params * forward_tokens + 2.0 * self.lm_head_params * sampled_tokens


def model_cost(model, hidden_size: int, vocab_size: int, num_layers: int, num_kv_heads: int,
               head_dim: int, kv_bytes_per_elem: Optional[int] = None) -> ModelCost:
    """Count a torch model's parameters (shared ones once): embeddings are the weights of
    ``nn.Embedding`` modules and any parameter named ``*lm_head.weight``; the rest is
    non-embedding. Works for Idleless's and transformers' Llama alike."""
    from torch import nn

    total = embed = 0
    elem = None
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, p in model.named_parameters():  # named_parameters() yields a shared tensor once
        total += p.numel()
        if id(p) in embed_ids or name.endswith("lm_head.weight"):
            embed += p.numel()
        elif elem is None and p.dim() == 2:
            elem = p.element_size()
    elem = elem or 4
    kv_elem = kv_bytes_per_elem or elem
    return ModelCost(non_embedding_params=total - embed, lm_head_params=hidden_size * vocab_size,
                     bytes_per_param=elem, kv_bytes_per_token=2 * num_layers * num_kv_heads * head_dim * kv_elem)


def measure_peaks(dtype, reps: int = 5) -> dict:
    """Quick roofline probes on this machine with torch's current thread count (best of ``reps``).

    copy_gbs: STREAM-copy bandwidth, GB/s counting bytes read + written (a 256 MiB float32
    ``copy_``); matmul_gflops: GFLOP/s of a 2048^3 matmul in ``dtype``; gemv_weight_gbs: weight
    bytes read per second by decode-shaped GEMVs ([1 x 576] x [576 x 3072] in ``dtype``) swept over
    distinct matrices totalling 256 MiB, so the weights stream from memory as a decode step's do
    (one matrix alone would sit in the last-level cache). ``gemv_weight_gbs`` / the weight bytes of
    a decode step is the batch-1 decode bound ``idleless bench offline --measure-peaks`` reports."""
    import torch

    src = torch.ones(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    a = torch.randn(2048, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    x = torch.randn(1, 576).to(dtype)
    w0 = torch.randn(3072, 576).to(dtype)
    ws = [w0.clone() for _ in range(-(-256 * 1024 * 1024 // (w0.numel() * w0.element_size())))]
    copy_s, mm_s, gemv_s = [], [], []
    for _ in range(max(1, reps)):
        t = time.perf_counter(); dst.copy_(src); copy_s.append(time.perf_counter() - t)
        t = time.perf_counter(); a @ b; mm_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for w in ws:
            torch.nn.functional.linear(x, w)
        gemv_s.append(time.perf_counter() - t)
    return {"copy_gbs": 2 * src.numel() * 4 / min(copy_s) / 1e9,
            "matmul_gflops": 2 * 2048**3 / min(mm_s) / 1e9,
            "gemv_weight_gbs": sum(w.numel() * w.element_size() for w in ws) / min(gemv_s) / 1e9,
            "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "load_avg_1m": load_avg()}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def load_avg() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _log(msg: str) -> None:
    print(f"[bench offline] {msg}", file=sys.stderr, flush=True)


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def _agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict:
    """How far two systems' greedy outputs agree: share of identical sequences, mean common
    prefix (tokens). Informational: bf16 numerics differ with batch shape, so ties flip."""
    same = sum(1 for x, y in zip(a, b) if list(x) == list(y))
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        prefixes.append(n)
    return {"identical_fraction": same / len(a) if a else 0.0,
            "mean_common_prefix_tokens": statistics.fmean(prefixes) if prefixes else 0.0}


def _host_info() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover
        tf_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": tf_version, "python": platform.python_version(),
            "git_commit": commit}


_COUNTERS = ("num_requests", "num_finished", "num_aborted", "prompt_tokens", "cached_tokens",
             "computed_prompt_tokens", "generation_tokens", "num_retractions", "evicted_tokens",
             "num_admitted", "queue_time", "num_steps", "forward_time", "schedule_time")


def _stats_diff(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in _COUNTERS if k in before and k in after}


def _run_summary(wall: float, prompt_tokens: int, cached: int, computed: int, output_tokens: int,
                 num_requests: int, cost: ModelCost, peak_gflops: float) -> dict:
    """Figures common to every system. Model FLOPs count the useful tokens: computed prompt
    tokens + fed-back output tokens (all but each request's last) through the body, and every
    output token through the lm_head."""
    forward_tokens = computed + max(0, output_tokens - num_requests)
    flops = cost.flops(forward_tokens, output_tokens)
    return {
        "wall_s": wall,
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": computed,
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall if wall else None,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall if wall else None,
        "model_gflop": flops / 1e9,
        "model_gflops_per_s": flops / 1e9 / wall if wall else None,
        "mfu": flops / 1e9 / wall / peak_gflops if wall else None,
    }


# --------------------------------------------------------------------------------------------------
# Idleless
# --------------------------------------------------------------------------------------------------
def _greedy(max_tokens: int, ignore_eos: bool = True, temperature: float = 0.0):
    from idleless.engine.request import SamplingParams

    return SamplingParams(temperature=temperature, max_new_tokens=max_tokens, ignore_eos=ignore_eos)


def engine_cost(engine) -> ModelCost:
    """ModelCost of a loaded Engine's model (its own dtype; KV in the pool's dtype; weight bytes
    as its linear methods store them, so a quantised model's MBU counts the bytes it reads)."""
    from idleless.quant.gate import linear_weight_bytes

    runner = engine.core.runner
    mc = runner.model_config
    dt = getattr(runner.pool, "dtype", None)
    kv_elem = dt.itemsize if dt is not None else None
    cost = model_cost(runner.model, mc.hidden_size, mc.vocab_size, mc.num_hidden_layers,
                      mc.num_key_value_heads, mc.head_dim, kv_elem)
    linear_bytes, linear_weights = linear_weight_bytes(runner.model)
    rest = cost.non_embedding_params + cost.lm_head_params - linear_weights  # norms, as plain tensors
    return dataclasses.replace(cost, weight_bytes=linear_bytes + rest * cost.bytes_per_param)


def warmup_engine(engine, prompt: Sequence[int]) -> None:
    """A tiny untimed generate (16 prompt tokens, 4 new), then flush the radix cache."""
    engine.generate(list(prompt)[:16], _greedy(4), use_tqdm=False)
    engine.flush_cache()


def run_engine_workload(engine, items: Sequence[WorkItem], workload: Workload, cost: ModelCost,
                        peak_gflops: float) -> tuple[dict, list[list[int]]]:
    """Submit every item at once (in the given order) to a warmed-up, flushed engine and time
    ``generate`` until all finish. Returns (figures, output ids in ``items`` order).

    Figures beyond ``_run_summary``: forward_s / schedule_s (seconds, from ``Engine.stats()``:
    forward = model forward + sampling), their fractions of the wall time, other_fraction (the
    rest: detokenization, output handling, Python around the loop), num_steps, num_retractions,
    mfu_in_forward (model FLOPs / forward seconds / peak), and the stats() differences."""
    params = [_greedy(it.max_tokens, workload.ignore_eos, workload.temperature) for it in items]
    load0 = load_avg()
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate([list(it.prompt_ids) for it in items], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = engine.stats()
    d = _stats_diff(before, after)
    output_ids = [list(o.token_ids) for o in outs]
    out_tokens = sum(len(o) for o in output_ids)
    prompt_tokens = sum(len(it.prompt_ids) for it in items)
    cached = sum(o.cached_tokens for o in outs)
    computed = int(d.get("computed_prompt_tokens", prompt_tokens - cached))
    res = _run_summary(wall, prompt_tokens, cached, computed, out_tokens, len(items), cost, peak_gflops)
    fwd, sched = d.get("forward_time", 0.0), d.get("schedule_time", 0.0)
    flops = res["model_gflop"] * 1e9
    res.update({
        "forward_s": fwd,
        "forward_fraction": fwd / wall if wall else None,
        "schedule_s": sched,
        "schedule_fraction": sched / wall if wall else None,
        "other_fraction": (wall - fwd - sched) / wall if wall else None,
        "num_steps": int(d.get("num_steps", 0)),
        "num_retractions": int(d.get("num_retractions", 0)),
        "ms_per_step": 1000 * wall / d["num_steps"] if d.get("num_steps") else None,
        "mfu_in_forward": flops / 1e9 / fwd / peak_gflops if fwd else None,
        "stats_diff": d,
        "stats_prompt_tokens": int(d.get("prompt_tokens", prompt_tokens)),
        "stats_cached_tokens": int(d.get("cached_tokens", cached)),
        "load_avg_1m_before": load0,
        "load_avg_1m_after": load_avg(),
    })
    return res, output_ids


def _engine_timer(engine) -> Callable[[Sequence[int], int], tuple[float, float]]:
    """time_fn for measure_batch1: flush the cache, generate one prompt; returns
    (wall seconds, seconds in model forward per Engine.stats())."""
    def time_fn(prompt: Sequence[int], n: int) -> tuple[float, float]:
        engine.flush_cache()
        f0 = engine.stats()["forward_time"]
        t0 = time.perf_counter()
        out = engine.generate(list(prompt), _greedy(n), use_tqdm=False)
        dt = time.perf_counter() - t0
        if out.completion_tokens != n:
            raise RuntimeError(f"expected {n} new tokens, got {out.completion_tokens}")
        return dt, engine.stats()["forward_time"] - f0
    return time_fn


# --------------------------------------------------------------------------------------------------
# batch 1
# --------------------------------------------------------------------------------------------------
TimeFn = Callable[[Sequence[int], int], tuple[float, Optional[float]]]


def measure_batch1(time_fns: dict[str, TimeFn], decode_prompt: Sequence[int], prefill_prompt: Sequence[int],
                   decode_tokens: int, reps: int, cost: ModelCost, peak_mem_bw_gbs: float,
                   peak_gflops: float, weight_bytes: Optional[dict[str, int]] = None) -> dict[str, dict]:
    """Batch-1 decode and prefill figures for each system, from ``time_fns[name](prompt,
    new_tokens) -> (seconds, forward seconds or None)``. The systems are interleaved within each
    repetition (and the order reversed every other one), so a change of machine load hits them alike.

    Per system: decode_tokens_per_s = decode_tokens / (median t(decode_tokens + 1) - median t(1))
    on ``decode_prompt``; mbu = that x the system's weight bytes / peak bandwidth (KV reads, a
    few MB at short context, are left out); decode_bound_tokens_per_s = peak bandwidth / weight
    bytes. A system's weight bytes are ``weight_bytes[name]`` when given (what that system stores:
    transformers' float weights, llama.cpp's GGUF tensors), else ``cost.decode_weight_bytes``. prefill_tokens_per_s = len(prefill_prompt) / median t(1) on ``prefill_prompt``;
    prefill_mfu = model FLOPs of that (prompt through the body + one lm_head row) / s / peak."""
    names = list(time_fns)
    raw = {n: {"t1": [], "tn": [], "tp": [], "f1": [], "fn": [], "load": [load_avg()]} for n in names}
    for r in range(max(1, reps)):
        for n in (names if r % 2 == 0 else names[::-1]):
            fn, d = time_fns[n], raw[n]
            a, fa = fn(decode_prompt, 1)
            b, fb = fn(decode_prompt, decode_tokens + 1)
            c, _ = fn(prefill_prompt, 1)
            d["t1"].append(a), d["tn"].append(b), d["tp"].append(c)
            if fa is not None and fb is not None:
                d["f1"].append(fa), d["fn"].append(fb)
            d["load"].append(load_avg())
    bw = peak_mem_bw_gbs * 1e9
    out = {}
    for n in names:
        d = raw[n]
        decode_s = statistics.median(d["tn"]) - statistics.median(d["t1"])
        decode_tps = decode_tokens / decode_s if decode_s > 0 else None
        prefill_s = statistics.median(d["tp"])
        prefill_flops = cost.flops(len(prefill_prompt), 1)
        wb = (weight_bytes or {}).get(n, cost.decode_weight_bytes)
        res = {
            "decode_prompt_tokens": len(decode_prompt),
            "decode_tokens": decode_tokens,
            "reps": max(1, reps),
            "t_first_token_s": d["t1"],
            "t_all_tokens_s": d["tn"],
            "decode_s": decode_s,
            "decode_tokens_per_s": decode_tps,
            "decode_ms_per_token": 1000 * decode_s / decode_tokens if decode_s > 0 else None,
            "weight_bytes": wb,
            "decode_bound_tokens_per_s": bw / wb,
            "mbu": decode_tps * wb / bw if decode_tps else None,
            "prefill_prompt_tokens": len(prefill_prompt),
            "t_prefill_s": d["tp"],
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": len(prefill_prompt) / prefill_s if prefill_s else None,
            "prefill_mfu": prefill_flops / prefill_s / (peak_gflops * 1e9) if prefill_s else None,
            "load_avg_1m_before": d["load"][0],
            "load_avg_1m_after": d["load"][-1],
            "load_avg_1m_samples": d["load"],
        }
        if d["f1"]:
            fwd = statistics.median(d["fn"]) - statistics.median(d["f1"])
            res["decode_forward_ms_per_token"] = 1000 * fwd / decode_tokens
            res["decode_forward_fraction"] = fwd / decode_s if decode_s > 0 else None
        out[n] = res
    return out


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``idleless bench offline``: its own plus every EngineConfig field (``--seed`` is
    both the engine seed and the shuffle seed)."""
    from idleless.config import add_cli_args

    parser.add_argument("--workload", default=DEFAULT_WORKLOAD,
                        help="workload JSON (absolute, or relative to the current directory or the repo root; "
                             "a bare name like 'random' means ../shared/workloads/<name>.json)")
    parser.add_argument("--compare", action="store_true",
                        help="also run the engine with the radix cache off and transformers' generate")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of the transformers baseline")
    parser.add_argument("--decode-batch1", action="store_true",
                        help="also measure batch-1 decode (MBU) and prefill (MFU), Idleless vs transformers")
    parser.add_argument("--decode-tokens", type=int, default=128, help="decode tokens timed at batch 1")
    parser.add_argument("--batch1-prompt-len", type=int, default=32,
                        help="batch-1 decode prompt: the first N ids of the workload's first request")
    parser.add_argument("--batch1-reps", type=int, default=3, help="repetitions of each batch-1 timing (medians)")
    parser.add_argument("--peak-mem-bw-gbs", type=float, default=DEFAULT_PEAK_MEM_BW_GBS,
                        help="memory bandwidth for MBU, GB/s (1e9 B/s)")
    parser.add_argument("--peak-gflops", type=float, default=DEFAULT_PEAK_GFLOPS,
                        help="matmul peak for MFU, GFLOP/s (of the run's dtype)")
    parser.add_argument("--measure-peaks", action="store_true",
                        help="also probe copy bandwidth, matmul GFLOP/s and the weight-streaming GEMV rate "
                             "here; MFU and MBU (and the batch-1 decode bound) are then taken against the probed "
                             "matmul and GEMV figures unless --peak-gflops / --peak-mem-bw-gbs are given")
    parser.add_argument("--output", default=None, help="write the figures as JSON to this file")
    add_cli_args(parser)


def write_result(result: dict, path: str, complete: bool) -> None:
    """Write ``result`` as JSON (``"complete"`` says whether every phase ran), atomically."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({**result, "complete": complete}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args`` and return the result dict (what --output writes).
    With ``args.output``, the figures so far are written after every phase (``"complete":
    false``), so a run cut short keeps what it measured."""
    import torch

    from idleless.bench.baselines import HFGenerateBaseline
    from idleless.config import config_from_args
    from idleless.engine.engine import Engine

    wl = load_workload(args.workload)
    config = config_from_args(args)
    items = shuffled(wl.items, args.seed)
    order = [it.id for it in items]
    decode_prompt = wl.items[0].prompt_ids[: max(1, args.batch1_prompt_len)]
    prefill_prompt = wl.items[0].prompt_ids
    peak_gflops, peak_bw = args.peak_gflops, args.peak_mem_bw_gbs
    result: dict[str, Any] = {
        "benchmark": "offline",
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "idleless " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "offline"] else None,
        "host": {},
        "workload": {
            "path": wl.path, "name": wl.name, "num_requests": len(wl.items), "prompt_tokens": wl.prompt_tokens,
            "output_tokens": wl.output_tokens, "shuffle_seed": args.seed, "submission_order_head": order[:8],
            "temperature": wl.temperature, "ignore_eos": wl.ignore_eos, "note": TOKENIZER_NOTE,
        },
        "engine_config": dataclasses.asdict(config),
        "peaks": {"mem_bw_gbs": peak_bw, "matmul_gflops": peak_gflops},
        "load_avg_1m_start": load_avg(),
    }

    def checkpoint() -> None:
        if getattr(args, "output", None):
            write_result(result, args.output, complete=False)

    # 1. Idleless, radix cache as configured (on by default)
    label = "radix off" if config.disable_radix_cache else "radix on"
    _log(f"Idleless ({label}): loading; {len(items)} requests, {wl.prompt_tokens} prompt tokens (load {load_avg()})")
    engine = Engine(config)
    runner = engine.core.runner
    cost = engine_cost(engine)
    dtype = runner.dtype
    result["model"] = {
        "dir": runner.model_dir, "dtype": str(dtype).replace("torch.", ""),
        "non_embedding_params": cost.non_embedding_params, "lm_head_params": cost.lm_head_params,
        "bytes_per_param": cost.bytes_per_param, "decode_weight_bytes": cost.decode_weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token, "kv_pool_tokens": runner.pool.num_slots,
    }
    result["host"] = _host_info()
    if args.measure_peaks:
        mp = result["measured_peaks"] = measure_peaks(dtype)
        _log(f"measured peaks: {mp}")
        # MFU / MBU against what this machine just did, unless the peaks were given explicitly
        if peak_gflops == DEFAULT_PEAK_GFLOPS:
            peak_gflops = mp["matmul_gflops"]
        if peak_bw == DEFAULT_PEAK_MEM_BW_GBS:  # the decode bound: weights streamed by a GEMV
            peak_bw = mp["gemv_weight_gbs"]
        result["peaks"] = {"mem_bw_gbs": round(peak_bw, 1), "matmul_gflops": round(peak_gflops)}
    warmup_engine(engine, items[0].prompt_ids)
    res, idl_out = run_engine_workload(engine, items, wl, cost, peak_gflops)
    res["radix_cache"] = not config.disable_radix_cache
    result["idleless"] = res
    _log(f"Idleless ({label}): {res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} out tok/s")
    checkpoint()
    del runner
    if not args.decode_batch1:  # else kept for the batch-1 timings, interleaved with transformers'
        del engine
        engine = None
    gc.collect()

    hf = None
    if args.compare:
        # 2. Idleless with the radix cache off
        cfg_off = dataclasses.replace(config, disable_radix_cache=True)
        _log(f"Idleless (radix off): loading (load {load_avg()})")
        engine_off = Engine(cfg_off)
        warmup_engine(engine_off, items[0].prompt_ids)
        res_off, off_out = run_engine_workload(engine_off, items, wl, cost, peak_gflops)
        res_off["radix_cache"] = False
        result["idleless_radix_off"] = res_off
        _log(f"Idleless (radix off): {res_off['wall_s']:.1f} s, {res_off['output_tokens_per_s']:.1f} out tok/s")
        del engine_off
        gc.collect()
        result["speedup_vs_radix_off"] = _ratio(res_off["wall_s"], res["wall_s"])
        result["agreement_radix_off"] = _agreement(idl_out, off_out)
        checkpoint()

    if args.compare or args.decode_batch1:
        _log(f"transformers: loading {result['model']['dir']} in {result['model']['dtype']} (load {load_avg()})")
        hf = HFGenerateBaseline(result["model"]["dir"], dtype=dtype, num_threads=config.resolved_threads())
        hf.warmup(items[0].prompt_ids)

    if args.compare:
        # 3. transformers' generate, static batches
        _log(f"transformers generate: {len(items)} requests in static batches of {args.hf_batch_size} (load {load_avg()})")
        l0 = load_avg()
        hf_run = hf.run_static_batches([it.prompt_ids for it in items], [it.max_tokens for it in items],
                                       args.hf_batch_size)
        out_tokens = sum(len(o) for o in hf_run.output_ids)
        hres = _run_summary(hf_run.wall_s, hf_run.prompt_tokens, 0, hf_run.prompt_tokens, out_tokens, len(items),
                            cost, peak_gflops)
        hres.update(batch_size=hf_run.batch_size, num_batches=hf_run.num_batches, batch_wall_s=hf_run.batch_wall_s,
                    padded_prompt_tokens=hf_run.padded_prompt_tokens, generated_tokens_run=hf_run.generated_tokens,
                    load_avg_1m_before=l0, load_avg_1m_after=load_avg())
        result["hf_generate"] = hres
        result["speedup_vs_hf"] = _ratio(hres["wall_s"], res["wall_s"])
        result["agreement_hf"] = _agreement(idl_out, hf_run.output_ids)
        _log(f"transformers generate: {hres['wall_s']:.1f} s, {hres['output_tokens_per_s']:.1f} out tok/s")
        checkpoint()

    if args.decode_batch1:
        _log(f"batch 1, Idleless and transformers interleaved: {args.decode_tokens} decode tokens x "
             f"{args.batch1_reps} reps (load {load_avg()})")
        b = measure_batch1({"idleless": _engine_timer(engine),
                            "hf_generate": lambda p, n: (hf.time_generate(p, n), None)},
                           decode_prompt, prefill_prompt, args.decode_tokens, args.batch1_reps, cost,
                           peak_bw, peak_gflops, weight_bytes={"hf_generate": cost.param_bytes})
        i, h = b["idleless"], b["hf_generate"]
        b["decode_speedup_vs_hf"] = _ratio(i["decode_tokens_per_s"] or 0.0, h["decode_tokens_per_s"] or 0.0)
        b["prefill_speedup_vs_hf"] = _ratio(i["prefill_tokens_per_s"] or 0.0, h["prefill_tokens_per_s"] or 0.0)
        b["decode_target_vs_hf"] = 1.5
        result["batch1"] = b
    del hf, engine
    gc.collect()
    result["load_avg_1m_end"] = load_avg()
    torch.set_num_threads(config.resolved_threads())
    return result


def _f(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _pct(v) -> str:
    return _f(None if v is None else 100 * v, "{:.1f}%")


def format_report(r: dict) -> str:
    """The one-screen table printed after a run."""
    w, m = r["workload"], r["model"]
    lines = [
        f"idleless bench offline: {w['name']} ({w['num_requests']} requests, {w['prompt_tokens']} prompt + "
        f"{w['output_tokens']} output tokens, shuffled with seed {w['shuffle_seed']}, greedy, ignore_eos={w['ignore_eos']})",
        f"model {m['dtype']}: {m['non_embedding_params'] / 1e6:.1f}M non-embedding + {m['lm_head_params'] / 1e6:.1f}M "
        f"lm_head params, {m['decode_weight_bytes'] / 1e6:.0f} MB read per decode step; "
        f"torch threads: {r['host'].get('torch_threads')} of {r['host'].get('cpu_count')} CPUs",
        "",
        f"{'system':<24}{'wall s':>8}{'out tok/s':>11}{'total tok/s':>13}{'computed':>10}{'cached':>9}"
        f"{'hit':>7}{'fwd':>7}{'MFU':>7}{'load':>12}",
    ]

    def row(name, x):
        load = f"{_f(x.get('load_avg_1m_before'), '{:.1f}')}->{_f(x.get('load_avg_1m_after'), '{:.1f}')}"
        lines.append(f"{name:<24}{_f(x['wall_s']):>8}{_f(x['output_tokens_per_s']):>11}"
                     f"{_f(x['total_tokens_per_s'], '{:.0f}'):>13}{x['computed_prompt_tokens']:>10}"
                     f"{x['cached_prompt_tokens']:>9}{_pct(x['cache_hit_rate']):>7}"
                     f"{_pct(x.get('forward_fraction')):>7}{_pct(x['mfu']):>7}{load:>12}")

    row("idleless" + ("" if r["idleless"].get("radix_cache", True) else " (radix off)"), r["idleless"])
    if "idleless_radix_off" in r:
        row("idleless, radix off", r["idleless_radix_off"])
    if "hf_generate" in r:
        row(f"transformers (bs {r['hf_generate']['batch_size']})", r["hf_generate"])
    x = r["idleless"]
    lines.append(f"idleless time split: forward+sample {_pct(x['forward_fraction'])}, schedule "
                 f"{_pct(x['schedule_fraction'])}, other (detokenize, loop) {_pct(x['other_fraction'])}; "
                 f"{x['num_steps']} steps, {_f(x['ms_per_step'])} ms/step, {x['num_retractions']} retractions, "
                 f"MFU in forward {_pct(x['mfu_in_forward'])}")
    sp = []
    if r.get("speedup_vs_hf") is not None:
        sp.append(f"vs transformers {r['speedup_vs_hf']:.2f}x")
    if r.get("speedup_vs_radix_off") is not None:
        sp.append(f"vs radix off {r['speedup_vs_radix_off']:.2f}x")
    if sp:
        lines.append("speedup (wall-time ratio): " + ", ".join(sp))
    ag = []
    if "agreement_radix_off" in r:
        ag.append(f"radix off {_pct(r['agreement_radix_off']['identical_fraction'])}")
    if "agreement_hf" in r:
        ag.append(f"transformers {_pct(r['agreement_hf']['identical_fraction'])} "
                  f"(mean common prefix {r['agreement_hf']['mean_common_prefix_tokens']:.1f} tokens)")
    if ag:
        lines.append("identical greedy outputs vs " + ", ".join(ag))
    b = r.get("batch1")
    if b:
        i = b["idleless"]
        lines += ["", f"batch 1: decode {i['decode_tokens']} tokens after a {i['decode_prompt_tokens']}-token prompt; "
                      f"prefill {i['prefill_prompt_tokens']} tokens; medians of {i['reps']}; bound "
                      f"{i['decode_bound_tokens_per_s']:.0f} tok/s at {r['peaks']['mem_bw_gbs']:g} GB/s",
                  f"{'system':<24}{'decode tok/s':>13}{'ms/tok':>8}{'MBU':>7}{'prefill tok/s':>15}{'MFU':>7}{'load':>12}"]
        for name, key in (("idleless", "idleless"), ("transformers", "hf_generate")):
            if key in b:
                x = b[key]
                load = f"{_f(x.get('load_avg_1m_before'), '{:.1f}')}->{_f(x.get('load_avg_1m_after'), '{:.1f}')}"
                lines.append(f"{name:<24}{_f(x['decode_tokens_per_s']):>13}{_f(x['decode_ms_per_token']):>8}"
                             f"{_pct(x['mbu']):>7}{_f(x['prefill_tokens_per_s'], '{:.0f}'):>15}"
                             f"{_pct(x['prefill_mfu']):>7}{load:>12}")
        if "decode_forward_ms_per_token" in i:
            lines.append(f"idleless decode: {i['decode_forward_ms_per_token']:.1f} ms/token in forward+sample "
                         f"({_pct(i.get('decode_forward_fraction'))} of decode time)")
        if b.get("decode_speedup_vs_hf") is not None:
            ok = "meets" if b["decode_speedup_vs_hf"] >= b["decode_target_vs_hf"] else "below"
            lines.append(f"decode speedup vs transformers {b['decode_speedup_vs_hf']:.2f}x ({ok} the "
                         f"{b['decode_target_vs_hf']}x target); prefill {_f(b.get('prefill_speedup_vs_hf'), '{:.2f}')}x")
    if "measured_peaks" in r:
        mp = r["measured_peaks"]
        lines.append(f"measured here ({mp['threads']} threads, load {mp['load_avg_1m']}): copy {mp['copy_gbs']:.1f} GB/s, "
                     f"{mp['dtype']} matmul {mp['matmul_gflops']:.0f} GFLOP/s, decode-shaped GEMV {mp['gemv_weight_gbs']:.1f} GB/s")
    lines += ["", f"MFU vs {r['peaks']['matmul_gflops']:g} GFLOP/s, MBU vs {r['peaks']['mem_bw_gbs']:g} GB/s; "
                  f"load = 1-min load average before->after each run (this machine has {r['host'].get('cpu_count')} CPUs)",
              f"note: {w['note']}"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``idleless bench offline``: run, print the table, write --output. Exit code
    2 with a one-line error for a missing or malformed workload or a request the engine refuses."""
    from idleless.engine.request import RequestError

    try:
        result = run(args)
    except (FileNotFoundError, WorkloadError, RequestError) as e:
        msg = e.message if isinstance(e, RequestError) else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.output:
        write_result(result, args.output, complete=True)
        print(f"wrote {args.output}")
    return 0
