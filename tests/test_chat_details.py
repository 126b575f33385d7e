"""Chat details of the OpenAI surface (issue 12, section 4): ``logit_bias`` in the sampler (against
hand-computed references) and through a real server; ``continue_final_message`` and
``add_generation_prompt`` against a hand-built SmolLM2 prompt and transformers' own rendering;
``chat_template_kwargs``, ``documents`` and ``--chat-template`` changing the rendered prompt."""

from __future__ import annotations

import httpx
import pytest
import torch

from idleless.errors import RequestError
from idleless.model.sampler import SamplingRow, apply_logit_bias, sample
from idleless.sampling_params import SamplingParams
from idleless.text.tokenizer import Tokenizer, load_chat_template
from server_harness import MAIN_ARGS, shared_server

pytestmark = pytest.mark.timeout(300)

# ---------------------------------------------------------------- logit_bias in the sampler


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), None, [1, 2], [])


def test_apply_logit_bias_adds_only_the_biased_rows():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    ref = logits.clone().double()
    ref[0, 2] += 5.0
    ref[0, 6] -= 1.5
    ref[2, 0] += 100.0
    rows = [_row(logit_bias={2: 5.0, 6: -1.5}), _row(), _row(logit_bias={0: 100})]
    out = apply_logit_bias(logits.clone(), rows)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    assert torch.equal(out[1], logits[1])  # a row without a bias is untouched, bit for bit


def test_bias_bans_and_forces_tokens_in_greedy_and_sampled_rows():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 0.5],
                           [0.1, 3.0, 2.0, -1.0, 0.5],
                           [0.1, 3.0, 2.0, -1.0, 0.5],
                           [0.1, 3.0, 2.0, -1.0, 0.5]])
    rows = [_row(temperature=0.0, logit_bias={1: -100}),  # argmax banned: the runner-up (2.0) wins
            _row(temperature=0.0, logit_bias={3: 100}),  # the least likely token forced
            _row(temperature=0.0),  # no bias: the argmax
            SamplingRow(SamplingParams(temperature=1.0, logit_bias={4: 100}), torch.Generator().manual_seed(1),
                        [1], [])]
    for _ in range(5):
        assert sample(logits, rows, eos_ids=set()).next_ids == [2, 3, 1, 4]


def test_bias_leaves_logprobs_raw():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample(logits, [_row(temperature=0.0, logit_bias={0: 100}, logprobs=True)], eos_ids=set())
    assert out.next_ids == [0]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0].double(), -1)[0]), abs=1e-6)


@pytest.mark.parametrize("bias, why", [({5: 100.5}, "values"), ({5: float("nan")}, "values"),
                                       ({50: 1.0}, "outside the vocabulary"), ({"5": 1.0}, "keys"),
                                       ({-1: 1.0}, "outside the vocabulary")])
def test_logit_bias_validation(bias, why):
    with pytest.raises(RequestError) as e:
        SamplingParams(logit_bias=bias).validate(vocab_size=50)
    assert e.value.param == "logit_bias" and why in e.value.message
    SamplingParams(logit_bias={0: -100, 49: 100.0}).validate(vocab_size=50)

# ---------------------------------------------------------------- chat template rendering

SYSTEM = "Be brief."
PARTIAL = "The capital of France is"
HISTORY = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"},
           {"role": "assistant", "content": PARTIAL}]
# SmolLM2-Instruct's template (ChatML), written out by hand: the final assistant turn left open
OPEN_PROMPT = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
               f"<|im_start|>assistant\n{PARTIAL}")


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


def test_continue_final_message_leaves_the_assistant_turn_open(tok):
    text = tok.render_chat(HISTORY, add_generation_prompt=False, continue_final_message=True)
    assert text == OPEN_PROMPT
    closed = tok.render_chat(HISTORY, add_generation_prompt=False)
    assert closed == OPEN_PROMPT + "<|im_end|>\n"
    ids = tok.apply_chat_template(HISTORY, add_generation_prompt=False, continue_final_message=True)
    assert ids == tok.encode(OPEN_PROMPT, add_special_tokens=False)
    ref = tok.hf.apply_chat_template(HISTORY, add_generation_prompt=False, continue_final_message=True,
                                     tokenize=False)
    assert text == ref


def test_template_variables_and_documents(tok):
    t = ("{{ prefix }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
         "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs, chat_template=t, prefix="P:") == "P:[user]hi>"
    assert tok.render_chat(msgs, chat_template=t, add_generation_prompt=False,
                           documents=[{"text": "a"}, {"text": "b"}]) == "[user]hi<doc>a</doc><doc>b</doc>"


def test_load_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}!\n")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}!\n"
    assert load_chat_template("{{ x }}\\n|") == "{{ x }}\n|"  # inline, a typed \n is a newline
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% if %}")

# ---------------------------------------------------------------- through the server


def _generate(http, **sp) -> list[int]:
    r = http.post("/generate", json={"text": "The sky is", "sampling_params": {
        "temperature": 0, "max_new_tokens": 3, "ignore_eos": True, **sp}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_server_logit_bias_bans_and_forces(http, tok):
    plain = _generate(http)
    banned = _generate(http, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    forced_id = tok.encode(" banana", add_special_tokens=False)[0]
    assert _generate(http, logit_bias={str(forced_id): 100}) == [forced_id] * 3
    r = http.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 2, "temperature": 0,
                                           "logit_bias": {str(forced_id): 100}, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([forced_id] * 2)


@pytest.mark.parametrize("bias, param", [({"999999": 5}, "logit_bias"), ({"1": 101}, "logit_bias"),
                                         ({"x": 1}, "logit_bias")])
def test_server_logit_bias_errors(http, bias, param):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_server_continue_final_message(http, tok):
    body = {"messages": HISTORY, "add_generation_prompt": False, "continue_final_message": True}
    r = http.post("/v1/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode(OPEN_PROMPT, add_special_tokens=False)
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0, "logprobs": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(OPEN_PROMPT, add_special_tokens=False))
    for bad in ({**body, "add_generation_prompt": True}, {**body, "add_generation_prompt": None},
                {**body, "messages": HISTORY[:2]}):
        r = http.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    r = http.post("/v1/chat/completions", json={"messages": HISTORY[:2], "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


TEMPLATE = ("{{ prefix }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}{% if add_generation_prompt %}>"
            "{% endif %}")


def test_server_chat_template_flag_and_kwargs(smollm2_dir, pytestconfig, tok):
    srv = shared_server(pytestconfig, MAIN_ARGS + ("--chat-template", TEMPLATE))
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as c:
        def rendered(**extra) -> list[int]:
            r = c.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **extra})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        def ids(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        assert rendered() == ids("[user]hi>")
        assert rendered(chat_template_kwargs={"prefix": "P:"}) == ids("P:[user]hi>")
        assert rendered(documents=[{"text": "d1"}], add_generation_prompt=False) == ids("[user]hi<doc>d1</doc>")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "chat_template_kwargs": {"prefix": "P:"}})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids("P:[user]hi>")), r.text
