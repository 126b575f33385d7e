"""``idleless bench compare``: one workload through several systems, side by side, in one run.

    idleless bench compare --workload ../shared/workloads/shared_prefix.json --num-threads 1

Systems (``--systems``, default all that are available; each is skipped with the reason recorded
when it is not):

* ``idleless``: the offline ``Engine`` (radix cache on), everything submitted at once;
* ``radix-off``: the same with ``--disable-radix-cache``;
* ``hf``: transformers' ``generate`` in static batches of ``--hf-batch-size``, same weights and dtype
  (``idleless.bench.baselines.HFGenerateBaseline``);
* ``llamacpp``: llama.cpp through llama-cpp-python (the optional extra ``llamacpp``: it builds
  llama.cpp from source, so it is kept out of the test install) on the *GGUF itself* (the bundled
  SmolLM2 is Q4_1: llama.cpp reads 4-bit weights while the others run the dequantized weights in
  ``--dtype``; the table says so). Its Python API runs one sequence at a time, so the requests go
  one after another in the same order; it reuses the KV of the prefix shared with the previous
  request (its own prefix cache), counted as cached tokens;
* ``vllm``: vLLM's offline ``LLM.generate`` on the same HF directory and dtype, when importable
  (never in the test install).

Every system gets the same token-id prompts (the workload's ``prompt_token_ids``), shuffled by
``--seed``, greedy, eos ignored, the recorded ``max_tokens``. Figures per system (as ``bench
offline``, whose functions this reuses): wall seconds, output and total tokens/s, prompt tokens
computed vs cached, model FLOP/s as a fraction of ``--peak-gflops`` (MFU over the run), and
``speedup`` = that system's wall time / Idleless's (> 1: Idleless is faster), all measured in
this run. For Idleless also the engine's wall-time split (forward, schedule, other) from
``Engine.stats()['time']``.

``--batch1`` (default on): decode at batch 1 as a fraction of the memory-bandwidth bound (MBU =
decode tokens/s x weight bytes read per token / ``--peak-mem-bw-gbs``) and prefill of the first
prompt as a fraction of the matmul peak (MFU), for idleless, hf and llamacpp, interleaved
(``bench offline``'s ``measure_batch1``). llama.cpp's weight bytes are the GGUF's tensor bytes.

``--telemetry-overhead N``: N interleaved pairs of Idleless runs of the workload on one engine,
with and without a per-step trace file (``--trace-file``); reports median throughputs and their
ratio (noisy on a shared machine), and the trace's cost timed directly inside the traced runs
(``trace_cost_fraction`` of the wall time). The wall-time buckets themselves cannot be switched
off; their cost is measured directly (ns per ``TimeAccount.mark`` x marks per step x steps).

Writes ``<results-dir>/<date>-<workload>.json`` (``-compare`` is appended if another benchmark
already wrote that name) and a table in ``--readme`` (default ``benchmarks/README.md``) between
``<!-- bench compare: <workload> -->`` markers, replacing the previous table of that workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from idleless.bench.offline import (DEFAULT_PEAK_GFLOPS, DEFAULT_PEAK_MEM_BW_GBS, DEFAULT_WORKLOAD, REPO_ROOT,
                                    TOKENIZER_NOTE, WorkloadError, _agreement, _engine_timer, _host_info,
                                    _run_summary, engine_cost, load_avg, load_workload, measure_batch1, shuffled,
                                    warmup_engine, run_engine_workload)

SYSTEMS = ("idleless", "radix-off", "hf", "llamacpp", "vllm")


def _log(msg: str) -> None:
    print(f"[bench compare] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Idleless helpers
# --------------------------------------------------------------------------------------------------
def _time_split(before: dict, after: dict) -> dict:
    """Engine wall-time buckets between two ``stats()['time']`` snapshots: seconds, fractions of
    the wall time, and the busy fraction ((forward + verify) / (wall - idle_no_work))."""
    d = {k: after[k] - before[k] for k in after if k in before and k != "busy_fraction"}
    wall = d.get("wall", 0.0)
    work = wall - d.get("idle_no_work", 0.0)
    return {"seconds": d, "fractions": {k: v / wall for k, v in d.items() if k != "wall"} if wall > 0 else {},
            "busy_fraction": (d.get("forward", 0.0) + d.get("verify", 0.0)) / work if work > 0 else None}


def run_idleless(engine, items, wl, cost, peak_gflops) -> tuple[dict, list[list[int]]]:
    """``run_engine_workload`` plus the engine's wall-time split over the run."""
    t0 = engine.stats()["time"]
    res, out = run_engine_workload(engine, items, wl, cost, peak_gflops)
    res["time_split"] = _time_split(t0, engine.stats()["time"])
    res["busy_fraction"] = res["time_split"]["busy_fraction"]
    return res, out


