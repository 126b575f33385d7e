"""Idleless: an LLM serving engine that keeps the accelerator busy."""

import os

# Transparent huge pages for PyTorch's large CPU tensors (weights, KV pool): PyTorch reads this once, at
# its first allocation, so it is set here, before anything imports torch (a process that imported torch
# first keeps its setting). It saves TLB misses on the weight stream of every decode step (measured in
# benchmarks/README.md, commit 7c0c6f1); THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

#: OpenMP threads (PyTorch's and the C kernels', one libgomp) spin this many times at the end of a parallel
#: region before they sleep: long enough to catch the next op of a step, short enough that a thread waiting
#: for a descheduled sibling gives its core back. libgomp's own default (300,000 spins with OMP_WAIT_POLICY
#: unset) made a 2-thread offline run 6x slower on a busy machine (benchmarks/README.md, "Issue 15: the
#: shared-prefix workload's time"); read when libgomp loads (with torch), so set here; the user's
#: GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
OPENMP_SPINCOUNT = "30000"


def bound_openmp_spin() -> None:
    """Set GOMP_SPINCOUNT to ``OPENMP_SPINCOUNT`` in this process's environment (inherited by the processes
    it starts) unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is already set. Takes effect in a process whose
    libgomp has not loaded yet (before torch is imported)."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT


bound_openmp_spin()

from idleless.config import EngineConfig  # noqa: E402 (after the environment above)
from idleless.engine.request import FinishReason  # noqa: E402
from idleless.errors import RequestError  # noqa: E402
from idleless.sampling_params import SamplingParams  # noqa: E402

__all__ = ["Engine", "EngineConfig", "SamplingParams", "FinishReason", "RequestError"]


def __getattr__(name):
    if name == "Engine":  # lazy: importing idleless must not import torch
        from idleless.engine.engine import Engine
        return Engine
    raise AttributeError(name)
