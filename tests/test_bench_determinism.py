"""``idleless bench determinism``: the 16 compositions are what they say; outputs are counted
bitwise (hand-made samples); on a tiny random bf16 Llama with ``--enable-deterministic-inference``
the command finds 1 distinct output, in-process and against ``idleless serve``, and that output is
the float64 transformers greedy continuation with its log-softmax (to bf16 rounding); the server's
logprobs equal the in-process ones bit for bit."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from conftest import TEST_THREADS, make_tiny_model

from idleless.bench import determinism as det
from idleless.cli import main as cli_main

MAX_TOKENS = 12


# --------------------------------------------------------------------------------------------------
# the compositions and the counting (no model)
# --------------------------------------------------------------------------------------------------
PROBE = tuple(range(1000, 1131))  # 131 ids, the default probe's length with SmolLM2's template
FILLER = tuple(range(5000, 5700))


def test_trials_are_the_16_compositions():
    trials = det.build_trials(PROBE, FILLER, MAX_TOKENS)
    assert len(trials) == 16
    assert [sum(t.mode == m for t in trials) for m in det.MODES] == [4, 6, 6]
    assert sum(t.probe_samples for t in trials) == 23  # two n=3 trials, one of 4 copies
    sizes = {sum(e.n for e in t.batch) for t in trials}
    assert {1, 2, 3, 4, 8, 16} <= sizes
    for t in trials:
        probes = [e for e in t.batch if e.probe]
        assert probes and all(e.ids == PROBE and e.temperature == 0 and e.max_tokens == MAX_TOKENS for e in probes)
        assert all(PROBE[:len(w)] == w for w in t.warm)  # warm-ups cache a prefix of the probe
        others = [e for e in t.batch if not e.probe]
        for e in others:
            shared = next((i for i in range(min(len(e.ids), len(PROBE))) if e.ids[i] != PROBE[i]), 0)
            assert set(e.ids[shared:]) <= set(FILLER), "the rest of another prompt is filler"
            assert (e.temperature == 0) == (e.seed is None) and 4 <= e.max_tokens <= 32
        if t.mode == "mixed":
            assert all(e.ids[0] in FILLER for e in others), "mixed: nothing shared with the probe"
        if t.mode == "prefix" and others:
            assert any(e.ids[:10] == PROBE[:10] for e in others), "prefix: some share the probe's prefix"
        if t.late:
            assert t.batch[-1].probe and len(others) == 15
    by_name = {t.name: t for t in trials}
    assert by_name["alone"].batch == [det.Entry(PROBE, MAX_TOKENS, probe=True)] and not by_name["alone"].warm
    assert by_name["alone, its prompt cached"].warm == [PROBE]
    assert by_name["half its prompt cached"].warm == [PROBE[:65]]
    shares = {next(i for i in range(len(PROBE)) if e.ids[i] != PROBE[i])
              for e in by_name["beside 7 sharing 1/4..all-but-1 (middle)"].batch if not e.probe}
    assert shares == {32, 65, 98, 130}
    lengths = {len(e.ids) for e in by_name["beside 15 others (last)"].batch if not e.probe}
    assert min(lengths) == 12 and max(lengths) == 480
    with pytest.raises(ValueError, match="filler"):
        det.build_trials(PROBE, FILLER[:599], MAX_TOKENS)


def test_outputs_are_counted_bitwise():
    a = det.Sample((5, 6, 7), (-0.5, -1.25, -2.0))
    one_ulp = det.Sample((5, 6, 7), (-0.5, math.nextafter(-1.25, 0.0), -2.0))
    other_token = det.Sample((5, 9, 7), (-0.5, -1.0, -2.0))
    neg_zero = det.Sample((5, 6, 7), (-0.5, -1.25, -0.0))
    pos_zero = det.Sample((5, 6, 7), (-0.5, -1.25, 0.0))
    short = det.Sample((5, 6), (-0.5, -1.25))
    assert det.compare(a, a) == {"equal": True, "first_diff": None, "first_token_diff": None,
                                 "max_abs_logprob_diff": 0.0}
    c = det.compare(a, one_ulp)
    assert not c["equal"] and c["first_diff"] == 1 and c["first_token_diff"] is None
    assert c["max_abs_logprob_diff"] == 1.25 - abs(math.nextafter(-1.25, 0.0))
    c = det.compare(a, other_token)
    assert c["first_diff"] == 1 and c["first_token_diff"] == 1 and c["max_abs_logprob_diff"] == 0.0
    assert det.compare(neg_zero, pos_zero)["first_diff"] == 2  # -0.0 and 0.0 are different bits
    assert det.compare(a, short)["first_diff"] == 2 and det.compare(a, short)["first_token_diff"] == 2

    trials = [det.Trial("alone", "single", []), det.Trial("t2", "single", []), det.Trial("t3", "prefix", [])]
    r = det.summarize(trials, [[a], [a, one_ulp, a], [other_token]])
    assert r["total_samples"] == 5 and r["distinct_outputs"] == 3 and not r["deterministic"]
    assert r["modes"] == {"single": {"trials": 2, "samples": 4, "distinct": 2},
                          "prefix": {"trials": 1, "samples": 1, "distinct": 1}}
    t2 = r["trials"][1]
    assert t2["samples"] == 3 and t2["distinct"] == 2 and t2["equal_to_alone"] == 2 and t2["first_diff"] == 1
    assert [o["count"] for o in r["outputs"]] == [3, 1, 1] and r["outputs"][0]["trials"] == ["alone", "t2"]
    assert det.summarize(trials[:1], [[a]])["deterministic"]


# --------------------------------------------------------------------------------------------------
# a tiny bf16 model: in-process and over HTTP
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_dir) -> str:
    """A tiny random Llama (untied: its greedy text varies) with SmolLM2's vocabulary and tokenizer."""
    path = make_tiny_model(tmp_path_factory.mktemp("det-bench"), vocab_size=49152, max_position_embeddings=1024)
    for name in os.listdir(smollm2_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    return path


ENGINE_FLAGS = ["--dtype", "bfloat16", "--enable-deterministic-inference", "--kv-cache-memory", "32MiB",
                "--log-level", "warning"]


@pytest.fixture(scope="module")
def offline_result(tiny_chat_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("det-out") / "offline.json"
    rc = cli_main(["bench", "determinism", "--model", tiny_chat_model, "--num-threads", str(TEST_THREADS),
                   "--max-tokens", str(MAX_TOKENS), "--output", str(out), *ENGINE_FLAGS])
    assert rc == 0
    return json.loads(out.read_text())


def test_offline_engine_gives_one_output(offline_result, capsys):
    r = offline_result
    assert r["benchmark"] == "determinism" and r["engine_config"]["enable_deterministic_inference"]
    assert r["engine_config"]["dtype"] == "bfloat16" and "bfloat16" in r["target"]
    assert r["total_samples"] == 23 and len(r["trials"]) == 16
    assert r["distinct_outputs"] == 1 and r["deterministic"], r["trials"]
    assert all(t["equal_to_alone"] == t["samples"] for t in r["trials"])
    (o,) = r["outputs"]
    assert o["count"] == 23 and len(o["tokens"]) == MAX_TOKENS == len(o["logprobs"])


def test_the_output_is_float64_greedy_with_its_logprobs(offline_result, tiny_chat_model):
    """Independent reference: transformers in float64 on the bf16-rounded weights. Our activations
    are bf16, so values agree to bf16 rounding (abs 0.05 on a log-softmax over 49152 tokens)
    and every token is float64's argmax or within 0.05 of it."""
    from transformers import AutoModelForCausalLM

    from idleless.text.tokenizer import Tokenizer

    ids = Tokenizer.load(tiny_chat_model).apply_chat_template([{"role": "user", "content": det.DEFAULT_PROMPT}])
    assert len(ids) == offline_result["probe"]["prompt_tokens"]
    (o,) = offline_result["outputs"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.bfloat16).to(torch.float64).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + o["tokens"][:-1]])).logits[0, len(ids) - 1:]
    ref = torch.log_softmax(logits, -1)
    for i, (tok, lp) in enumerate(zip(o["tokens"], o["logprobs"])):
        assert abs(ref[i, tok].item() - lp) < 0.05, (i, ref[i, tok].item(), lp)
        assert ref[i].max().item() - ref[i, tok].item() < 0.05, f"token {i} is not greedy"


@pytest.mark.timeout(300)
def test_against_idleless_serve(offline_result, tiny_chat_model, tmp_path):
    from server_harness import ServerProcess

    from idleless.text.tokenizer import Tokenizer

    srv = ServerProcess(["--model", tiny_chat_model, "--num-threads", "1", *ENGINE_FLAGS], api_key="k")
    try:
        srv.wait_ready()
        out = tmp_path / "http.json"
        assert cli_main(["bench", "determinism", "--url", srv.url, "--api-key", "k", "--max-tokens", str(MAX_TOKENS),
                         "--output", str(out)]) == 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    r = json.loads(out.read_text())
    assert r["total_samples"] == 23 and r["distinct_outputs"] == 1 and r["cache_flushed_per_trial"], r["trials"]
    (o,) = r["outputs"]
    (ref,) = offline_result["outputs"]
    assert o["logprobs"] == ref["logprobs"]  # the same numbers in another process, bit for bit
    tok = Tokenizer.load(tiny_chat_model)
    assert o["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ref["tokens"]]


def test_unreachable_server_is_an_error_not_a_result(capsys):
    from server_harness import free_port

    assert cli_main(["bench", "determinism", "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "error:" in capsys.readouterr().err
