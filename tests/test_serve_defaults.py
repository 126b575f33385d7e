"""`idleless serve`'s own defaults (issue 15; measurements in benchmarks/README.md "Server threads"):
the step token budget, the engine core's thread count and its OpenMP spin, each overridable."""

from __future__ import annotations

import argparse
import os

import torch

from idleless.config import EngineConfig
from idleless.server import launch


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_args(p)
    return p.parse_args(list(argv))


def test_serve_step_budget_default_and_override():
    assert _parse().max_prefill_tokens == launch.SERVE_MAX_NUM_BATCHED_TOKENS == 1024
    assert _parse("--max-num-batched-tokens", "4096").max_prefill_tokens == 4096
    assert EngineConfig().max_prefill_tokens == 8192  # offline keeps its own


def test_engine_threads_rule(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # the test process keeps its threads
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = EngineConfig(num_threads=0)
    launch.engine_threads(cfg)
    assert cfg.num_threads == len(os.sched_getaffinity(0)) and calls == [1]
    assert os.environ["GOMP_SPINCOUNT"] == launch.SERVE_GOMP_SPINCOUNT
    # the user's own choices win: a thread count, a wait policy, a spin count
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    cfg = EngineConfig(num_threads=3)
    launch.engine_threads(cfg)
    assert cfg.num_threads == 3 and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    launch.engine_threads(EngineConfig())
    assert os.environ["GOMP_SPINCOUNT"] == "7"


def test_every_idleless_process_bounds_the_openmp_spin():
    """Importing idleless (before torch) sets GOMP_SPINCOUNT unless the user set it or OMP_WAIT_POLICY; the
    check runs in fresh interpreters, since libgomp reads it once."""
    import subprocess
    import sys

    code = "import os, idleless, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,  # noqa: E731
                                       text=True, check=True).stdout.strip()
    assert run({}) == launch.SERVE_GOMP_SPINCOUNT == "30000"
    assert run({"GOMP_SPINCOUNT": "7"}) == "7"
    assert run({"OMP_WAIT_POLICY": "PASSIVE"}) == "None"
