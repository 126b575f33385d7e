"""Prompt logprobs over HTTP (issue 11, part 2), on the session's shared float32 SmolLM2 server:

* the request shapes lm-eval's ``local-completions`` sends for loglikelihood (a batch of token-id
  prompts, echo, logprobs=1, temperature 0; max_tokens 1 as lm-eval sends it now and 0 as OpenAI's
  scoring form), parsed the way lm-eval's ``parse_logprobs`` parses them, against transformers'
  float32 log-softmax of the same tokens;
* streamed completions with echo + logprobs: entry for entry the non-streamed answer;
* vLLM's ``prompt_logprobs`` (completions per choice, chat per response) and SGLang's /generate
  ``return_logprob`` / ``logprob_start_len`` / ``top_logprobs_num`` shapes, agreeing with each other;
* bad values: 400 in the OpenAI error shape, and the server serves on.
"""

from __future__ import annotations

import json
from operator import itemgetter

import pytest
import torch

from hf_ref import hf_logits, load_hf

pytestmark = pytest.mark.timeout(300)
MODEL = "SmolLM2-135M-Instruct"
# our float32 engine vs transformers' float32 eager forward on the same weights: the two sum in
# different orders through 30 layers (the offline test measured <= 1.5e-5 per logprob)
HF_TOL = 2e-4


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    return load_hf(smollm2_dir)


def tokens(http, text: str) -> list[int]:
    return http.post("/v1/tokenize", json={"prompt": text}).json()["tokens"]


def lm_eval_parse(out: dict, ctxlens: list[int], drop_last: bool) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs`` (lm_eval/models/openai_completions.py): per
    choice in index order, the sum of token_logprobs[ctxlen:-1] and whether each of those is the top
    one. ``drop_last``: the trailing generated token (max_tokens 1) is not the continuation's; with
    max_tokens 0 (OpenAI's scoring form) nothing trails."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        end = -1 if drop_last else None
        lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return res


CONTEXTS = [("The capital of France is", " Paris"), ("The capital of France is", " a banana"),
            ("1, 2, 3, 4,", " 5, 6")]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_requests(http, hf, max_tokens):
    """A batch of context+continuation token prompts, as lm-eval sends them: each choice's logprobs
    cover every prompt token (the first null) and then the generated token, and the continuation's
    loglikelihood and is-greedy equal transformers' (sum of log-softmax within HF_TOL * tokens)."""
    prompts, ctxlens = [], []
    for ctx, cont in CONTEXTS:
        c, whole = tokens(http, ctx), tokens(http, ctx + cont)
        assert whole[:len(c)] == c
        prompts.append(whole)
        ctxlens.append(len(c))
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == len(prompts)
    for ch, p in zip(sorted(out["choices"], key=itemgetter("index")), prompts):
        lp = ch["logprobs"]
        n = len(p) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert "".join(lp["tokens"][:len(p)]) == ch["text"][:len("".join(lp["tokens"][:len(p)]))]
    assert out["usage"]["completion_tokens"] == len(prompts) * max_tokens
    parsed = lm_eval_parse(out, ctxlens, drop_last=max_tokens == 1)
    for (ll, greedy), p, c in zip(parsed, prompts, ctxlens):
        ref = torch.log_softmax(hf_logits(hf, p), -1)
        want = [ref[i - 1, p[i]] for i in range(c, len(p))]
        assert ll == pytest.approx(float(sum(want)), abs=HF_TOL * len(want))
        assert greedy == all(int(ref[i - 1].argmax()) == p[i] for i in range(c, len(p)))
    assert parsed[0][0] > parsed[1][0]  # " Paris" is likelier than " a banana"
    # lm-eval with tokenized_requests=False sends the texts: the same tokens and numbers (to float32
    # rounding: this server is not in the deterministic mode, and the batch may be split otherwise)
    texts = http.post("/v1/completions", json={**body, "prompt": [a + b for a, b in CONTEXTS]})
    assert texts.status_code == 200, texts.text
    for a, b in zip(texts.json()["choices"], out["choices"]):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"] and a["logprobs"]["token_logprobs"][0] is None
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=1e-5)


def stream_choices(http, body: dict) -> tuple[dict, list[dict]]:
    """POST a streamed completion; returns the choice-0 concatenation (text + logprobs lists) and the chunks."""
    acc = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                chunks.append(ch)
                for c in ch["choices"]:
                    acc["text"] += c["text"]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        acc[k] += (c["logprobs"] or {}).get(k, [])
    return acc, chunks


