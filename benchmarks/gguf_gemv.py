"""GGUF linear kernels at SmolLM2-135M's shapes: the float-activation kernels (``q41_linear`` /
``q80_linear``) against the int8-activation ones (``q41_a8_linear`` / ``q80_a8_linear``, W4A8), per shape
and thread count, in microseconds per call and GB/s of weight bytes (codes + float16 factors).

    .venv/bin/python benchmarks/gguf_gemv.py [ROWS] [THREADS, e.g. 1,2]

Random weights quantised with ``idleless.quant.formats``; each kernel called through ctypes with its
pointers prepared (no Python checks), old and new alternating in 3 rounds of 3 windows, the best window
kept. 1 thread: process CPU time (steadier on a shared machine); more threads: wall time. The weights of
the small shapes stay in the caches between calls, so these are kernel rates, not DRAM rates (the 30 MB
lm_head does not fit).
"""

import sys
import time

import torch

from idleless.model import cpu_kernels
from idleless.quant.formats import quantize_q4_1, quantize_q8_0

SHAPES = [("qkv", 960, 576, "q4_1"), ("o", 576, 576, "q4_1"), ("gate_up", 3072, 576, "q4_1"),
          ("down", 576, 1536, "q4_1"), ("lm_head", 49152, 576, "q8_0")]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    threads = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,2").split(",")]
    kern = cpu_kernels.load(torch.float32)
    g = torch.Generator().manual_seed(0)
    for name, n, k, fmt in SHAPES:
        w = torch.randn(n, k, generator=g) * k ** -0.5
        x = torch.randn(rows, k, generator=g)
        out = torch.empty(rows, n)
        xp, op = x.data_ptr(), out.data_ptr()
        if fmt == "q4_1":
            qs, d, m = quantize_q4_1(w)
            nbytes = qs.numel() + 4 * d.numel()
            args = (qs.data_ptr(), d.data_ptr(), m.data_ptr(), n, None, op, n)
            fns = {"float x": kern._q41_linear, "int8 x": kern._q41_a8_linear}
        else:
            q, d = quantize_q8_0(w)
            nbytes = q.numel() + 2 * d.numel()
            args = (q.data_ptr(), d.data_ptr(), n, None, op, n)
            fns = {"float x": kern._q80_linear, "int8 x": kern._q80_a8_linear}
        reps = max(2, int(1e8 / nbytes / rows ** 0.5))
        for th in threads:
            torch.set_num_threads(th)
            clock = time.process_time if th == 1 else time.perf_counter
            best = {}
            for _ in range(3):
                for key, fn in fns.items():
                    fn(xp, rows, k, k, *args)
                    for _ in range(3):
                        t0 = clock()
                        for _ in range(reps):
                            fn(xp, rows, k, k, *args)
                        best[key] = min(best.get(key, 1e9), (clock() - t0) / reps)
            cells = " | ".join(f"{key}: {t * 1e6:8.1f} us {nbytes / t / 1e9:5.1f} GB/s" for key, t in best.items())
            print(f"{name:8s} {n}x{k} {fmt} rows={rows} threads={th} | {cells} | x{best['float x'] / best['int8 x']:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
