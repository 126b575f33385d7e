"""``idleless bench precision``: each weight / activation / KV-cache precision against the float model on
one fixed text (quality), and prefill / batch-1 decode speed of the main ones beside llama.cpp on the
same GGUF file (issue 14).

    idleless bench precision [--model PATH] [--combos int8,int4,kv=int8,...] [--speed-combos float,auto,...]
                             [--llamacpp /tmp/llamacpp-venv/bin/python] [--repeats 2] [--output r.json]

Quality (one process; ``idleless.quant.accuracy``, the measurement of the start-up accuracy gate, which
the bench skips: its first row is the reference): the built-in text (a few hundred tokens) is run
through each configuration in extends of ``--chunk`` tokens (so later chunks attend to K/V read back
from the quantised cache) and, per position, the next-token distribution is compared with the float
model's: mean KL(float || quant), top-1 agreement, and the perplexity of the text itself. Memory: the
bytes the linear layers read per forward (the quantised copies; the float master weights stay in RAM
for weight updates) and the KV bytes per token with the tokens ``--kv-cache-memory`` buys.

Speed (``--speed-combos``, and llama.cpp with ``--llamacpp PYTHON``: a Python with llama-cpp-python,
running ``llamacpp_speed.py``): every row in its own fresh process, the rows alternating, ``--repeats``
rounds, the median reported (and each row's ratio to the first row's figure in the same round, the median
over the rounds: the pairing cancels what drifts between rounds on a shared machine); the same token ids
(the text repeated) and ``--threads`` for all. A prefill of ``--prefill-tokens`` from an empty cache,
``--prefill-repeats`` of them timed after an untimed one of the same size (one extend each for Idleless;
their median), and ``--decode-steps`` greedy batch-1 decode steps after a ``--decode-prompt``-token prompt
(one forward and an argmax per step: the model alone, without scheduler or sampler; each step timed, the
median step), in tokens/s of wall time and of the process's CPU time (the steadier figure on a shared
machine with one thread). Each row also shows the machine's steal time over its run (Linux /proc/stat: a
virtual machine's CPUs taken by the hypervisor), the share of CPU time the rows of that run lost.

A combination is one item of --combos: ``float`` (the reference: weights in --dtype), ``auto`` (the
checkpoint's own format: the bundled GGUF's Q4_1 / Q8_0 blocks), ``int8``, ``fp8``, ``int4``, ``w8a8``
(int8 weights and activations), ``w4a8`` (Q4_1 weights, the bundled GGUF's own bits, with activations
quantised to int8 per block of 32: llama.cpp's arithmetic), ``kv=int8`` / ``kv=fp8_e4m3`` /
``kv=fp8_e5m2`` / ``kv=bf16``, or weights with a KV format joined by ``+`` (``int8+kv=fp8_e4m3``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from idleless.config import EngineConfig, at_least_one
from idleless.engine.threads import cpu_steal_seconds
from idleless.quant.accuracy import compare, forward_range, next_token_logits, text_token_ids
from idleless.quant.gate import linear_weight_bytes

DEFAULT_COMBOS = "float,auto,int8,fp8,int4,w8a8,w4a8,kv=int8,kv=fp8_e4m3,kv=fp8_e5m2,int8+kv=fp8_e4m3,w8a8+kv=int8"
DEFAULT_SPEED_COMBOS = "float,auto,int8,w8a8,w4a8"


def parse_combo(item: str) -> dict:
    """One --combos item -> EngineConfig precision fields. Raises ValueError for an unknown piece."""
    out = {"weight_dtype": "bf16", "activation_dtype": "bf16", "kv_cache_dtype": "auto"}
    for piece in item.split("+"):
        if piece.startswith("kv="):
            out["kv_cache_dtype"] = piece[3:]
        elif piece == "w8a8":
            out.update(weight_dtype="int8", activation_dtype="int8")
        elif piece == "w4a8":
            out.update(weight_dtype="int4", activation_dtype="int8")
        elif piece in ("auto", "int8", "int4", "fp8", "bf16"):
            out["weight_dtype"] = piece
        elif piece != "float":
            raise ValueError(f"unknown precision {piece!r} in {item!r}")
    return out


def combo_list(text: str) -> str:
    """argparse type of --combos / --speed-combos: the items joined by commas without the empty ones ("" for
    none) when every item parses (``parse_combo``), else argparse.ArgumentTypeError naming the item."""
    items = [item for item in text.split(",") if item]
    for item in items:
        try:
            parse_combo(item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return ",".join(items)


def speed(runner, ids: list[int], prefill_tokens: int, decode_prompt: int, decode_steps: int,
          prefill_repeats: int = 3) -> dict:
    """Prefills of ids[:prefill_tokens] from an empty cache, ``prefill_repeats`` of them timed after an
    untimed one of the same size (the first in a process runs at about half the rate), their median,
    then ``decode_steps`` greedy batch-1 steps after a prefill of ids[:decode_prompt], each timed, their
    median (the median TPOT): tokens/s of wall and of process CPU time for each."""
    pool, n = runner.pool, prefill_tokens
    out = {}
    slots = pool.alloc(0, 0, n)
    # warm-up at the timed size: a first 1000-token extend in a fresh process runs at about half the
    # rate of the next (first-call allocations, the GEMM library's plans), which hid the kernels' ratios;
    # and one timed prefill on a shared 2-core machine varied by 10% from one to the next: the median
    walls, cpus = [], []
    forward_range(runner, ids[:n], slots, 0, torch.tensor([n - 1]))
    for _ in range(prefill_repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        forward_range(runner, ids[:n], slots, 0, torch.tensor([n - 1]))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out.update(prefill_tok_s=n / statistics.median(walls), prefill_tok_s_cpu=n / statistics.median(cpus))
    pool.free(slots)
    slots = pool.alloc(0, 0, decode_prompt + decode_steps)
    tok = int(forward_range(runner, ids[:decode_prompt], slots, 0, torch.tensor([decode_prompt - 1])).argmax())
    # each step timed: the hypervisor of a shared virtual machine steals whole stretches of tens of steps
    # (steal time, printed per row by speed_rows), which a total over the steps charges to the engine
    walls, cpus = [], []
    for i in range(decode_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        tok = int(forward_range(runner, [tok], slots, decode_prompt + i, torch.tensor([0])).argmax())
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out.update(decode_tok_s=1 / statistics.median(walls), decode_tok_s_cpu=1 / statistics.median(cpus))
    pool.free(slots)
    return out


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        return platform.processor()


def _config(args: argparse.Namespace, item: str) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                        kv_cache_memory=args.kv_cache_memory, skip_quantization_gate=True, **parse_combo(item))


def quality_rows(args: argparse.Namespace, ids: list[int]) -> list[dict]:
    """One row per --combos item, in one process: KL / top-1 / perplexity against the first item,
    linear bytes, KV bytes per token and the tokens --kv-cache-memory holds. Printed as they finish."""
    from idleless.cache.kv_pool import KVPool
    from idleless.model.runner import ModelRunner

    results, ref = [], None
    for item in args.combos.split(","):
        cfg = _config(args, item)
        t0 = time.perf_counter()
        runner = ModelRunner(cfg)
        load_s = time.perf_counter() - t0
        logits = next_token_logits(runner, ids, args.chunk)
        if ref is None:
            ref = logits
        mc = runner.model_config
        row = {"combo": item, **parse_combo(item), "load_s": load_s, **compare(logits, ref, ids),
               "linear_bytes": linear_weight_bytes(runner.model)[0],
               "kv_bytes_per_token": KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads,
                                                            mc.head_dim, runner.dtype, cfg.kv_cache_dtype),
               "kv_tokens": runner.pool.num_slots}
        results.append(row)
        print(_quality_md(row), flush=True)
        del runner
    return results


def _speed_child(args: argparse.Namespace, ids: list[int]) -> dict:
    from idleless.model.runner import ModelRunner

    runner = ModelRunner(_config(args, args.speed_child))
    return {"engine": "idleless", **speed(runner, ids, args.prefill_tokens, args.decode_prompt, args.decode_steps,
                                          args.prefill_repeats)}


def _speed_ids(ids: list[int], n: int) -> list[int]:
    return (ids * (n // len(ids) + 1))[:n]


def _gguf_path(model) -> str:
    from idleless.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise ValueError(f"--llamacpp needs a GGUF model (llama.cpp runs the same file), got {path!r}")
    return path


def speed_rows(args: argparse.Namespace, ids: list[int]) -> list[dict]:
    """Every --speed-combos item (and llama.cpp with --llamacpp) in its own process, the rows
    alternating over --repeats rounds; per row the median of each figure and every run. Raises
    RuntimeError when a child fails (its output in the message)."""
    import tempfile

    items = [c for c in args.speed_combos.split(",") if c] + (["llama.cpp"] if args.llamacpp else [])
    common = ["--threads", str(args.threads), "--prefill-tokens", str(args.prefill_tokens),
              "--prefill-repeats", str(args.prefill_repeats),
              "--decode-prompt", str(args.decode_prompt), "--decode-steps", str(args.decode_steps)]
    runs: dict[str, list[dict]] = {item: [] for item in items}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(_speed_ids(ids, max(args.prefill_tokens, args.decode_prompt)), f)
        f.flush()
        for _ in range(args.repeats):
            for item in items:
                if item == "llama.cpp":
                    cmd = [args.llamacpp, __file__.replace("precision.py", "llamacpp_speed.py"), "--gguf",
                           _gguf_path(args.model), "--ids", f.name, *common]
                else:
                    cmd = [sys.executable, "-m", "idleless.bench.precision", "--speed-child", item, "--dtype",
                           args.dtype, "--kv-cache-memory", args.kv_cache_memory, *common]
                    cmd += ["--model", args.model] if args.model else []
                t0, steal0 = time.perf_counter(), cpu_steal_seconds()
                p = subprocess.run(cmd, capture_output=True, text=True)
                wall, steal1 = time.perf_counter() - t0, cpu_steal_seconds()
                line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
                if p.returncode or line is None:
                    raise RuntimeError(f"speed run {item!r} failed ({p.returncode}):\n{p.stdout[-2000:]}"
                                       f"{p.stderr[-4000:]}")
                runs[item].append(json.loads(line))
                if steal0 is not None and steal1 is not None:  # the machine's steal over the child's whole run
                    runs[item][-1]["steal_share"] = (steal1 - steal0) / (wall * (os.cpu_count() or 1))
                print(f"  {item}: " + ", ".join(f"{k} {100 * v:.1f}%" if k == "steal_share" else f"{k} {v:.1f}"
                                                for k, v in runs[item][-1].items() if isinstance(v, float)), flush=True)
    return summarise(runs)


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per item of ``runs`` (item -> its runs, one per round, in round order; the first item is the
    reference): the median of each tok/s figure over the rounds, and ``prefill_x_first`` /
    ``decode_x_first``: the median over the rounds of the item's tok/s divided by the first item's in the
    same round (rows of a round run back to back, so the pairing cancels what drifts between rounds on a
    shared machine)."""
    first = next(iter(runs.values()))
    rows = []
    for item, rs in runs.items():
        keys = [k for k in rs[0] if k.endswith(("tok_s", "tok_s_cpu"))]
        row = {"combo": item, **{k: statistics.median(r[k] for r in rs) for k in keys}}
        for k in ("prefill", "decode"):
            row[f"{k}_x_first"] = statistics.median(r[f"{k}_tok_s"] / f[f"{k}_tok_s"] for r, f in zip(rs, first))
        if all("steal_share" in r for r in rs):
            row["steal_share"] = statistics.median(r["steal_share"] for r in rs)
        rows.append({**row, "version": rs[0].get("version"), "runs": rs})
    return rows


