"""``idleless bench stream-cost``: what one streamed token costs between the engine core and the client.

    idleless bench stream-cost [--streams 64] [--max-tokens 256] [--step-ms 20] [--repeats 3] [--route completions|chat]
                               [--http auto|h11|httptools] [--loop asyncio|uvloop] [--output result.json]

Isolates the frontend path of a streamed token (issue 15, item 4): a replay engine core
(``ReplayCore`` under the real ``EngineCoreLoop``, so the real serialisation and ZMQ send) answers
every request by echoing its prompt ids back, one token per request per step, a step every
``--step-ms`` ms, with no model and no forward. The frontend is the real one, in this process:
``EngineClient`` (ZMQ receive, unpickle, routing), ``RequestState`` (incremental detokenization,
stop strings), the route's stream format and SSE, uvicorn writing HTTP. The HTTP client runs in its
own process (httpx, ``--streams`` concurrent streaming requests), so its CPU is not counted.

Prompts are English text (the docstrings of a fixed list of standard-library modules) tokenized
with the served model's tokenizer (the bundled SmolLM2 by default), so the detokenizer sees real
text; stream ``i`` starts ``7 * i`` tokens into it. Every request gets ``--max-tokens`` tokens.

Reported per streamed token, in microseconds:

* ``core: serialise + send``: ``EngineCoreLoop._flush`` (pickling one step's outputs, ZMQ send), CPU
  time inside it; ``core: process CPU`` the whole replay core process (``time.process_time``: its
  loop, message handling and the replay itself, which does next to nothing).
* frontend stages, CPU time of the event-loop thread inside each synchronous call
  (``time.thread_time``, exclusive of the stages nested in it): ``receive + unpickle``
  (``EngineClient._dispatch`` less routing), ``route`` (``EngineClient._route`` less the request
  state: the TTFT/ITL metrics, queue put), ``detokenize``
  (``RequestState.process``: incremental detokenizer, stop strings, the delta), ``SSE format``
  (the route's ``StreamFormat.delta``: chunk model, JSON, ``data:`` line) and ``HTTP write``
  (the ASGI ``send`` of each body chunk: uvicorn's framing and the socket write);
* ``frontend: process CPU``: this whole process's CPU (``time.process_time``, all threads, the
  ZMQ I/O thread included) over the streaming window, and ``other`` what the stages above do not
  cover (the asyncio loop and its wake-ups, the SSE generator, ZMQ's receive, and each request's
  own work — connection, parsing, routing, validation, submission — spread over its tokens: run
  with ``--max-tokens 1`` to see that part alone);
  ``timer overhead`` is the stage clocks' own cost (two readings per timed call), counted apart.

CPU times do not count time the process waits for a core, but a loaded machine still slows them
(caches, frequency): repeat the run (``--repeats``) and read the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import logging
import multiprocessing
import os
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PASSAGE_MODULES = ("json", "csv", "argparse", "statistics", "textwrap", "difflib", "heapq", "tempfile")
STREAM_SHIFT = 7  # stream i's prompt starts this many tokens further into the passage


# --------------------------------------------------------------------------------------------------
# the replay engine core (runs in its own process)
# --------------------------------------------------------------------------------------------------
class _Clock:
    def reset(self) -> None:
        pass

    def mark(self, bucket: str) -> None:
        pass


@dataclass
class _ReplayScheduler:
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    clock: _Clock = field(default_factory=_Clock)
    tracer: None = None

    def take_outputs(self) -> list:
        return []


class _NoConnector:
    wake_sockets: tuple = ()


@dataclass
class _Replayed:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    sent: int = 0
    aborted: bool = False


class ReplayCore:
    """A stand-in ``EngineCore`` with no model: request ``r``'s k-th output token is
    ``r.prompt_ids[k % len(prompt_ids)]``, one per running request per ``step()``; a request ends
    (finish_reason ``length``) after ``max_new_tokens`` (None: 256). ``step()`` first waits until
    ``step_s`` seconds after the previous step began. Supports the verbs the frontend sends at
    start-up and ``GetStats``: ``stats()`` reports the loop's send counters (``TimedLoop``) and this
    process's CPU seconds. Raises nothing for unknown rids (as the engine)."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.scheduler = _ReplayScheduler()
        self.kv_connector = _NoConnector()
        self.requests: dict[str, _Replayed] = {}
        self.eos_ids: set[int] = set()
        self.flush_ns = 0
        self.flush_bytes = 0
        self.flush_messages = 0
        self._next_step = 0.0

    def add_request(self, req) -> None:
        n = req.params.max_new_tokens
        self.requests[req.rid] = _Replayed(req.rid, list(req.prompt_ids), 256 if n is None else int(n))

    def abort(self, rid: str) -> None:
        r = self.requests.get(rid)
        if r is not None:
            r.aborted = True

    def has_work(self) -> bool:
        return bool(self.requests)

    def add_eos_ids(self, ids) -> list[int]:
        self.eos_ids.update(int(i) for i in ids)
        return sorted(self.eos_ids)

    def flush_cache(self) -> bool:
        return not self.requests

    def stats(self) -> dict:
        return {"flush_ns": self.flush_ns, "flush_bytes": self.flush_bytes, "flush_messages": self.flush_messages,
                "cpu_s": time.process_time()}

    def step(self) -> list:
        from idleless.engine.request import FinishReason, RequestOutput

        now = time.monotonic()
        if now < self._next_step:
            time.sleep(self._next_step - now)
        self._next_step = max(now, self._next_step) + self.step_s
        outs = []
        for rid, r in list(self.requests.items()):
            if r.aborted:
                outs.append(RequestOutput(rid, [], FinishReason.ABORT, prompt_tokens=len(r.prompt_ids),
                                          completion_tokens=r.sent))
                del self.requests[rid]
                continue
            tok = r.prompt_ids[r.sent % len(r.prompt_ids)]
            r.sent += 1
            done = r.sent >= r.max_new_tokens
            outs.append(RequestOutput(rid, [tok], FinishReason.LENGTH if done else None,
                                      prompt_tokens=len(r.prompt_ids), cached_tokens=0, completion_tokens=r.sent))
            if done:
                del self.requests[rid]
        return outs


