"""Plots of a benchmark run (matplotlib, the optional extra ``plot``: ``pip install idleless[plot]``).

    idleless bench serving ... --trace-file /tmp/trace.jsonl --plot run.png   # the server ran --trace-file
    idleless bench plot --trace-file /tmp/trace.jsonl --output run.png        # a trace alone (offline or server)

Four panels over time, in windows of ``window`` seconds:

1. throughput: generated tokens/s (steps' ``sampled`` requests, one token each) and prefill
   tokens/s (``new_tokens`` - decode tokens) from the engine trace; the client's received output
   tokens/s (each stream chunk counted as output_len / chunks tokens) when a serving result is given;
2. running batch size: the trace's ``running`` after each step and ``batch_size`` (requests in the
   step), time-weighted per window; the client's requests in flight;
3. busy fraction: the trace's forward seconds / window length (idle time included, so it equals
   the busy fraction while the engine has work);
4. cache hit rate: of the prompts the engine admitted in each window (trace ``cached_tokens`` /
   ``admitted_prompt_tokens``), the engine's cumulative one (finished requests), and the client's
   per window (cached / prompt tokens of the requests that finished in it, from ``usage``).

A step's forward seconds and tokens are spread over the windows its span
[t - schedule_s - forward_s, t] overlaps.

Trace records are the JSON lines of ``idleless.telemetry.timing.StepTracer`` (t, kind, batch_size,
new_tokens, decode, sampled, admitted_prompt_tokens, cached_tokens, running, waiting, schedule_s,
forward_s, hit_rate). Only the part of the
trace file after ``trace_offset`` bytes is read (what the server wrote during the run); its time
axis starts at the first step's start, the client's at the first request sent (they differ by the
request's trip to the engine, milliseconds). The last window may be shorter: its rates are over
its own length.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def require_matplotlib():
    """Import matplotlib with the Agg backend; raises ImportError with the install hint."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("plotting needs matplotlib, an optional extra: pip install 'idleless[plot]' "
                          "(or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_trace(path: str, offset: int = 0) -> list[dict]:
    """The step records of a trace file from byte ``offset`` (a partial first or last line is skipped)."""
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _windows(t0: float, t1: float, window: float) -> list[float]:
    n = max(1, int((t1 - t0) / window + 0.999999))
    return [t0 + i * window for i in range(n + 1)]


def trace_series(records: list[dict], window: float) -> dict:
    """Per-window series from trace records: centers (s from the first step's start), generated
    tok/s, prefill tok/s, running and batch size (time-weighted means), busy fraction (forward
    seconds / window), hit rate of the prompts admitted in the window (``cached_tokens`` /
    ``admitted_prompt_tokens``; None without admissions) and the engine's cumulative hit rate.

    A step spans [t - schedule_s - forward_s, t]; its forward seconds and tokens are spread over
    the windows it overlaps (a long prefill step on a busy CPU can last seconds)."""
    if not records:
        return {}
    spans = [(max(0.0, r["t"] - r.get("forward_s", 0.0) - r.get("schedule_s", 0.0)), r["t"], r) for r in records]
    start = min(a for a, _, _ in spans)
    t_last = max(b for _, b, _ in spans)
    edges = _windows(start, t_last, window)
    n = len(edges) - 1
    gen, pre, busy, run, bs, occ = ([0.0] * n for _ in range(6))
    cached, admitted = [0] * n, [0] * n
    cum: list = [None] * n
    for a, b, r in spans:
        decode = r.get("decode")
        if decode is None:
            decode = r["batch_size"] if r.get("kind") == "decode" else 0
        sampled = r.get("sampled", r["batch_size"] if r.get("kind") == "decode" else 0)
        prefill = max(0, r.get("new_tokens", 0) - decode)
        dur = b - a
        i0 = min(n - 1, max(0, int((a - start) / window)))
        i1 = min(n - 1, max(0, int((b - start) / window)))
        for i in range(i0, i1 + 1):
            ov = min(b, edges[i + 1]) - max(a, edges[i])
            share = ov / dur if dur > 0 else (1.0 if i == i1 else 0.0)
            if share <= 0:
                continue
            gen[i] += sampled * share
            pre[i] += prefill * share
            busy[i] += r.get("forward_s", 0.0) * share
            run[i] += r.get("running", 0) * max(ov, 0.0)
            bs[i] += r.get("batch_size", 0) * max(ov, 0.0)
            occ[i] += max(ov, 0.0)
        if "admitted_prompt_tokens" in r:
            cached[i1] += r.get("cached_tokens", 0)
            admitted[i1] += r["admitted_prompt_tokens"]
        cum[i1] = r.get("hit_rate", cum[i1])
    last = None
    for i in range(n):  # carry the cumulative hit rate across windows without steps
        if cum[i] is None:
            cum[i] = last
        last = cum[i]
    width = [min(edges[i + 1], t_last) - edges[i] for i in range(n)]  # the last window may be partial
    width = [w if w > 1e-9 else window for w in width]
    return {"t": [edges[i] + width[i] / 2 - start for i in range(n)],
            "gen_tps": [g / w for g, w in zip(gen, width)], "prefill_tps": [p / w for p, w in zip(pre, width)],
            "running": [run[i] / occ[i] if occ[i] > 0 else 0.0 for i in range(n)],
            "batch_size": [bs[i] / occ[i] if occ[i] > 0 else 0.0 for i in range(n)],
            "busy": [min(1.0, x / w) for x, w in zip(busy, width)],
            "hit_rate": [cached[i] / admitted[i] if admitted[i] else None for i in range(n)],
            "hit_rate_cumulative": cum}