def run(args: argparse.Namespace) -> dict:
    """Quality rows (unless --combos is empty), then speed rows (unless --speed-combos is empty and
    there is no --llamacpp); returns the JSON record."""
    from idleless.model.loader import load_model_config, prepare_model_dir

    model_dir = prepare_model_dir(args.model)
    ids = text_token_ids(model_dir, load_model_config(model_dir).vocab_size)
    quality = []
    if args.combos:
        print(QUALITY_HEADER, flush=True)
        quality = quality_rows(args, ids)
    speeds = []
    if args.speed_combos or args.llamacpp:
        print(f"speed: prefill {args.prefill_tokens} tokens (median of {args.prefill_repeats} per process), batch-1 "
              f"decode {args.decode_steps} steps after {args.decode_prompt} (median step), {args.threads} thread(s), "
              f"{args.repeats} alternating round(s); steal: the machine's steal time over a row's run, as a share of "
              "its CPUs' time", flush=True)
        speeds = speed_rows(args, ids)
        print(SPEED_HEADER)
        for r in speeds:
            print(_speed_md(r))
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": _cpu_name(),
            "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "model": model_dir,
            "text_tokens": len(ids), "chunk": args.chunk, "prefill_tokens": args.prefill_tokens,
            "prefill_repeats": args.prefill_repeats, "decode_prompt": args.decode_prompt,
            "decode_steps": args.decode_steps, "repeats": args.repeats, "command": " ".join(sys.argv),
            "quality": quality, "speed": speeds}


