"""llama.cpp's speed on a GGUF file, the baseline row of ``idleless bench precision --llamacpp PYTHON``.

Run by the Python of a separate venv that has llama-cpp-python (``shared/baselines/setup_llamacpp.sh``
builds it from source for the CPU); it imports nothing from Idleless, so it runs as a file:

    PYTHON idleless/bench/llamacpp_speed.py --gguf F --ids ids.json --threads 1 \\
        --prefill-tokens 1000 --prefill-repeats 3 --decode-prompt 16 --decode-steps 64

Measures, on the token ids given (the same ids the Idleless rows use): after one untimed prefill of
the same size (warm-up), --prefill-repeats prefills (their median) of --prefill-tokens from an empty context (``Llama.eval``, llama.cpp's own batching: n_batch = the prefill, its default
micro-batch), and --decode-steps greedy batch-1 decode steps after a --decode-prompt-token prompt
(one ``eval`` of one token per step, the argmax of its logits; each step timed, their median). Prints one
JSON line: tokens/s by wall time and by this process's CPU time, and llama.cpp's version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from llama_cpp import Llama, __version__


def _timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--ids", required=True, help="JSON list of token ids (at least --prefill-tokens)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills (their median)")
    p.add_argument("--decode-prompt", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=64)
    a = p.parse_args()
    for flag in ("prefill_tokens", "prefill_repeats", "decode_prompt"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    with open(a.ids) as f:
        ids = json.load(f)
    n = a.prefill_tokens
    llm = Llama(model_path=a.gguf, n_ctx=max(n, a.decode_prompt + a.decode_steps) + 16, n_batch=n,
                n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    llm.eval(ids[:n])  # warm-up at the timed size: first-call allocations, as the Idleless rows
    llm.reset()
    runs = []
    for _ in range(a.prefill_repeats):
        runs.append(_timed(lambda: llm.eval(ids[:n])))
        llm.reset()
    prefill_wall = statistics.median(w for w, _ in runs)
    prefill_cpu = statistics.median(c for _, c in runs)
    llm.eval(ids[:a.decode_prompt])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def step():
        nonlocal tok
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))

    steps = [_timed(step) for _ in range(a.decode_steps)]  # each step timed, their median (as the Idleless rows)
    print(json.dumps({"engine": "llama.cpp", "version": __version__, "prefill_tok_s": n / prefill_wall,
                      "prefill_tok_s_cpu": n / prefill_cpu,
                      "decode_tok_s": 1 / statistics.median(w for w, _ in steps),
                      "decode_tok_s_cpu": 1 / statistics.median(c for _, c in steps)}), flush=True)


if __name__ == "__main__":
    main()
