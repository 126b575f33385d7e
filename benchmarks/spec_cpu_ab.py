"""Speculative decoding vs off as an A/B in process CPU time (issue 13), for a shared machine where
wall-clock figures are noisy: every run is its own process (``--num-threads 1`` by default), built,
warmed and driven with ``idleless bench spec``'s own helpers (``_Cores().build``, ``warmup``,
``run_batch1`` / ``drive``), ``time.process_time()`` around the run (prefill included), off and the
speculative configuration alternated (the order reversed every other pair).

    .venv/bin/python benchmarks/spec_cpu_ab.py --pairs 3 --mode batch1 --n 4 \\
        --workload ../shared/workloads/random.json -- --speculative-algorithm draft \\
        --speculative-draft-weight-dtype int4
    .venv/bin/python benchmarks/spec_cpu_ab.py --pairs 3 --mode at_once --n 4 ... (the first n submitted together)
    .venv/bin/python benchmarks/spec_cpu_ab.py --pairs 3 --mode workload --workload ../shared/workloads/shared_prefix.json \
        -- --speculative-algorithm ngram                         (every request at once, shuffled with seed 0)

Arguments after ``--`` go to the speculative engine only; ``--common`` flags (a quoted string) to
both. One JSON line per run on stdout, then spec / off per pair (above 1: speculation is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(a) -> dict:
    from idleless.bench.offline import load_workload, shuffled
    from idleless.bench.spec import _Cores, drive, run_batch1, warmup
    from idleless.config import add_cli_args, config_from_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    flags = ["--num-threads", str(a.threads)] + shlex.split(a.common) + (a.spec if a.arm == "spec" else [])
    cfg = config_from_args(p.parse_args(flags))
    wl = load_workload(a.workload)
    items = shuffled(wl.items, 0) if a.mode == "workload" else wl.items[:a.n]
    core = _Cores().build(cfg)
    warmup(core, wl.items[0].prompt_ids)
    s0 = core.stats().get("speculative") or {}
    load0 = os.getloadavg()[0]
    t0, w0 = time.process_time(), time.perf_counter()
    runs = run_batch1(core, items, wl) if a.mode == "batch1" else drive(core, items, wl)[1]
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    s1 = core.stats().get("speculative") or {}
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                   "num_steps_on", "num_steps_off", "draft_seconds")}
    return {"arm": a.arm, "mode": a.mode, "cpu_s": cpu, "wall_s": wall, "load_1m": [load0, os.getloadavg()[0]],
            "tokens": sum(len(r.output_ids) for r in runs), "outputs": [r.output_ids for r in runs],
            "spec": d, "time": time.strftime("%H:%M:%S", time.gmtime())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--mode", choices=("batch1", "at_once", "workload"), default="batch1",
                    help="batch1: the first n one at a time; at_once: the first n submitted together; workload: "
                         "every request submitted together, shuffled with seed 0 (as bench spec / offline)")
    ap.add_argument("--n", type=int, default=4, help="the workload's first n requests")
    ap.add_argument("--workload", default=os.path.join(HERE, "..", "..", "shared", "workloads", "random.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--common", default="", help="engine flags for both arms (one quoted string)")
    ap.add_argument("--arm", choices=("off", "spec"), help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs=argparse.REMAINDER, help="after --: the speculative arm's engine flags")
    a = ap.parse_args()
    if a.spec and a.spec[0] == "--":
        a.spec = a.spec[1:]
    if a.arm:
        print(json.dumps(child(a)), flush=True)
        return 0
    base = [sys.executable, os.path.abspath(__file__), "--mode", a.mode, "--n", str(a.n), "--workload", a.workload,
            "--threads", str(a.threads), "--common", a.common]
    res = []
    for i in range(a.pairs):
        pair = {}
        for arm in (("off", "spec") if i % 2 == 0 else ("spec", "off")):
            out = subprocess.run(base + ["--arm", arm, "--"] + a.spec, capture_output=True, text=True)
            if out.returncode:
                sys.stderr.write(out.stderr[-3000:])
                return 1
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            pair[arm] = rec
            print(json.dumps({k: v for k, v in rec.items() if k != "outputs"}), flush=True)
        same = sum(x == y for x, y in zip(pair["off"]["outputs"], pair["spec"]["outputs"]))
        r = pair["off"]["cpu_s"] / pair["spec"]["cpu_s"]
        res.append(r)
        print(f"pair {i}: off {pair['off']['cpu_s']:.2f} s, spec {pair['spec']['cpu_s']:.2f} s CPU -> {r:.3f}x; "
              f"identical {same}/{len(pair['off']['outputs'])}", flush=True)
    print(f"spec/off speedup per pair: {', '.join(f'{r:.3f}' for r in res)}; median {statistics.median(res):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
