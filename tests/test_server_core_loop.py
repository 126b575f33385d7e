"""The engine-core loop (idleless.engine.core_process.EngineCoreLoop) without a model: bad
messages, refused requests and a failing step are answered per request and never end the loop."""

from __future__ import annotations

import pickle

import zmq

from idleless.engine.core_process import (AbortRequest, AddRequest, ControlReply, ControlRequest, EngineCoreLoop,
                                          ErrorOutput)
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput, SamplingParams


class FakeClock:
    def reset(self):
        pass

    def mark(self, bucket):
        pass


class FakeScheduler:
    def __init__(self):
        self.waiting, self.running, self._outputs, self.eos_ids = [], [], [], set()
        self.clock, self.tracer = FakeClock(), None  # what the loop's wall-time accounting touches


class FakeCore:
    """Accepts requests whose prompt is non-empty; each step emits one token per request and
    finishes it; ``fail_next_step`` makes the next step raise."""

    def __init__(self):
        self.scheduler = FakeScheduler()
        self.fail_next_step = False
        self.flushed = 0

    def add_request(self, req):
        if not req.prompt_ids:
            raise RequestError("the prompt is empty", param="prompt", code="invalid_prompt")
        self.scheduler.running.append(req)

    def abort(self, rid):
        for r in self.scheduler.running:
            if r.rid == rid:
                self.scheduler.running.remove(r)
                self.scheduler._outputs.append(RequestOutput(rid, [], FinishReason.ABORT))
                return True
        return False

    def has_work(self):
        return bool(self.scheduler.running or self.scheduler._outputs)

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs, self.scheduler._outputs = self.scheduler._outputs, []
        for r in list(self.scheduler.running):
            self.scheduler.running.remove(r)
            outs.append(RequestOutput(r.rid, [7], FinishReason.LENGTH))
        return outs

    def control(self, kind, payload=None):
        if kind == "flush_cache":
            self.flushed += 1
            return True
        if kind == "stats":
            return {"num_running": len(self.scheduler.running)}
        raise ValueError(f"unknown control call {kind!r}")


class Inbox:
    """Stands in for the PULL socket: poll/recv over a list of frames; ``last`` frames (the
    shutdown) arrive only once the core is idle, as the frontend sends shutdown after draining."""

    def __init__(self, frames, core=None, last=()):
        self.frames = list(frames)
        self.core = core
        self.last = list(last)

    def _ready(self):
        if not self.frames and self.last and (self.core is None or not self.core.has_work()):
            self.frames, self.last = self.last, []
        return bool(self.frames)

    def poll(self, timeout=0):
        return self._ready()

    def recv(self, flags=0):
        if not self._ready():
            raise zmq.Again()
        return self.frames.pop(0)


class Outbox:
    def __init__(self):
        self.batches = []

    def send(self, data):
        self.batches.append(pickle.loads(data))

    @property
    def messages(self):
        return [m for b in self.batches for m in b]


def req(rid, prompt=(1, 2, 3)):
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=1))


def run(core, frames):
    out = Outbox()
    loop = EngineCoreLoop(core, Inbox(frames, core, [pickle.dumps(ControlRequest(999, "shutdown"))]), out)
    loop.run()
    return out


def test_bad_messages_never_end_the_loop():
    core = FakeCore()
    frames = [b"not a pickle", pickle.dumps({"some": "dict"}), pickle.dumps(AddRequest(req("bad", prompt=()))),
              pickle.dumps(AddRequest("not a request")), pickle.dumps(AbortRequest("unknown-rid")),
              pickle.dumps(ControlRequest(1, "no-such-call")), pickle.dumps(ControlRequest(2, "ping")),
              pickle.dumps(AddRequest(req("good")))]
    msgs = run(core, frames).messages
    errors = {m.rid: m for m in msgs if isinstance(m, ErrorOutput)}
    assert errors["bad"].code == "invalid_prompt" and errors["bad"].param == "prompt"
    assert errors["bad"].finish_reason == FinishReason.ABORT and errors["bad"].error
    good = [m for m in msgs if isinstance(m, RequestOutput) and m.rid == "good"]
    assert good and good[-1].new_token_ids == [7] and good[-1].finish_reason == FinishReason.LENGTH
    replies = {m.call_id: m for m in msgs if isinstance(m, ControlReply)}
    assert replies[1].ok is False and "no-such-call" in replies[1].error
    assert replies[2].ok and replies[2].result == "pong"
    assert replies[999].ok  # shutdown answered


def test_failing_step_fails_its_requests_and_the_loop_goes_on():
    core = FakeCore()
    core.fail_next_step = True
    out = Outbox()
    inbox = Inbox([pickle.dumps(AddRequest(req("a"))), pickle.dumps(AddRequest(req("b")))])
    loop = EngineCoreLoop(core, inbox, out)
    # one turn by hand: drain, step (fails), flush
    loop._drain(0)
    try:
        loop.pending.extend(core.step())
    except RuntimeError as e:
        loop._fail_all(f"engine step failed: {e}")
    loop._flush()
    errs = [m for m in out.messages if isinstance(m, ErrorOutput)]
    assert sorted(m.rid for m in errs) == ["a", "b"] and all(m.code == "internal_error" for m in errs)
    assert core.flushed == 1 and not core.has_work()
    # the loop still serves
    inbox.core, inbox.frames, inbox.last = core, [pickle.dumps(AddRequest(req("c")))], [
        pickle.dumps(ControlRequest(5, "shutdown"))]
    loop.run()
    assert any(isinstance(m, RequestOutput) and m.rid == "c" and m.new_token_ids == [7] for m in out.messages)


def test_outputs_are_batched_per_turn():
    core = FakeCore()
    out = run(core, [pickle.dumps(AddRequest(req(f"r{i}"))) for i in range(5)])
    first = out.batches[0]
    assert sorted(m.rid for m in first if isinstance(m, RequestOutput)) == [f"r{i}" for i in range(5)]
