"""OpenAI-compatibility findings of a new-user pass (each failed before its fix)."""

from __future__ import annotations

import httpx
import pytest

from server_harness import MAIN_API_KEY, MAIN_ARGS, shared_server


@pytest.fixture(scope="module")
def srv(smollm2_dir, pytestconfig):
    return shared_server(pytestconfig, MAIN_ARGS, api_key=MAIN_API_KEY)


def _post(srv, path, body, headers=None):
    return httpx.post(srv.url + path, json=body, headers=headers if headers is not None else srv.headers, timeout=300)


def _assert_error_shape(r, status=400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}


def test_bearer_scheme_is_case_insensitive(srv):
    """RFC 7235 s2.1: the auth scheme is case-insensitive; `Authorization: bearer <key>` gets 401."""
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1},
              headers={"Authorization": f"bearer {srv.api_key}"})
    assert r.status_code == 200, r.text


def test_stream_options_without_stream_is_rejected(srv):
    """OpenAI: 400 "The 'stream_options' parameter is only allowed when 'stream' is enabled."
    Idleless silently ignores it (200)."""
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}})
    _assert_error_shape(r)
    assert r.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "ab\\ud800"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
    ("/generate", '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/v1/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogate_is_a_400(srv, path, body, param):
    """JSON may escape a lone UTF-16 surrogate ("\\udfff"), which has no UTF-8 form: the tokenizer
    raised TypeError and the server answered 500 (and dropped the keep-alive connection)."""
    with httpx.Client(base_url=srv.url, headers={**srv.headers, "Content-Type": "application/json"}, timeout=60) as c:
        r = c.post(path, content=body)
        _assert_error_shape(r)
        assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]
        if param == "messages":  # names the message, not a position in the rendered template
            assert r.json()["error"]["message"].startswith("messages[0].content")
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})  # same connection, still served
        assert ok.status_code == 200, ok.text