def client_series(result: dict, window: float) -> dict:
    """Per-window series from a serving result's request rows: received output tok/s, requests in
    flight (mean over the window), hit rate of the requests finished in the window."""
    rows = [r for r in result.get("requests", []) if r.get("ok")]
    if not rows:
        return {}
    t1 = max(r["send_s"] + r["e2e_s"] for r in rows)
    edges = _windows(0.0, t1, window)
    n = len(edges) - 1
    out_tok, inflight = [0.0] * n, [0.0] * n
    hit_c, hit_p = [0] * n, [0] * n
    for r in rows:
        chunks = r.get("chunk_s") or []
        per = (r.get("output_len") or len(chunks)) / len(chunks) if chunks else 0
        for c in chunks:
            out_tok[min(n - 1, int(c / window))] += per
        s, e = r["send_s"], r["send_s"] + r["e2e_s"]
        for i in range(n):  # time-weighted in-flight count
            ov = min(e, edges[i + 1]) - max(s, edges[i])
            if ov > 0:
                inflight[i] += ov / window
        if r.get("cached_tokens") is not None and r.get("input_len"):
            i = min(n - 1, int(e / window))
            hit_c[i] += r["cached_tokens"]
            hit_p[i] += r["input_len"]
    width = [min(edges[i + 1], t1) - edges[i] for i in range(n)]
    width = [w if w > 1e-9 else window for w in width]
    return {"t": [edges[i] + width[i] / 2 for i in range(n)], "out_tps": [x / w for x, w in zip(out_tok, width)],
            "inflight": [x * window / w for x, w in zip(inflight, width)], "hit_rate": [hit_c[i] / hit_p[i] if hit_p[i] else None for i in range(n)]}


def plot_run(result: Optional[dict], out_png: str, trace_file: Optional[str] = None, trace_offset: int = 0,
             window: float = 1.0, title: Optional[str] = None) -> dict:
    """Draw the four panels to ``out_png``; returns the series drawn ({"trace": ..., "client": ...}).
    Either source may be missing (a panel then shows what the other has). Raises ImportError
    without matplotlib, ValueError when there is nothing to draw."""
    plt = require_matplotlib()
    tr = trace_series(read_trace(trace_file, trace_offset), window) if trace_file else {}
    cl = client_series(result, window) if result else {}
    if not tr and not cl:
        raise ValueError("nothing to plot: no trace records and no successful requests")
    fig, ax = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    if tr:
        ax[0].plot(tr["t"], tr["gen_tps"], label="generated tok/s (engine)")
        ax[0].plot(tr["t"], tr["prefill_tps"], label="prefill tok/s (engine)", alpha=0.7)
        ax[1].plot(tr["t"], tr["running"], label="running (engine)")
        ax[1].plot(tr["t"], tr["batch_size"], label="batch size per step (engine)", alpha=0.7)
        ax[2].plot(tr["t"], tr["busy"], label="forward / wall (engine)")
        ax[3].plot(tr["t"], [h if h is not None else float("nan") for h in tr["hit_rate"]], "o-",
                   label="hit rate of prompts admitted (engine)")
        ax[3].plot(tr["t"], [h if h is not None else float("nan") for h in tr["hit_rate_cumulative"]],
                   label="hit rate, cumulative over finished (engine)", alpha=0.6)
    if cl:
        ax[0].plot(cl["t"], cl["out_tps"], "--", label="received output tok/s (client)")
        ax[1].plot(cl["t"], cl["inflight"], "--", label="requests in flight (client)")
        ax[3].plot(cl["t"], [h if h is not None else float("nan") for h in cl["hit_rate"]], "o--",
                   label="hit rate of finished requests (client)")
    if not tr:
        ax[2].text(0.5, 0.5, "no trace file: run the server with --trace-file and pass it here",
                   ha="center", va="center", transform=ax[2].transAxes)
    ax[0].set_ylabel("tokens/s")
    ax[1].set_ylabel("requests")
    ax[2].set_ylabel("busy fraction")
    ax[2].set_ylim(0, 1.05)
    ax[3].set_ylabel("cache hit rate")
    ax[3].set_ylim(0, 1.05)
    ax[3].set_xlabel(f"seconds (windows of {window:g} s)")
    for a in ax:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="upper right", fontsize=8)
    if title is None and result:
        w, m = result.get("workload", {}), result.get("metrics", {})
        title = (f"{w.get('name')}: {m.get('completed')} requests, "
                 f"{(m.get('output_throughput') or 0):.1f} out tok/s, rate {result.get('settings', {}).get('request_rate')}")
    fig.suptitle(title or "run")
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return {"trace": tr, "client": cl}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-file", default=None, help="an engine trace (--trace-file of serve / bench / generate)")
    p.add_argument("--result", default=None, help="a bench serving result JSON (client-side series)")
    p.add_argument("--output", required=True, help="PNG to write")
    p.add_argument("--window", type=float, default=1.0, help="seconds per point")
    p.add_argument("--trace-offset", type=int, default=None,
                   help="bytes of the trace to skip (default: the result's trace_offset, else 0)")


def main(args: argparse.Namespace) -> int:
    result = None
    if args.result:
        with open(args.result, encoding="utf-8") as f:
            result = json.load(f)
    offset = args.trace_offset if args.trace_offset is not None else (result or {}).get("trace_offset") or 0
    try:
        plot_run(result, args.output, args.trace_file, offset, args.window)
    except (ImportError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
