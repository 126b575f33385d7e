"""No silent drops (issue 12, section 3): every known field the server does not implement is a 400 in
the OpenAI error shape naming it, unless its value asks for nothing; known bookkeeping fields are
ignored; any other top-level name is refused as OpenAI refuses it ("Unrecognized request argument")."""

from __future__ import annotations

import pytest

from idleless.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                      parse_request)

pytestmark = pytest.mark.timeout(300)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMP = {"prompt": "hi", "max_tokens": 1}
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}

# a value that asks for something, per known-unsupported field
ASKING = {
    "guided_whitespace_pattern": " ", "structural_tag": "{}", "use_beam_search": True, "length_penalty": 0.5,
    "bad_words": ["x"], "allowed_token_ids": [1, 2], "truncate_prompt_tokens": 5, "return_tokens_as_token_ids": True,
    "spaces_between_special_tokens": False, "cache_salt": "s",
    "vllm_xargs": {}, "logits_processors": ["p"], "return_hidden_states": True, "lora_path": "l",
    "mm_processor_kwargs": {}, "no_stop_trim": True, "custom_logit_processor": "c",
}
CHAT_ASKING = {**ASKING, "functions": [{"name": "f"}], "function_call": {"name": "f"}, "modalities": ["text", "audio"],
               "audio": {"voice": "x"}, "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
               "chat_template": "{{ x }}", "echo": True, "add_special_tokens": True}
COMP_ASKING = {**ASKING, "add_special_tokens": False}
GEN_ASKING = {"image_data": "x", "audio_data": "x", "video_data": "x", "input_embeds": [[0.0]], "lora_path": "l",
              "lora_id": "l", "custom_logit_processor": "c", "session_params": {}, "token_ids_logprob": [1],
              "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1, "data_parallel_rank": 0,
              "modalities": ["image"], "return_hidden_states": True}
GEN_SAMPLING_ASKING = {"structural_tag": "{}",
                       "custom_params": {"a": 1}, "stop_regex": "a", "no_stop_trim": True,
                       "spaces_between_special_tokens": False, "sampling_seed": 3}

# values that ask for nothing: accepted
HARMLESS = [("guided_json", None), ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"),
            ("tool_choice", "auto"), ("priority", 0), ("length_penalty", 1.0), ("use_beam_search", False),
            ("spaces_between_special_tokens", True), ("modalities", ["text"]), ("user", "u-1"),
            ("metadata", {"k": "v"}), ("store", False), ("service_tier", "auto"), ("parallel_tool_calls", True)]


def _refused(model, body, param: str, code: str) -> None:
    with pytest.raises(APIError) as e:
        r = parse_request(model, body)
        if model is GenerateRequest:
            r.params()
        else:
            r.sampling_params()
    assert e.value.status == 400 and e.value.param == param and e.value.code == code, e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("name", sorted(CHAT_ASKING))
def test_chat_known_unsupported(name):
    _refused(ChatCompletionRequest, {**CHAT, name: CHAT_ASKING[name]}, name, "unsupported_parameter")


@pytest.mark.parametrize("name", sorted(COMP_ASKING))
def test_completions_known_unsupported(name):
    _refused(CompletionRequest, {**COMP, name: COMP_ASKING[name]}, name, "unsupported_parameter")


@pytest.mark.parametrize("name", sorted(GEN_ASKING))
def test_generate_known_unsupported(name):
    _refused(GenerateRequest, {**GEN, name: GEN_ASKING[name]}, name, "unsupported_parameter")


@pytest.mark.parametrize("name", sorted(GEN_SAMPLING_ASKING))
def test_generate_sampling_params_known_unsupported(name):
    body = {**GEN, "sampling_params": {"max_new_tokens": 1, name: GEN_SAMPLING_ASKING[name]}}
    _refused(GenerateRequest, body, f"sampling_params.{name}", "unsupported_parameter")


@pytest.mark.parametrize("model, body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMP),
                                         (GenerateRequest, GEN)])
def test_unknown_names_are_refused(model, body):
    _refused(model, {**body, "mirostat_tau": 5.0}, "mirostat_tau", "unknown_parameter")


def test_unknown_sampling_params_key_is_named():
    _refused(GenerateRequest, {**GEN, "sampling_params": {"bogus": 1}}, "sampling_params.bogus", "unknown_parameter")


@pytest.mark.parametrize("name, value", HARMLESS)
def test_harmless_values_are_accepted(name, value):
    parse_request(ChatCompletionRequest, {**CHAT, name: value}).sampling_params()


# ---------------------------------------------------------------- the same through a real server


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {**CHAT, "nonsense_field": 1}, "nonsense_field"),
    ("/v1/completions", {**COMP, "structural_tag": "{}"}, "structural_tag"),
    ("/generate", {**GEN, "sampling_params": {"max_new_tokens": 1, "structural_tag": "{}"}},
     "sampling_params.structural_tag"),
    ("/generate", {**GEN, "lora_path": "x"}, "lora_path"),
])
def test_server_refuses_with_the_openai_error(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_server_accepts_harmless_and_bookkeeping_fields(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "user": "u", "metadata": {"a": "b"}, "store": False,
                                                "response_format": {"type": "text"}, "tools": [],
                                                "tool_choice": "none", "priority": 0, "guided_json": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {**COMP, "logprobs": True}, "logprobs"),  # lax pydantic read it as 1
    (CompletionRequest, {**COMP, "logprobs": "3"}, "logprobs"),
    (ChatCompletionRequest, {**CHAT, "logprobs": "yes"}, "logprobs"),
    (ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
])
def test_coercible_values_are_refused_not_coerced(model, body, param):
    """A value of the wrong JSON type is a 400 naming the field, never silently converted."""
    with pytest.raises(APIError) as e:
        parse_request(model, body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_message_without_content_is_refused(role):
    """OpenAI's API requires content on every message but an assistant's tool-call turn."""
    msg = {"role": role, **({"tool_call_id": "c1"} if role == "tool" else {})}
    for m in (msg, {**msg, "content": None}):
        with pytest.raises(APIError) as e:
            parse_request(ChatCompletionRequest, {**CHAT, "messages": [m]})
        assert e.value.status == 400 and e.value.param.startswith("messages"), e.value.message
        assert "content" in e.value.message


def test_assistant_without_content_and_typed_logprobs_are_accepted():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "again"}]
    r = parse_request(ChatCompletionRequest, {**CHAT, "messages": history, "logprobs": True, "top_logprobs": 2})
    assert r.sampling_params().top_logprobs == 2 and r.messages[1].to_template()["content"] == ""
    assert parse_request(CompletionRequest, {**COMP, "logprobs": 3}).sampling_params().top_logprobs == 3
