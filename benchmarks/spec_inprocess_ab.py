"""4 requests at once, speculation off vs the int4 self-draft, alternated in one process (issue 13's floor).

Each run builds a fresh engine core (``idleless bench spec``'s builder, warm-up and driver), submits
random.json's first 4 requests at once and reports the process CPU seconds of the run (prefill
included), the CPU seconds inside the target's ``ModelRunner.execute`` and the steps with guesses.
Arms alternate (off first on even repetitions). ``forced`` instead of ``adaptive`` keeps the draft
loaded with the controller forced off (``draft_lengths`` -> zeros): the control for the draft's mere
presence.

    .venv/bin/python benchmarks/spec_inprocess_ab.py adaptive 4     # 4 pairs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

from idleless.bench.offline import load_workload
from idleless.bench.spec import _Cores, drive, warmup
from idleless.config import add_cli_args, config_from_args

COMMON = ["--num-threads", "1", "--weight-dtype", "bf16", "--enable-deterministic-inference"]
SPEC = ["--speculative-algorithm", "draft", "--speculative-draft-weight-dtype", "int4"]


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "adaptive"
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    p = argparse.ArgumentParser()
    add_cli_args(p)
    wl = load_workload("../shared/workloads/random.json")
    items = wl.items[:4]
    cores = _Cores()

    def build(spec: bool):
        core = cores.build(config_from_args(p.parse_args(COMMON + (SPEC if spec else []))))
        if spec and mode == "forced":
            core.proposer.draft_lengths = lambda rates, room, catchup=(): [0] * len(rates)
        ex, acc = core.runner.execute, []

        def timed(plan):
            t0 = time.process_time()
            out = ex(plan)
            acc.append((plan.num_tokens, time.process_time() - t0))
            return out

        core.runner.execute = timed
        warmup(core, wl.items[0].prompt_ids)
        acc.clear()
        return core, acc

    for rep in range(reps):
        for spec in ((False, True) if rep % 2 == 0 else (True, False)):
            core, acc = build(spec)
            t0 = time.process_time()
            drive(core, items, wl)
            cpu = time.process_time() - t0
            dec = [t for n, t in acc if n <= 4]
            st = core.stats().get("speculative") or {}
            print(f"rep {rep} spec={spec} cpu {cpu:.2f} exec {sum(t for _, t in acc):.2f} plain-steps {len(dec)} "
                  f"median {statistics.median(dec) * 1e3:.1f} ms on {st.get('num_steps_on')}", flush=True)
            del core
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
