"""``idleless bench router``: routing policies side by side over the same engine replicas.

    idleless bench router --dp 2 --policies exact,round_robin,cache_aware_approx,power_of_two \\
        --workloads multi-turn,random --kv-cache-memory 24MiB --output-file router.json

Starts ``--dp`` replicas (``idleless serve`` processes with KV events, one thread each unless
``--num-threads``) once; then for every workload and every policy: flushes every replica's prefix
cache, starts a router with that policy in this process (``--track-cache-hits``: it tokenizes and
follows the KV events whatever the policy), and runs ``idleless bench serving``'s load against it.

Workloads: ``multi-turn`` (the agent shape: ``--sessions`` conversations, each with its own system
prompt of ``--system-len`` tokens, ``--turns`` turns of ``--user-len`` tokens, ``--output-len`` new
tokens; size the KV pool so that all the system prompts do not fit one replica) and ``random``
(``--random-prompts`` unrelated prompts of ``--random-input-len`` tokens: low reuse).

Per policy and workload: the engines' cache hit rate (``usage.cached_tokens`` / prompt tokens), the
router's view of it (the chosen worker's cached prefix at routing time) and the oracle's (the most
any replica held at routing time) as shares of the prompt tokens, output throughput, TTFT p50/p99,
requests per replica. ``--scale-workers`` also measures the router's own cost: microseconds per
routing decision against simulated workers (each with a token index), and per index look-up against
one index of growing size. The result names the CPU (lscpu) and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import platform
import random
import subprocess
import sys
import time

POLICY_NAMES = ("exact", "round_robin", "cache_aware_approx", "power_of_two")


def cpu_model() -> str:
    """lscpu's "Model name" (platform.processor() when lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def add_args(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags (see the module docstring)."""
    p.add_argument("--dp", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--model", default=None, help="the replicas' model (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="24MiB", help="KV pool per replica (default 24MiB)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica (default 1)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policies, run in this order")
    p.add_argument("--workloads", default="multi-turn,random", help="multi-turn and/or random")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--random-prompts", type=int, default=16)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale-workers", default="1,10,100,1000,4000",
                   help="simulated worker counts for the router-cost curve ('' to skip)")
    p.add_argument("--output-file", default=None, help="write the result JSON here")


def _log(msg: str) -> None:
    print(f"[bench router] {msg}", file=sys.stderr, flush=True)


async def _flush(urls: list[str]) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=30) as c:
        for u in urls:
            for _ in range(300):
                r = await c.post(u + "/flush_cache")
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.1)  # requests still finishing
            else:
                raise RuntimeError(f"{u} would not flush its cache")


def _serving_args(args, workload: str, base_url: str) -> argparse.Namespace:
    from idleless.bench import serving
    p = argparse.ArgumentParser()
    serving.add_args(p)
    flags = ["--base-url", base_url, "--workload", workload, "--warmup-requests", "0", "--quiet",
             "--seed", str(args.seed)]
    if workload == "multi-turn":
        flags += ["--num-prompts", str(args.sessions * args.turns), "--mt-turns", str(args.turns),
                  "--mt-system-len", str(args.system_len), "--mt-user-len", str(args.user_len),
                  "--mt-output-len", str(args.output_len)]
    else:
        flags += ["--num-prompts", str(args.random_prompts), "--random-input-len", str(args.random_input_len),
                  "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0"]
    if args.max_concurrency:
        flags += ["--max-concurrency", str(args.max_concurrency)]
    return p.parse_args(flags)


