"""The cost of train-inference alignment for rollouts: the GRPO example's rollouts (``examples/grpo.py``:
chat-templated "What is a + b?" questions, ``--group-size`` samples each at temperature 1 with their
logprobs) from two offline engines on the same float weights, one with the default kernels and one with
``enable_deterministic_inference`` (the batch-invariant kernels ``KernelPolicy`` trains on), alternated
A B A B for ``--rounds`` rounds.

    python -m idleless.rl.rollout_cost [--model DIR] [--max-new-tokens 16] [--rounds 2] [--threads 1]

Prints one JSON line per round and engine: wall seconds, process CPU seconds and generated tokens per
CPU second (with one thread, CPU time is the figure a loaded machine disturbs least).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def question(rng: random.Random) -> str:
    """A question of the example's task ("What is a + b? Answer with just the number.", a, b in 0..9)."""
    return f"What is {rng.randint(0, 9)} + {rng.randint(0, 9)}? Answer with just the number."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from idleless.engine.engine import Engine
    from idleless.model.loader import prepare_model_dir
    from idleless.sampling_params import SamplingParams
    from idleless.text.tokenizer import Tokenizer

    model_dir = prepare_model_dir(args.model)  # float weights (a GGUF is converted): what a trainer holds
    tok = Tokenizer.load(model_dir)
    engines = {det: Engine(model=model_dir, dtype="float32", num_threads=args.threads, kv_cache_memory="64MiB",
                           enable_deterministic_inference=det) for det in (False, True)}
    for rnd in range(args.rounds):
        rng = random.Random(rnd)
        prompts = [tok.apply_chat_template([{"role": "user", "content": question(rng)}]) for _ in range(args.prompts)]
        params = [SamplingParams(n=args.group_size, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                 seed=rnd * 1000 + i, logprobs=True, ignore_eos=True) for i in range(args.prompts)]
        for det in (False, True):
            wall, cpu = time.perf_counter(), time.process_time()
            outs = engines[det].generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = sum(len(o.token_ids) for group in outs for o in group)
            print(json.dumps({"deterministic": det, "round": rnd, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                              "tokens": tokens, "tokens_per_cpu_s": round(tokens / cpu, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
