"""``idleless bench spec``: speculative decoding on vs off, in one process, on the same workloads.

    idleless bench spec --algorithms ngram --batch1-requests 8 \\
        --output benchmarks/results/<date>-spec.json
    idleless bench spec --workload benchmarks/workloads/copy_heavy.json --algorithms ngram,draft \\
        --speculative-draft-model-path <smaller model with the same tokenizer>

Configurations: speculation off, then each of ``--algorithms`` (``EngineConfig.speculative_algorithm``,
with ``--speculative-num-draft-tokens`` etc. and every other engine flag shared). Phases:

* **batch 1**: the first ``--batch1-requests`` requests of the first workload (the copy-heavy one by
  default), one at a time (radix cache flushed before each). Decode tokens/s = (output tokens - 1) /
  (time of the last token - time of the first), summed over the requests: the prefill step that
  produces the first token is left out.
* **workload**: every request of each workload submitted at once, in a seeded shuffled order
  (``--seed``), as ``bench offline`` does (natural concurrency); wall seconds until all finish.

Each (phase, configuration) runs on a fresh engine core: built, warmed (16 prompt tokens, 4 new, then
the cache flushed), run, deleted. A fresh one per phase because the ngram proposer indexes the outputs
of finished requests: one engine for every phase would let the workload run look up the very answers
it produced in the batch-1 phase. Within a phase the configurations run back to back, in the listed
order on even repetitions and reversed on odd ones (``--reps``), so a change in machine load hits them
alike; figures are medians over the repetitions.

Reported per configuration and phase: the ratio vs speculation off (decode tokens/s ratio at batch 1,
wall-time ratio off / on for a workload: above 1 is faster), the process's CPU seconds over the phase
(``time.process_time``: steadier than wall time on a shared machine) and their ratio, the acceptance rate (accepted / drafted
tokens) and mean accepted length (tokens per verify: accepted guesses + the target's own), steps
where speculation was off / on, the ``draft`` and ``verify`` seconds of the engine's time account,
and how many greedy outputs are token-for-token identical to speculation off's (lossless
verification makes that all of them). Requests are fed as token ids to ``EngineCore`` (no text
frontend: detokenization costs the same per token in every configuration). End of sequence: the
model's eos ids plus the tokenizer's where the model directory has one, as ``Engine`` uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from idleless.bench.offline import (REPO_ROOT, WorkItem, Workload, WorkloadError, load_avg, load_workload, shuffled,
                                    write_result)

DEFAULT_WORKLOADS = ("benchmarks/workloads/copy_heavy.json", "../shared/workloads/shared_prefix.json",
                     "../shared/workloads/random.json")
OFF = "off"
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_steps_on", "num_steps_off",
                 "draft_seconds")
TIME_BUCKETS = ("forward", "verify", "draft", "schedule")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_rid = itertools.count()


# --------------------------------------------------------------------------------------------------
# driving the engine core
# --------------------------------------------------------------------------------------------------
@dataclass
class RequestRun:
    """One request's outcome. Times in seconds from the submission of its batch."""

    id: str
    output_ids: list[int]
    finish_reason: Optional[str] = None
    first_token_s: Optional[float] = None
    end_s: Optional[float] = None
    accepted_per_verify: list[int] = field(default_factory=list)


def make_request(item: WorkItem, workload: Workload):
    """The engine ``Request`` of a workload item: its prompt ids and max_tokens, the workload's
    temperature and ignore_eos (greedy when the temperature is 0), a fresh rid."""
    from idleless.engine.request import Request, SamplingParams

    params = SamplingParams(temperature=workload.temperature, max_new_tokens=item.max_tokens,
                            ignore_eos=workload.ignore_eos)
    return Request(f"{item.id}#{next(_rid)}", list(item.prompt_ids), params)


