"""The CPU kernels as built for this machine and a portable build of the same source, so tests check both
code paths on any machine (AVX2 intrinsics where the CPU has them, the scalar loops everywhere).

    from kernel_builds import native_and_portable
    BUILDS = native_and_portable()   # {dtype: (native, portable)}, {} without a C compiler
"""

from __future__ import annotations

import ctypes

import torch

from idleless.model import cpu_kernels


def native_and_portable() -> dict:
    """{dtype: (native, portable)} for float32 and bfloat16: ``cpu_kernels.load`` (this CPU's build) and a
    ``-march=x86-64`` build (no AVX2: the scalar paths) of the same source; {} without a C compiler."""
    native = {dt: cpu_kernels.load(dt) for dt in (torch.float32, torch.bfloat16)}
    if native[torch.float32] is None:
        return {}
    saved = cpu_kernels.CFLAGS
    cpu_kernels.CFLAGS = [("-march=x86-64" if f.startswith("-march") else f) for f in saved
                          if not f.startswith("-mprefer")]
    try:
        so = cpu_kernels.build_library()
    finally:
        cpu_kernels.CFLAGS = saved
    lib = ctypes.CDLL(str(so))
    return {dt: (native[dt], cpu_kernels.CpuKernels(lib, dt)) for dt in native}
