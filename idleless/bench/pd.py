"""``idleless bench pd``: colocated serving vs prefill/decode disaggregation, side by side, one run.

    idleless bench pd --request-rates 0.25,0.5,1 --num-prompts 16 --random-input-len 768 \\
        --random-output-len 48 --slo ttft:4000,tpot:400 --output pd.json

Starts, in turn, (a) one colocated ``idleless serve`` with all ``--num-threads`` threads and (b) a
prefill server and a decode server with half the threads each behind ``idleless router
--pd-disaggregation``, and drives each with the same ``idleless bench serving`` run (the random
workload: long prompts arriving while others decode) at every request rate. Reports TTFT p50/p99,
ITL p99, TPOT p50 and goodput (requests/s meeting every ``--slo`` bound: DistServe's metric), and for
(b) the TTFT split (queue, prefill, transfer, first decode: p50/p99 ms, ``idleless.disagg.timing``)
and the KV bytes the decode server pulled with two rates next to a loopback copy rate: end to end as
the decode server sees it (pull sent -> KV in its pool) and the prefill server's transfer thread's
copy and send alone. Servers are stopped between setups; the prefix caches are flushed before every run.

``--setups colocated,pd,pd-layerwise`` adds (c), the setup (b) with the router's ``--pd-layerwise``:
both legs start at once and the KV travels layer by layer while the prefill server computes it.

Extra server flags go in ``--server-args`` (e.g. ``"--dtype float32"``). Every figure names the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from idleless.bench import serving


def _exe() -> list[str]:
    return [sys.executable, "-m", "idleless.cli"]


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s), for every reported figure."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


class Procs:
    """Child processes (servers, routers) started for one setup; ``stop`` ends them all."""

    def __init__(self, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen(_exe() + argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()


def wait_healthy(url: str, procs: Procs, timeout_s: float) -> None:
    """Poll ``url``/health until 200. Raises RuntimeError when a child exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(p.args[3:6])} exited with {p.returncode} (logs in {procs.log_dir})")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")
        time.sleep(0.5)


def loopback_copy_gbps(nbytes: int = 256 << 20) -> float:
    """Memory copy rate of this machine (GB/s): the bound a same-machine KV transfer is compared to."""
    import torch
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(4):
        b.copy_(a)
    return 4 * nbytes / (time.perf_counter() - t0) / 1e9


def _serving_args(args: argparse.Namespace, url: str, rate: float) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serving.add_args(p)
    argv = ["--base-url", url, "--workload", "random", "--num-prompts", str(args.num_prompts),
            "--random-input-len", str(args.random_input_len), "--random-output-len", str(args.random_output_len),
            "--random-range-ratio", str(args.random_range_ratio), "--request-rate", str(rate),
            "--seed", str(args.seed), "--quiet", "--warmup-requests", "1", "--flush-cache"]
    if args.slo:
        argv += ["--slo", args.slo]
    return p.parse_args(argv)


def _flush(url: str) -> None:
    try:
        httpx.post(url + "/flush_cache", timeout=30.0)
    except httpx.HTTPError:
        pass


def _kv_transfer(url: str) -> dict:
    try:
        return (httpx.get(url + "/server_info", timeout=10.0).json().get("stats") or {}).get("kv_transfer") or {}
    except (httpx.HTTPError, ValueError):
        return {}