def drive(core, items: Sequence[WorkItem], workload: Workload) -> tuple[float, list[RequestRun]]:
    """Submit ``items`` to ``core`` (an ``EngineCore``) at once and step until every one finishes.
    Returns (wall seconds, one RequestRun per item in ``items`` order). Raises RuntimeError if a
    request fails (aborted or an engine error)."""
    reqs = [make_request(it, workload) for it in items]
    runs = {r.rid: RequestRun(it.id, []) for r, it in zip(reqs, items)}
    t0 = time.perf_counter()
    for r in reqs:
        core.add_request(r)
    pending = len(reqs)
    while pending:
        outs = core.step()
        now = time.perf_counter() - t0
        for o in outs:
            run = runs.get(o.rid)
            if run is None:
                continue
            if o.new_token_ids and run.first_token_s is None:
                run.first_token_s = now
            run.output_ids += o.new_token_ids
            if o.finished:
                if o.error or o.finish_reason == "abort":
                    raise RuntimeError(f"request {run.id} failed: {o.error or 'aborted'}")
                run.finish_reason, run.end_s = str(getattr(o.finish_reason, "value", o.finish_reason)), now
                run.accepted_per_verify = list(o.accepted_per_verify or [])
                pending -= 1
        if not outs and not core.has_work():
            raise RuntimeError(f"the engine went idle with {pending} requests unfinished")
    return time.perf_counter() - t0, [runs[r.rid] for r in reqs]


def run_batch1(core, items: Sequence[WorkItem], workload: Workload) -> list[RequestRun]:
    """Each item alone on ``core``, the radix cache flushed before each; one RequestRun per item."""
    out = []
    for it in items:
        core.flush_cache()
        out += drive(core, [it], workload)[1]
    return out


def warmup(core, prompt_ids: Sequence[int]) -> None:
    """A tiny untimed request (the first 16 prompt ids, 4 new tokens), then flush the radix cache."""
    from idleless.engine.request import Request, SamplingParams

    core.add_request(Request(f"warmup#{next(_rid)}", list(prompt_ids)[:16],
                             SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)))
    while core.has_work():
        core.step()
    core.flush_cache()


# --------------------------------------------------------------------------------------------------
# figures (pure functions of recorded numbers)
# --------------------------------------------------------------------------------------------------
def spec_counters(before: dict, after: dict) -> dict:
    """The speculative counters of a phase from two ``stats()["speculative"]`` snapshots (empty
    dicts when speculation is off): the differences of ``SPEC_COUNTERS`` (missing keys count 0),
    ``acceptance_rate`` = accepted / drafted tokens (None without drafts) and
    ``mean_accepted_length`` = (accepted tokens + verifies) / verifies, tokens per verify step
    (None without verifies)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    d["mean_accepted_length"] = ((d["num_accepted_tokens"] + d["num_drafts"]) / d["num_drafts"]
                                 if d["num_drafts"] else None)
    return d


def time_buckets(before: dict, after: dict) -> dict:
    """Seconds of ``TIME_BUCKETS`` (forward, verify, draft, schedule) between two
    ``stats()["time"]`` snapshots (missing buckets count 0)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in TIME_BUCKETS}


def batch1_figures(runs: Sequence[RequestRun]) -> dict:
    """Decode figures of one-at-a-time runs: decode_tokens = sum of (outputs - 1), decode_s = sum
    of (last - first token time), decode_tokens_per_s (None when no request decoded), and the mean
    time to first token (s). Requests with fewer than 2 tokens add nothing to the decode sums."""
    toks = sum(len(r.output_ids) - 1 for r in runs if len(r.output_ids) > 1)
    secs = sum(r.end_s - r.first_token_s for r in runs if len(r.output_ids) > 1)
    ttft = [r.first_token_s for r in runs if r.first_token_s is not None]
    return {"num_requests": len(runs), "decode_tokens": toks, "decode_s": secs,
            "decode_tokens_per_s": toks / secs if secs > 0 else None,
            "mean_ttft_s": statistics.fmean(ttft) if ttft else None}


def accepted_from_outputs(runs: Sequence[RequestRun]) -> dict:
    """Verify steps and accepted guesses summed over the requests' ``accepted_per_verify``, and the
    mean accepted length from them (tokens per verify; None without verifies)."""
    acc = [a for r in runs for a in r.accepted_per_verify]
    return {"num_verifies": len(acc), "num_accepted": sum(acc),
            "mean_accepted_length": (sum(acc) + len(acc)) / len(acc) if acc else None}


