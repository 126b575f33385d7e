"""Scheduling benchmarks (issue 4): ``idleless bench policies | chunked-prefill | eviction``.

All three drive ``EngineCore`` in-process with token ids (no tokenizer, no detokenization: the
figures are the engine loop's own) and take every engine flag (``--dtype``, ``--kv-cache-memory``,
...); a fresh engine is loaded for each run so no cache or counter carries over. Times are
``time.perf_counter`` seconds. Each run records the 1-minute load average before and after it: on
a shared machine the numbers are only as quiet as the load.

* ``policies``: the workload (default ``../shared/workloads/shared_prefix.json``) submitted all at
  once in a seeded shuffled order, once per schedule policy (fcfs, lpm, dfs-weight), in two
  settings: *unlimited* (the engine flags as given: every request fits, so order barely matters)
  and *constrained* (``--constrained-max-running`` running requests and a KV pool of
  ``--constrained-kv-tokens`` tokens, so the cache cannot hold every group's document and the
  order decides what is still cached). Reported per run: cache hit rate (prompt tokens served by
  the radix cache / prompt tokens), its fraction of the workload's upper bound
  (``stats.prefix_cache_hit_ratio_upper_bound``: every distinct prefix token computed once),
  prompt tokens computed, wall seconds, output and total tokens/s, steps, retractions, evicted tokens.
* ``chunked-prefill``: ``--decoders`` short requests decode ``--decode-tokens`` tokens each while
  ``--long-prompts`` prompts of ``--long-prompt-len`` tokens arrive, one every ``--arrival-gap``
  steps once the decoders are running. Inter-token latency (ITL) = seconds between successive
  tokens of a decoder, timestamped in the loop right after each ``step()``; reported p50 / p90 /
  p99 / max over all decoders, and the long prompts' time to first token, for chunked prefill off
  (``--chunked-prefill-size 0``) and for each size in ``--chunk-sizes``.
* ``eviction``: a scripted stream, one request at a time: each round, ``--hot-uses`` requests on a
  hot system prompt (the workload's, each with its own question), then ``--docs-per-round``
  one-off documents (prompts of ``../shared/workloads/random.json``, never reused), in a pool of
  ``--kv-tokens`` tokens. LRU evicts the hot prefix while the documents stream through; GDSF
  (value-aware) keeps it. Reported: hit rate and computed prompt tokens for lru, gdsf, and lru with
  the hot prefix pinned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_PREFIX = "../shared/workloads/shared_prefix.json"
RANDOM_WORKLOAD = "../shared/workloads/random.json"
POLICIES = ("fcfs", "lpm", "dfs-weight")


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def load_avg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def load_workload_file(path: str) -> dict:
    """Read a workload JSON (see ../shared/workloads/README.md); a relative path is tried from the
    current directory, then from the repository root. Raises FileNotFoundError / ValueError."""
    p = Path(os.path.expanduser(path))
    for c in ([p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]):
        if c.is_file():
            data = json.loads(c.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not data.get("requests"):
                raise ValueError(f"workload {c} has no 'requests'")
            data["_path"] = str(c.resolve())
            return data
    raise FileNotFoundError(f"workload file {path!r} not found (from {Path.cwd()} or {REPO_ROOT})")


def percentile(xs: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _greedy(n: int):
    from idleless.engine.request import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def make_core(config, **overrides):
    """A fresh EngineCore for ``config`` with ``overrides`` (EngineConfig fields); ``kv_tokens``
    sizes the KV pool in tokens instead of bytes."""
    from idleless.cache.kv_pool import KVPool
    from idleless.engine.core import EngineCore
    from idleless.model.loader import load_model_config, prepare_model_dir
    from idleless.model.runner import resolve_dtype

    kv_tokens = overrides.pop("kv_tokens", None)
    cfg = dataclasses.replace(config, **overrides)
    if kv_tokens:
        mc = load_model_config(prepare_model_dir(cfg.model))
        per = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                     resolve_dtype(cfg.dtype))
        cfg = dataclasses.replace(cfg, kv_cache_memory=str(int(kv_tokens) * per))
    return EngineCore(cfg)


def _warmup(core) -> None:
    """One tiny untimed request, then an empty cache."""
    from idleless.engine.request import Request

    core.add_request(Request("__warmup__", list(range(10, 42)), _greedy(2)))
    while core.has_work():
        core.step()
    core.scheduler.flush_cache()


def run_loop(core, on_step=None, max_steps: int = 10**7) -> dict:
    """Step until idle. Returns {"wall_s", "steps", "tokens": {rid: ids}, "token_times": {rid:
    [perf_counter after the step that produced each token]}}. ``on_step(step_index)`` runs before
    each step (to submit arrivals)."""
    tokens: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    steps = 0
    while steps < max_steps:
        if on_step is not None:
            on_step(steps)
        if not core.has_work():
            if on_step is None or getattr(on_step, "done", True):
                break
            steps += 1  # idle until the next arrival
            continue
        outs = core.step()
        t = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                tokens.setdefault(o.rid, []).extend(o.new_token_ids)
                times.setdefault(o.rid, []).extend([t] * len(o.new_token_ids))
            if o.finished and o.error:
                raise RuntimeError(f"request {o.rid} failed: {o.error}")
        steps += 1
    return {"wall_s": time.perf_counter() - t0, "steps": steps, "tokens": tokens, "token_times": times}


def _stats_delta(core, before: dict) -> dict:
    after = core.stats()
    keys = ("prompt_tokens", "cached_tokens", "computed_prompt_tokens", "generation_tokens", "num_retractions",
            "num_steps", "forward_time", "schedule_time", "evicted_tokens")
    return {k: after[k] - before.get(k, 0) for k in keys}


def _write(args, result: dict) -> None:
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    result = {"command": " ".join(sys.argv), "git_commit": commit, "cpu_count": os.cpu_count(), **result}
    if getattr(args, "output", None):
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2))
        _log(f"wrote {args.output}")


def _engine_config(args):
    from idleless.config import config_from_args

    return config_from_args(args)


def _common_args(p: argparse.ArgumentParser, skip=()) -> None:
    from idleless.config import add_cli_args

    p.add_argument("--output", default=None, help="write the results as JSON here")
    add_cli_args(p, skip=tuple(skip))


# --------------------------------------------------------------------------------------------------
# policies
# --------------------------------------------------------------------------------------------------
def run_policy(config, workload: dict, order: list[int], policy: str, **overrides) -> dict:
    """One run: every request of ``workload`` (in ``order``) submitted at once under ``policy``."""
    from idleless.engine.request import Request

    core = make_core(config, schedule_policy=policy, **overrides)
    _warmup(core)
    reqs = workload["requests"]
    before = core.stats()
    load0 = load_avg()
    max_tok = workload.get("sampling", {}).get("max_tokens", 64)
    for i in order:
        r = reqs[i]
        core.add_request(Request(f"q{i}", list(r["prompt_token_ids"]), _greedy(int(r.get("max_tokens", max_tok)))))
    res = run_loop(core)
    d = _stats_delta(core, before)
    wall = res["wall_s"]
    bound = workload.get("stats", {}).get("prefix_cache_hit_ratio_upper_bound")
    hit = d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
    out_tokens = sum(len(v) for v in res["tokens"].values())
    return {
        "policy": policy, "kv_slots": core.runner.pool.num_slots,
        "max_running_requests": core.config.max_running_requests,
        "cache_hit_rate": hit, "fraction_of_upper_bound": hit / bound if bound else None,
        "prompt_tokens": d["prompt_tokens"], "cached_tokens": d["cached_tokens"],
        "computed_prompt_tokens": d["computed_prompt_tokens"], "output_tokens": out_tokens,
        "wall_s": wall, "output_tokens_per_s": out_tokens / wall, "total_tokens_per_s":
            (d["prompt_tokens"] + out_tokens) / wall, "steps": res["steps"],
        "num_retractions": d["num_retractions"], "evicted_tokens": d["evicted_tokens"],
        "forward_s": d["forward_time"], "schedule_s": d["schedule_time"],
        "load_avg_1m_before": load0, "load_avg_1m_after": load_avg(),
    }, {k: v for k, v in res["tokens"].items()}


def add_policies_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=SHARED_PREFIX)
    p.add_argument("--shuffle-seed", type=int, default=0, help="seed of the shuffled submission order")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--settings", default="unlimited,constrained", help="which of unlimited, constrained")
    p.add_argument("--num-requests", type=int, default=0, help="only the first N of the shuffled order (0: all)")
    p.add_argument("--constrained-max-running", type=int, default=8)
    p.add_argument("--constrained-kv-tokens", type=int, default=2048)
    _common_args(p, skip=("schedule_policy",))


def main_policies(args) -> int:
    workload = load_workload_file(args.workload)
    config = _engine_config(args)
    n = len(workload["requests"])
    order = list(range(n))
    random.Random(args.shuffle_seed).shuffle(order)
    if 0 < args.num_requests < n:
        order = order[: args.num_requests]
        n = len(order)
        workload = dict(workload, stats={})  # the upper bound is the whole workload's
    settings = {"unlimited": {}, "constrained": {"max_running_requests": args.constrained_max_running,
                                                 "kv_tokens": args.constrained_kv_tokens}}
    results = []
    ref_tokens = None
    for name in args.settings.split(","):
        for policy in args.policies.split(","):
            _log(f"policies: {name} {policy} (load {load_avg()})")
            r, toks = run_policy(config, workload, order, policy, **dict(settings[name]))
            r["setting"] = name
            if ref_tokens is None:
                ref_tokens = toks
            r["outputs_equal_first_run"] = toks == ref_tokens
            results.append(r)
            _log(f"  hit {r['cache_hit_rate']:.3f} ({r['fraction_of_upper_bound'] or 0:.1%} of bound) "
                 f"wall {r['wall_s']:.1f}s out {r['output_tokens_per_s']:.1f} tok/s")
    bound = workload.get("stats", {}).get("prefix_cache_hit_ratio_upper_bound")
    print(f"workload {workload.get('name')} ({n} requests, shuffle seed {args.shuffle_seed}); "
          f"hit-rate upper bound {bound if bound is None else round(bound, 4)}; dtype {config.dtype}")
    print(f"{'setting':<12}{'policy':<11}{'running':>8}{'kv tok':>8}{'hit':>7}{'of bound':>9}{'computed':>9}"
          f"{'wall s':>8}{'out t/s':>8}{'tot t/s':>8}{'retract':>8}{'evicted':>8}{'load':>11}")
    for r in results:
        print(f"{r['setting']:<12}{r['policy']:<11}{r['max_running_requests']:>8}{r['kv_slots']:>8}"
              f"{r['cache_hit_rate']:>7.3f}{(r['fraction_of_upper_bound'] or 0):>9.1%}"
              f"{r['computed_prompt_tokens']:>9}{r['wall_s']:>8.1f}{r['output_tokens_per_s']:>8.1f}"
              f"{r['total_tokens_per_s']:>8.0f}{r['num_retractions']:>8}{r['evicted_tokens']:>8}"
              f"{r['load_avg_1m_before']:>5}->{r['load_avg_1m_after']:<5}")
    _write(args, {"benchmark": "policies", "workload": workload["_path"], "shuffle_seed": args.shuffle_seed,
                  "upper_bound": bound, "results": results})
    return 0


# --------------------------------------------------------------------------------------------------
# chunked prefill
# --------------------------------------------------------------------------------------------------
def _long_prompt(workload: dict, n: int, k: int) -> list[int]:
    """``n`` real token ids: the workload's prompts concatenated, starting at prompt ``k`` (so
    each long prompt differs from the others from its first token)."""
    reqs = workload["requests"]
    out: list[int] = []
    i = k
    while len(out) < n:
        out.extend(reqs[i % len(reqs)]["prompt_token_ids"][::-1] if (i // len(reqs)) % 2 else
                   reqs[i % len(reqs)]["prompt_token_ids"])
        i += 7
    return out[:n]


def run_chunked(config, workload: dict, chunk: int, args) -> dict:
    from idleless.engine.request import Request

    core = make_core(config, chunked_prefill_size=chunk)
    _warmup(core)
    decoders = [f"d{i}" for i in range(args.decoders)]
    rand = load_workload_file(args.short_workload)["requests"]
    for i, rid in enumerate(decoders):
        ids = list(rand[i % len(rand)]["prompt_token_ids"])[: args.decoder_prompt_len]
        core.add_request(Request(rid, ids, _greedy(args.decode_tokens)))
    longs = [_long_prompt(workload, args.long_prompt_len, k) for k in range(args.long_prompts)]
    arrivals = {args.first_arrival + k * args.arrival_gap: k for k in range(args.long_prompts)}
    submitted: dict[str, float] = {}

    def on_step(step):
        k = arrivals.get(step)
        if k is not None:
            core.add_request(Request(f"long{k}", longs[k], _greedy(args.long_new_tokens)))
            submitted[f"long{k}"] = time.perf_counter()
        on_step.done = len(submitted) == len(longs)

    on_step.done = False
    load0 = load_avg()
    res = run_loop(core, on_step)
    itl = []
    for rid in decoders:
        ts = res["token_times"].get(rid, [])
        itl += [b - a for a, b in zip(ts, ts[1:])]
    ttft = [res["token_times"][r][0] - t for r, t in submitted.items()]
    return {
        "chunked_prefill_size": chunk, "max_prefill_tokens": core.config.max_prefill_tokens,
        "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90), "itl_p99_s": percentile(itl, 99),
        "itl_max_s": max(itl) if itl else None, "itl_mean_s": statistics.fmean(itl) if itl else None,
        "num_itl_samples": len(itl), "long_ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "long_ttft_max_s": max(ttft) if ttft else None, "wall_s": res["wall_s"], "steps": res["steps"],
        "load_avg_1m_before": load0, "load_avg_1m_after": load_avg(),
    }, res["tokens"]


def add_chunked_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=SHARED_PREFIX, help="source of the long prompts' token ids")
    p.add_argument("--short-workload", default=RANDOM_WORKLOAD, help="source of the decoders' prompts")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decoder-prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-prompt-len", type=int, default=4096)
    p.add_argument("--long-new-tokens", type=int, default=4)
    p.add_argument("--first-arrival", type=int, default=8, help="step of the first long prompt's arrival")
    p.add_argument("--arrival-gap", type=int, default=32, help="steps between long prompt arrivals")
    p.add_argument("--chunk-sizes", default="512,256", help="chunked runs to compare with chunking off")
    _common_args(p, skip=("chunked_prefill_size",))


def main_chunked(args) -> int:
    workload = load_workload_file(args.workload)
    config = _engine_config(args)
    results = []
    ref = None
    for chunk in [0] + [int(c) for c in args.chunk_sizes.split(",") if c]:
        _log(f"chunked-prefill: chunk {chunk or 'off'} (load {load_avg()})")
        r, toks = run_chunked(config, workload, chunk, args)
        ref = toks if ref is None else ref
        r["outputs_equal_unchunked"] = toks == ref
        results.append(r)
    print(f"{args.decoders} decoders x {args.decode_tokens} tokens; {args.long_prompts} prompts of "
          f"{args.long_prompt_len} tokens arriving every {args.arrival_gap} steps; dtype {config.dtype}")
    print(f"{'chunk':>7}{'budget':>8}{'ITL p50':>9}{'p90':>8}{'p99':>8}{'max':>8}{'long TTFT':>10}{'wall s':>8}"
          f"{'same out':>9}{'load':>12}")
    for r in results:
        print(f"{r['chunked_prefill_size'] or 'off':>7}{r['max_prefill_tokens']:>8}{r['itl_p50_s']:>9.3f}"
              f"{r['itl_p90_s']:>8.3f}{r['itl_p99_s']:>8.3f}{r['itl_max_s']:>8.3f}{r['long_ttft_mean_s']:>10.2f}"
              f"{r['wall_s']:>8.1f}{str(r['outputs_equal_unchunked']):>9}"
              f"{r['load_avg_1m_before']:>6}->{r['load_avg_1m_after']:<5}")
    _write(args, {"benchmark": "chunked-prefill", "args": {k: v for k, v in vars(args).items()
                                                          if isinstance(v, (int, float, str)) or v is None},
                  "results": results})
    return 0


# --------------------------------------------------------------------------------------------------
# eviction
# --------------------------------------------------------------------------------------------------
def eviction_stream(workload: dict, docs: dict, rounds: int, hot_uses: int, docs_per_round: int):
    """(hot prefix ids, [prompt ids in order]): per round ``hot_uses`` requests made of the
    workload's shared system-prompt prefix + a different request's tail, then ``docs_per_round``
    one-off documents (each document used once)."""
    reqs = workload["requests"]
    n_hot = int(reqs[0].get("shared_prefix_tokens") or workload.get("stats", {})["shared_prefix_tokens_all_requests"])
    hot = list(reqs[0]["prompt_token_ids"][:n_hot])
    pool = [list(r["prompt_token_ids"]) for r in docs["requests"]]
    if rounds * docs_per_round > len(pool):
        raise ValueError(f"{rounds} rounds x {docs_per_round} documents need more than the {len(pool)} prompts")
    stream, q, d = [], 0, 0
    for _ in range(rounds):
        for _ in range(hot_uses):
            # the hot prefix + the tail (document and question) of a request, rotated through the groups
            r = reqs[(q * 9) % len(reqs)]
            tail = r["prompt_token_ids"][r.get("group_prefix_tokens", n_hot):]
            stream.append(hot + list(tail))
            q += 1
        for _ in range(docs_per_round):
            stream.append(pool[d])
            d += 1
    return hot, stream


def run_eviction(config, hot: list[int], stream: list[list[int]], policy: str, pin: bool, args) -> dict:
    from idleless.engine.request import Request

    core = make_core(config, radix_eviction_policy=policy, kv_tokens=args.kv_tokens,
                     max_pinned_tokens=len(hot) if pin else None)
    _warmup(core)
    if pin:
        done: dict = {}
        core.pin_prefix("hot", hot, 3600.0, lambda n, err: done.update(n=n, err=err))
        while core.has_work():
            core.step()
        if done.get("err"):
            raise RuntimeError(f"pin failed: {done['err']}")
    before = core.stats()
    load0 = load_avg()
    t0 = time.perf_counter()
    hot_hits = []
    for i, ids in enumerate(stream):
        core.add_request(Request(f"s{i}", ids, _greedy(args.max_tokens)))
        while core.has_work():
            for o in core.step():
                if o.finished and ids[: len(hot)] == hot:
                    hot_hits.append(o.cached_tokens >= len(hot))
    wall = time.perf_counter() - t0
    d = _stats_delta(core, before)
    return {"policy": policy + (" + pin" if pin else ""), "kv_slots": core.runner.pool.num_slots,
            "cache_hit_rate": d["cached_tokens"] / d["prompt_tokens"], "prompt_tokens": d["prompt_tokens"],
            "computed_prompt_tokens": d["computed_prompt_tokens"], "evicted_tokens": d["evicted_tokens"],
            "hot_prefix_hits": sum(hot_hits), "hot_prefix_uses": len(hot_hits),
            "hot_prefix_cached_at_end": core.scheduler.cache.peek_prefix_len(hot) >= len(hot),
            "wall_s": wall, "load_avg_1m_before": load0, "load_avg_1m_after": load_avg()}


def add_eviction_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=SHARED_PREFIX, help="source of the hot prefix and questions")
    p.add_argument("--docs", default=RANDOM_WORKLOAD, help="source of the one-off documents")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--hot-uses", type=int, default=2, help="requests on the hot prefix per round")
    p.add_argument("--docs-per-round", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=1536, help="KV pool size in tokens")
    p.add_argument("--max-tokens", type=int, default=1, help="new tokens per request")
    _common_args(p, skip=("radix_eviction_policy",))


def main_eviction(args) -> int:
    workload = load_workload_file(args.workload)
    docs = load_workload_file(args.docs)
    config = _engine_config(args)
    hot, stream = eviction_stream(workload, docs, args.rounds, args.hot_uses, args.docs_per_round)
    results = []
    for policy, pin in (("lru", False), ("gdsf", False), ("lru", True)):
        _log(f"eviction: {policy}{' + pin' if pin else ''} (load {load_avg()})")
        results.append(run_eviction(config, hot, stream, policy, pin, args))
    print(f"stream: {args.rounds} rounds x ({args.hot_uses} uses of a {len(hot)}-token hot prefix + "
          f"{args.docs_per_round} one-off documents), {len(stream)} requests, one at a time; "
          f"KV pool {results[0]['kv_slots']} tokens; dtype {config.dtype}")
    print(f"{'policy':<12}{'hit rate':>9}{'computed':>10}{'evicted':>9}{'hot hits':>10}{'hot kept':>9}"
          f"{'wall s':>8}{'load':>12}")
    for r in results:
        print(f"{r['policy']:<12}{r['cache_hit_rate']:>9.3f}{r['computed_prompt_tokens']:>10}"
              f"{r['evicted_tokens']:>9}{r['hot_prefix_hits']:>5}/{r['hot_prefix_uses']:<4}"
              f"{str(r['hot_prefix_cached_at_end']):>9}{r['wall_s']:>8.1f}"
              f"{r['load_avg_1m_before']:>6}->{r['load_avg_1m_after']:<5}")
    _write(args, {"benchmark": "eviction", "rounds": args.rounds, "hot_uses": args.hot_uses,
                  "docs_per_round": args.docs_per_round, "hot_prefix_tokens": len(hot),
                  "num_requests": len(stream), "results": results})
    return 0


# --------------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------------
COMMANDS = {
    "policies": (add_policies_args, main_policies, "cache hit rate and throughput of fcfs / lpm / dfs-weight"),
    "chunked-prefill": (add_chunked_args, main_chunked, "inter-token latency of decodes while long prompts arrive"),
    "eviction": (add_eviction_args, main_eviction, "hit rate of lru vs gdsf on a hot-prefix + one-off stream"),
}


def register(sub) -> None:
    """Add ``policies``, ``chunked-prefill`` and ``eviction`` to a bench subparsers object; each
    sets ``bench_main``."""
    for name, (add, main, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add(p)
        p.set_defaults(bench_main=main)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m idleless.bench.scheduling {policies,chunked-prefill,eviction} ...`` (the same as
    ``idleless bench ...``, without loading the other bench modules)."""
    import logging

    parser = argparse.ArgumentParser(prog="python -m idleless.bench.scheduling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    register(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
