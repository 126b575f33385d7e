"""``idleless serve --dp 2``: two real engine replicas (a tiny random model with SmolLM2's tokenizer,
so its chat template and vocabulary are real) behind the exact-policy router, in one subprocess.
The one test with real engines: a conversation's second turn goes to the replica that served the
first (the router's index, fed by that replica's KV events, holds its prompt) and that replica reports
the shared prefix as cached; streaming passes through; a removed replica stops getting traffic."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from conftest import make_tiny_model
from server_harness import ServerProcess

pytestmark = pytest.mark.timeout(600)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@pytest.fixture(scope="module")
def tiny_chat_model(smollm2_dir, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152, bos_token_id=1, eos_token_id=2,
                        pad_token_id=2)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2_dir, f)):
            shutil.copy(os.path.join(smollm2_dir, f), d)
    return d


def test_dp2_routes_a_conversation_back_to_its_cache(tiny_chat_model):
    srv = ServerProcess(["--dp", "2", "--model", tiny_chat_model, "--dtype", "float32", "--kv-cache-memory", "32MiB",
                         "--log-level", "warning", "--router-policy", "exact"], api_key="sk-dp")
    try:
        srv.wait_ready(timeout=400)
        h = srv.headers
        with httpx.Client(base_url=srv.url, headers=h, timeout=120) as c:
            workers = c.get("/workers").json()["workers"]
            assert len(workers) == 2 and all(w["healthy"] for w in workers)
            system = {"role": "system", "content": "You are a pirate who answers every question in rhyme. " * 8}
            turn1 = [system, {"role": "user", "content": "Where is the treasure?"}]
            r = c.post("/v1/chat/completions", json={"messages": turn1, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            first = {w["url"]: w["routed"] for w in c.get("/workers").json()["workers"]}
            served = next(u for u, n in first.items() if n == 1)

            def synced_tokens():
                w = next(w for w in c.get("/workers").json()["workers"] if w["url"] == served)
                return w["kv_events"]["synced"], w["kv_events"]["index_tokens"]

            import time
            deadline = time.monotonic() + 60
            while synced_tokens()[1] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert synced_tokens()[0] and synced_tokens()[1] > 0  # the replica's KV events reached the index
            time.sleep(2.5)  # past the router's just-routed window: the choice comes from the index alone
            turn2 = turn1 + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "And the map?"}]
            with c.stream("POST", "/v1/chat/completions",
                          json={"messages": turn2, "max_tokens": 4, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}) as s:
                assert s.status_code == 200
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            usage = json.loads(events[-2][6:])["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] > 100  # the system prompt, on that replica
            after = {w["url"]: w for w in c.get("/workers").json()["workers"]}
            assert after[served]["routed"] == 2
            m = c.get("/metrics").text
            assert f'idleless_router_predicted_hit_tokens_total{{worker="{served}"}}' in m
            other = next(u for u in after if u != served)
            assert c.post("/remove_worker", params={"url": served}).status_code == 200
            r = c.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 2})
            assert r.status_code == 200
            assert {w["url"]: w["routed"] for w in c.get("/workers").json()["workers"]} == {other: 1}
    finally:
        code = srv.stop()
        log = srv.log()
    assert code == 0, log[-3000:]
