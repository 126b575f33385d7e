"""``priority`` (vLLM's and SGLang's request field) reaches the engine: the request models take it, the
frontend's submission puts it on every engine request it sends, and the engine admits higher first."""

from __future__ import annotations

import asyncio

import pytest

from idleless.engine.messages import AddRequest, CoreReady
from idleless.server.engine_client import EngineClient
from idleless.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, parse_request
from idleless.config import EngineConfig
from idleless.engine.request import SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_request_models_take_priority():
    chat = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "priority": 7})
    comp = parse_request(CompletionRequest, {"prompt": "x", "priority": -2})
    gen = parse_request(GenerateRequest, {"text": "x", "priority": 3})
    assert (chat.priority, comp.priority, gen.priority) == (7, -2, 3)
    assert parse_request(CompletionRequest, {"prompt": "x"}).priority == 0


def test_client_sends_priority_on_every_engine_request(smollm2_dir):
    from idleless.text.tokenizer import Tokenizer

    async def run():
        client = EngineClient(EngineConfig(model=smollm2_dir))
        try:
            client.tokenizer = Tokenizer.load(smollm2_dir)
            client.info = CoreReady(pid=0, model_dir=smollm2_dir, dtype="float32", vocab_size=49152,
                                    context_length=2048, kv_slots=4096, page_size=1, max_running_requests=4,
                                    eos_token_ids=[2], load_seconds=0.0)
            sent = []
            client._send = sent.append
            client.submit([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_new_tokens=3), priority=5)
            assert [type(m) for m in sent] == [AddRequest] * 4
            assert [m.request.priority for m in sent] == [5] * 4
        finally:
            client._push.close(linger=0)
            client._pull.close(linger=0)
            client._ctx.term()

    asyncio.run(run())


def test_engine_admits_higher_priority_first(tiny_model_dir):
    """One running slot: of two requests queued together, the later one with the higher priority runs
    (and so finishes) first."""
    from idleless.engine.core import EngineCore
    from idleless.engine.request import Request

    core = EngineCore(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_memory="8MiB",
                                   max_running_requests=1, num_threads=1))
    p = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    core.add_request(Request("low", [5, 6, 7], p, priority=0, arrival_time=1.0))
    core.add_request(Request("high", [8, 9, 10], p, priority=9, arrival_time=2.0))
    finished = []
    while core.has_work():
        finished += [o.rid for o in core.step() if o.finished]
    assert finished == ["high", "low"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": -1}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "priority": 2}),
])
def test_server_accepts_priority(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