def _timed_loop_class():
    from idleless.engine.core_process import EngineCoreLoop

    class TimedLoop(EngineCoreLoop):
        """The real loop; ``_flush`` (serialise + send) timed into the core's counters."""

        def _flush(self) -> None:
            if not self.pending:
                return
            core = self.core
            sock = self.push
            sent = []

            class _Counting:
                def send(self, data, *args, **kwargs):
                    sent.append(len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0)
                    return sock.send(data, *args, **kwargs)

                def __getattr__(self, name):
                    return getattr(sock, name)

            self.push = _Counting()
            t0 = time.thread_time_ns()
            try:
                super()._flush()
            finally:
                core.flush_ns += time.thread_time_ns() - t0
                self.push = sock
            core.flush_bytes += sum(sent)
            core.flush_messages += 1

    return TimedLoop


def replay_core_main(config, in_addr: str, out_addr: str, step_s: float = 0.02) -> None:
    """Entry point of the replay core process (``EngineClient.start(core_main=...)``): the
    sockets as ``run_engine_core`` connects them, ``CoreReady`` with the model's vocabulary, then
    the real ``EngineCoreLoop`` (timed ``_flush``) over a ``ReplayCore``."""
    from idleless.engine.core_process import core_sockets, run_and_close
    from idleless.engine.messages import CoreReady
    from idleless.model.loader import load_model_config

    ctx, pull, push = core_sockets(in_addr, out_addr)
    mc = load_model_config(config.model)
    push.send(pickle.dumps([CoreReady(pid=os.getpid(), model_dir=str(config.model), dtype="replay",
                                      vocab_size=int(mc.vocab_size), context_length=1 << 20, kv_slots=1 << 20,
                                      page_size=1, max_running_requests=int(config.max_running_requests),
                                      eos_token_ids=[], load_seconds=0.0)]))
    run_and_close(_timed_loop_class()(ReplayCore(step_s), pull, push, idle_poll_ms=50), ctx)


# --------------------------------------------------------------------------------------------------
# the HTTP client (runs in its own process)
# --------------------------------------------------------------------------------------------------
def _client_main(url: str, route: str, prompts: list[list[int]], max_tokens: int, result) -> None:
    """Stream every prompt at once over HTTP; put {"chunks", "chars", "errors", "wall_s"} on ``result``."""
    import httpx

    async def one(http, ids: list[int]) -> tuple[int, int, int]:
        if route == "chat":
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": ids}], "max_tokens": max_tokens, "stream": True}
        else:
            path = "/v1/completions"
            body = {"prompt": ids, "max_tokens": max_tokens, "stream": True}
        chunks = chars = errors = 0
        async with http.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return 0, 0, 1
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    errors += 1
                    continue
                for c in obj.get("choices", ()):
                    text = c.get("text") if route != "chat" else (c.get("delta") or {}).get("content")
                    chars += len(text or "")
                chunks += 1
        return chunks, chars, errors

    async def run() -> dict:
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(http, p) for p in prompts))
            wall = time.perf_counter() - t0
        return {"chunks": sum(r[0] for r in res), "chars": sum(r[1] for r in res),
                "errors": sum(r[2] for r in res), "wall_s": wall}

    result.put(asyncio.run(run()))


