"""RL routes of a real server (issue 16): a server started on tiny random model A gets B's weights by
each path (shared-memory tensors, disk, a gloo broadcast from a trainer process) and must then answer as a
fresh offline engine built on B (the independent reference); refused updates are 400s and A keeps
serving; a prompt cached before an update has cached_tokens 0 after it; a request streaming during an
update finishes on the old weights (or ends with abort when asked); a trainer that dies mid-broadcast
leaves the engine serving its old weights, able to join a new group; pause and continue keep what each
mode promises.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time

import httpx
import pytest
from conftest import TEST_THREADS, make_tiny_model
from server_harness import ServerProcess, free_port
from test_rl_updates import checkpoint

from idleless.engine.engine import Engine
from idleless.rl.trainer import WeightPusher, WeightPushError, _Call
from idleless.sampling_params import SamplingParams

PROMPT = list(range(30, 62))
MAX_NEW = 12
ARGS = ["--dtype", "float32", "--kv-cache-memory", "2MiB", "--num-threads", "1", "--page-size", "4",
        "--log-level", "warning"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_dir):
    d = tmp_path_factory.mktemp("rl-server")
    a, b = make_tiny_model(d, seed=0), make_tiny_model(d, seed=1)
    ref = {}
    for name, path in (("A", a), ("B", b)):
        eng = Engine(model=path, tokenizer=smollm2_dir, dtype="float32", kv_cache_memory="2MiB",
                     num_threads=TEST_THREADS, page_size=4)
        ref[name] = eng.generate(PROMPT, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                                 use_tqdm=False).token_ids
    assert ref["A"] != ref["B"]
    srv = ServerProcess([*ARGS, "--model", a, "--tokenizer-path", smollm2_dir])
    try:
        srv.wait_ready()
        yield srv, a, b, ref
    finally:
        srv.stop()


def generate(srv, max_new: int = MAX_NEW) -> dict:
    r = httpx.post(srv.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def version(srv) -> str:
    return httpx.get(srv.url + "/get_weight_version", timeout=30).json()["weight_version"]


def test_tensor_and_disk_updates(setup):
    srv, a, b, ref = setup
    assert version(srv) == "default"
    assert generate(srv)["output_ids"] == ref["A"]
    assert generate(srv)["meta_info"]["cached_tokens"] > 0
    pusher = WeightPusher(srv.url, timeout_s=60)
    res = pusher.push_tensor(checkpoint(a), weight_version="v0")  # the file made here is rewritten below
    res = pusher.push_tensor(checkpoint(b), weight_version="v1")
    assert res["success"] and res["flushed_cache"] and res["weight_version"] == "v1"
    out = generate(srv)
    assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == ref["B"]
    assert version(srv) == "v1"
    assert httpx.get(srv.url + "/get_model_info", timeout=30).json()["weight_version"] == "v1"
    assert httpx.get(srv.url + "/server_info", timeout=30).json()["weight_version"] == "v1"
    pusher.close()
    assert not [n for n in os.listdir("/dev/shm") if str(os.getpid()) in n and n.startswith("idleless-shm-")]
    pusher = WeightPusher(srv.url, timeout_s=60)
    res = pusher.push_disk(a, weight_version="v2")
    assert res["success"] and version(srv) == "v2" and generate(srv)["output_ids"] == ref["A"]


def test_bad_updates_are_400_and_the_old_weights_serve(setup, tmp_path):
    srv, a, b, ref = setup
    before = version(srv)
    pusher = WeightPusher(srv.url, timeout_s=60)
    bad_shape = [(n, t[:, :-1] if n.endswith("down_proj.weight") else t) for n, t in checkpoint(b)]
    unknown = [("model.layers.7.mlp.up_proj.weight", t) for _, t in checkpoint(b)[:1]]
    for push in (lambda: pusher.push_tensor(bad_shape, weight_version="bad"),
                 lambda: pusher.push_tensor(unknown, weight_version="bad"),
                 lambda: pusher.push_disk(str(tmp_path / "no-such-model"), weight_version="bad"),
                 lambda: pusher.push_disk(make_tiny_model(tmp_path, hidden_size=32), weight_version="bad")):
        with pytest.raises(WeightPushError) as e:
            push()
        assert e.value.status == 400
    for body in ({"shm_path": "/etc/passwd", "tensors": [{"name": "model.norm.weight", "dtype": "float32",
                                                          "shape": [64], "offset": 0}]},
                 {"serialized_named_tensors": ["gASV"]},
                 {"shm_path": "/dev/shm/idleless-shm-x", "tensors": [], "surprise": 1}):
        r = httpx.post(srv.url + "/update_weights_from_tensor", json=body, timeout=60)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert version(srv) == before and generate(srv)["output_ids"] == ref["A"]


def stream(srv, max_new: int, out: list, started: threading.Event) -> None:
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(timeout=300) as c, c.stream("POST", srv.url + "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                started.set()


def test_a_streaming_request_finishes_on_the_old_weights_or_is_aborted(setup):
    srv, a, b, ref = setup
    n = 400  # long enough that the update arrives while it runs
    for abort in (False, True):
        out, started = [], threading.Event()
        t = threading.Thread(target=stream, args=(srv, n, out, started))
        t.start()
        assert started.wait(120)
        res = WeightPusher(srv.url, timeout_s=120).push_disk(b if not abort else a, abort_all_requests=abort)
        t.join(300)
        ids = [i for d in out for i in d["output_ids"]]
        reason = out[-1]["meta_info"]["finish_reason"]["type"]
        if abort:
            assert reason == "abort" and res["num_aborted_requests"] == 1 and len(ids) < n
        else:
            assert reason == "length" and len(ids) == n and ids[:MAX_NEW] == ref["A"]
            versions = [v for d in out for v in d["meta_info"]["output_token_weight_versions"]]
            assert len(versions) == n and set(versions) == {out[0]["meta_info"]["weight_version"]}  # old weights
    assert generate(srv)["output_ids"] == ref["A"]


def test_a_rollout_spanning_an_update_says_which_tokens_came_from_which_weights(setup):
    srv, a, b, ref = setup
    pusher = WeightPusher(srv.url, timeout_s=120)
    old = version(srv)
    n, out, started = 400, [], threading.Event()
    t = threading.Thread(target=stream, args=(srv, n, out, started))
    t.start()
    assert started.wait(120)
    pusher.push_disk(a, weight_version="rollout-v2", flush_cache=False)  # written between two steps, at once
    t.join(300)
    versions = [v for d in out for v in d["meta_info"]["output_token_weight_versions"]]
    ids = [i for d in out for i in d["output_ids"]]
    assert len(versions) == len(ids) == n
    k = versions.index("rollout-v2")
    assert 0 < k < n and versions == [old] * k + ["rollout-v2"] * (n - k), (k, set(versions))
    assert out[-1]["meta_info"]["weight_version"] == "rollout-v2"
    whole = generate(srv)
    assert set(whole["meta_info"]["output_token_weight_versions"]) == {"rollout-v2"}


def die_mid_broadcast(url: str, port: int, path: str) -> None:
    """A trainer that joins, announces every tensor of ``path``, broadcasts half of them and dies."""
    pusher = WeightPusher(url, timeout_s=60)
    pusher.init_group("127.0.0.1", port)
    items = checkpoint(path)
    _Call(pusher, "/update_weights_from_distributed", {
        "names": [n for n, _ in items], "dtypes": ["float32"] * len(items),
        "shapes": [list(t.shape) for _, t in items], "weight_version": "never"}, 60)
    time.sleep(1.0)  # the announcement reaches the engine first (else it never starts to receive)
    pusher.group.broadcast(items[: len(items) // 2])
    os._exit(3)


def test_distributed_update_and_a_trainer_dying_mid_broadcast(setup):
    srv, a, b, ref = setup
    pusher = WeightPusher(srv.url, timeout_s=60)
    pusher.init_group("127.0.0.1", free_port())
    try:
        res = pusher.push_distributed(checkpoint(b), weight_version="d1")
        assert res["success"] and res["flushed_cache"]
        assert version(srv) == "d1" and generate(srv)["output_ids"] == ref["B"]
    finally:
        pusher.destroy_group()
    proc = multiprocessing.get_context("spawn").Process(target=die_mid_broadcast, args=(srv.url, free_port(), a))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 3
    # the engine's receive fails (peer gone): old weights, old version, and the broken group is dropped
    assert version(srv) == "d1" and generate(srv)["output_ids"] == ref["B"]
    pusher.init_group("127.0.0.1", free_port())
    try:
        assert pusher.push_distributed(checkpoint(a), weight_version="d2")["success"]
        assert generate(srv)["output_ids"] == ref["A"]
    finally:
        pusher.destroy_group()


def test_pause_and_continue_in_each_mode(setup):
    """in_place keeps the running request and its KV; retract releases its KV and recomputes after
    continue; abort ends it; in every mode a request arriving while paused waits, and everything ends
    with no KV held."""
    srv = setup[0]
    n = 1500  # long enough that the pause lands while it runs on a fast, loaded machine (400 was not on Zen 4)
    base = generate(srv, n)["output_ids"]
    for mode in ("in_place", "retract", "abort"):
        out, started = [], threading.Event()
        t = threading.Thread(target=stream, args=(srv, n, out, started))
        t.start()
        assert started.wait(120)
        r = httpx.post(srv.url + "/pause_generation", json={"mode": mode}, timeout=60)
        assert r.status_code == 200 and r.json()["num_requests"] == (0 if mode == "in_place" else 1), r.text
        late = []
        w = threading.Thread(target=lambda: late.append(generate(srv, n)))
        w.start()
        try:
            time.sleep(1.0)
            assert not late  # waits while paused
            s = srv.stats()
            if mode == "in_place":
                assert s["num_running"] == 1 and s["kv"]["in_use"] > 0
            else:
                assert s["num_running"] == 0 and s["kv"]["in_use"] == 0
                assert s["num_waiting"] == (1 if mode == "retract" else 0)
        finally:  # a failed check must not leave the module's server paused for the next tests
            assert httpx.post(srv.url + "/continue_generation", timeout=60).status_code == 200
        t.join(300)
        w.join(300)
        ids = [i for d in out for i in d["output_ids"]]
        reason = out[-1]["meta_info"]["finish_reason"]["type"]
        if mode == "abort":
            assert reason == "abort" and len(ids) < n
        else:
            assert reason == "length" and ids == base
        assert late[0]["output_ids"] == base
        srv.wait_idle_kv()
    r = httpx.post(srv.url + "/pause_generation", json={"mode": "sideways"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


def test_release_and_resume_memory_occupation(setup):
    """SGLang's memory hand-off: refused while a request runs; released (KV pool and weights freed,
    pool bytes as /server_info's slots say), requests wait, an update is refused until the weights are
    resumed, then the pushed weights serve (B's reference); nothing leaks."""
    srv, a, b, ref = setup
    post = lambda path, body=None: httpx.post(srv.url + path, json=body or {}, timeout=120)  # noqa: E731
    out, started = [], threading.Event()
    t = threading.Thread(target=stream, args=(srv, 1500, out, started))  # long enough to still run below
    t.start()
    assert started.wait(120)
    r = post("/release_memory_occupation")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text  # a request runs
    t.join(300)
    assert out[-1]["meta_info"]["finish_reason"]["type"] == "length"
    srv.wait_idle_kv()

    r = post("/release_memory_occupation", {"tags": ["gpu"]})
    assert r.status_code == 400 and "tags" in r.json()["error"]["param"], r.text
    assert post("/pause_generation", {"mode": "abort"}).status_code == 200  # nothing runs on zeros later
    r = post("/release_memory_occupation")
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache", "weights"], r.text
    slots = httpx.get(srv.url + "/server_info", timeout=30).json()["kv_slots"]
    assert r.json()["bytes"] > 2 * 4 * slots  # at least K and V of one float32 element per slot, and the weights
    assert post("/release_memory_occupation", {"tags": ["kv_cache"]}).json()["bytes"] == 0  # released already
    late = []
    w = threading.Thread(target=lambda: late.append(generate(srv)))
    w.start()
    r = post("/update_weights_from_disk", {"model_path": b})
    assert r.status_code == 400 and "resume_memory_occupation" in r.json()["error"]["message"], r.text
    r = post("/resume_memory_occupation", {"tags": ["weights"]})
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache"]
    assert post("/update_weights_from_disk", {"model_path": b, "weight_version": "after-release"}).status_code == 200
    assert post("/resume_memory_occupation").json()["released"] == []
    time.sleep(1.0)
    assert not late  # still paused
    assert post("/continue_generation").status_code == 200
    w.join(300)
    assert late[0]["output_ids"] == ref["B"]
    assert late[0]["meta_info"]["weight_version"] == "after-release"
    srv.wait_idle_kv()
    post("/update_weights_from_disk", {"model_path": a})
    assert generate(srv)["output_ids"] == ref["A"]
