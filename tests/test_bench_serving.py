"""`idleless bench serving`: the client's metrics against a fake streaming server with scripted
delays (expected values computed from the script), the workload generators, the load shape, the
busy-fraction scrape, the plot, and one end-to-end run against a real `idleless serve`.

The fake server is a plain asyncio HTTP server on 127.0.0.1 (free port) in a thread of its own. It
answers each streaming request with SSE chunks at scripted offsets from the request's arrival
(absolute deadlines, so its own jitter does not accumulate) and records when it actually wrote
each chunk. Timing tolerances are fractions of the scripted gaps (scheduling jitter of a loaded
2-core machine), never bounds on how fast anything is.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
import time

import numpy as np
import pytest

from idleless.bench import serving
from idleless.bench.serving import (BenchRequest, RequestResult, RunSettings, Session, WorkloadPlan, arrival_times,
                                    busy_counters_from_metrics, busy_over_run, compute_metrics, parse_prometheus,
                                    parse_slo, run_plan)
from idleless.cli import main as cli_main

TOL = 0.15  # s: scheduling jitter allowed (a loaded 2-core machine); the smallest scripted gap is 0.4 s


# --------------------------------------------------------------------------------------------------
# the fake server
# --------------------------------------------------------------------------------------------------
class FakeServer:
    """SSE server with scripted timings. ``scripts[key]`` (key = the prompt's first token id, or
    the last user message for chat): ``ttft`` (s after arrival), ``gaps`` (s between chunks),
    ``tokens`` (text pieces, one per chunk), ``usage`` (sent in a final chunk, or None).
    ``metrics``: list of /metrics bodies served in turn (the last one repeats)."""

    def __init__(self, scripts=None, metrics=None, default=None):
        self.scripts = scripts or {}
        self.default = default
        self.metrics = list(metrics or [])
        self.bodies: list[dict] = []
        self.sent: dict = {}  # key -> [perf_counter of each chunk write]
        self.arrived: dict = {}
        self.inflight = 0
        self.max_inflight = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def close(self):
        async def stop():
            self.server.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            arrival = time.perf_counter()
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            hdr = {k.lower(): v for k, v in (l.split(": ", 1) for l in lines[1:] if ": " in l)}
            body = await reader.readexactly(int(hdr.get("content-length", 0))) if method == "POST" else b""
            if path == "/metrics":
                text = self.metrics.pop(0) if len(self.metrics) > 1 else (self.metrics[0] if self.metrics else "")
                await self._plain(writer, 200, text, "text/plain")
            elif path == "/v1/models":
                await self._plain(writer, 200, json.dumps({"data": [{"id": "fake-model"}]}), "application/json")
            elif path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(writer, json.loads(body), arrival)
            else:
                await self._plain(writer, 404, "{}", "application/json")
        finally:
            writer.close()

    async def _plain(self, writer, code, text, ctype):
        data = text.encode()
        writer.write(f"HTTP/1.1 {code} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _stream(self, writer, req, arrival):
        self.bodies.append(req)
        chat = "messages" in req
        key = req["messages"][-1]["content"] if chat else req["prompt"][0]
        sc = self.scripts.get(key) or self.default(req)
        self.arrived[key] = arrival
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            if chat:  # the role chunk OpenAI servers send first: no text, must not count as the first token
                writer.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
            await writer.drain()
            offsets = [sc["ttft"]]
            for g in sc.get("gaps", []):
                offsets.append(offsets[-1] + g)
            times = self.sent.setdefault(key, [])
            for off, tok in zip(offsets, sc["tokens"]):
                delay = arrival + off - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                choice = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
                writer.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                await writer.drain()
                times.append(time.perf_counter())
            if sc.get("usage"):
                writer.write(f"data: {json.dumps({'choices': [], 'usage': sc['usage']})}\n\n".encode())
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        finally:
            self.inflight -= 1


def _usage(prompt, completion, cached):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _workload_file(tmp_path, first_ids, max_tokens=8):
    reqs = [{"id": f"q{k}", "prompt_token_ids": [k] + [5] * 9, "max_tokens": max_tokens} for k in first_ids]
    path = tmp_path / "wl.json"
    path.write_text(json.dumps({"name": "scripted", "sampling": {"temperature": 0.0, "ignore_eos": True},
                                "requests": reqs}))
    return str(path)


METRICS_BEFORE = ('# HELP idleless:engine_time_seconds engine wall time by bucket\n'
                  '# TYPE idleless:engine_time_seconds counter\n'
                  'idleless:engine_time_seconds_total{model_name="m",bucket="forward"} 10.0\n'
                  'idleless:engine_time_seconds_total{model_name="m",bucket="schedule"} 1.0\n'
                  'idleless:engine_time_seconds_total{model_name="m",bucket="io"} 0.5\n'
                  'idleless:engine_time_seconds_total{model_name="m",bucket="idle_no_work"} 5.0\n'
                  'idleless:engine_time_seconds_total{model_name="m",bucket="other"} 0.0\n'
                  'idleless:engine_time_seconds_total{model_name="m",bucket="wall"} 16.5\n')
METRICS_AFTER = METRICS_BEFORE.replace("} 10.0", "} 13.6").replace('"schedule"} 1.0', '"schedule"} 1.3') \
    .replace('"io"} 0.5', '"io"} 0.6').replace('"idle_no_work"} 5.0', '"idle_no_work"} 5.5') \
    .replace('"wall"} 16.5', '"wall"} 21.0')


# --------------------------------------------------------------------------------------------------
# metrics against the script
# --------------------------------------------------------------------------------------------------
SCRIPTS = {
    # A: three one-token chunks
    1: {"ttft": 0.4, "gaps": [0.4, 0.6], "tokens": ["a", "b", "c"], "usage": _usage(10, 3, 4)},
    # B: two chunks, the second carrying two tokens (ITL sees one gap, TPOT divides by 3 - 1)
    2: {"ttft": 1.0, "gaps": [0.4], "tokens": ["d", "ef"], "usage": _usage(10, 3, 0)},
    # C: one token: no ITL, no TPOT
    3: {"ttft": 0.6, "gaps": [], "tokens": ["g"], "usage": _usage(10, 1, 2)},
}


def _expected():
    ttft = {k: s["ttft"] for k, s in SCRIPTS.items()}
    e2e = {k: s["ttft"] + sum(s["gaps"]) for k, s in SCRIPTS.items()}
    itl = [g for s in SCRIPTS.values() for g in s["gaps"]]
    tpot = {k: (e2e[k] - ttft[k]) / (s["usage"]["completion_tokens"] - 1)
            for k, s in SCRIPTS.items() if s["usage"]["completion_tokens"] > 1}
    return ttft, e2e, itl, tpot


def test_metrics_match_the_script(tmp_path):
    srv = FakeServer(SCRIPTS, metrics=[METRICS_BEFORE, METRICS_AFTER])
    try:
        out = tmp_path / "res.json"
        rc = cli_main(["bench", "serving", "--base-url", srv.url, "--workload", _workload_file(tmp_path, [1, 2, 3]),
                       "--warmup-requests", "0", "--slo", "ttft:800,tpot:700", "--output-file", str(out), "--quiet"])
        assert rc == 0
        r = json.loads(out.read_text())
    finally:
        srv.close()
    m = r["metrics"]
    ttft, e2e, itl, tpot = _expected()
    rows = {int(x["id"][1:]): x for x in r["requests"]}
    assert r["settings"]["model"] == "fake-model"
    assert m["completed"] == 3 and m["failed"] == 0
    # the server's ground truth, same clock: client TTFT / ITL are its chunk arrivals
    for k, row in rows.items():
        assert row["ttft_s"] == pytest.approx(ttft[k], abs=TOL)
        # E2E sums the server's sleeps, so their jitter adds up: one TOL per scripted sleep
        assert row["e2e_s"] == pytest.approx(e2e[k], abs=TOL * (1 + len(SCRIPTS[k]["gaps"])))
        assert row["chunks"] == len(SCRIPTS[k]["tokens"])
        assert row["output_len"] == SCRIPTS[k]["usage"]["completion_tokens"]
        gaps = np.diff(row["chunk_s"]).tolist()
        assert gaps == pytest.approx(SCRIPTS[k]["gaps"], abs=TOL)
        if k in tpot:
            assert row["tpot_s"] == pytest.approx(tpot[k], abs=TOL)
            # TPOT is exactly (latency - TTFT) / (output_len - 1) of the measured values
            assert row["tpot_s"] == pytest.approx((row["e2e_s"] - row["ttft_s"]) / (row["output_len"] - 1), abs=1e-5)
        else:
            assert row["tpot_s"] is None
    # distributions (ms): numpy percentiles of the scripted values
    for key, vals, tol in (("ttft_ms", list(ttft.values()), TOL), ("e2e_ms", list(e2e.values()), TOL * 3),
                           ("itl_ms", itl, TOL), ("tpot_ms", list(tpot.values()), TOL)):
        a = np.asarray(vals) * 1000
        exp = {"mean": a.mean(), "median": np.median(a), "p90": np.percentile(a, 90), "p99": np.percentile(a, 99)}
        for stat, v in exp.items():
            assert m[key][stat] == pytest.approx(v, abs=tol * 1000), (key, stat)
    # token counts, throughputs, cache hit rate: exact from usage
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 7
    assert m["cached_tokens"] == 6 and m["cache_hit_rate"] == pytest.approx(6 / 30)
    dur = m["duration_s"]
    assert dur == pytest.approx(max(e2e.values()), abs=TOL)
    assert m["request_throughput"] == pytest.approx(3 / dur)
    assert m["output_throughput"] == pytest.approx(7 / dur)
    assert m["total_throughput"] == pytest.approx(37 / dur)
    # goodput: A (ttft .4, tpot .5) and C (ttft .6, no tpot) meet ttft<=800, tpot<=700; B (ttft 1.0) does not
    assert m["good_requests"] == 2 and m["goodput"] == pytest.approx(2 / dur)
    # busy fraction from the /metrics buckets scraped before and after: 3.6 / (4.5 - 0.5)
    b = r["busy"]
    assert b["source"] == "metrics"
    assert b["busy_fraction"] == pytest.approx(3.6 / 4.0)
    assert b["split_of_wall"]["forward"] == pytest.approx(3.6 / 4.5)
    assert sum(b["split_of_wall"].values()) == pytest.approx(1.0)


def test_chat_role_chunk_is_not_the_first_token():
    """The chat role chunk (empty content) comes at once; TTFT is the first chunk with text."""
    srv = FakeServer({"hi": {"ttft": 0.6, "gaps": [0.4], "tokens": ["x", "y"], "usage": None}})
    try:
        plan = WorkloadPlan("chat", [BenchRequest("c", 2, messages=[{"role": "user", "content": "hi"}])], api="chat")
        results, start, end = asyncio.run(run_plan(plan, RunSettings(srv.url, "m")))
    finally:
        srv.close()
    (res,) = results
    assert res.success and res.text == "xy"
    assert res.ttft == pytest.approx(0.6, abs=TOL)
    assert res.itls == pytest.approx([0.4], abs=TOL)
    assert res.output_len == 2  # no usage and no tokenizer: one token per text chunk
    assert res.cached_tokens is None
    m = compute_metrics(results, end - start)
    assert m["cache_hit_rate"] is None  # not reported, not invented


def test_max_concurrency_and_errors(tmp_path):
    seen = {"n": 0}

    def default(req):
        seen["n"] += 1
        return {"ttft": 0.4, "gaps": [0.4], "tokens": ["a", "b"], "usage": _usage(10, 2, 0)}

    srv = FakeServer(default=default)
    try:
        items = [BenchRequest(f"r{i}", 2, prompt=[100 + i, 1, 2]) for i in range(6)]
        plan = WorkloadPlan("x", items)
        results, start, end = asyncio.run(run_plan(plan, RunSettings(srv.url, "m", max_concurrency=2)))
        assert srv.max_inflight == 2
        assert all(r.success for r in results)
        # 6 requests, 2 at a time, 0.8 s each: three waves
        assert end - start == pytest.approx(3 * 0.8, abs=3 * TOL)
        # a failing server: the error is a result, not a crash
        bad = WorkloadPlan("x", [BenchRequest("b", 2, prompt=[1])])
        results, start, end = asyncio.run(run_plan(bad, RunSettings(srv.url.replace(str(srv.port), "1"), "m")))
        assert not results[0].success and results[0].error
        m = compute_metrics(results, end - start)
        assert m["completed"] == 0 and m["failed"] == 1 and m["errors"]
    finally:
        srv.close()


def test_multi_turn_sends_the_previous_answer():
    def default(req):
        user = req["messages"][-1]["content"]
        return {"ttft": 0.01, "gaps": [0.01], "tokens": [f"answer to {user}", "!"], "usage": None}

    class Words:  # fixed text: "u<n>" per turn is recognisable
        def __init__(self):
            self.i = 0

        def text(self, n, rng):
            self.i += 1
            return f"text{self.i}"

    plan = serving.gen_multi_turn(Words(), num_prompts=5, turns=3, system_len=4, user_len=4, output_len=2, seed=0)
    assert [len(s.turns) for s in plan.items] == [3, 2] and plan.num_requests == 5 and plan.api == "chat"
    srv = FakeServer(default=default)
    try:
        results, _, _ = asyncio.run(run_plan(plan, RunSettings(srv.url, "m")))
    finally:
        srv.close()
    assert len(results) == 5 and all(r.success for r in results)
    by_session: dict = {}
    for b in srv.bodies:
        by_session.setdefault(b["messages"][0]["content"], []).append(b["messages"])
    assert sorted(len(v) for v in by_session.values()) == [2, 3]
    for turns in by_session.values():
        for k, msgs in enumerate(turns):
            assert msgs[0]["role"] == "system" and len(msgs) == 2 + 2 * k
            if k:  # turn k repeats turn k-1's messages, then the streamed answer, then a new user turn
                prev = turns[k - 1]
                assert msgs[: len(prev)] == prev
                assert msgs[len(prev)] == {"role": "assistant", "content": f"answer to {prev[-1]['content']}!"}
                assert msgs[-1]["role"] == "user"


# --------------------------------------------------------------------------------------------------
# load shape, SLO parsing, /metrics parsing
# --------------------------------------------------------------------------------------------------
def test_arrival_times():
    assert arrival_times(4, math.inf, 0) == [0.0] * 4
    a = arrival_times(2000, 5.0, seed=7)
    assert a == arrival_times(2000, 5.0, seed=7) and a != arrival_times(2000, 5.0, seed=8)
    gaps = np.diff([0.0] + a)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.1)  # exponential with mean 1/rate
    assert np.std(gaps) == pytest.approx(1 / 5.0, rel=0.15)  # (std = mean for an exponential)


def test_parse_slo():
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError):
        parse_slo("latency:3")


def test_busy_from_metrics_shapes():
    # the label shape (parsed from text)
    c = busy_counters_from_metrics(parse_prometheus(METRICS_BEFORE))
    assert c == {"forward": 10.0, "schedule": 1.0, "io": 0.5, "idle_no_work": 5.0, "other": 0.0, "wall": 16.5}
    # one metric per bucket
    text = ("idleless:engine_forward_seconds_total 2.0\nidleless:engine_wall_seconds_total 4.0\n"
            "idleless:engine_idle_no_work_seconds_total 1.0\nidleless:ttft_seconds_bucket{le=\"1\"} 3\n")
    assert busy_counters_from_metrics(parse_prometheus(text)) == {"forward": 2.0, "wall": 4.0, "idle_no_work": 1.0}
    # only forward seconds (today's Idleless /metrics): forward / the client's wall between scrapes
    before = {"metrics": {"forward": 1.0}, "server_info": None, "t": 100.0}
    after = {"metrics": {"forward": 1.8}, "server_info": None, "t": 101.0}
    b = busy_over_run(before, after)
    assert b["busy_fraction"] == pytest.approx(0.8) and "client wall" in b["source"]
    # /server_info buckets win over forward-only metrics
    before["server_info"] = {"forward": 1.0, "wall": 10.0, "idle_no_work": 2.0, "schedule": 0.5}
    after["server_info"] = {"forward": 1.9, "wall": 11.5, "idle_no_work": 2.5, "schedule": 0.6}
    b = busy_over_run(before, after)
    assert b["source"] == "server_info" and b["busy_fraction"] == pytest.approx(0.9)
    # nothing exposed: None with a note, not an error
    b = busy_over_run({"metrics": {}, "server_info": None, "t": 0}, {"metrics": {}, "server_info": None, "t": 1})
    assert b["busy_fraction"] is None and "not measured" in b["note"]


def test_compute_metrics_by_hand():
    """Pure computation on hand-made results (no server): TPOT, ITL pooling, goodput with e2e."""
    def res(i, ttft, gaps, out, inp=5, cached=None):
        r = RequestResult(str(i), success=True, send_time=0.0, input_len=inp, output_len=out, cached_tokens=cached)
        t = ttft
        r.chunk_times = [t]
        for g in gaps:
            t += g
            r.chunk_times.append(t)
        r.end_time = t
        return r

    rs = [res(0, 1.0, [0.5, 0.5], 5, cached=5), res(1, 2.0, [1.0], 2, cached=0)]
    m = compute_metrics(rs, 4.0, {"ttft": 1.5, "e2e": 3.0})
    assert m["tpot_ms"]["mean"] == pytest.approx((250 + 1000) / 2)  # (2-1)/4, (3-2)/1
    assert m["itl_ms"]["median"] == pytest.approx(500) and m["itl_ms"]["max"] == pytest.approx(1000)
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(0.25)
    assert m["cache_hit_rate"] == pytest.approx(0.5) and m["concurrency"] == pytest.approx((2 + 3) / 4)


# --------------------------------------------------------------------------------------------------
# generated workloads (real tokenizer: the bundled SmolLM2's)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def words(smollm2_dir):
    return serving.WordSource(serving.load_tokenizer(smollm2_dir))


def test_shared_prefix_workload(words):
    plan = serving.gen_shared_prefix(words, num_groups=3, prompts_per_group=4, system_len=40, question_len=8,
                                     output_len=5, seed=1)
    assert plan.num_requests == 12 and [r.group for r in plan.items] != sorted(r.group for r in plan.items)
    tok = words.tokenizer
    ids = {r.id: tok.encode(r.prompt, add_special_tokens=False) for r in plan.items}
    for r in plan.items:
        assert len(ids[r.id]) == r.input_len == 48 and r.max_tokens == 5
    for g in range(3):
        members = [ids[r.id] for r in plan.items if r.group == g]
        assert all(m[:40] == members[0][:40] for m in members)
        assert len({tuple(m[40:]) for m in members}) == 4
    others = [ids[r.id] for r in plan.items if r.group != 0]
    first = next(ids[r.id] for r in plan.items if r.group == 0)
    assert all(o[:40] != first[:40] for o in others)
    assert plan.info["hit_rate_upper_bound"] == pytest.approx(1 - (3 * 40 + 12 * 8) / (12 * 48))
    again = serving.gen_shared_prefix(words, 3, 4, 40, 8, 5, seed=1)
    assert [r.prompt for r in again.items] == [r.prompt for r in plan.items]


def test_random_workload(words):
    plan = serving.gen_random(words, num_prompts=20, input_len=50, output_len=10, range_ratio=0.5, seed=3)
    tok = words.tokenizer
    for r in plan.items:
        assert 25 <= r.input_len <= 50 and 5 <= r.max_tokens <= 10
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.input_len
    assert len({r.input_len for r in plan.items}) > 3


# --------------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------------
def test_plot_from_trace_and_result(tmp_path):
    pytest.importorskip("matplotlib")
    from idleless.bench.plot import client_series, plot_run, trace_series

    trace = tmp_path / "trace.jsonl"
    recs = []
    t = 0.0
    for i in range(20):  # 2 s of steps: 0.1 s each, 0.08 s of it forward; 4 running, 4 sampled
        t += 0.1
        recs.append({"t": t, "kind": "decode", "batch_size": 4, "new_tokens": 4, "decode": 4, "sampled": 4,
                     "running": 4, "waiting": 0, "schedule_s": 0.02, "forward_s": 0.08, "hit_rate": 0.5})
    recs[0].update(kind="prefill", decode=0, sampled=4, new_tokens=400, admitted_prompt_tokens=400, cached_tokens=100)
    trace.write_text("garbage partial line\n" + "".join(json.dumps(r) + "\n" for r in recs))
    ser = trace_series([json.loads(x) for x in trace.read_text().splitlines()[1:]], window=1.0)
    assert ser["gen_tps"] == pytest.approx([40.0, 40.0])
    assert ser["prefill_tps"] == pytest.approx([400.0, 0.0])
    assert ser["busy"] == pytest.approx([0.8, 0.8])
    assert ser["running"] == pytest.approx([4, 4]) and ser["hit_rate_cumulative"] == [0.5, 0.5]
    assert ser["hit_rate"] == [0.25, None]  # admitted prompts: 100 of 400 tokens cached, in window 0
    # a long step (a big prefill on a busy CPU) is spread over the windows it spans
    long = trace_series([{"t": 0.5, "kind": "decode", "batch_size": 1, "new_tokens": 1, "sampled": 1,
                          "forward_s": 0.5, "schedule_s": 0.0},
                         {"t": 2.0, "kind": "prefill", "batch_size": 1, "new_tokens": 300, "decode": 0,
                          "sampled": 1, "forward_s": 1.5, "schedule_s": 0.0}], window=1.0)
    assert long["busy"] == pytest.approx([1.0, 1.0]) and long["prefill_tps"] == pytest.approx([100.0, 200.0])
    result = {"workload": {"name": "w"}, "metrics": {"completed": 1}, "settings": {"request_rate": "inf"},
              "requests": [{"ok": True, "send_s": 0.0, "e2e_s": 2.0, "chunk_s": [0.5, 1.5], "output_len": 4,
                            "input_len": 10, "cached_tokens": 5}]}
    cl = client_series(result, window=1.0)
    assert cl["out_tps"] == pytest.approx([2.0, 2.0]) and cl["inflight"] == pytest.approx([1.0, 1.0])
    png = tmp_path / "run.png"
    plot_run(result, str(png), trace_file=str(trace))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------
# end to end against a real server
# --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_bench_serving_against_idleless_serve(tmp_path, smollm2_dir):
    from server_harness import ServerProcess

    trace = tmp_path / "trace.jsonl"
    srv = ServerProcess(["--kv-cache-memory", "64MiB", "--num-threads", "1", "--log-level", "warning",
                         "--trace-file", str(trace)])
    try:
        srv.wait_ready()
        out, png = tmp_path / "res.json", tmp_path / "run.png"
        args = ["bench", "serving", "--base-url", srv.url, "--workload", "shared-prefix", "--tokenizer", smollm2_dir,
                "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "64",
                "--gsp-question-len", "8", "--gsp-output-len", "6", "--max-concurrency", "2", "--flush-cache",
                "--slo", "ttft:100000,tpot:100000", "--output-file", str(out), "--quiet", "--trace-file", str(trace)]
        try:
            import matplotlib  # noqa: F401
            args += ["--plot", str(png)]
        except ImportError:
            png = None
        assert cli_main(args) == 0
        r = json.loads(out.read_text())
        s = srv.stats()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    m = r["metrics"]
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_input_tokens"] == 4 * 72  # usage.prompt_tokens: generated prompts are exact
    assert m["total_output_tokens"] == 4 * 6  # ignore_eos
    assert m["good_requests"] == 4
    assert 0 < m["cache_hit_rate"] < 1  # the system prompts are shared within a group
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert m[key]["mean"] > 0 and m[key]["p99"] >= m[key]["median"]
    b = r["busy"]
    assert b["busy_fraction"] is not None and 0 < b["busy_fraction"] <= 1
    if b["source"] != "metrics forward seconds / client wall":  # full buckets: the split adds up
        assert sum(b["split_of_wall"].values()) == pytest.approx(1.0, abs=1e-6)
    assert s["time"]["wall"] > 0
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert rows and sum(x["sampled"] for x in rows) >= 4 * 6  # the run's tokens are in the trace
    if png is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------------
# bench compare (tiny model: the figures are consistent, the README section is replaced in place)
# --------------------------------------------------------------------------------------------------
def test_bench_compare_tiny(tmp_path, smollm2_dir):
    import shutil

    from conftest import make_tiny_model

    from idleless.bench.compare import update_readme

    model = make_tiny_model(tmp_path, vocab_size=49152, tie=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src := os.path.join(smollm2_dir, name)) and os.path.exists(src):
            shutil.copy(src, model)
    prefix = [(7 * i + 11) % 49000 + 100 for i in range(40)]
    reqs = [{"id": f"r{i}", "prompt_token_ids": prefix + [500 + i, 600 + i], "max_tokens": 4} for i in range(4)]
    wl = tmp_path / "tiny.json"
    wl.write_text(json.dumps({"name": "tiny", "sampling": {"temperature": 0.0, "ignore_eos": True}, "requests": reqs}))
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nother engineers' text\n")
    update_readme(readme, "tiny", "old table")
    rc = cli_main(["bench", "compare", "--workload", str(wl), "--model", model, "--dtype", "float32",
                   "--kv-cache-memory", "16MiB", "--num-threads", "1", "--systems", "idleless,radix-off,hf,llamacpp",
                   "--hf-batch-size", "2", "--decode-tokens", "3", "--batch1-prompt-len", "8", "--batch1-reps", "1",
                   "--telemetry-overhead", "1", "--results-dir", str(tmp_path / "res"), "--readme", str(readme),
                   "--log-level", "warning"])
    assert rc == 0
    (out,) = list((tmp_path / "res").iterdir())
    assert out.name.endswith("-tiny.json")
    r = json.loads(out.read_text())
    s = r["systems"]
    assert set(s) == {"idleless", "radix-off", "hf"} and "llamacpp" in r["skipped"]  # not a GGUF / not installed
    for name, x in s.items():
        assert x["output_tokens"] == 16 and x["prompt_tokens"] == 4 * 42
        if name != "idleless":
            assert x["idleless_speedup"] == pytest.approx(x["wall_s"] / s["idleless"]["wall_s"])
    assert s["idleless"]["cached_prompt_tokens"] > 0 and s["radix-off"]["cached_prompt_tokens"] == 0
    ts = s["idleless"]["time_split"]
    assert sum(ts["fractions"].values()) == pytest.approx(1.0, abs=1e-6)
    t = r["telemetry_overhead"]
    assert len(t["traced_out_tok_s"]) == len(t["untraced_out_tok_s"]) == 1 and t["mark_ns"] > 0
    assert 0 < t["trace_cost_fraction"] < 1 and 0 < t["marks_cost_fraction"] < 1
    assert {"idleless", "hf"} <= set(r["batch1"])
    text = readme.read_text()
    assert "other engineers' text" in text and "old table" not in text
    assert text.count("<!-- bench compare: tiny -->") == 1 and "| Idleless |" in text