QUALITY_HEADER = ("| combination | KL mean | KL max | top-1 | ppl | linear MiB | KV B/token | KV tokens |\n"
                  "|---|---|---|---|---|---|---|---|")
SPEED_HEADER = ("| engine / weights | prefill tok/s (wall) | prefill tok/s (CPU) | decode tok/s (wall) | "
                "decode tok/s (CPU) | prefill x first row | decode x first row | steal |\n|---|---|---|---|---|---|---|---|")


def _quality_md(r: dict) -> str:
    return (f"| {r['combo']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1']:.3f} | {r['perplexity']:.3f} | "
            f"{r['linear_bytes'] / 2**20:.1f} | {r['kv_bytes_per_token']} | {r['kv_tokens']} |")


def _speed_md(r: dict) -> str:
    return (f"| {r['combo']} | {r['prefill_tok_s']:.0f} | {r['prefill_tok_s_cpu']:.0f} | {r['decode_tok_s']:.1f} | "
            f"{r['decode_tok_s_cpu']:.1f} | {r['prefill_x_first']:.2f} | {r['decode_x_first']:.2f} | "
            + (f"{100 * r['steal_share']:.1f}% |" if "steal_share" in r else "- |"))


def add_args(parser: argparse.ArgumentParser) -> None:
    """The bench's flags."""
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="model dtype (float32 | bfloat16 | auto)")
    parser.add_argument("--threads", type=at_least_one, default=1, help="torch (and llama.cpp) threads (default 1)")
    parser.add_argument("--combos", type=combo_list, default=DEFAULT_COMBOS, help=f"quality rows, comma-separated "
                        f"(default {DEFAULT_COMBOS}); the first is the reference; empty: none")
    parser.add_argument("--speed-combos", type=combo_list, default=DEFAULT_SPEED_COMBOS, help="speed rows, each in "
                        f"its own process (default {DEFAULT_SPEED_COMBOS}); empty: none")
    parser.add_argument("--llamacpp", default=None, metavar="PYTHON", help="a Python with llama-cpp-python: adds "
                        "llama.cpp's speed on the same GGUF file (shared/baselines/setup_llamacpp.sh builds one)")
    parser.add_argument("--repeats", type=at_least_one, default=2, help="alternating rounds of the speed rows (median)")
    parser.add_argument("--chunk", type=int, default=64, help="extend size of the quality pass (tokens)")
    parser.add_argument("--prefill-tokens", type=at_least_one, default=1000)
    parser.add_argument("--prefill-repeats", type=at_least_one, default=3, help="timed prefills per process (their median)")
    parser.add_argument("--decode-prompt", type=at_least_one, default=16, help="prompt tokens before the decode steps")
    parser.add_argument("--decode-steps", type=at_least_one, default=64)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--output", default=None, help="write the JSON here")
    parser.add_argument("--speed-child", default=None, help=argparse.SUPPRESS)  # one speed row (a child process)


def main(args: argparse.Namespace) -> int:
    """Run, print the markdown tables (quality rows as they finish), write --output. Returns 0. With
    --speed-child: one Idleless speed row, printed as a JSON line."""
    if args.speed_child:
        from idleless.model.loader import load_model_config, prepare_model_dir

        model_dir = prepare_model_dir(args.model)
        ids = text_token_ids(model_dir, load_model_config(model_dir).vocab_size)
        print(json.dumps(_speed_child(args, _speed_ids(ids, max(args.prefill_tokens, args.decode_prompt)))))
        return 0
    res = run(args)
    print(f"\n{res['cpu']}, torch {res['torch']}, {res['threads']} thread(s), dtype {res['dtype']}, "
          f"{res['text_tokens']} text tokens")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    sys.exit(main(p.parse_args()))
