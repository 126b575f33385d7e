"""The engine-core loop (idleless.engine.core_process.EngineCoreLoop) without a model: bad
messages, refused requests and a failing step are answered per request and never end the loop;
every control verb goes through the loop's handler table and comes back as one ControlReply."""

from __future__ import annotations

import pickle

import zmq

from idleless.engine.core_process import EngineCoreLoop
from idleless.engine.messages import (AbortRequest, AddEosIds, AddRequest, ControlCall, ControlReply, ControlVerb,
                                      ErrorOutput, FlushCache, GetStats, PinPrefix, Ping, Shutdown, UnpinPrefix)
from idleless.disagg import KVConnector
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

    def take_outputs(self):
        outs, self._outputs = self._outputs, []
        return outs


class FakeCore:
    """Accepts requests whose prompt is non-empty; each step emits one token per request and
    finishes it; ``fail_next_step`` makes the next step raise.

    Pins (EngineCore.pin_prefix's contract): a prefix of ``pin_budget`` tokens at most; a prefix
    not in ``cached`` is "prefilled" first, so ``done`` fires from the next step, not at once."""

    def __init__(self, pin_budget=8):
        self.scheduler = FakeScheduler()
        self.fail_next_step = False
        self.flushed = 0
        self.pin_budget = pin_budget
        self.pins = {}  # pin id -> tokens
        self.cached = set()  # prefixes (tuples) "in the cache"
        self.pin_waiters = []  # (pin id, ids, done) waiting for the next step
        self.kv_connector = KVConnector()  # colocated: no transfer port to wake the idle loop

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
        return bool(self.scheduler.running or self.scheduler._outputs or self.pin_waiters)

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        waiters, self.pin_waiters = self.pin_waiters, []
        for pin_id, ids, done in waiters:
            self.cached.add(ids)
            self._pin(pin_id, ids, done)
        outs, self.scheduler._outputs = self.scheduler._outputs, []
        for r in list(self.scheduler.running):
            self.scheduler.running.remove(r)
            outs.append(RequestOutput(r.rid, [7], FinishReason.LENGTH))
        return outs

    def flush_cache(self):
        self.flushed += 1
        self.pins.clear()
        return True

    def stats(self):
        return {"num_running": len(self.scheduler.running), "pinned_tokens": sum(self.pins.values())}

    def add_eos_ids(self, ids):
        self.scheduler.eos_ids |= set(ids)
        return sorted(self.scheduler.eos_ids)

    def pin_prefix(self, pin_id, prompt_ids, ttl, done):
        ids = tuple(prompt_ids)
        if ttl <= 0:
            done(None, "ttl must be > 0")
        elif ids in self.cached:
            self._pin(pin_id, ids, done)
        else:
            self.pin_waiters.append((pin_id, ids, done))

    def _pin(self, pin_id, ids, done):
        if sum(self.pins.values()) - self.pins.get(pin_id, 0) + len(ids) > self.pin_budget:
            done(None, "pinning would exceed the pinned budget")
        else:
            self.pins[pin_id] = len(ids)
            done(len(ids), None)

    def unpin_prefix(self, pin_id):
        return self.pins.pop(pin_id, None) is not None


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


def call(call_id, verb):
    return pickle.dumps(ControlCall(call_id, verb))


def run(core, frames):
    out = Outbox()
    loop = EngineCoreLoop(core, Inbox(frames, core, [call(999, Shutdown())]), out)
    loop.run()
    return out


def replies(out):
    return {m.call_id: m for m in out.messages if isinstance(m, ControlReply)}


def test_bad_messages_never_end_the_loop():
    core = FakeCore()
    frames = [b"not a pickle", pickle.dumps({"some": "dict"}), pickle.dumps(AddRequest(req("bad", prompt=()))),
              pickle.dumps(AddRequest("not a request")), pickle.dumps(AbortRequest("unknown-rid")),
              call(1, ControlVerb()), pickle.dumps(ControlCall(3, "flush")), call(2, Ping()),
              pickle.dumps(AddRequest(req("good")))]
    msgs = run(core, frames).messages
    errors = {m.rid: m for m in msgs if isinstance(m, ErrorOutput)}
    assert errors["bad"].code == "invalid_prompt" and errors["bad"].param == "prompt"
    assert errors["bad"].finish_reason == FinishReason.ABORT and errors["bad"].error
    good = [m for m in msgs if isinstance(m, RequestOutput) and m.rid == "good"]
    assert good and good[-1].new_token_ids == [7] and good[-1].finish_reason == FinishReason.LENGTH
    got = {m.call_id: m for m in msgs if isinstance(m, ControlReply)}
    assert got[1].ok is False and got[1].code == "unknown_verb" and "ControlVerb" in got[1].error
    assert got[3].ok is False and got[3].code == "unknown_verb" and "str" in got[3].error  # a string is no verb
    assert got[2].ok and got[2].result == "pong"
    assert got[999].ok  # shutdown answered
    assert core.flushed == 0


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
    inbox.core, inbox.frames, inbox.last = core, [pickle.dumps(AddRequest(req("c")))], [call(5, Shutdown())]
    loop.run()
    assert any(isinstance(m, RequestOutput) and m.rid == "c" and m.new_token_ids == [7] for m in out.messages)


