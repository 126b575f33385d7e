"""Weight-push latency into a running server, by each path (issue 16's benchmark).

    idleless bench rl-update [--model DIR] [--dtype float32] [--repeats 5] [--output result.json]

Starts ``idleless serve`` on the model (default: the bundled SmolLM2-135M-Instruct), loads the same
checkpoint in this process as the "trainer's" weights, and pushes all of them ``--repeats`` times by
each path, idle server, flush_cache on:

* ``disk``: ``/update_weights_from_disk`` (the server reads the safetensors itself);
* ``tensor``: ``/update_weights_from_tensor`` through one shared-memory file (the copy into it counted);
* ``distributed``: ``/update_weights_from_distributed``, one gloo broadcast per tensor from this
  process (the group is made once, not counted).

Reports per path the median and best wall seconds seen by the trainer (request to answer), the
engine's own share (``seconds``: writing the parameters and re-processing the linear methods) and, for
the distributed path, the trainer's broadcast seconds (until the engine received the last byte), with
the CPU model, torch version, thread counts and load average. After the last push the server's greedy
answer is checked against the one before (same weights pushed back: same answer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch


def cpu_model() -> str:
    """``lscpu``'s model name (the processor name from /proc/cpuinfo, else the platform's)."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--paths", default="disk,tensor,distributed")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `idleless serve` argument, e.g. --server-arg=--enable-deterministic-inference")
    p.add_argument("--output", default=None, help="write the result JSON here")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a markdown table and returns 0 (1 if the answer changed)."""
    import httpx

    from idleless.model.loader import load_state_dict, prepare_model_dir
    from idleless.model.runner import resolve_dtype
    from idleless.rl.trainer import WeightPusher, free_port, start_server

    model_dir = prepare_model_dir(args.model)
    named = list(load_state_dict(model_dir, resolve_dtype(args.dtype)).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    proc, url = start_server(model_dir, ["--dtype", args.dtype, "--num-threads", str(args.engine_threads),
                                         "--log-level", "warning", *args.server_arg])
    http = httpx.Client(timeout=600)
    probe = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    pusher = WeightPusher(url, timeout_s=600)
    results: dict = {}
    try:
        before = http.post(url + "/generate", json=probe).json()["output_ids"]
        for path in args.paths.split(","):
            if path == "distributed":
                pusher.init_group("127.0.0.1", free_port())
            push = {"disk": lambda v: pusher.push_disk(model_dir, weight_version=v),
                    "tensor": lambda v: pusher.push_tensor(named, weight_version=v),
                    "distributed": lambda v: pusher.push_distributed(named, weight_version=v)}[path]
            wall, engine, send = [], [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                res = push(f"{path}-{i}")
                wall.append(time.perf_counter() - t0)
                engine.append(res["seconds"])
                if path == "distributed":
                    send.append(pusher.last_broadcast_s)
            if path == "distributed":
                pusher.destroy_group()
            results[path] = {"wall_s_median": statistics.median(wall), "wall_s_min": min(wall),
                             "engine_s_median": statistics.median(engine), "wall_s": wall, "engine_s": engine}
            if send:
                results[path].update(broadcast_s_median=statistics.median(send), broadcast_s=send)
        after = http.post(url + "/generate", json=probe).json()["output_ids"]
    finally:
        pusher.close()
        http.close()
        proc.terminate()
        proc.wait(60)
    out = {"model": model_dir, "dtype": args.dtype, "server_args": args.server_arg, "tensors": len(named),
           "bytes": nbytes, "cpu": cpu_model(), "torch": torch.__version__, "engine_threads": args.engine_threads,
           "trainer_threads": torch.get_num_threads(), "repeats": args.repeats, "paths": results,
           "same_answer_after": before == after, "load_average": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d")}
    print(f"weights: {len(named)} tensors, {nbytes / 2**20:.0f} MiB ({args.dtype}); CPU: {out['cpu']}; "
          f"torch {torch.__version__}; engine threads {args.engine_threads}; load average "
          + " ".join(f"{x:.2f}" for x in out["load_average"]))
    print("| path | wall s (median) | wall s (best) | engine write + re-process s (median) | broadcast s (median) |")
    print("|---|---|---|---|---|")
    for path, r in results.items():
        send = f"{r['broadcast_s_median']:.3f}" if "broadcast_s_median" in r else ""
        print(f"| {path} | {r['wall_s_median']:.3f} | {r['wall_s_min']:.3f} | {r['engine_s_median']:.3f} | {send} |")
    print("greedy answer after the last push (the same weights pushed back): "
          + ("the same as before" if before == after else f"CHANGED: {before!r} -> {after!r}"))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if before == after else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap)
    sys.exit(main(ap.parse_args()))