def identical_outputs(reference: Sequence[RequestRun], runs: Sequence[RequestRun]) -> int:
    """How many requests have exactly the reference's output ids (matched by request id)."""
    ref = {r.id: r.output_ids for r in reference}
    return sum(1 for r in runs if ref.get(r.id) == r.output_ids)


def speedup(off: Optional[float], on: Optional[float], higher_is_better: bool) -> Optional[float]:
    """How many times better ``on`` is than ``off``: on / off for a rate (tokens/s), off / on for
    a time (seconds). None when either is missing or the divisor is 0."""
    if off is None or on is None:
        return None
    num, den = (on, off) if higher_is_better else (off, on)
    return num / den if den else None


def _median(values) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _sum_counters(reps: Sequence[dict]) -> dict:
    """Spec counters added over repetitions, rates recomputed from the sums."""
    tot = {k: sum(r["speculative"][k] for r in reps) for k in SPEC_COUNTERS}
    before = dict.fromkeys(SPEC_COUNTERS, 0)
    return spec_counters(before, tot)


def summarize(phase: dict, configs: Sequence[str]) -> dict:
    """Per configuration of one phase (``phase[config]`` = list of per-repetition records with
    ``wall_s``, ``speculative``, ``time`` and, for batch 1, ``batch1``): the median figure
    (``decode_tokens_per_s`` at batch 1, else ``wall_s``), ``speedup_vs_off`` (median vs off's
    median), spec counters summed over repetitions, median draft/verify seconds, and the fewest
    identical outputs in any repetition (``identical_to_off`` of ``num_requests``)."""
    batch1 = "batch1" in phase[configs[0]][0]
    key = "decode_tokens_per_s" if batch1 else "wall_s"

    def figure(rec):
        return rec["batch1"][key] if batch1 else rec[key]

    off = _median(figure(r) for r in phase[OFF]) if OFF in phase else None
    off_cpu = _median(r.get("cpu_s") for r in phase[OFF]) if OFF in phase else None
    out = {}
    for c in configs:
        reps = phase[c]
        med = _median(figure(r) for r in reps)
        sc = _sum_counters(reps)
        out[c] = {
            key: med,
            "speedup_vs_off": speedup(off, med, higher_is_better=batch1),
            "output_tokens": reps[0]["output_tokens"],
            "output_tokens_per_s": _median(r["output_tokens"] / r["wall_s"] for r in reps if r["wall_s"]),
            "acceptance_rate": sc["acceptance_rate"],
            "mean_accepted_length": sc["mean_accepted_length"],
            "num_steps_off": sc["num_steps_off"],
            "num_steps_on": sc["num_steps_on"],
            "cpu_s": _median(r.get("cpu_s") for r in reps),
            "cpu_speedup_vs_off": speedup(off_cpu, _median(r.get("cpu_s") for r in reps), higher_is_better=False),
            "draft_s": _median(r["time"]["draft"] for r in reps),
            "verify_s": _median(r["time"]["verify"] for r in reps),
            "identical_to_off": min(r["identical_to_off"] for r in reps),
            "num_requests": reps[0]["num_requests"],
            "reps": len(reps),
        }
    return out


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _fmt(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table (first column left-aligned, the rest right-aligned)."""
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _row(name: str, s: dict, main: str) -> list[str]:
    return [name, _fmt(s[main], "{:.1f}" if main == "decode_tokens_per_s" else "{:.2f}"),
            _fmt(s["speedup_vs_off"], "{:.2f}x"), _fmt(s["output_tokens_per_s"], "{:.1f}"),
            _fmt(None if s["acceptance_rate"] is None else 100 * s["acceptance_rate"], "{:.1f}%"),
            _fmt(s["mean_accepted_length"]), f"{s['num_steps_off']}/{s['num_steps_on']}",
            _fmt(s["draft_s"]), _fmt(s["verify_s"]), f"{s['identical_to_off']}/{s['num_requests']}",
            _fmt(s.get("cpu_s")), _fmt(s.get("cpu_speedup_vs_off"), "{:.2f}x")]


def format_report(result: dict) -> str:
    """Markdown: a batch-1 table and one table row per (workload, configuration)."""
    common = ["acceptance", "mean accepted len", "steps spec off/on", "draft s", "verify s", "identical to off",
              "process CPU s", "CPU vs off"]
    lines = [f"## idleless bench spec: {', '.join(result['configs'])} "
             f"({result['host']['cpu']}, torch {result['host']['torch']}, {result['date']})", ""]
    b = result.get("batch1")
    if b:
        lines += [f"Batch 1, decode only: the first {b['num_requests']} requests of {b['workload']}, one at a time",
                  "", markdown_table(["config", "decode tok/s", "vs off", "out tok/s (incl. prefill)"] + common,
                                     [_row(c, b["summary"][c], "decode_tokens_per_s") for c in result["configs"]]),
                  ""]
    sw = result.get("sweep")
    if sw:
        lines += [f"Batch-size sweep: the first B requests of {sw['workload']} submitted together", "",
                  markdown_table(["batch", "config", "wall s", "vs off", "out tok/s"] + common,
                                 [[str(p["batch_size"])] + _row(c, p["summary"][c], "wall_s")
                                  for p in sw["points"] for c in result["configs"]]), ""]
    rows = [[f"{w['name']} ({w['num_requests']} req)"] + _row(c, w["summary"][c], "wall_s")
            for w in result["workloads"] for c in result["configs"]]
    if rows:
        lines += ["Whole workloads, all requests submitted at once", "",
                  markdown_table(["workload", "config", "wall s", "vs off", "out tok/s"] + common, rows)]
    lines += ["", "vs off: decode tok/s ratio at batch 1, wall-time ratio off/on for workloads (above 1: faster); "
                  "acceptance = accepted / drafted tokens; mean accepted len = tokens per verify step; "
                  "identical = greedy outputs token for token equal to speculation off's (fewest over repetitions); "
                  "process CPU s = the process's CPU seconds over the phase (all its threads; steadier than wall time "
                  "on a shared machine), CPU vs off = off's / this one's"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# host
# --------------------------------------------------------------------------------------------------
def host_info() -> dict:
    """CPU model name and flags of interest (``lscpu``, else /proc/cpuinfo), CPU count, torch and
    Python versions, git commit."""
    import torch

    model, flags = "", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if not out:
        try:
            with open("/proc/cpuinfo") as f:
                out = f.read()
        except OSError:
            out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": model or platform.processor(), "cpu_flags": {f: f in flags for f in CPU_FLAGS_OF_INTEREST},
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "git_commit": commit}


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``idleless bench spec``: its own plus every EngineConfig field but
    ``speculative_algorithm`` (set per configuration); ``--seed`` is also the shuffle seed."""
    from idleless.config import add_cli_args

    parser.add_argument("--workload", action="append", default=None,
                        help="workload JSON, repeatable (default: " + ", ".join(DEFAULT_WORKLOADS) + "); the first "
                             "one is also the batch-1 workload")
    parser.add_argument("--algorithms", default="ngram",
                        help="comma-separated speculative algorithms compared with speculation off (ngram, draft); "
                             "empty: off only")
    parser.add_argument("--batch1-requests", type=int, default=8,
                        help="batch-1 phase: this many leading requests of the first workload, one at a time (0: skip)")
    parser.add_argument("--max-requests", type=int, default=0,
                        help="use only the first N requests of each workload (0: all)")
    parser.add_argument("--batch-sizes", default="",
                        help="comma-separated batch sizes (e.g. 1,4,16,32): for each B, the first B requests of the first "
                             "workload submitted together (repeated when B exceeds it), to show where the gains vanish")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of every phase (order alternates)")
    parser.add_argument("--output", default=None, help="write the figures as JSON to this file")
    add_cli_args(parser, skip=("speculative_algorithm",))


def _configs(args: argparse.Namespace) -> dict:
    """{name: EngineConfig}: off first, then each algorithm. Raises ValueError for a bad one."""
    from idleless.config import config_from_args

    base = config_from_args(args)
    algos = [a.strip() for a in (args.algorithms or "").split(",") if a.strip()]
    out = {OFF: base}
    for a in algos:
        cfg = dataclasses.replace(base, speculative_algorithm=a)
        out[cfg.speculative_algorithm] = cfg
    return out


def _tokenizer_eos_ids(config, model_dir: str) -> set[int]:
    """The tokenizer's end-of-sequence ids (what ``Engine`` adds to the model's), or none when the
    model directory has no tokenizer (tiny test models)."""
    from idleless.text.tokenizer import Tokenizer

    path = config.tokenizer or model_dir
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return set()
    try:
        return set(Tokenizer.load(path).eos_token_ids)
    except (OSError, ValueError, TypeError):
        return set()


class _Cores:
    """Builds engine cores; remembers the tokenizer's eos ids after the first."""

    def __init__(self):
        self.eos: Optional[set[int]] = None
        self.model: dict = {}

    def build(self, config):
        from idleless.engine.core import EngineCore

        core = EngineCore(config)
        if self.eos is None:
            self.eos = _tokenizer_eos_ids(config, core.runner.model_dir)
            self.model = {"dir": core.runner.model_dir, "dtype": str(core.runner.dtype).replace("torch.", "")}
        core.add_eos_ids(self.eos)
        return core


def _log(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def _phase(cores: _Cores, configs: dict, reps: int, run_fn, warm_ids: Sequence[int], label: str) -> dict:
    """Run ``run_fn(core) -> (wall_s, runs)`` on a fresh, warmed core per configuration and
    repetition (order alternating); returns {config: [record per repetition]}, each record with
    ``identical_to_off`` against speculation off of the same repetition."""
    names = list(configs)
    recs: dict = {n: [] for n in names}
    for r in range(max(1, reps)):
        outs = {}
        for n in (names if r % 2 == 0 else names[::-1]):
            core = cores.build(configs[n])
            warmup(core, warm_ids)
            load0 = load_avg()
            s0 = core.stats()
            c0 = time.process_time()
            wall, runs = run_fn(core)
            cpu = time.process_time() - c0
            s1 = core.stats()
            rec = {"wall_s": wall, "cpu_s": cpu, "num_requests": len(runs), "output_tokens": sum(len(x.output_ids) for x in runs),
                   "speculative": spec_counters(s0.get("speculative") or {}, s1.get("speculative") or {}),
                   "time": time_buckets(s0.get("time") or {}, s1.get("time") or {}),
                   "from_outputs": accepted_from_outputs(runs),
                   "finish_reasons": {k: sum(1 for x in runs if x.finish_reason == k)
                                      for k in sorted({x.finish_reason for x in runs})},
                   "load_avg_1m_before": load0, "load_avg_1m_after": load_avg()}
            outs[n] = runs
            recs[n].append(rec)
            _log(f"{label} [{n}] rep {r}: {wall:.2f} s ({cpu:.2f} s CPU), {rec['output_tokens']} tokens, "
                 f"acceptance {_fmt(rec['speculative']['acceptance_rate'])}")
            del core
            gc.collect()  # the engine's cycles (~3 GiB with its KV pools) before the next one loads
        for n in names:
            recs[n][-1]["identical_to_off"] = identical_outputs(outs[OFF], outs[n])
            recs[n][-1]["_runs"] = outs[n]
    return recs


def _strip_runs(recs: dict, batch1: bool) -> None:
    """Replace the RequestRun lists by their JSON figures (batch 1: per-request decode figures)."""
    for reps in recs.values():
        for rec in reps:
            runs = rec.pop("_runs")
            if batch1:
                rec["batch1"] = batch1_figures(runs)
                rec["per_request"] = [{"id": x.id, "output_tokens": len(x.output_ids), "ttft_s": x.first_token_s,
                                       "end_s": x.end_s, "accepted_per_verify": x.accepted_per_verify} for x in runs]


def prepare(args: argparse.Namespace) -> tuple[dict, list[Workload]]:
    """The configurations ({name: EngineConfig}, off first) and the workloads (cut to
    ``--max-requests``). Raises FileNotFoundError / WorkloadError for a bad workload and ValueError
    for a bad configuration (an unknown algorithm, ``draft`` without a draft model path)."""
    configs = _configs(args)
    workloads = [load_workload(p) for p in (args.workload or DEFAULT_WORKLOADS)]
    if args.max_requests > 0:
        for w in workloads:
            w.items = w.items[:args.max_requests]
    return configs, workloads


def run(args: argparse.Namespace, prepared: Optional[tuple[dict, list[Workload]]] = None) -> dict:
    """Run every phase for every configuration; returns the result dict (what --output writes,
    after every phase with ``"complete": false``). ``prepared``: ``prepare(args)``'s result (made
    here when None)."""
    configs, workloads = prepared or prepare(args)
    names = list(configs)
    cores = _Cores()
    result: dict = {
        "benchmark": "spec",
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "idleless " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "spec"] else None,
        "host": host_info(),
        "configs": names,
        "engine_configs": {n: dataclasses.asdict(c) for n, c in configs.items()},
        "reps": max(1, args.reps),
        "shuffle_seed": args.seed,
        "workloads": [],
    }

    def checkpoint():
        if args.output:
            write_result(result, args.output, complete=False)

    first = workloads[0]
    warm_ids = first.items[0].prompt_ids
    n1 = min(max(0, args.batch1_requests), len(first.items))
    if n1:
        items = first.items[:n1]
        recs = _phase(cores, configs, args.reps, lambda core: _timed_batch1(core, items, first), warm_ids,
                      f"batch 1 on {first.name}")
        _strip_runs(recs, batch1=True)
        result["batch1"] = {"workload": first.name, "path": first.path, "num_requests": n1,
                            "runs": recs, "summary": summarize(recs, names)}
        checkpoint()
    sizes = [int(x) for x in (getattr(args, "batch_sizes", "") or "").split(",") if x.strip()]
    if sizes:
        result["sweep"] = {"workload": first.name, "path": first.path, "points": []}
        for size in sizes:
            items = [first.items[i % len(first.items)] for i in range(size)]
            recs = _phase(cores, configs, args.reps, lambda core, items=items: drive(core, items, first), warm_ids,
                          f"batch {size} on {first.name}")
            _strip_runs(recs, batch1=False)
            result["sweep"]["points"].append({"batch_size": size, "runs": recs, "summary": summarize(recs, names)})
            checkpoint()
    for w in workloads:
        order = shuffled(w.items, args.seed)
        recs = _phase(cores, configs, args.reps, lambda core, w=w, order=order: drive(core, order, w), warm_ids,
                      f"workload {w.name}")
        _strip_runs(recs, batch1=False)
        result["workloads"].append({
            "name": w.name, "path": w.path, "num_requests": len(w.items), "prompt_tokens": w.prompt_tokens,
            "max_tokens": w.output_tokens, "temperature": w.temperature, "ignore_eos": w.ignore_eos,
            "runs": recs, "summary": summarize(recs, names)})
        checkpoint()
    result["model"] = cores.model
    result["load_avg_1m_end"] = load_avg()
    return result


def _timed_batch1(core, items: Sequence[WorkItem], workload: Workload) -> tuple[float, list[RequestRun]]:
    t0 = time.perf_counter()
    runs = run_batch1(core, items, workload)
    return time.perf_counter() - t0, runs


def main(args: argparse.Namespace) -> int:
    """Entry point of ``idleless bench spec``: run, print the markdown tables, write --output.
    Exit code 2 with a one-line error for a missing or malformed workload or a bad configuration."""
    try:
        prepared = prepare(args)
    except (FileNotFoundError, WorkloadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run(args, prepared)
    print(format_report(result))
    if args.output:
        write_result(result, args.output, complete=True)
        print(f"wrote {args.output}")
    return 0