def test_tensor_parallel_failure_ends_the_loop_with_exit_code_1():
    from idleless.dist.group import TensorParallelError

    class DeadRankCore(FakeCore):
        def step(self):
            raise TensorParallelError("tensor-parallel rank 1 (pid 123) exited with code -9")

    core, out = DeadRankCore(), Outbox()
    loop = EngineCoreLoop(core, Inbox([pickle.dumps(AddRequest(req("a")))]), out)
    assert loop.exit_code == 0
    loop.run()  # returns without a Shutdown: no step can run any more
    assert loop.exit_code == 1 and not loop.running
    errs = [m for m in out.messages if isinstance(m, ErrorOutput)]
    assert [m.rid for m in errs] == ["a"] and "exited with code -9" in errs[0].error


def test_outputs_are_batched_per_turn():
    core = FakeCore()
    out = run(core, [pickle.dumps(AddRequest(req(f"r{i}"))) for i in range(5)])
    first = out.batches[0]
    assert sorted(m.rid for m in first if isinstance(m, RequestOutput)) == [f"r{i}" for i in range(5)]


def test_every_control_verb_round_trips_through_the_handler_table():
    core = FakeCore(pin_budget=8)
    core.cached.add((1, 2, 3))
    out = run(core, [call(1, Ping()), call(2, GetStats()), call(3, AddEosIds((7, 2, 7))),
                     call(4, PinPrefix([1, 2, 3], 60.0, "a")), call(5, UnpinPrefix("a")), call(6, UnpinPrefix("a")),
                     call(7, FlushCache())])
    got = replies(out)
    assert {k: (r.ok, r.result) for k, r in got.items()} == {
        1: (True, "pong"), 2: (True, {"num_running": 0, "pinned_tokens": 0}), 3: (True, [2, 7]),
        4: (True, 3), 5: (True, True), 6: (True, False), 7: (True, True), 999: (True, True)}
    assert all(r.error is None and r.code is None for r in got.values())
    assert core.flushed == 1 and core.scheduler.eos_ids == {2, 7}
    # one handler per verb, and every verb the messages module defines has one
    import idleless.engine.messages as m
    verbs = {c for c in vars(m).values() if isinstance(c, type) and issubclass(c, ControlVerb) and c is not ControlVerb}
    assert set(EngineCoreLoop(core, Inbox([]), Outbox()).handlers) == verbs


def test_pin_is_answered_only_when_the_core_calls_done():
    """A prefix that must be prefilled first: the reply comes from the step that pins it, in a later
    batch than the call's own turn, and the loop kept serving meanwhile."""
    core = FakeCore(pin_budget=8)
    out = Outbox()
    inbox = Inbox([call(1, PinPrefix((4, 5, 6, 7), 60.0, "sys")), pickle.dumps(AddRequest(req("r")))])
    loop = EngineCoreLoop(core, inbox, out)
    loop._drain(0)  # the call is handled; nothing answers yet
    loop._flush()
    assert out.batches == [] and 1 in loop.open_calls
    loop.pending.extend(core.step())  # the "prefill" step: done fires, the request finishes
    loop._flush()
    (batch,) = out.batches
    pin = [m for m in batch if isinstance(m, ControlReply)]
    assert [(r.call_id, r.ok, r.result) for r in pin] == [(1, True, 4)] and not loop.open_calls
    assert any(isinstance(m, RequestOutput) and m.rid == "r" for m in batch)
    assert core.pins == {"sys": 4}


class Boom(ControlVerb):
    """A verb whose handler (installed by the test) raises."""


def test_pin_refusals_and_failures_are_replies_with_codes():
    core = FakeCore(pin_budget=5)
    core.cached |= {(1, 2, 3), (4, 5, 6)}

    def boom(verb, reply):
        raise RuntimeError("handler broke")

    out = Outbox()
    loop = EngineCoreLoop(core, Inbox([call(1, PinPrefix((1, 2, 3), 60.0, "a")),
                                       call(2, PinPrefix((4, 5, 6), 60.0, "b")),  # 3 + 3 > 5
                                       call(3, PinPrefix((1, 2, 3), 0.0, "c")),
                                       call(4, Boom())], core, [call(999, Shutdown())]), out)
    loop.handlers[Boom] = boom
    loop.run()
    got = replies(out)
    assert got[1].ok and got[1].result == 3
    assert (got[2].ok, got[2].code) == (False, "refused") and "budget" in got[2].error
    assert (got[3].ok, got[3].code) == (False, "refused") and "ttl" in got[3].error
    assert (got[4].ok, got[4].code) == (False, "internal_error") and "handler broke" in got[4].error
    assert core.pins == {"a": 3}


def test_shutdown_answers_calls_still_waiting():
    core = FakeCore()
    core.pin_prefix = lambda pin_id, ids, ttl, done: None  # a pin whose done never fires
    out = run(core, [call(1, PinPrefix((9,), 60.0, "x"))])
    got = replies(out)
    assert got[999].ok and (got[1].ok, got[1].code) == (False, "internal_error") and "shutting down" in got[1].error


def test_messages_are_frozen_and_pickle():
    import dataclasses

    import pytest

    v = PinPrefix([1, 2], 10.0, "p")
    assert v.input_ids == (1, 2) and pickle.loads(pickle.dumps(ControlCall(3, v))) == ControlCall(3, v)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.ttl_s = 5.0
    assert AddEosIds([3]).ids == (3,)
