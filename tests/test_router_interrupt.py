"""``idleless serve --dp N``'s launch (idleless.router.replicas.serve_replicas) stops on Ctrl-C before its
router listens even when the KeyboardInterrupt is swallowed inside a blocking call of the start-up (as
Ray's ``ray.get`` may do): scripted start / ready / stop, a real SIGINT to this process."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from idleless.router import launch as router_launch
from idleless.router import replicas


def _swallowing_call():
    """A library call that receives SIGINT and swallows the KeyboardInterrupt."""
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs as soon as the interpreter checks signals
        for _ in range(1000):
            pass
    except KeyboardInterrupt:
        pass


@pytest.mark.parametrize("where", ["start", "ready"])
def test_a_swallowed_ctrl_c_during_start_up_stops_the_replicas_and_no_router_starts(monkeypatch, where):
    calls = []

    def start(args, dp):
        calls.append("start")
        if where == "start":
            _swallowing_call()
        return ["replica"], ["http://127.0.0.1:1"]

    def ready(procs, urls, timeout_s):
        calls.append("ready")
        if where == "ready":
            _swallowing_call()

    def stop(procs, grace_s):
        calls.append(("stop", procs))

    async def serve(rargs):
        calls.append("router")

    monkeypatch.setattr(replicas, "start_replicas", start)
    monkeypatch.setattr(replicas, "wait_ready", ready)
    monkeypatch.setattr(replicas, "stop_replicas", stop)
    monkeypatch.setattr(router_launch, "serve", serve)
    before = signal.getsignal(signal.SIGINT)
    args = argparse.Namespace(dp=2, ray_address=None, shutdown_grace=1.0)
    assert replicas.serve_replicas(args) == 0
    expected = ["start", "ready"] if where == "ready" else ["start"]
    assert calls == expected + [("stop", ["replica"])]  # stopped, and the router never started
    assert signal.getsignal(signal.SIGINT) is before  # the launch's handler is gone again


def test_without_ctrl_c_the_router_starts_and_the_replicas_stop_after_it(monkeypatch):
    calls = []
    monkeypatch.setattr(replicas, "start_replicas", lambda args, dp: (calls.append("start") or ["r"], ["http://h:1"]))
    monkeypatch.setattr(replicas, "wait_ready", lambda procs, urls, t: calls.append("ready"))
    monkeypatch.setattr(replicas, "stop_replicas", lambda procs, g: calls.append("stop"))
    monkeypatch.setattr(replicas, "replica_args", lambda *a: argparse.Namespace(num_threads=1))

    async def serve(rargs):
        calls.append(("router", rargs.worker_urls))

    monkeypatch.setattr(router_launch, "serve", serve)
    args = argparse.Namespace(dp=2, ray_address=None, shutdown_grace=1.0, host="127.0.0.1", port=1,
                              router_policy="exact", log_level="warning", api_key=None, chat_template=None)
    assert replicas.serve_replicas(args) == 0
    assert calls == ["start", "ready", ("router", ["http://h:1"]), "stop"]
