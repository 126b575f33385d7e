"""`idleless bench compare-serving`: the harness against stub OpenAI servers it starts itself.

The stub (a stdlib HTTP server written to tmp_path and run as a subprocess, like the real servers)
streams exactly ``max_tokens`` one-character chunks per request and reports usage, so the token
counts each row must hold are known from the workload file. It logs its start and stop and every
prefix-cache reset (refusing the first when told, as vLLM does while blocks are held), and can be
told to fail at start, never become healthy, or die after N requests.
Checked: the JSON's structure, exact counts, the ratios against the rows' own values by hand, that
two servers never run at once, and that a missing / broken vLLM venv, a server that will not start and
one that dies mid-way are recorded as skipped with the reason (never a hang). The last test starts a
real `idleless serve` on the bundled model (slow).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from idleless.bench import compare_serving as cs

STUB = r'''
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

opts = dict(a.split("=", 1) for a in sys.argv[2:])
port, events = int(sys.argv[1]), opts["events"]
delay, die_after = float(opts.get("delay", "0.002")), int(opts.get("die_after", "0"))
lock, state = threading.Lock(), {"inflight": 0, "max": 0, "served": 0}

def event(*words):
    with open(events, "a") as f:
        f.write(" ".join(str(w) for w in words) + "\n")

if opts.get("fail_start"):
    print("(Worker) ERROR [x.py:1] ValueError: cannot load the model (told to fail)", flush=True)
    print("Traceback (most recent call last):\nRuntimeError: engine core initialization failed", flush=True)
    sys.exit(3)
event("start", os.getpid(), time.time())
signal.signal(signal.SIGTERM, lambda *a: (event("stop", os.getpid(), time.time()), os._exit(0)))

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health" and not opts.get("never_healthy"):
            self.reply(200, {})
        elif self.path == "/v1/models":
            self.reply(200, {"data": [{"id": "stub"}]})
        else:
            self.reply(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/flush_cache":
            with lock:
                if opts.get("refuse_first_reset") and not state.get("refused"):  # as vLLM while blocks are held
                    state["refused"] = True
                    event("refused")
                    return self.reply(200, {"success": False})
                event("reset", state["max"])
                state["max"] = 0
            return self.reply(200, {})
        if self.path != "/v1/completions":
            return self.reply(404, {})
        with lock:
            state["served"] += 1
            if die_after and state["served"] > die_after:
                os._exit(7)
            state["inflight"] += 1
            state["max"] = max(state["max"], state["inflight"])
        n, prompt = body["max_tokens"], body["prompt"]
        if not body.get("stream"):
            finished()
            return self.reply(200, {"choices": [{"index": 0, "text": "x" * n}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(n):
            time.sleep(delay)
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        self.wfile.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n").encode())
        finished()  # before the last write: the client sends its next request only after it
        self.wfile.write(b"data: [DONE]\n\n")

def finished():
    with lock:
        state["inflight"] -= 1

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

MAX_TOKENS = [3, 5, 4, 6]


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub_server.py"
    path.write_text(STUB)

    def spec(name, timeout=60.0, **opts):
        events = tmp_path / f"{name}.events"
        argv = [sys.executable, str(path), "{port}", f"events={events}"] + [f"{k}={v}" for k, v in opts.items()]
        return cs.ServerSpec(name, argv, timeout, "/flush_cache"), events
    return spec


@pytest.fixture
def workload(tmp_path):
    reqs = [{"id": f"r{i}", "prompt_token_ids": list(range(10 + i)), "max_tokens": mt} for i, mt in enumerate(MAX_TOKENS)]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"name": "tiny", "sampling": {"temperature": 0.0, "ignore_eos": True}, "requests": reqs}))
    return str(path)


def _events(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def test_two_servers_one_at_a_time(tmp_path, stub, workload):
    a, a_events = stub("idleless")
    b, b_events = stub("vllm", delay="0.01", refuse_first_reset="1")
    opts = cs.Options([workload], [1, 2], run_timeout_s=120.0, request_timeout_s=60.0)
    saved = []
    result = cs.run_comparison([a, b], opts, tmp_path, save=lambda r: saved.append(json.loads(json.dumps(r))))
    assert [len(x["rows"]) for x in saved] == [1, 2, 3, 4, 4]  # after every row, then at the end
    assert saved[-1] == result
    assert result["cpu"]["model"] and set(result["cpu"]["flags"]) == set(cs.CPU_FLAGS)
    assert all(isinstance(v, bool) for v in result["cpu"]["flags"].values())
    for name in ("idleless", "vllm"):
        s = result["systems"][name]
        assert s["status"] == "ok" and s["reason"] is None and "{port}" not in s["command"]
        assert len(s["load_avg_before_start"]) == 3
        assert s["server_info"] is None and s["precision"] is None  # no /server_info, no start-up line
    rows = result["rows"]
    assert [(r["system"], r["concurrency"]) for r in rows] == [("idleless", 1), ("idleless", 2), ("vllm", 1), ("vllm", 2)]
    for r in rows:
        assert r["status"] == "ok" and r["client"] == "bench-serving" and r["workload"] == workload
        assert r["requests_ok"] == 4 and r["requests_failed"] == 0
        assert r["output_tokens"] == sum(MAX_TOKENS)
        assert r["output_tok_s"] == pytest.approx(sum(MAX_TOKENS) / r["duration_s"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p95_ms"]
        assert r["cache_reset"] is True and r["cache_reset_error"] is None
        assert len(r["load_avg_before"]) == 3 and len(r["load_avg_after"]) == 3
    # one reset before each run; the requests in flight between resets never exceed that run's level
    for ev, first in ((a_events, []), (b_events, ["refused"])):  # a refused reset is retried
        e = _events(ev)
        assert [x[0] for x in e] == ["start", *first, "reset", "reset", "stop"]
        assert int(e[-2][1]) <= 1  # the max in flight of the concurrency-1 run
    # the second server started only after the first had stopped
    assert float(_events(a_events)[-1][2]) <= float(_events(b_events)[0][2])
    # ratios: Idleless / vLLM of each metric, by hand from the rows
    assert len(result["ratios"]) == 2
    for q in result["ratios"]:
        ra, rb = (next(r for r in rows if r["system"] == s and r["concurrency"] == q["concurrency"])
                  for s in ("idleless", "vllm"))
        for k in cs.METRICS:
            assert q[k] == pytest.approx(ra[k] / rb[k])
    table = cs.format_table(result)
    assert "ratio" in table and table.count("| bench-serving | tiny |") == 2


def test_missing_or_broken_vllm_venv_is_skipped(tmp_path, stub, workload):
    missing = cs.vllm_spec(str(tmp_path / "nope"), "/m", "float32", "m", 2048, 0.5, "", 60.0)
    assert missing.skip_reason and "bin/python does not exist" in missing.skip_reason
    broken = tmp_path / "broken-venv"
    (broken / "bin").mkdir(parents=True)
    py = broken / "bin" / "python"
    py.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    py.chmod(0o755)
    spec = cs.vllm_spec(str(broken), "/m", "float32", "m", 2048, 0.5, "--enforce-eager", 60.0)
    assert "import vllm" in spec.skip_reason and "No module named 'vllm'" in spec.skip_reason
    assert spec.argv[-1] == "--enforce-eager" and spec.argv[spec.argv.index("--port") + 1] == "{port}"
    a, _ = stub("idleless")
    opts = cs.Options([workload], [2], guidellm_venv=str(tmp_path / "no-guidellm"), run_timeout_s=120.0)
    result = cs.run_comparison([a, spec], opts, tmp_path)
    assert result["systems"]["vllm"]["status"] == "skipped"
    assert result["systems"]["vllm"]["reason"] == spec.skip_reason
    by = {(r["system"], r["client"]): r for r in result["rows"]}
    assert by[("idleless", "bench-serving")]["status"] == "ok"
    assert by[("vllm", "bench-serving")] == {"system": "vllm", "client": "bench-serving", "workload": workload,
                                             "concurrency": 2, "status": "skipped", "reason": spec.skip_reason}
    assert by[("vllm", "guidellm")]["status"] == "skipped"
    g = by[("idleless", "guidellm")]
    assert g["status"] == "skipped" and "no-guidellm/bin/guidellm" in g["reason"]
    assert result["ratios"] == []
    assert "vllm: skipped" in cs.format_table(result)


def test_servers_that_fail_hang_or_die_are_skipped(tmp_path, stub, workload):
    fails, _ = stub("fails", fail_start="1")
    hangs, hang_events = stub("hangs", timeout=2.0, never_healthy="1")
    dies, _ = stub("dies", die_after="5")  # the warm-up and 4 requests of the first run, then the 6th kills it
    opts = cs.Options([workload], [1, 2, 4], run_timeout_s=120.0, request_timeout_s=30.0)
    result = cs.run_comparison([fails, hangs, dies], opts, tmp_path)
    s = result["systems"]
    assert s["fails"]["status"] == "skipped" and "did not start" in s["fails"]["reason"]
    assert "exited with 3" in s["fails"]["reason"]
    assert "first error: ValueError: cannot load the model (told to fail)" in s["fails"]["reason"]  # the root cause
    assert s["fails"]["reason"].endswith("RuntimeError: engine core initialization failed")  # then the tail
    assert s["hangs"]["status"] == "skipped" and "not healthy after 2 s" in s["hangs"]["reason"]
    assert [x[0] for x in _events(hang_events)] == ["start", "stop"]  # stopped, not left behind
    assert s["dies"]["status"] == "died" and "exited with code 7" in s["dies"]["reason"]
    rows = {(r["system"], r["concurrency"]): r for r in result["rows"]}
    for name in ("fails", "hangs"):
        assert all(rows[(name, c)]["status"] == "skipped" for c in (1, 2, 4))
    assert rows[("dies", 1)]["status"] == "ok" and rows[("dies", 1)]["requests_ok"] == 4
    assert rows[("dies", 2)]["status"] == "failed" and rows[("dies", 2)]["requests_failed"] > 0
    assert rows[("dies", 4)]["status"] == "skipped" and "exited with code 7" in rows[("dies", 4)]["reason"]


def test_bad_flags_exit_2(tmp_path, workload):
    from idleless.cli import main as cli_main

    for flags in (["--systems", "sglang"], ["--concurrency", "0"], ["--workloads", str(tmp_path / "none.json")]):
        assert cli_main(["bench", "compare-serving", "--workloads", workload, "--output", str(tmp_path / "o.json"),
                         *flags]) == 2
    assert not (tmp_path / "o.json").exists()


def test_row_from_guidellm_report():
    def dist(median, p95, mean=None):
        return {"successful": {"mean": mean if mean is not None else median, "median": median,
                               "percentiles": {"p50": median, "p95": p95}}}
    report = {"benchmarks": [{"metrics": {
        "output_tokens_per_second": dist(140.0, 150.0, mean=145.5),
        "time_to_first_token_ms": dist(1350.0, 1640.0), "inter_token_latency_ms": dist(40.0, 55.0),
        "request_totals": {"successful": 31, "errored": 1, "incomplete": 0, "total": 32}}}]}
    assert cs.row_from_guidellm(report) == {
        "output_tok_s": 145.5, "ttft_p50_ms": 1350.0, "ttft_p95_ms": 1640.0, "itl_p50_ms": 40.0, "itl_p95_ms": 55.0,
        "requests_ok": 31, "requests_failed": 1}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_against_idleless_serve(tmp_path, smollm2_dir, workload):
    from idleless.cli import main as cli_main

    out = tmp_path / "cmp.json"
    rc = cli_main(["bench", "compare-serving", "--workloads", workload, "--concurrency", "1,2",
                   "--idleless-args", "--kv-cache-memory 64MiB --num-threads 1",
                   "--vllm-venv", str(tmp_path / "no-vllm"), "--log-dir", str(tmp_path / "logs"), "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["model_dir"] == smollm2_dir and r["systems"]["idleless"]["status"] == "ok"
    assert "--kv-cache-memory 64MiB" in r["systems"]["idleless"]["command"]
    assert r["systems"]["idleless"]["server_info"]["model_path"]
    assert set(r["systems"]["idleless"]["precision"]) == {"weights", "activations"}  # from its INFO start-up line
    ok = [x for x in r["rows"] if x["system"] == "idleless"]
    assert len(ok) == 2 and all(x["status"] == "ok" and x["output_tokens"] == sum(MAX_TOKENS) for x in ok)
    assert all(x["status"] == "skipped" for x in r["rows"] if x["system"] == "vllm")
    assert r["systems"]["vllm"]["status"] == "skipped" and r["ratios"] == []
