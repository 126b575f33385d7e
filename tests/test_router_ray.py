"""``idleless serve --dp 2 --ray-address ADDR`` (idleless.router.ray_replicas): two replicas of a tiny
random model (SmolLM2's tokenizer) as Ray actors on a local Ray cluster this module starts (2 CPUs, a
200 MiB object store, stopped at the end), the router in the serve process. Both replicas answer
through the router, a greedy completion equals an offline Engine's on the same model, SIGTERM stops
the actors and frees their CPUs, as Ctrl-C does while the replicas start; a replica that cannot start
fails the launch and frees the cluster; without Ray installed the flag names the extra to install."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time

import httpx
import pytest

from conftest import TEST_THREADS, make_tiny_model
from server_harness import ServerProcess

from idleless.router import ray_replicas
from idleless.server import launch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def _serve_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_args(p)
    return p.parse_args(list(flags))


def test_replica_threads_split_the_smallest_node():
    a = _serve_args()
    assert ray_replicas.replica_threads(a, 2, [2.0]) == 1  # one node: both replicas share its 2 CPUs
    assert ray_replicas.replica_threads(a, 3, [8.0, 4.0]) == 2  # ceil(3/2) = 2 replicas on the 4-CPU node
    assert ray_replicas.replica_threads(a, 2, [16.0, 16.0, 16.0]) == 16  # one replica per node
    assert ray_replicas.replica_threads(a, 4, [2.0]) == 1  # never below 1
    assert ray_replicas.replica_threads(_serve_args("--num-threads", "3"), 2, [2.0]) == 3  # the flag wins
    with pytest.raises(RuntimeError, match="no node with CPUs"):
        ray_replicas.replica_threads(a, 2, [])


def test_without_ray_the_flag_names_the_extra(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    args = _serve_args("--dp", "2", "--ray-address", "auto", "--port", "1")
    with caplog.at_level(logging.ERROR, logger="idleless.server"):
        assert launch.main(args) == 1
    assert "pip install 'idleless[ray]'" in caplog.text


@pytest.fixture(scope="module")
def tiny_chat_model(smollm2_dir, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny-ray"), vocab_size=49152, bos_token_id=1, eos_token_id=2,
                        pad_token_id=2)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2_dir, f)):
            shutil.copy(os.path.join(smollm2_dir, f), d)
    return d


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (this process is its head): yields its GCS address and ``ray``."""
    ray = pytest.importorskip("ray")
    ctx = ray.init(num_cpus=2, object_store_memory=200 * 1024 ** 2, include_dashboard=False, log_to_driver=False)
    try:
        yield ctx.address_info["gcs_address"], ray
    finally:
        ray.shutdown()


def _wait_cpus_free(ray, cpus: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) < cpus and time.monotonic() < deadline:
        time.sleep(0.5)
    return free


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ray_replicas_answer_through_the_router(ray_cluster, tiny_chat_model):
    address, ray = ray_cluster
    srv = ServerProcess(["--dp", "2", "--ray-address", address, "--model", tiny_chat_model, "--dtype", "float32",
                         "--kv-cache-memory", "16MiB", "--router-policy", "round_robin", "--log-level", "warning"],
                        api_key="sk-ray")
    prompt = [1, 504, 3458, 6354, 16092, 28, 2, 9, 77]
    try:
        srv.wait_ready(timeout=480)
        assert ray.available_resources().get("CPU", 0.0) == 0.0  # the 2 replicas hold the 2 CPUs
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as c:
            workers = c.get("/workers").json()["workers"]
            urls = sorted(w["url"] for w in workers)
            assert len(urls) == 2 and all(w["healthy"] for w in workers)
            assert all(u.startswith("http://127.0.0.1:") for u in urls)  # this node: the loopback
            texts = []
            for _ in range(4):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            routed = {w["url"]: w["routed"] for w in c.get("/workers").json()["workers"]}
            assert routed == {urls[0]: 2, urls[1]: 2}  # round robin: both replicas answered
            for u in urls:  # the replicas keep the key: they may listen beyond the loopback
                assert httpx.get(u + "/v1/models", timeout=30).status_code == 401
                assert httpx.get(u + "/v1/models", headers=srv.headers, timeout=30).status_code == 200
    finally:
        code = srv.stop()
        log = srv.log()
    assert code == 0, log[-3000:]
    assert _wait_cpus_free(ray, 2.0) == 2.0  # actors and placement group gone
    for u in urls:
        with pytest.raises(httpx.HTTPError):
            httpx.get(u + "/health", timeout=5)

    from idleless.engine.engine import Engine
    from idleless.engine.request import SamplingParams
    engine = Engine(model=tiny_chat_model, dtype="float32", kv_cache_memory="16MiB", num_threads=TEST_THREADS)
    ref = engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert texts == [ref.text] * 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replica_that_cannot_start_fails_the_launch(ray_cluster, tmp_path):
    address, ray = ray_cluster
    srv = ServerProcess(["--dp", "2", "--ray-address", address, "--model", str(tmp_path / "missing"),
                         "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 400
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        code = srv.stop()
        log = srv.log()
    assert code == 1, log[-3000:]
    assert "exited with code 1 while starting" in log, log[-3000:]
    assert _wait_cpus_free(ray, 2.0) == 2.0  # the other replica's actor was stopped too


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_while_replicas_start_stops_the_actors(ray_cluster, tiny_chat_model):
    address, ray = ray_cluster
    srv = ServerProcess(["--dp", "2", "--ray-address", address, "--model", tiny_chat_model, "--dtype", "float32",
                         "--kv-cache-memory", "16MiB", "--log-level", "info"])
    try:
        deadline = time.monotonic() + 300
        while "replicas placed on Ray" not in srv.log() and srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "replicas placed on Ray" in srv.log(), srv.log()[-3000:]
        assert ray.available_resources().get("CPU", 0.0) == 0.0
    finally:
        # Ctrl-C: the terminal's process group, which the actors are not in. The launcher's stop is bounded
        # (drain grace 30 s + STOP_MARGIN_S + SHUTDOWN_TIMEOUT_S); 180 s leaves room on a loaded machine.
        code = srv.stop(signal.SIGINT, timeout=180)
        log = srv.log()
    assert code == 0, log[-3000:]
    assert _wait_cpus_free(ray, 2.0) == 2.0
