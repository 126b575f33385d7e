"""The CPU kernels as built for this machine and a portable build of the same source, so tests check both
code paths on any machine (AVX2 intrinsics where the CPU has them, the scalar loops everywhere).

    from kernel_builds import native_and_portable
    BUILDS = native_and_portable()   # {dtype: (native, portable)}, {} without a C compiler
"""

from __future__ import annotations

import ctypes

import torch

from idleless.model import cpu_kernels


def _build(flags: list[str]) -> ctypes.CDLL:
    saved = cpu_kernels.CFLAGS
    cpu_kernels.CFLAGS = flags
    try:
        so = cpu_kernels.build_library()
    finally:
        cpu_kernels.CFLAGS = saved
    return ctypes.CDLL(str(so))


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (``avx512_bf16``, ``amx_tile``, ...) for this CPU: the native
    build (``-march=native``) compiles that flag's code paths in exactly then."""
    try:
        return any(ln.startswith("flags") and flag in ln.split() for ln in open("/proc/cpuinfo"))
    except OSError:
        return False


def native_without_avx512_bf16() -> dict:
    """{dtype: kernels} built for this CPU with ``-mno-avx512bf16``: on an AVX-512 BF16 CPU the native
    build's bfloat16 decode attention is the VDPBF16PS kernel (another summation order, by design); this
    build runs the AVX2 decode kernel that must give the scalar kernel's bits."""
    lib = _build(list(cpu_kernels.CFLAGS) + ["-mno-avx512bf16"])
    return {dt: cpu_kernels.CpuKernels(lib, dt) for dt in (torch.float32, torch.bfloat16)}


def native_and_portable() -> dict:
    """{dtype: (native, portable)} for float32 and bfloat16: ``cpu_kernels.load`` (this CPU's build) and a
    ``-march=x86-64`` build (no AVX2: the scalar paths) of the same source; {} without a C compiler."""
    native = {dt: cpu_kernels.load(dt) for dt in (torch.float32, torch.bfloat16)}
    if native[torch.float32] is None:
        return {}
    lib = _build([("-march=x86-64" if f.startswith("-march") else f) for f in cpu_kernels.CFLAGS
                  if not f.startswith("-mprefer")])
    return {dt: (native[dt], cpu_kernels.CpuKernels(lib, dt)) for dt in native}


def avx2_only() -> dict:
    """{dtype: kernels} built for this CPU with ``-mno-avx512f`` (every AVX-512 subset off, VNNI and BF16
    included): on an AVX-512 CPU the native build takes the AVX-512 paths (e.g. vpdpbusd in the 8-bit
    integer dot products), and this build keeps the AVX2 intrinsics they replace under test; {} on a CPU
    without AVX2 (its native build already runs the scalar paths) or without a C compiler."""
    if not cpu_has("avx2") or cpu_kernels.load(torch.float32) is None:
        return {}
    lib = _build(list(cpu_kernels.CFLAGS) + ["-mno-avx512f"])
    return {dt: cpu_kernels.CpuKernels(lib, dt) for dt in (torch.float32, torch.bfloat16)}
