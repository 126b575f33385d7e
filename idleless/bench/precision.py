"""``idleless bench precision``: each weight / activation / KV-cache precision against the float model on
one fixed text (quality) and batch-1 speed, side by side in one process (issue 14).

    idleless bench precision [--model PATH] [--combos int8,int4,kv=int8,...] [--output r.json]

Quality (``idleless.quant.accuracy``, the measurement of the start-up accuracy gate, which the bench
skips: its first row is the reference): the built-in text (a few hundred tokens) is run through each
configuration in extends of ``--chunk`` tokens (so later chunks attend to K/V read back from the quantised cache) and,
per position, the next-token distribution is compared with the float model's: mean KL(float || quant),
top-1 agreement, and the perplexity of the text itself. Speed: a ``--prefill-tokens`` prefill (tokens/s)
and ``--decode-steps`` greedy batch-1 decode steps after it (tokens/s, the mean over steps). Memory: the
bytes the linear layers read per forward (the quantised copies; the float master weights stay in RAM
for weight updates) and the KV bytes per token with the tokens ``--kv-cache-memory`` buys.

A combination is one item of --combos: ``float`` (the reference: weights in --dtype), ``auto`` (the
checkpoint's own format: the bundled GGUF's Q4_1 / Q8_0 blocks), ``int8``, ``fp8``, ``int4``, ``w8a8``
(int8 weights and activations), ``kv=int8`` / ``kv=fp8_e4m3`` /
``kv=fp8_e5m2`` / ``kv=bf16``, or weights with a KV format joined by ``+`` (``int8+kv=fp8_e4m3``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import subprocess
import sys
import time

import torch

from idleless.config import EngineConfig
from idleless.quant.accuracy import compare, forward_range, next_token_logits, text_token_ids
from idleless.quant.gate import linear_weight_bytes

DEFAULT_COMBOS = "float,auto,int8,fp8,int4,w8a8,kv=int8,kv=fp8_e4m3,kv=fp8_e5m2,int8+kv=fp8_e4m3,w8a8+kv=int8"


def parse_combo(item: str) -> dict:
    """One --combos item -> EngineConfig precision fields. Raises ValueError for an unknown piece."""
    out = {"weight_dtype": "bf16", "activation_dtype": "bf16", "kv_cache_dtype": "auto"}
    for piece in item.split("+"):
        if piece.startswith("kv="):
            out["kv_cache_dtype"] = piece[3:]
        elif piece == "w8a8":
            out.update(weight_dtype="int8", activation_dtype="int8")
        elif piece in ("auto", "int8", "int4", "fp8", "bf16"):
            out["weight_dtype"] = piece
        elif piece != "float":
            raise ValueError(f"unknown precision {piece!r} in {item!r}")
    return out


def measure(runner, ids: list[int], chunk: int, prefill_tokens: int, decode_steps: int) -> dict:
    """Logits of every position of ``ids`` (``accuracy.next_token_logits``, extends of ``chunk``), then the
    speed runs: a ``prefill_tokens`` prefill (tokens/s) and ``decode_steps`` greedy batch-1 decode steps."""
    logits = next_token_logits(runner, ids, chunk)
    pool = runner.pool
    n = min(prefill_tokens, len(ids))
    slots = pool.alloc(0, 0, n + decode_steps)
    t0 = time.perf_counter()
    last = forward_range(runner, ids[:n], slots, 0, torch.tensor([n - 1]))
    prefill_s = time.perf_counter() - t0
    tok = int(last.argmax())
    t0 = time.perf_counter()
    for i in range(decode_steps):
        tok = int(forward_range(runner, [tok], slots, n + i, torch.tensor([0])).argmax())
    decode_s = time.perf_counter() - t0
    pool.free(slots)
    return {"logits": logits, "prefill_tok_s": n / prefill_s,
            "decode_tok_s": decode_steps / decode_s if decode_steps else None}


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        return platform.processor()


def run(args: argparse.Namespace) -> dict:
    from idleless.model.loader import load_model_config, prepare_model_dir
    from idleless.model.runner import ModelRunner
    from idleless.cache.kv_pool import KVPool

    model_dir = prepare_model_dir(args.model)
    ids = text_token_ids(model_dir, load_model_config(model_dir).vocab_size)
    results, ref = [], None
    for item in args.combos.split(","):
        prec = parse_combo(item)
        cfg = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                           kv_cache_memory=args.kv_cache_memory, skip_quantization_gate=True, **prec)
        t0 = time.perf_counter()
        runner = ModelRunner(cfg)
        load_s = time.perf_counter() - t0
        m = measure(runner, ids, args.chunk, args.prefill_tokens, args.decode_steps)
        if ref is None:
            ref = m["logits"]
        mc = runner.model_config
        row = {"combo": item, **prec, "load_s": load_s, **compare(m["logits"], ref, ids),
               "prefill_tok_s": m["prefill_tok_s"], "decode_tok_s": m["decode_tok_s"],
               "linear_bytes": linear_weight_bytes(runner.model)[0],
               "kv_bytes_per_token": KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads,
                                                            mc.head_dim, runner.dtype, cfg.kv_cache_dtype),
               "kv_tokens": runner.pool.num_slots}
        results.append(row)
        print(_row_md(row), flush=True)
        del runner
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": _cpu_name(),
            "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "model": model_dir,
            "text_tokens": len(ids), "chunk": args.chunk, "command": " ".join(sys.argv), "results": results}


HEADER = ("| combination | KL mean | KL max | top-1 | ppl | prefill tok/s | decode tok/s | linear MiB | "
          "KV B/token | KV tokens |\n|---|---|---|---|---|---|---|---|---|---|")


def _row_md(r: dict) -> str:
    dec = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
    return (f"| {r['combo']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1']:.3f} | {r['perplexity']:.3f} | "
            f"{r['prefill_tok_s']:.0f} | {dec} | {r['linear_bytes'] / 2**20:.1f} | {r['kv_bytes_per_token']} | "
            f"{r['kv_tokens']} |")


def add_args(parser: argparse.ArgumentParser) -> None:
    """The bench's flags."""
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="model dtype (float32 | bfloat16 | auto)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--combos", default=DEFAULT_COMBOS, help=f"comma-separated (default {DEFAULT_COMBOS}); "
                        "the first is the reference")
    parser.add_argument("--chunk", type=int, default=64, help="extend size of the quality pass (tokens)")
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--output", default=None, help="write the JSON here")


def main(args: argparse.Namespace) -> int:
    """Run, print the markdown table (rows as they finish), write --output. Returns 0."""
    print(HEADER, flush=True)
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