def mark_cost_ns(n: int = 200_000) -> float:
    """Nanoseconds per ``TimeAccount.mark`` call (the always-on part of the telemetry)."""
    from idleless.telemetry.timing import TimeAccount

    acct = TimeAccount()
    t = time.perf_counter()
    for _ in range(n):
        acct.mark("other")
    return (time.perf_counter() - t) / n * 1e9


def telemetry_overhead(engine, items, wl, cost, peak_gflops, pairs: int) -> dict:
    """Interleaved runs with and without a StepTracer on one engine (order alternated per pair).

    Two measures: (1) the A/B ratio of output tokens/s (median traced / median untraced), which on
    a loaded machine is dominated by run-to-run noise; (2) the trace's own cost, timed directly in
    the traced runs (every ``Scheduler._trace`` call: building the record, JSON, the write) as a
    fraction of the run's wall time, plus the always-on bucket marks (marks per step x steps x the
    cost of one mark) as a fraction of the untraced runs' wall time."""
    from idleless.telemetry.timing import StepTracer

    sched = engine.core.scheduler
    saved = sched.tracer
    original_trace = sched._trace
    spent = [0.0]

    def timed_trace(*a, **k):
        t = time.perf_counter()
        try:
            return original_trace(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    tps = {"traced": [], "untraced": []}
    walls = {"traced": [], "untraced": []}
    trace_frac, steps = [], []
    tmp = tempfile.mkdtemp(prefix="idleless-trace-")
    try:
        for i in range(pairs):
            for mode in (("untraced", "traced") if i % 2 == 0 else ("traced", "untraced")):
                path = os.path.join(tmp, f"trace-{i}-{mode}.jsonl")
                sched.tracer = StepTracer(path) if mode == "traced" else None
                sched._trace = timed_trace
                spent[0] = 0.0
                engine.flush_cache()
                res, _ = run_engine_workload(engine, items, wl, cost, peak_gflops)
                if sched.tracer is not None:
                    t = time.perf_counter()
                    sched.tracer.close()
                    spent[0] += time.perf_counter() - t
                    trace_frac.append(spent[0] / res["wall_s"])
                sched.tracer = None
                tps[mode].append(res["output_tokens_per_s"])
                walls[mode].append(res["wall_s"])
                steps.append(res["num_steps"])
                _log(f"telemetry overhead pair {i + 1}/{pairs} {mode}: {res['output_tokens_per_s']:.1f} out tok/s"
                     + (f", trace cost {100 * trace_frac[-1]:.4f}% of wall" if mode == "traced" else ""))
    finally:
        sched.tracer = saved
        sched.__dict__.pop("_trace", None)
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    mu, mt = statistics.median(tps["untraced"]), statistics.median(tps["traced"])
    ns = mark_cost_ns()
    per_step_marks = 6  # schedule x2 + forward in step(); io, other / io, idle_no_work around it in the loops
    mean_steps = statistics.fmean(steps) if steps else 0
    mark_frac = per_step_marks * mean_steps * ns * 1e-9 / statistics.median(walls["untraced"])
    return {"pairs": pairs, "untraced_out_tok_s": tps["untraced"], "traced_out_tok_s": tps["traced"],
            "median_untraced": mu, "median_traced": mt, "ab_overhead": 1 - mt / mu if mu else None,
            "ab_spread": (max(tps["untraced"] + tps["traced"]) - min(tps["untraced"] + tps["traced"])) / mu if mu else None,
            "trace_cost_fraction": statistics.fmean(trace_frac) if trace_frac else None,
            "mark_ns": ns, "marks_per_step": per_step_marks, "steps_per_run": mean_steps,
            "marks_cost_fraction": mark_frac,
            "note": "ab_overhead = 1 - median traced / median untraced output tok/s (run-to-run noise included; "
                    "ab_spread = (max - min) / median untraced over all runs); trace_cost_fraction = time inside "
                    "the trace hook / wall, measured directly; marks_cost_fraction = the always-on bucket marks"}


# --------------------------------------------------------------------------------------------------
# llama.cpp
# --------------------------------------------------------------------------------------------------
def gguf_weight_bytes(path: str) -> int:
    """Bytes of all tensors in a GGUF file (what a decode step reads; the tied embedding is the lm_head)."""
    from gguf import GGUFReader

    return int(sum(int(t.n_bytes) for t in GGUFReader(path).tensors))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class LlamaCppBaseline:
    """llama-cpp-python's ``Llama`` on a GGUF: greedy, eos ignored (the caller stops at max tokens).

    Raises ImportError when llama_cpp is not installed."""

    def __init__(self, gguf_path: str, n_ctx: int, n_threads: int, n_batch: int = 512, extra_bufts: bool = False):
        """``extra_bufts``: llama.cpp's repacked weight buffers (CPU_REPACK, AMX). Off by default:
        a native build on this machine's AMX CPU segfaults in ``ggml_backend_amx_mul_mat`` on the
        Q4_1 GGUF (llama-cpp-python 0.3.36), so the plain quantized kernels run instead."""
        import llama_cpp
        import llama_cpp.llama_cpp as lowlevel

        self.version = getattr(llama_cpp, "__version__", None)
        self.extra_bufts = extra_bufts
        t = time.perf_counter()
        default_params = lowlevel.llama_model_default_params

        def params():
            p = default_params()
            if hasattr(p, "use_extra_bufts"):
                p.use_extra_bufts = bool(extra_bufts)
            return p

        lowlevel.llama_model_default_params = params  # Llama() takes no such argument: patch its default
        try:
            self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=n_threads,
                                       n_threads_batch=n_threads, n_batch=n_batch, verbose=False)
        finally:
            lowlevel.llama_model_default_params = default_params
        self.load_seconds = time.perf_counter() - t
        self.path = gguf_path

    def generate(self, prompt: Sequence[int], n: int, reset: bool = False) -> list[int]:
        """n new tokens after ``prompt``; reuses the KV of the prefix shared with the previous call
        unless ``reset``."""
        if reset:
            self.llm.reset()
        out = []
        for tok in self.llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            out.append(int(tok))
            if len(out) >= n:
                break
        return out

    def run_sequential(self, prompts: Sequence[Sequence[int]], max_new: Sequence[int]) -> dict:
        """All prompts one after another; cached = the prefix each shares with the previous
        request's tokens (what llama-cpp-python's generate reuses)."""
        self.llm.reset()
        outs, cached, prev = [], 0, []
        t0 = time.perf_counter()
        for p, n in zip(prompts, max_new):
            c = _common_prefix(p, prev)
            cached += min(c, len(p) - 1)
            o = self.generate(p, n)
            outs.append(o)
            prev = list(p) + o[:-1]  # the last sampled token is never evaluated
        return {"wall_s": time.perf_counter() - t0, "output_ids": outs, "cached": cached}

    def timer(self):
        def time_fn(prompt, n):
            t = time.perf_counter()
            out = self.generate(prompt, n, reset=True)
            dt = time.perf_counter() - t
            if len(out) != n:
                raise RuntimeError(f"llama.cpp returned {len(out)} tokens, expected {n}")
            return dt, None
        return time_fn


