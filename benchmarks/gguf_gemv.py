"""GGUF linear kernels at SmolLM2-135M's shapes: the float-activation kernels (``q41_linear`` /
``q80_linear``) against the int8-activation ones (``q41_a8_linear`` / ``q80_a8_linear``, W4A8), per shape
and thread count, in microseconds per call and GB/s of weight bytes (codes + float16 factors).

    .venv/bin/python benchmarks/gguf_gemv.py [ROWS] [THREADS, e.g. 1,2]
    .venv/bin/python benchmarks/gguf_gemv.py sweep [THREADS] [OLD.so]

Random weights quantised with ``idleless.quant.formats``; each kernel called through ctypes with its
pointers prepared (no Python checks), old and new alternating in 3 rounds of 3 windows, the best window
kept. 1 thread: process CPU time (steadier on a shared machine); more threads: wall time. The weights of
the small shapes stay in the caches between calls, so these are kernel rates, not DRAM rates (the 30 MB
lm_head does not fit).

``sweep``: one row through all of SmolLM2's W4A8 linears as a decode step reads them — 30 layers of
distinct Q4_1 weights (66 MB, from memory like the model's) then the Q8_0 lm_head — in ms per step: the
linears, the head alone, both. With OLD.so (a build of an earlier ``cpu_kernels.c`` whose
``q41_a8_linear`` / ``q80_a8_linear`` took GGUF's own codes, before 2026-12-02 10:00) old and new alternate, 5 rounds of 10 steps, best.
"""

import ctypes
import sys
import time

import torch

from idleless.model import cpu_kernels
from idleless.quant.formats import interleave_q4_1, interleave_q8_0, quantize_q4_1, quantize_q8_0

SHAPES = [("qkv", 960, 576, "q4_1"), ("o", 576, 576, "q4_1"), ("gate_up", 3072, 576, "q4_1"),
          ("down", 576, 1536, "q4_1"), ("lm_head", 49152, 576, "q8_0")]
LAYERS = 30


def kernels(rows: int, threads: list[int]) -> None:
    kern = cpu_kernels.load(torch.float32)
    g = torch.Generator().manual_seed(0)
    for name, n, k, fmt in SHAPES:
        w = torch.randn(n, k, generator=g) * k ** -0.5
        x = torch.randn(rows, k, generator=g)
        out = torch.empty(rows, n)
        xp, op = x.data_ptr(), out.data_ptr()
        if fmt == "q4_1":
            qs, d, m = quantize_q4_1(w)
            codes = interleave_q4_1(qs)
            nbytes = qs.numel() + 4 * d.numel()
            fns = {"float x": lambda *a, p=(qs.data_ptr(), d.data_ptr(), m.data_ptr(), n, None, op, n):
                   kern._q41_linear(*a, *p),
                   "int8 x": lambda *a, p=(codes.data_ptr(), d.data_ptr(), m.data_ptr(), n, None, op, n):
                   kern._q41_a8_linear(*a, *p)}
        else:
            q, d = quantize_q8_0(w)
            codes = interleave_q8_0(q)
            nbytes = q.numel() + 2 * d.numel()
            fns = {"float x": lambda *a, p=(q.data_ptr(), d.data_ptr(), n, None, op, n): kern._q80_linear(*a, *p),
                   "int8 x": lambda *a, p=(codes.data_ptr(), d.data_ptr(), n, None, op, n):
                   kern._q80_a8_linear(*a, *p)}
        reps = max(2, int(1e8 / nbytes / rows ** 0.5))
        for th in threads:
            torch.set_num_threads(th)
            clock = time.process_time if th == 1 else time.perf_counter
            best = {}
            for _ in range(3):
                for key, fn in fns.items():
                    fn(xp, rows, k, k)
                    for _ in range(3):
                        t0 = clock()
                        for _ in range(reps):
                            fn(xp, rows, k, k)
                        best[key] = min(best.get(key, 1e9), (clock() - t0) / reps)
            cells = " | ".join(f"{key}: {t * 1e6:8.1f} us {nbytes / t / 1e9:5.1f} GB/s" for key, t in best.items())
            print(f"{name:8s} {n}x{k} {fmt} rows={rows} threads={th} | {cells} | x{best['float x'] / best['int8 x']:.2f}",
                  flush=True)


def _lib(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.q41_a8_linear_f32.argtypes = [p, i, i, i, p, p, p, i, p, p, i]
    lib.q80_a8_linear_f32.argtypes = [p, i, i, i, p, p, i, p, p, i]
    return lib


def sweep(threads: int, old: str | None) -> None:
    libs = {"new": (_lib(str(cpu_kernels.build_library())), True)}
    if old:
        libs = {"old": (_lib(old), False), **libs}
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for _, n, k, _ in SHAPES[:4]:
            qs, d, m = quantize_q4_1(torch.randn(n, k, generator=g) * k ** -0.5)
            layers.append((n, k, {False: qs, True: interleave_q4_1(qs)}, d, m, torch.randn(1, k, generator=g),
                           torch.empty(1, n)))
    hq, hd = quantize_q8_0(torch.randn(49152, 576, generator=g) * 576 ** -0.5)
    hq = {False: hq, True: interleave_q8_0(hq)}
    hx, ho = torch.randn(1, 576, generator=g), torch.empty(1, 49152)
    total = sum(c[True].numel() + 4 * d.numel() for _, _, c, d, *_ in layers)

    def linears(lib, interleaved):
        for n, k, codes, d, m, x, o in layers:
            lib.q41_a8_linear_f32(x.data_ptr(), 1, k, k, codes[interleaved].data_ptr(), d.data_ptr(), m.data_ptr(), n,
                                  None, o.data_ptr(), n)

    def head(lib, interleaved):
        lib.q80_a8_linear_f32(hx.data_ptr(), 1, 576, 576, hq[interleaved].data_ptr(), hd.data_ptr(), 49152, None, ho.data_ptr(),
                              49152)

    def both(lib, interleaved):
        linears(lib, interleaved)
        head(lib, interleaved)

    for name, fn in (("linears", linears), ("head", head), ("both", both)):
        best = {}
        for _ in range(5):
            for key, (lib, interleaved) in libs.items():
                fn(lib, interleaved)
                t0 = clock()
                for _ in range(10):
                    fn(lib, interleaved)
                best[key] = min(best.get(key, 1e9), (clock() - t0) / 10)
        cells = " | ".join(f"{key} {t * 1e3:6.3f} ms" for key, t in best.items())
        rate = f" ({total / best['new'] / 1e9:.1f} GB/s)" if name == "linears" else ""
        ratio = f" | x{best['old'] / best['new']:.3f}" if old else ""
        print(f"{name:8s} threads={threads} | {cells}{rate}{ratio}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "sweep":
        sweep(int(sys.argv[2]) if len(sys.argv) > 2 else 1, sys.argv[3] if len(sys.argv) > 3 else None)
        return
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    kernels(rows, [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,2").split(",")])


if __name__ == "__main__":
    main()