# --------------------------------------------------------------------------------------------------
# frontend stage timers
# --------------------------------------------------------------------------------------------------
class StageTimers:
    """CPU nanoseconds of this thread (``time.thread_time_ns``) inside wrapped synchronous calls, per
    stage (``wrap``), and inside the ASGI ``send`` of response body chunks (``asgi``, which runs no
    other task unless uvicorn pauses for flow control). ``read_ns``: what one reading of the clock
    costs (a system call on some machines), measured at construction."""

    def __init__(self):
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        n, t0 = 20000, time.perf_counter_ns()
        for _ in range(n):
            time.thread_time_ns()
        self.read_ns = (time.perf_counter_ns() - t0) / n

    def wrap(self, owner: Any, name: str, stage: str) -> None:
        fn = getattr(owner, name)
        self.ns.setdefault(stage, 0)
        self.calls.setdefault(stage, 0)
        pc = time.thread_time_ns
        ns, calls = self.ns, self.calls

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[stage] += pc() - t0
                calls[stage] += 1

        self._undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, timed)

    def asgi(self, app, stage: str = "write"):
        self.ns.setdefault(stage, 0)
        self.calls.setdefault(stage, 0)
        pc = time.thread_time_ns
        ns, calls = self.ns, self.calls

        async def timed_app(scope, receive, send):
            async def timed_send(message):
                if message.get("type") != "http.response.body":
                    return await send(message)
                t0 = pc()
                try:
                    return await send(message)
                finally:
                    ns[stage] += pc() - t0
                    calls[stage] += 1

            return await app(scope, receive, timed_send)

        return timed_app

    def reset(self) -> None:
        for k in self.ns:
            self.ns[k] = 0
            self.calls[k] = 0

    def restore(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def passage_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of English text: the docstrings of ``PASSAGE_MODULES``, repeated as needed."""
    import importlib

    text = "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in PASSAGE_MODULES)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
async def _round(url: str, route: str, prompts: list[list[int]], max_tokens: int, client, timers: StageTimers) -> dict:
    from idleless.engine.messages import GetStats

    before = await client.call(GetStats())
    timers.reset()
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=_client_main, args=(url, route, prompts, max_tokens, result), daemon=True)
    cpu0 = time.process_time()
    proc.start()
    res = await asyncio.to_thread(result.get)
    cpu = time.process_time() - cpu0
    await asyncio.to_thread(proc.join, 30)
    after = await client.call(GetStats())
    tokens = len(prompts) * max_tokens
    ns = dict(timers.ns)
    us = 1e-3 / tokens  # ns total -> microseconds per token
    stages = {
        "core: serialise + send": (after["flush_ns"] - before["flush_ns"]) * us,
        "core: process CPU": (after["cpu_s"] - before["cpu_s"]) * 1e6 / tokens,
        "receive + unpickle": (ns["dispatch"] - ns["route"]) * us,
        "route": (ns["route"] - ns["detokenize"]) * us,
        "detokenize": ns["detokenize"] * us,
        "SSE format": ns["format"] * us,
        "HTTP write": ns["write"] * us,
    }
    # each timed call reads the clock twice; the readings of the calls nested in a stage land in it
    stages["timer overhead"] = 2 * timers.read_ns * sum(timers.calls.values()) * us
    covered = sum(v for k, v in stages.items() if not k.startswith("core"))
    stages["frontend: process CPU"] = cpu * 1e6 / tokens
    stages["other"] = stages["frontend: process CPU"] - covered
    return {"tokens": tokens, "chunks": res["chunks"], "chars": res["chars"], "errors": res["errors"],
            "wall_s": res["wall_s"], "core_messages": after["flush_messages"] - before["flush_messages"],
            "core_bytes": after["flush_bytes"] - before["flush_bytes"], "us_per_token": stages}


async def _run(args: argparse.Namespace) -> dict:
    import uvicorn

    from idleless.config import EngineConfig
    from idleless.model.loader import prepare_model_dir
    from idleless.server import routes_openai
    from idleless.server.app import ServerSettings, build_app
    from idleless.server.engine_client import EngineClient
    from idleless.server.launch import _bind
    from idleless.telemetry.metrics import ServerMetrics
    from idleless.text.output import RequestState

    model_dir = await asyncio.to_thread(prepare_model_dir, args.model)
    config = EngineConfig(model=model_dir, max_running_requests=max(args.streams, 1),
                          max_queued_requests=max(args.streams, 1))
    metrics = ServerMetrics("replay")  # as idleless serve: the client observes TTFT/ITL per output
    client = await EngineClient.start(config, metrics,
                                      core_main=functools.partial(replay_core_main, step_s=args.step_ms / 1e3))
    sock = _bind("127.0.0.1", 0)
    server = serving = None
    timers = StageTimers()
    try:
        timers.wrap(EngineClient, "_dispatch", "dispatch")
        timers.wrap(EngineClient, "_route", "route")
        timers.wrap(RequestState, "process", "detokenize")
        timers.wrap(routes_openai.CompletionStream, "delta", "format")
        timers.wrap(routes_openai.ChatStream, "delta", "format")
        app = timers.asgi(build_app(client, ServerSettings(model_names=["replay"], model_path=model_dir), metrics))
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                               log_level="warning", http=args.http))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.02)
        port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        ids = passage_ids(client.tokenizer, args.prompt_tokens + STREAM_SHIFT * args.streams)
        prompts = [ids[STREAM_SHIFT * i:STREAM_SHIFT * i + args.prompt_tokens] for i in range(args.streams)]
        if args.route == "chat":
            texts = [client.tokenizer.decode(p) for p in prompts]
            prompts = texts  # the chat route renders them with the template
        await _round(url, args.route, prompts[:8], 16, client, timers)  # warm-up: imports, first calls
        rounds = []
        for i in range(args.repeats):
            r = await _round(url, args.route, prompts, args.max_tokens, client, timers)
            rounds.append(r)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["us_per_token"].items())
                  + f" (us/token; {r['chunks']} chunks, {r['errors']} errors, {r['wall_s']:.1f} s)", flush=True)
        return {"streams": args.streams, "max_tokens": args.max_tokens, "step_ms": args.step_ms, "route": args.route,
                "http": server.config.http_protocol_class.__name__, "loop": args.loop,
                "prompt_tokens": args.prompt_tokens, "cpu": _cpu_name(), "rounds": rounds,
                "median_us_per_token": {k: statistics.median(r["us_per_token"][k] for r in rounds)
                                        for k in rounds[0]["us_per_token"]}}
    finally:
        timers.restore()
        if server is not None:
            server.should_exit = True
            await serving
        sock.close()
        await client.shutdown()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"unknown ({os.cpu_count()} CPUs)"


def add_args(p: argparse.ArgumentParser) -> None:
    """The ``idleless bench stream-cost`` flags."""
    p.add_argument("--model", default=None,
                   help="model directory or GGUF whose tokenizer is used (default: the bundled SmolLM2)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streaming requests")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens streamed per request")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (the replayed text)")
    p.add_argument("--step-ms", type=float, default=20.0, help="the replay core's step period (0: as fast as it can)")
    p.add_argument("--route", choices=("completions", "chat"), default="completions")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (medians reported)")
    p.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto",
                   help="uvicorn's HTTP implementation (auto, as idleless serve: httptools when installed, else h11)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="the frontend's event loop (idleless serve runs asyncio's)")
    p.add_argument("--output", default=None, help="write the result JSON here")


def main(args: argparse.Namespace) -> int:
    """Run the rounds, print the per-token table (medians), write ``--output``; 1 if a stream failed."""
    logging.basicConfig(level=logging.WARNING)
    if args.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            res = runner.run(_run(args))
    else:
        res = asyncio.run(_run(args))
    med = res["median_us_per_token"]
    print(f"\n{res['streams']} streams x {res['max_tokens']} tokens, step {res['step_ms']} ms, route {res['route']}, "
          f"http {res['http']}, loop {res['loop']}, "
          f"{res['cpu']}; medians of {len(res['rounds'])} rounds")
    print("| stage | us per streamed token |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} |")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    bad = any(r["errors"] or r["chunks"] == 0 for r in res["rounds"])
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    sys.exit(main(ap.parse_args()))
