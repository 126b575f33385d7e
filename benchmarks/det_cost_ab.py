"""The deterministic mode's cost as an A/B in process CPU time (issue 11), for a shared machine where
wall-clock figures are noisy: every run is its own process on 1 torch thread, default and
``--enable-deterministic-inference`` alternated (the order reversed every other pair).

    .venv/bin/python benchmarks/det_cost_ab.py --pairs 3 --mode shared_prefix [engine flags...]
    .venv/bin/python benchmarks/det_cost_ab.py --pairs 3 --mode b1 [engine flags...]

Modes: ``shared_prefix`` (every request of ../shared/workloads/shared_prefix.json, shuffled with seed 0 as
``idleless bench offline`` does, after its warm-up; CPU seconds of the one ``generate``) and ``b1``
(batch-1 decode as ``bench offline --decode-batch1`` times it: the first 32 ids of the workload's first
request, CPU(1 + 128 new tokens) - CPU(1 new token), medians of 3, reported as decode tokens per CPU
second). Extra arguments go to both engines (e.g. ``--weight-dtype bf16``). One JSON line per run on
stdout, then a summary of det / default per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKLOAD = os.path.join(REPO, "..", "shared", "workloads", "shared_prefix.json")


def child(mode: str, det: bool, extra: list[str]) -> dict:
    from idleless.bench.offline import _greedy, load_workload, shuffled, warmup_engine
    from idleless.config import add_cli_args, config_from_args
    from idleless.engine.engine import Engine

    p = argparse.ArgumentParser()
    add_cli_args(p)
    flags = ["--num-threads", "1"] + (["--enable-deterministic-inference"] if det else []) + extra
    engine = Engine(config_from_args(p.parse_args(flags)))
    wl = load_workload(WORKLOAD)
    items = shuffled(wl.items, 0)
    warmup_engine(engine, items[0].prompt_ids)
    load0 = os.getloadavg()[0]
    if mode == "shared_prefix":
        params = [_greedy(it.max_tokens, wl.ignore_eos, wl.temperature) for it in items]
        t0, w0 = time.process_time(), time.perf_counter()
        engine.generate([list(it.prompt_ids) for it in items], params, use_tqdm=False)
        res = {"cpu_s": time.process_time() - t0, "wall_s": time.perf_counter() - w0}
    else:
        prompt = list(wl.items[0].prompt_ids[:32])
        n = 128
        t1, tn = [], []
        for _ in range(3):
            for k, acc in ((1, t1), (n + 1, tn)):
                engine.flush_cache()
                t0 = time.process_time()
                out = engine.generate(prompt, _greedy(k), use_tqdm=False)
                acc.append(time.process_time() - t0)
                assert out.completion_tokens == k
        dec = statistics.median(tn) - statistics.median(t1)
        res = {"cpu_s": dec, "decode_tok_per_cpu_s": n / dec, "t1": t1, "tn": tn}
    res.update(mode=mode, det=det, flags=flags, load_before=load0, load_after=os.getloadavg()[0])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["shared_prefix", "b1"], required=True)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.mode, bool(args.child), extra)), flush=True)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ratios = []
    for i in range(args.pairs):
        pair = {}
        for det in ((False, True) if i % 2 == 0 else (True, False)):
            out = subprocess.run([sys.executable, __file__, "--mode", args.mode, "--child", str(int(det)), *extra],
                                 capture_output=True, text=True, cwd=REPO, env=env)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"run failed:\n{out.stderr[-3000:]}")
            r = json.loads(line[7:])
            r["pair"] = i
            print(json.dumps(r), flush=True)
            pair[det] = r["cpu_s"]
        ratios.append(pair[True] / pair[False])
        print(f"# pair {i}: default {pair[False]:.2f} s, det {pair[True]:.2f} s, det/default {ratios[-1]:.3f}",
              flush=True)
    print(f"# det/default per pair: {', '.join(f'{r:.3f}' for r in ratios)}; mean {statistics.mean(ratios):.3f}")


if __name__ == "__main__":
    main()