# --------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------
def run_vllm(model_dir: str, dtype: str, items, wl) -> dict:
    """vLLM offline generate on token-id prompts (greedy, ignore_eos). Raises ImportError without vllm."""
    from vllm import LLM, SamplingParams as VSP

    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True)
    prompts = [{"prompt_token_ids": list(it.prompt_ids)} for it in items]
    params = [VSP(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True) for it in items]
    llm.generate(prompts[:1], VSP(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_ids": [list(o.outputs[0].token_ids) for o in outs],
            "cached": sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)}


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def _gguf_path(model: Optional[str]) -> Optional[str]:
    from idleless.model.loader import resolve_model_path

    p = resolve_model_path(model)
    return p if os.path.isfile(p) and p.lower().endswith(".gguf") else None


def run(args: argparse.Namespace) -> dict:
    import torch

    from idleless.bench.baselines import HFGenerateBaseline
    from idleless.config import config_from_args
    from idleless.engine.engine import Engine

    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    wl = load_workload(args.workload)
    config = config_from_args(args)
    threads = config.resolved_threads()
    items = shuffled(wl.items, args.seed)
    prompts = [it.prompt_ids for it in items]
    max_new = [it.max_tokens for it in items]
    pg, bw = args.peak_gflops, args.peak_mem_bw_gbs
    result: dict[str, Any] = {
        "benchmark": "compare",
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "idleless " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "compare"] else None,
        "workload": {"path": wl.path, "name": wl.name, "num_requests": len(items), "prompt_tokens": wl.prompt_tokens,
                     "output_tokens": wl.output_tokens, "shuffle_seed": args.seed, "note": TOKENIZER_NOTE,
                     "hit_rate_upper_bound": (wl.stats or {}).get("prefix_cache_hit_ratio_upper_bound")},
        "engine_config": dataclasses.asdict(config),
        "peaks": {"mem_bw_gbs": bw, "matmul_gflops": pg},
        "systems": {}, "skipped": {},
        "load_avg_1m_start": load_avg(),
    }
    systems = result["systems"]
    outputs: dict[str, list] = {}

    _log(f"Idleless: loading ({len(items)} requests, {wl.prompt_tokens} prompt tokens, load {load_avg()})")
    engine = Engine(config)
    runner = engine.core.runner
    cost = engine_cost(engine)
    dtype = runner.dtype
    dtype_name = str(dtype).replace("torch.", "")
    model_dir = str(runner.model_dir)
    result["model"] = {"dir": model_dir, "dtype": dtype_name, "non_embedding_params": cost.non_embedding_params,
                       "lm_head_params": cost.lm_head_params, "decode_weight_bytes": cost.decode_weight_bytes}
    result["host"] = _host_info()
    warmup_engine(engine, prompts[0])
    if "idleless" in wanted:
        res, outputs["idleless"] = run_idleless(engine, items, wl, cost, pg)
        res.update(precision=dtype_name, label="Idleless")
        systems["idleless"] = res
        _log(f"Idleless: {res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} out tok/s, busy "
             f"{res['busy_fraction'] or 0:.2f}")
    if args.telemetry_overhead > 0:
        _log(f"telemetry overhead: {args.telemetry_overhead} interleaved pairs (load {load_avg()})")
        result["telemetry_overhead"] = telemetry_overhead(engine, items, wl, cost, pg, args.telemetry_overhead)

    if "radix-off" in wanted:
        _log(f"Idleless radix off: loading (load {load_avg()})")
        eng_off = Engine(dataclasses.replace(config, disable_radix_cache=True))
        warmup_engine(eng_off, prompts[0])
        res, outputs["radix-off"] = run_idleless(eng_off, items, wl, cost, pg)
        res.update(precision=dtype_name, label="Idleless, radix cache off")
        systems["radix-off"] = res
        _log(f"radix off: {res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} out tok/s")
        del eng_off
        gc.collect()

    hf = None
    if "hf" in wanted:
        _log(f"transformers: loading {model_dir} in {dtype_name} (load {load_avg()})")
        hf = HFGenerateBaseline(model_dir, dtype=dtype, num_threads=threads)
        hf.warmup(prompts[0])
        l0 = load_avg()
        run_ = hf.run_static_batches(prompts, max_new, args.hf_batch_size)
        out_tok = sum(len(o) for o in run_.output_ids)
        res = _run_summary(run_.wall_s, run_.prompt_tokens, 0, run_.prompt_tokens, out_tok, len(items), cost, pg)
        res.update(label=f"transformers generate (static batches of {args.hf_batch_size})", precision=dtype_name,
                   padded_prompt_tokens=run_.padded_prompt_tokens, load_avg_1m_before=l0,
                   load_avg_1m_after=load_avg())
        systems["hf"] = res
        outputs["hf"] = run_.output_ids
        _log(f"transformers: {res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} out tok/s")

    llama = None
    if "llamacpp" in wanted:
        gguf = _gguf_path(config.model)
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            result["skipped"]["llamacpp"] = "llama-cpp-python is not installed (pip install 'idleless[llamacpp]')"
        else:
            if gguf is None:
                result["skipped"]["llamacpp"] = f"the model {config.model!r} is not a GGUF file"
            else:
                n_ctx = max(len(p) + n for p, n in zip(prompts, max_new)) + 8
                _log(f"llama.cpp: loading {gguf} (n_ctx {n_ctx}, {threads} threads, load {load_avg()})")
                llama = LlamaCppBaseline(gguf, n_ctx, threads, extra_bufts=args.llamacpp_repack)
                llama.generate(prompts[0][:16], 4, reset=True)
                l0 = load_avg()
                r = llama.run_sequential(prompts, max_new)
                out_tok = sum(len(o) for o in r["output_ids"])
                ptok = sum(len(p) for p in prompts)
                res = _run_summary(r["wall_s"], ptok, r["cached"], ptok - r["cached"], out_tok, len(items), cost, pg)
                wb = gguf_weight_bytes(gguf)
                res.update(label=f"llama.cpp {llama.version} (llama-cpp-python, sequential"
                                 f"{', repack' if args.llamacpp_repack else ''})",
                           precision=f"GGUF ({os.path.basename(gguf)})", gguf_weight_bytes=wb,
                           load_avg_1m_before=l0, load_avg_1m_after=load_avg())
                systems["llamacpp"] = res
                outputs["llamacpp"] = r["output_ids"]
                _log(f"llama.cpp: {res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} out tok/s")

    if "vllm" in wanted:
        try:
            import vllm  # noqa: F401
        except ImportError:
            result["skipped"]["vllm"] = "vllm is not importable"
        else:
            try:
                l0 = load_avg()
                r = run_vllm(model_dir, dtype_name, items, wl)
                out_tok = sum(len(o) for o in r["output_ids"])
                ptok = sum(len(p) for p in prompts)
                res = _run_summary(r["wall_s"], ptok, r["cached"], ptok - r["cached"], out_tok, len(items), cost, pg)
                res.update(label="vLLM (offline LLM.generate)", precision=dtype_name, load_avg_1m_before=l0,
                           load_avg_1m_after=load_avg())
                systems["vllm"] = res
                outputs["vllm"] = r["output_ids"]
            except Exception as e:  # noqa: BLE001 - vLLM on an unsupported device: record why
                result["skipped"]["vllm"] = f"vLLM failed: {type(e).__name__}: {e}"[:300]

    base = systems.get("idleless")
    for name, res in systems.items():
        if base and name != "idleless":
            res["idleless_speedup"] = res["wall_s"] / base["wall_s"] if base["wall_s"] else None
            res["agreement_with_idleless"] = _agreement(outputs["idleless"], outputs[name])

    if args.batch1:
        fns = {}
        if "idleless" in wanted:
            fns["idleless"] = _engine_timer(engine)
        if hf is not None:
            fns["hf"] = lambda p, n: (hf.time_generate(p, n), None)
        if llama is not None:
            fns["llamacpp"] = llama.timer()
        if fns:
            _log(f"batch 1 ({', '.join(fns)}): {args.decode_tokens} decode tokens x {args.batch1_reps} reps "
                 f"(load {load_avg()})")
            wbytes = {"hf": cost.param_bytes}  # MBU of the bytes each system reads
            if llama is not None:
                wbytes["llamacpp"] = systems["llamacpp"]["gguf_weight_bytes"]
            b = measure_batch1(fns, prompts[0][: args.batch1_prompt_len], prompts[0], args.decode_tokens,
                               args.batch1_reps, cost, bw, pg, weight_bytes=wbytes)
            if "llamacpp" in b:
                b["llamacpp"]["prefill_mfu_note"] = "model FLOPs of the same model; llama.cpp computes them on 4-bit weights"
            result["batch1"] = b
    del hf, llama, engine
    gc.collect()
    result["load_avg_1m_end"] = load_avg()
    torch.set_num_threads(threads)
    return result