@pytest.mark.parametrize("max_tokens", [6, 0])
def test_streamed_echo_logprobs_equal_the_answer(http, max_tokens):
    body = {"model": MODEL, "prompt": "Once upon a time, in a land far away,", "echo": True, "logprobs": 2,
            "max_tokens": max_tokens, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    acc, chunks = stream_choices(http, body)
    assert acc["text"] == full["text"]
    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert acc[k] == full["logprobs"][k], k
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(body["prompt"]) and first["logprobs"]["token_logprobs"][0] is None
    n_prompt = len(tokens(http, body["prompt"]))
    assert len(full["logprobs"]["tokens"]) == n_prompt + max_tokens


def test_vllm_prompt_logprobs_on_completions_and_chat(http):
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the top k; equal to the echo's entries."""
    prompt = "The capital of France is Paris."
    ids = tokens(http, prompt)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["logprobs"] is None and not ch["text"].startswith(prompt)  # no echo asked
    plp = ch["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    echo = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                              "logprobs": 3}).json()["choices"][0]["logprobs"]
    for i, (tok, d) in enumerate(zip(ids[1:], plp[1:]), 1):
        mine = d[str(tok)]
        assert mine["logprob"] == echo["token_logprobs"][i] and mine["rank"] >= 1
        assert mine["decoded_token"] == echo["tokens"][i]
        top = sorted((v for k, v in d.items() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == [1, 2, 3]
        assert [v["logprob"] for v in top] == sorted(echo["top_logprobs"][i].values(), reverse=True)
        assert len(d) in (3, 4)  # the top 3, and the prompt token when it is not among them
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 0, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    c = chat.json()
    rendered = http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    assert c["choices"][0]["message"]["content"] == "" and c["usage"]["completion_tokens"] == 0
    assert len(c["prompt_logprobs"]) == len(rendered) and c["prompt_logprobs"][0] is None
    assert [list(d)[0] for d in c["prompt_logprobs"][1:]] == [str(t) for t in rendered[1:]]


def test_sglang_generate_logprob_shapes(http):
    ids = tokens(http, "The capital of France is Paris. It is")
    base = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True}
    shapes = {}
    for start in (-1, 0, 4, len(ids) - 1):
        r = http.post("/generate", json={**base, "logprob_start_len": start, "top_logprobs_num": 2})
        assert r.status_code == 200, r.text
        m = r.json()["meta_info"]
        inp, top = m["input_token_logprobs"], m["input_top_logprobs"]
        first = max(start, 0)
        assert [e[1] for e in inp] == (ids[first:] if start >= 0 else [])
        assert all(len(e) == 3 and e[2] is None for e in inp)
        assert len(top) == len(inp) and all(t is None or len(t) == 2 for t in top)
        if start == 0:
            assert inp[0][0] is None and top[0] is None
        assert len(m["output_token_logprobs"]) == 3 and len(m["output_top_logprobs"]) == 3
        assert [e[1] for e in m["output_token_logprobs"]] == r.json()["output_ids"]
        shapes[start] = m
    # the same positions, the same numbers (recomputed: start 0 attaches no cached prefix)
    full = {e[1] for e in shapes[0]["input_token_logprobs"]}
    assert full >= {e[1] for e in shapes[4]["input_token_logprobs"]}
    assert [e[0] for e in shapes[4]["input_token_logprobs"]] == pytest.approx(
        [e[0] for e in shapes[0]["input_token_logprobs"][4:]], abs=1e-5)
    # text in the entries, and the stream: the prompt's lists in the first chunk
    r = http.post("/generate", json={**base, "logprob_start_len": 0, "return_text_in_logprobs": True})
    m = r.json()["meta_info"]
    assert "input_top_logprobs" not in m and m["input_token_logprobs"][1][2] == \
        http.post("/v1/detokenize", json={"tokens": [ids[1]]}).json()["prompt"]
    pieces = []
    with http.stream("POST", "/generate", json={**base, "logprob_start_len": 0, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["meta_info"])
    assert pieces[0]["input_token_logprobs"] == [[a, b, None] for a, b, _ in m["input_token_logprobs"]]
    assert all("input_token_logprobs" not in p for p in pieces[1:])
    assert [e for p in pieces for e in p["output_token_logprobs"]] == \
        [[a, b, None] for a, b, _ in m["output_token_logprobs"]]
    # max_new_tokens 0 scores the prompt only
    r = http.post("/generate", json={**base, "sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 0})
    m = r.json()["meta_info"]
    assert r.json()["output_ids"] == [] and len(m["input_token_logprobs"]) == len(ids)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
BAD = [
    ("/v1/completions", {**COMP, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {**COMP, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {**COMP, "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {**COMP, "prompt_logprobs": True}, "prompt_logprobs"),
    ("/v1/completions", {**COMP, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {**COMP, "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMP, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 30}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"prompt_logprobs": 1}}, "sampling_params"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_prompt_logprobs_are_400(server, http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert http.post("/v1/completions", json={**COMP, "echo": True, "logprobs": 0, "max_tokens": 0}).status_code == 200