def _percentile(values: list[float], q: float) -> Optional[float]:
    """The ``q``-quantile (0..1) by linear interpolation between order statistics; None when empty."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def split_summary(before: dict, after: dict) -> dict:
    """p50/p99 in ms of each TTFT part over the requests between two ``ttft_split`` snapshots (those
    still in ``recent``); ``split_n``: how many."""
    n = (after.get("count") or 0) - (before.get("count") or 0)
    recs = (after.get("recent") or [])[-n:] if n > 0 else []
    out: dict = {"split_n": len(recs)}
    for part in ("queue", "prefill", "transfer", "first_decode"):
        vals = [r[part + "_s"] * 1e3 for r in recs if r.get(part + "_s") is not None]
        out[f"{part}_p50_ms"], out[f"{part}_p99_ms"] = _percentile(vals, 0.5), _percentile(vals, 0.99)
    return out


def transfer_summary(d0: dict, d1: dict, p0: dict, p1: dict) -> dict:
    """KV bytes and rates between two readings of the decode (``d``) and prefill (``p``) servers'
    ``kv_transfer`` stats."""
    b = d1.get("bytes_received", 0) - d0.get("bytes_received", 0)
    s = d1.get("seconds", 0.0) - d0.get("seconds", 0.0)
    pb = p1.get("bytes_sent", 0) - p0.get("bytes_sent", 0)
    ps = p1.get("seconds", 0.0) - p0.get("seconds", 0.0)
    return {"kv_bytes": b, "kv_transfer_s": round(s, 4), "kv_gb_per_s": round(b / s / 1e9, 3) if s else None,
            "kv_send_s": round(ps, 4), "kv_send_gb_per_s": round(pb / ps / 1e9, 3) if ps else None,
            "kv_send_wait_s": round(p1.get("wait_seconds", 0.0) - p0.get("wait_seconds", 0.0), 4),
            "kv_fallbacks": d1.get("num_fallbacks", 0) - d0.get("num_fallbacks", 0),
            "kv_pulls": d1.get("num_pulls", 0) - d0.get("num_pulls", 0),
            "kv_layerwise_pulls": d1.get("num_layerwise", 0) - d0.get("num_layerwise", 0),
            "kv_layer_messages": d1.get("num_layer_messages", 0) - d0.get("num_layer_messages", 0)}


def _row(setup: str, rate: float, result: dict, extra: Optional[dict] = None) -> dict:
    m = result["metrics"]

    def q(key, stat):
        d = m.get(key) or {}
        return d.get(stat)
    return {"setup": setup, "request_rate": rate, "completed": m.get("completed"), "failed": m.get("failed"),
            "ttft_p50_ms": q("ttft_ms", "median"), "ttft_p99_ms": q("ttft_ms", "p99"),
            "itl_p99_ms": q("itl_ms", "p99"), "tpot_p50_ms": q("tpot_ms", "median"),
            "goodput_rps": m.get("goodput"), "output_tok_s": m.get("output_throughput"), **(extra or {})}


def run_setup(args, setup: str, log_dir: Path) -> list[dict]:
    """Start one setup's processes, run every rate through it, stop it; returns one row per rate."""
    from idleless.router.replicas import free_ports
    procs = Procs(log_dir)
    extra = shlex.split(args.server_args or "")
    threads = args.num_threads
    rows = []
    try:
        if setup == "colocated":
            (port,) = free_ports(1)
            url = f"http://127.0.0.1:{port}"
            procs.start("colocated", ["serve", "--port", str(port), "--num-threads", str(threads), *extra])
            wait_healthy(url, procs, args.start_timeout)
            decode_url = url
        else:
            pp, dp, rp, bp = free_ports(4)
            half = str(max(1, threads // 2))
            procs.start("prefill", ["serve", "--port", str(pp), "--num-threads", half, "--disaggregation-mode",
                                    "prefill", "--disaggregation-bootstrap-port", str(bp), *extra])
            procs.start("decode", ["serve", "--port", str(dp), "--num-threads", half, "--disaggregation-mode",
                                   "decode", *extra])
            wait_healthy(f"http://127.0.0.1:{pp}", procs, args.start_timeout)
            wait_healthy(f"http://127.0.0.1:{dp}", procs, args.start_timeout)
            procs.start("router", ["router", "--port", str(rp), "--pd-disaggregation",
                                   "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
                                   *(["--pd-layerwise"] if setup == "pd-layerwise" else [])])
            url, decode_url = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{dp}"
            wait_healthy(url, procs, 60)
        for rate in args.rates:
            prefill_url = None
            if setup != "colocated":
                prefill_url = f"http://127.0.0.1:{pp}"
                _flush(decode_url)
                _flush(prefill_url)
            d0, p0 = _kv_transfer(decode_url), _kv_transfer(prefill_url) if prefill_url else {}
            result, _, _ = asyncio.run(serving.run_benchmark(_serving_args(args, url, rate)))
            d1, p1 = _kv_transfer(decode_url), _kv_transfer(prefill_url) if prefill_url else {}
            kv = {}
            if d1:
                kv = {**transfer_summary(d0, d1, p0, p1),
                      **split_summary(d0.get("ttft_split") or {}, d1.get("ttft_split") or {})}
            rows.append(_row(setup, rate, result, kv))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        procs.stop()
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rates", default="0.25,0.5,1", help="comma-separated requests/s (Poisson)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--random-input-len", type=int, default=768)
    p.add_argument("--random-output-len", type=int, default=48)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--slo", default="ttft:4000,tpot:400", help="goodput bounds in ms (serving's --slo)")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 2,
                   help="threads of the colocated server; PD gives each of its two servers half")
    p.add_argument("--setups", default="colocated,pd", help="which setups, in order: colocated, pd, pd-layerwise")
    p.add_argument("--server-args", default=None, help="extra flags for every server, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--output", default=None, help="write the result JSON here")


def main(args: argparse.Namespace) -> int:
    """Run every setup at every rate; print one JSON row per run and a summary table."""
    import tempfile
    args.rates = [float(x) for x in args.request_rates.split(",") if x.strip()]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="idleless-pd-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for setup in [s.strip() for s in args.setups.split(",") if s.strip()]:
        if setup not in ("colocated", "pd", "pd-layerwise"):
            print(f"error: unknown setup {setup!r} (colocated, pd, pd-layerwise)", file=sys.stderr)
            return 2
        rows += run_setup(args, setup, log_dir)
    result = {"benchmark": "pd", "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": "idleless bench pd " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
              "loopback_copy_gb_per_s": round(loopback_copy_gbps(), 2), "rows": rows}
    print(f"\nCPU: {result['cpu']}; loopback copy {result['loopback_copy_gb_per_s']} GB/s")
    f = (lambda v: "n/a" if v is None else f"{v:.3g}")
    print("| setup | rate | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | TPOT p50 ms | goodput req/s | out tok/s | "
          "KV GB/s (pull) | KV GB/s (send) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['request_rate']} | {f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} | "
              f"{f(r['itl_p99_ms'])} | {f(r['tpot_p50_ms'])} | {f(r['goodput_rps'])} | {f(r['output_tok_s'])} | "
              f"{f(r.get('kv_gb_per_s'))} | {f(r.get('kv_send_gb_per_s'))} |")
    split_rows = [r for r in rows if r.get("split_n")]
    if split_rows:
        print("\nTTFT split (ms, p50 / p99), disaggregated requests:")
        print("| rate | n | queue | prefill | transfer | first decode |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in split_rows:
            cells = " | ".join(f"{f(r[part + '_p50_ms'])} / {f(r[part + '_p99_ms'])}"
                               for part in ("queue", "prefill", "transfer", "first_decode"))
            print(f"| {r['request_rate']} | {r['split_n']} | {cells} |")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0 if rows and all(r["completed"] for r in rows) else 1