# --------------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------------
def _f(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown_table(r: dict) -> str:
    """The README table: one row per system, ratios from this run."""
    w, b = r["workload"], r.get("batch1") or {}
    lines = [
        f"`{r.get('command') or 'idleless bench compare'}` — {r['date']}, {w['name']} ({w['num_requests']} requests, "
        f"{w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, greedy, ignore_eos), model "
        f"{r['model']['dtype']}, {r['host'].get('torch_threads')} torch threads on {r['host'].get('cpu_count')} CPUs, "
        f"load average {r.get('load_avg_1m_start')} -> {r.get('load_avg_1m_end')}.",
        "",
        "| system | weights | wall s | out tok/s | total tok/s | prompt hit | Idleless speedup | run MFU "
        "| b1 decode tok/s | decode MBU | b1 prefill tok/s | prefill MFU | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, x in r["systems"].items():
        bx = b.get(name) or {}
        sp = "1.00x" if name == "idleless" else (f"{x['idleless_speedup']:.2f}x" if x.get("idleless_speedup") else "-")
        load = f"{_f(x.get('load_avg_1m_before'))}->{_f(x.get('load_avg_1m_after'))}"
        lines.append(f"| {x.get('label', name)} | {x.get('precision', '')} | {_f(x['wall_s'])} | "
                     f"{_f(x['output_tokens_per_s'])} | {_f(x['total_tokens_per_s'], '{:.0f}')} | "
                     f"{_pct(x['cache_hit_rate'])} | {sp} | {_pct(x.get('mfu'))} | {_f(bx.get('decode_tokens_per_s'))} | "
                     f"{_pct(bx.get('mbu'))} | {_f(bx.get('prefill_tokens_per_s'), '{:.0f}')} | "
                     f"{_pct(bx.get('prefill_mfu'))} | {load} |")
    for name, why in r.get("skipped", {}).items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | | | | | |")
    lines.append("")
    notes = [f"Idleless speedup = the system's wall time / Idleless's in this run (> 1: Idleless is faster). "
             f"MFU vs {r['peaks']['matmul_gflops']:g} GFLOP/s, MBU vs {r['peaks']['mem_bw_gbs']:g} GB/s (bench offline's "
             f"definitions); b1 = batch 1, decode after a short prompt, prefill of the first prompt."]
    i = r["systems"].get("idleless")
    if i and i.get("time_split"):
        fr = i["time_split"]["fractions"]
        notes.append("Idleless engine wall split over the run: " +
                     ", ".join(f"{k} {_pct(v)}" for k, v in fr.items() if v) +
                     f"; busy fraction {_pct(i['time_split']['busy_fraction'])}.")
    t = r.get("telemetry_overhead")
    if t:
        notes.append(f"Telemetry overhead: the trace file costs {100 * (t['trace_cost_fraction'] or 0):.3f}% of the "
                     f"wall time (timed inside the trace hook), the always-on bucket marks "
                     f"{100 * t['marks_cost_fraction']:.4f}% ({t['marks_per_step']} x {t['mark_ns']:.0f} ns per step, "
                     f"{t['steps_per_run']:.0f} steps per run); A/B over {t['pairs']} interleaved pairs: "
                     f"{t['median_untraced']:.1f} out tok/s without, {t['median_traced']:.1f} with "
                     f"({_pct(t['ab_overhead'])}, within the {_pct(t['ab_spread'])} run-to-run spread).")
    if "llamacpp" in r["systems"]:
        notes.append("llama.cpp runs the GGUF's quantized weights (fewer bytes per decode step: its MBU counts "
                     "those bytes) and one request at a time; its prompt hits are its reuse of the previous "
                     "request's prefix; weight repacking off (its AMX kernel crashes on this CPU) unless "
                     "--llamacpp-repack.")
    return "\n".join(lines + [" ".join(notes)])


def format_report(r: dict) -> str:
    return f"idleless bench compare: {r['workload']['name']}\n\n" + markdown_table(r)


def update_readme(readme: Path, workload: str, table: str) -> None:
    """Replace (or append) the section between this workload's markers."""
    begin, end = f"<!-- bench compare: {workload} -->", f"<!-- /bench compare: {workload} -->"
    text = readme.read_text(encoding="utf-8") if readme.exists() else "# Benchmarks\n"
    block = f"{begin}\n### `bench compare`: {workload}\n\n{table}\n{end}"
    if begin in text and end in text:
        a = text.index(begin)
        z = text.index(end) + len(end)
        text = text[:a] + block + text[z:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(text, encoding="utf-8")


def result_path(results_dir: Path, date: str, workload: str) -> Path:
    p = results_dir / f"{date}-{workload}.json"
    if p.exists():
        try:
            if json.loads(p.read_text()).get("benchmark") == "compare":
                return p
        except (OSError, ValueError):
            pass
        p = results_dir / f"{date}-{workload}-compare.json"
    return p


def add_args(parser: argparse.ArgumentParser) -> None:
    from idleless.config import add_cli_args

    parser.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload JSON (or a bare name like 'random')")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--batch1", action=argparse.BooleanOptionalAction, default=True,
                        help="batch-1 decode MBU and prefill MFU (default on)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch1-prompt-len", type=int, default=32)
    parser.add_argument("--batch1-reps", type=int, default=3)
    parser.add_argument("--llamacpp-repack", action="store_true",
                        help="let llama.cpp repack weights (CPU_REPACK/AMX buffers); off: its AMX path crashes here")
    parser.add_argument("--telemetry-overhead", type=int, default=0, metavar="PAIRS",
                        help="interleaved Idleless runs with and without a trace file (0: skip)")
    parser.add_argument("--peak-mem-bw-gbs", type=float, default=DEFAULT_PEAK_MEM_BW_GBS)
    parser.add_argument("--peak-gflops", type=float, default=DEFAULT_PEAK_GFLOPS)
    parser.add_argument("--results-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    parser.add_argument("--readme", default=str(REPO_ROOT / "benchmarks" / "README.md"),
                        help="markdown file that gets the table ('' to skip)")
    parser.add_argument("--output", default=None, help="result JSON path (default <results-dir>/<date>-<workload>.json)")
    add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    from idleless.engine.request import RequestError

    try:
        r = run(args)
    except (FileNotFoundError, WorkloadError, RequestError, ValueError) as e:
        print(f"error: {getattr(e, 'message', None) or e}", file=sys.stderr)
        return 2
    print(format_report(r))
    name = r["workload"]["name"]
    out = Path(args.output) if args.output else result_path(Path(args.results_dir), r["date"][:10], name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    if args.readme:
        update_readme(Path(args.readme), name, markdown_table(r))
        print(f"updated {args.readme}")
    return 0