async def run_policy(args, urls: list[str], policy: str, workload: str) -> dict:
    """One (policy, workload) run against fresh caches; returns its row."""
    import uvicorn

    from idleless.bench import serving
    from idleless.router import launch as router_launch
    from idleless.router.app import build_app
    from idleless.router.replicas import free_ports

    await _flush(urls)
    p = argparse.ArgumentParser()
    router_launch.add_args(p)
    rargs = p.parse_args(["--worker-urls", *urls, "--policy", policy, "--track-cache-hits", "--log-level", "warning"])
    router = await router_launch.build_router(rargs)
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_config=None,
                                           lifespan="off", access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        result, _, _ = await serving.run_benchmark(_serving_args(args, workload, f"http://127.0.0.1:{port}"))
    finally:
        server.should_exit = True
        await task
        await router.pool.stop()
        await router.pool.client.aclose()
    m = result["metrics"]
    workers = list(router.pool.workers.values())
    prompt = sum(w.prompt_tokens for w in workers) or 1
    return {"policy": policy, "workload": workload, "completed": m["completed"], "failed": m["failed"],
            "engine_hit_rate": m["cache_hit_rate"],
            "router_hit_rate": sum(w.predicted_hit_tokens for w in workers) / prompt,
            "oracle_hit_rate": router.oracle_hit_tokens / prompt,
            "output_throughput": m["output_throughput"], "total_throughput": m["total_throughput"],
            "ttft_p50_ms": m["ttft_ms"]["median"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "duration_s": m["duration_s"], "requests_per_worker": [w.routed for w in workers]}


class _SimWorker:
    """A worker for the cost curve: a token index and a fixed load."""

    def __init__(self, url: str, load: int):
        from idleless.router.index import TokenIndex
        self.url, self._load, self.index = url, load, TokenIndex()

    def load(self):
        return self._load

    def queued_prefill_tokens(self):
        return 0

    def cached_prefix(self, tokens):
        return self.index.match(tokens)


def router_cost_curve(worker_counts: list[int], prompt_len: int = 512, per_worker_tokens: int = 1024,
                      seed: int = 0) -> dict:
    """Microseconds per routing decision of ``exact`` and ``cache_aware_approx`` with N simulated
    workers (each index holding ``per_worker_tokens`` tokens in 4 sequences sharing a 64-token
    system prompt), and per ``TokenIndex.match`` of a ``prompt_len`` prompt against one index of
    growing size (random 512-token sequences; the prompt shares its first three quarters with one)."""
    from idleless.router.index import TokenIndex
    from idleless.router.policies import CacheAwareApprox, Exact, RouteInput

    rng = random.Random(seed)
    system = [rng.randrange(49152) for _ in range(64)]
    seq_len = per_worker_tokens // 4
    rows = []
    for n in worker_counts:
        workers = []
        for i in range(n):
            w = _SimWorker(f"w{i}", rng.randrange(8))
            for _ in range(4):
                w.index.stored(system + [rng.randrange(49152) for _ in range(seq_len - 64)])
            workers.append(w)
        prompt = system + [rng.randrange(49152) for _ in range(prompt_len - 64)]
        text = " ".join(map(str, prompt))
        timings = {}
        for name, pol in (("exact", Exact()), ("cache_aware_approx", CacheAwareApprox())):
            reps = max(3, 2000 // n)
            t0 = time.perf_counter()
            for _ in range(reps):
                pol.select(workers, RouteInput(text, prompt))
            timings[name] = (time.perf_counter() - t0) / reps * 1e6
        rows.append({"workers": n, "exact_us": round(timings["exact"], 1),
                     "cache_aware_approx_us": round(timings["cache_aware_approx"], 1)})
    index_rows = []
    idx, held, last = TokenIndex(), 0, []
    for target in (10_000, 100_000, 1_000_000):
        while held < target:
            last = [rng.randrange(49152) for _ in range(512)]
            idx.stored(last)
            held += 512
        q = last[:prompt_len * 3 // 4] + [rng.randrange(49152) for _ in range(prompt_len - prompt_len * 3 // 4)]
        reps = 2000
        t0 = time.perf_counter()
        for _ in range(reps):
            idx.match(q)
        index_rows.append({"cached_tokens": held, "match_us": round((time.perf_counter() - t0) / reps * 1e6, 2)})
    return {"prompt_len": prompt_len, "per_worker_tokens": per_worker_tokens, "select": rows, "index": index_rows}


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_tables(result: dict) -> str:
    """Markdown tables of a result: one row per (workload, policy), then the router-cost curve."""
    lines = [f"CPU: {result['cpu']}; {result['dp']} replicas x {result['threads_per_replica']} thread(s), "
             f"KV pool {result['kv_cache_memory']} each; model {result['model']}", "",
             "| workload | policy | engine hit rate | router-seen hit | oracle hit | output tok/s | TTFT p50 ms | "
             "TTFT p99 ms | requests per replica | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['workload']} | {r['policy']} | {_fmt(r['engine_hit_rate'], '.1%')} | "
                     f"{_fmt(r['router_hit_rate'], '.1%')} | {_fmt(r['oracle_hit_rate'], '.1%')} | "
                     f"{_fmt(r['output_throughput'], '.2f')} | {_fmt(r['ttft_p50_ms'], '.0f')} | "
                     f"{_fmt(r['ttft_p99_ms'], '.0f')} | {r['requests_per_worker']} | {r['failed']} |")
    curve = result.get("router_cost")
    if curve:
        lines += ["", f"Router cost per decision ({curve['prompt_len']}-token prompt, "
                      f"{curve['per_worker_tokens']} cached tokens per simulated worker):", "",
                  "| workers | exact µs | cache_aware_approx µs |", "|---|---|---|"]
        lines += [f"| {r['workers']} | {r['exact_us']} | {r['cache_aware_approx_us']} |" for r in curve["select"]]
        lines += ["", "| tokens in one index | match µs |", "|---|---|"]
        lines += [f"| {r['cached_tokens']} | {r['match_us']} |" for r in curve["index"]]
    return "\n".join(lines)


def _save(args, result: dict) -> None:
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=1)


async def _run_all(args, urls, result: dict) -> None:
    """Every (workload, policy) run into ``result["runs"]``, saved after each."""
    for wl in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        for pol in [p.strip() for p in args.policies.split(",") if p.strip()]:
            _log(f"{wl} with {pol}")
            result["runs"].append(await run_policy(args, urls, pol, wl))
            _save(args, result)


async def _warm(urls: list[str]) -> None:
    """One short request per replica (first-use costs: kernels, allocator), before any timed run."""
    import httpx
    async with httpx.AsyncClient(timeout=600) as c:
        for u in urls:
            await c.post(u + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2})


def main(args: argparse.Namespace) -> int:
    """Run the comparison; prints markdown tables, writes ``--output-file``. Exit 1 when a replica fails."""
    from idleless.router.policies import POLICIES
    from idleless.router.replicas import start_replicas, stop_replicas, wait_ready
    from idleless.server import launch

    bad = [p for p in args.policies.split(",") if p.strip() and p.strip() not in POLICIES]
    if bad or args.dp < 1:
        print(f"error: unknown policies {bad} (known: {', '.join(POLICIES)})" if bad else "error: --dp >= 1",
              file=sys.stderr)
        return 2
    sp = argparse.ArgumentParser()
    launch.add_args(sp)
    flags = ["--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--num-threads",
             str(args.num_threads), "--log-level", "warning"] + (["--model", args.model] if args.model else [])
    sargs = sp.parse_args(flags)
    result = {"benchmark": "router", "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": "idleless " + " ".join(sys.argv[1:]), "cpu": cpu_model(), "dp": args.dp,
              "threads_per_replica": args.num_threads, "kv_cache_memory": args.kv_cache_memory,
              "model": args.model or "SmolLM2-135M-Instruct (bundled)", "runs": []}
    procs, urls = start_replicas(sargs, args.dp)
    try:
        wait_ready(procs, urls, 900)
        asyncio.run(_warm(urls))
        asyncio.run(_run_all(args, urls, result))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stop_replicas(procs, 5)
    counts = [int(x) for x in args.scale_workers.split(",") if x.strip()]
    if counts:
        _log("router cost curve")
        result["router_cost"] = router_cost_curve(counts)
    _save(args, result)
    print(format_tables(result))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m idleless.bench.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
