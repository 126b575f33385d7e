"""``idleless bench make-copy-workload`` and ``idleless bench spec``.

The copy-heavy workload: built twice it is the same, every prompt's ids decode back to the prompt (the
chat template's rendering of the request's messages), prompts are 150-700 tokens, and every request's
answer can be copied from its prompt: the passage, the paragraph or the code block is in the prompt,
a typo-fix answer differs from its passage only by adjacent-letter swaps, and a rename answer is the
code's syntax tree with the parameter renamed (checked on the tree, not on the text).
The bench's figures are checked on hand-made numbers, and a smoke run on a tiny random Llama (token
ids, no tokenizer) in bf16 with deterministic numerics, where speculation must change no output.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import sys

import pytest

from idleless.bench import copy_workload as cw
from idleless.bench import spec
from idleless.bench.offline import load_workload
from idleless.bench.spec import RequestRun

from conftest import TEST_THREADS, make_tiny_model


# --------------------------------------------------------------------------------------------------
# workload builder: pure parts
# --------------------------------------------------------------------------------------------------
def test_take_paragraphs_keeps_whole_leading_paragraphs_within_the_budget():
    words = len  # "tokens" = characters here
    text = "aaaa\n\nbbbbbb\n\ncc"
    assert cw.take_paragraphs(text, words, 4) == "aaaa"
    assert cw.take_paragraphs(text, words, 11) == "aaaa"  # "aaaa\n\nbbbbbb" is 12
    assert cw.take_paragraphs(text, words, 12) == "aaaa\n\nbbbbbb"
    assert cw.take_paragraphs(text, words, 100) == text
    assert cw.take_paragraphs("l1\nline2\nl3\n\nzz", words, 8) == "l1\nline2"  # first paragraph cut by lines


def test_typos_are_adjacent_swaps_and_deterministic():
    text = "Several interesting paragraphs describe wonderful algorithms carefully. " * 4
    a, n = cw.add_typos(text, seed=3)
    assert (a, n) == cw.add_typos(text, seed=3)
    assert n >= 1 and a != text and len(a) == len(text)
    diffs = [i for i, (x, y) in enumerate(zip(a, text)) if x != y]
    assert len(diffs) == 2 * n
    for i, j in zip(diffs[::2], diffs[1::2]):
        assert j == i + 1 and a[i] == text[j] and a[j] == text[i]


def test_rename_identifier_renames_the_variable_only():
    code = "def f(k, items):\n    total = k + len(items)\n    return g(k=k, v=items.k, s='k')"
    assert cw.rename_target(code) == "k"  # k and items are used 3 times each: the first in the signature wins
    assert cw.rename_identifier(code, "k", "k_value") == \
        "def f(k_value, items):\n    total = k_value + len(items)\n    return g(k=k_value, v=items.k, s='k')"
    with pytest.raises(ValueError):
        cw.rename_identifier(code, "k", "items")
    assert cw.rename_target("def m(self, x, y):\n    return y + y") == "y"


def test_quote_paragraph_has_a_unique_opening_phrase():
    doc = "Title line.\n\nShort one here.\n\nThe longest paragraph of all starts here and goes on.\n\nThe end."
    p = cw.quote_paragraph(doc)
    assert p == "The longest paragraph of all starts here and goes on."
    assert cw.quote_phrase(p) == "The longest paragraph of all starts"


# --------------------------------------------------------------------------------------------------
# workload builder on the bundled tokenizer
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from idleless.text.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_dir)


@pytest.fixture(scope="module")
def workload(tokenizer):
    return cw.build_copy_workload(tokenizer)


def test_builder_is_deterministic_and_prompt_ids_decode_to_the_prompt(tokenizer, workload):
    assert json.dumps(cw.build_copy_workload(tokenizer)) == json.dumps(workload)
    reqs = workload["requests"]
    assert len(reqs) == 32 and len({r["id"] for r in reqs}) == 32
    assert {r["kind"] for r in reqs} == {"repeat", "fix_typos", "quote_document", "rename_identifier"}
    assert [r["kind"] for r in reqs[:4]] != [reqs[0]["kind"]] * 4  # kinds are mixed, not in blocks
    for r in reqs:
        assert r["prompt"] == tokenizer.render_chat(r["messages"])
        assert tokenizer.decode(r["prompt_token_ids"], skip_special_tokens=False) == r["prompt"]
        assert 150 <= len(r["prompt_token_ids"]) <= 700
        expected = len(tokenizer.encode(r["expected"], add_special_tokens=False))
        assert r["max_tokens"] >= expected + 16


def test_every_prompt_holds_the_text_its_answer_copies(workload):
    for r in workload["requests"]:
        user, src, exp = r["messages"][0]["content"], r["source"], r["expected"]
        assert src in user and src in r["prompt"], r["id"]
        if r["kind"] in ("repeat", "quote_document"):
            assert exp == src
        if r["kind"] == "quote_document":
            phrase = cw.quote_phrase(src)
            assert f'"{phrase}"' in user and user.count(phrase) == 2  # in the question and once in the document
        if r["kind"] == "fix_typos":  # the answer is the passage with each adjacent-letter swap undone
            assert len(exp) == len(src) and exp != src
            diffs = [i for i, (x, y) in enumerate(zip(src, exp)) if x != y]
            pairs = list(zip(diffs[::2], diffs[1::2]))
            assert len(diffs) % 2 == 0 and all(j == i + 1 and src[i] == exp[j] and src[j] == exp[i] for i, j in pairs)
        if r["kind"] == "rename_identifier":
            old = user.split("`")[1]
            new = user.split("`")[3]
            assert f"```python\n{src}\n```" in user and new == old + cw.RENAME_SUFFIX

            class Rename(ast.NodeTransformer):
                def visit_Name(self, node):
                    node.id = new if node.id == old else node.id
                    return node

                def visit_arg(self, node):
                    node.arg = new if node.arg == old else node.arg
                    return node

            assert ast.dump(Rename().visit(ast.parse(src))) == ast.dump(ast.parse(exp))
            assert exp.count(new) >= 2 and src.count(old) >= 2


def test_the_command_writes_a_workload_bench_offline_reads(tmp_path, tokenizer, workload, monkeypatch):
    from idleless.bench import serving

    monkeypatch.setattr(serving, "load_tokenizer", lambda path: tokenizer)  # the bundled one, loaded once
    out = tmp_path / "copy.json"
    assert cw.main(argparse.Namespace(output=str(out), tokenizer=None)) == 0
    w = load_workload(str(out))
    assert w.name == "copy_heavy" and len(w.items) == 32
    assert w.temperature == 0.0 and w.ignore_eos is False
    assert [it.max_tokens for it in w.items] == [r["max_tokens"] for r in workload["requests"]]
    assert [it.prompt_ids for it in w.items] == [r["prompt_token_ids"] for r in workload["requests"]]


def test_the_committed_workload_is_what_the_builder_makes(workload):
    committed = json.loads((spec.REPO_ROOT / cw.DEFAULT_OUTPUT).read_text(encoding="utf-8"))
    if committed["builder"]["python"] != sys.version.split()[0]:
        pytest.skip(f"built with Python {committed['builder']['python']}: stdlib docstrings differ between versions")
    assert committed == json.loads(json.dumps(workload))


# --------------------------------------------------------------------------------------------------
# bench figures on hand-made numbers
# --------------------------------------------------------------------------------------------------
def test_spec_counters_are_differences_and_rates_of_them():
    before = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20, "num_steps_on": 10,
              "num_steps_off": 2, "draft_seconds": 1.0, "algorithm": "ngram"}
    after = {"num_drafts": 30, "num_draft_tokens": 100, "num_accepted_tokens": 65, "num_steps_on": 25,
             "num_steps_off": 7, "draft_seconds": 1.5, "algorithm": "ngram"}
    d = spec.spec_counters(before, after)
    assert d["num_drafts"] == 20 and d["num_draft_tokens"] == 60 and d["num_accepted_tokens"] == 45
    assert d["num_steps_on"] == 15 and d["num_steps_off"] == 5 and d["draft_seconds"] == pytest.approx(0.5)
    assert d["acceptance_rate"] == pytest.approx(45 / 60)
    assert d["mean_accepted_length"] == pytest.approx((45 + 20) / 20)  # 3.25 tokens per verify
    off = spec.spec_counters({}, {})
    assert off["acceptance_rate"] is None and off["mean_accepted_length"] is None and off["num_steps_off"] == 0


def test_batch1_figures_leave_the_first_token_out():
    runs = [RequestRun("a", [1, 2, 3, 4, 5], first_token_s=0.5, end_s=1.3),
            RequestRun("b", [7], first_token_s=0.4, end_s=0.4),  # no decode
            RequestRun("c", [1, 2, 3], first_token_s=0.2, end_s=0.4)]
    f = spec.batch1_figures(runs)
    assert f["decode_tokens"] == 6 and f["decode_s"] == pytest.approx(1.0)
    assert f["decode_tokens_per_s"] == pytest.approx(6.0)
    assert f["mean_ttft_s"] == pytest.approx((0.5 + 0.4 + 0.2) / 3)
    assert spec.batch1_figures([RequestRun("x", [1], 0.1, 0.1)])["decode_tokens_per_s"] is None


def test_speedup_identical_and_accepted_lengths():
    assert spec.speedup(10.0, 15.0, higher_is_better=True) == pytest.approx(1.5)  # tokens/s
    assert spec.speedup(10.0, 8.0, higher_is_better=False) == pytest.approx(1.25)  # seconds
    assert spec.speedup(None, 8.0, False) is None and spec.speedup(10.0, 0.0, False) is None
    ref = [RequestRun("a", [1, 2]), RequestRun("b", [3])]
    assert spec.identical_outputs(ref, [RequestRun("b", [3]), RequestRun("a", [1, 3])]) == 1
    acc = spec.accepted_from_outputs([RequestRun("a", [], accepted_per_verify=[0, 3]),
                                      RequestRun("b", [], accepted_per_verify=[2])])
    assert acc == {"num_verifies": 3, "num_accepted": 5, "mean_accepted_length": pytest.approx(8 / 3)}


def _rec(wall, drafted=0, accepted=0, verifies=0, off_steps=0, identical=4, tps=None):
    r = {"wall_s": wall, "cpu_s": 2 * wall, "num_requests": 4, "output_tokens": 100, "identical_to_off": identical,
         "speculative": spec.spec_counters({}, {"num_drafts": verifies, "num_draft_tokens": drafted,
                                                "num_accepted_tokens": accepted, "num_steps_off": off_steps}),
         "time": {"forward": 1.0, "verify": wall / 2, "draft": wall / 10, "schedule": 0.1}}
    if tps is not None:
        r["batch1"] = {"decode_tokens_per_s": tps}
    return r


def test_summary_and_report_on_hand_made_runs():
    phase = {"off": [_rec(10.0), _rec(12.0), _rec(11.0)],
             "ngram": [_rec(5.0, 40, 30, 10, 1), _rec(6.0, 60, 30, 20, 2, identical=3), _rec(5.5, 0, 0, 0, 0)]}
    s = spec.summarize(phase, ["off", "ngram"])
    assert s["off"]["wall_s"] == 11.0 and s["off"]["speedup_vs_off"] == pytest.approx(1.0)
    assert s["ngram"]["wall_s"] == 5.5 and s["ngram"]["speedup_vs_off"] == pytest.approx(2.0)
    assert s["ngram"]["acceptance_rate"] == pytest.approx(60 / 100)
    assert s["ngram"]["mean_accepted_length"] == pytest.approx((60 + 30) / 30)
    assert s["ngram"]["num_steps_off"] == 3 and s["ngram"]["identical_to_off"] == 3
    assert s["ngram"]["verify_s"] == pytest.approx(2.75)
    assert s["ngram"]["output_tokens_per_s"] == pytest.approx(100 / 5.5)
    assert s["ngram"]["cpu_s"] == 11.0 and s["ngram"]["cpu_speedup_vs_off"] == pytest.approx(2.0)

    b1 = {"off": [_rec(3.0, tps=20.0)], "ngram": [_rec(2.0, 10, 9, 3, tps=50.0)]}
    sb = spec.summarize(b1, ["off", "ngram"])
    assert sb["ngram"]["decode_tokens_per_s"] == 50.0 and sb["ngram"]["speedup_vs_off"] == pytest.approx(2.5)

    result = {"configs": ["off", "ngram"], "date": "2026-12-01", "host": {"cpu": "cpu", "torch": "2"},
              "batch1": {"workload": "copy_heavy", "num_requests": 4, "summary": sb},
              "workloads": [{"name": "random", "num_requests": 4, "summary": s}]}
    text = spec.format_report(result)
    assert "| ngram | 50.0 | 2.50x |" in text
    assert "| random (4 req) | ngram | 5.50 | 2.00x |" in text
    assert "| 60.0% | 3.00 | 3/" in text and "| 3/4 | 11.00 | 2.00x |" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in lines[:4]}) == 1  # batch-1 table rows have the header's columns


# --------------------------------------------------------------------------------------------------
# smoke run on a tiny model
# --------------------------------------------------------------------------------------------------
def _ngram_available() -> bool:
    try:
        return importlib.util.find_spec("idleless.spec.ngram") is not None and \
            hasattr(importlib.import_module("idleless.spec.ngram"), "NgramProposer")
    except ImportError:
        return False


def test_bench_spec_smoke_on_a_tiny_model(tmp_path, capsys):
    import random

    model = make_tiny_model(tmp_path, max_position_embeddings=512)
    rng = random.Random(0)
    reqs = []
    for i in range(3):  # a repeated pattern: something for prompt lookup to find
        pattern = [rng.randrange(3, 256) for _ in range(10)]
        reqs.append({"id": f"r{i}", "prompt_token_ids": pattern * 4, "max_tokens": 12})
    wl = tmp_path / "tiny.json"
    wl.write_text(json.dumps({"name": "tiny", "sampling": {"temperature": 0.0, "ignore_eos": False},
                              "requests": reqs}))
    algos = "ngram" if _ngram_available() else ""
    parser = argparse.ArgumentParser()
    spec.add_args(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args(["--model", model, "--workload", str(wl), "--algorithms", algos, "--batch1-requests",
                              "2", "--dtype", "bfloat16", "--enable-deterministic-inference", "--num-threads",
                              str(TEST_THREADS), "--kv-cache-memory", "16MiB", "--output", str(out)])
    assert spec.main(args) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    configs = ["off"] + ([algos] if algos else [])
    assert r["complete"] is True and r["configs"] == configs
    assert set(r["host"]["cpu_flags"]) >= {"avx512_bf16", "amx_bf16"} and r["host"]["torch"]
    assert r["batch1"]["num_requests"] == 2 and len(r["workloads"]) == 1
    for c in configs:
        b = r["batch1"]["runs"][c][0]
        assert b["batch1"]["decode_tokens"] == sum(p["output_tokens"] - 1 for p in b["per_request"])
        assert r["batch1"]["summary"][c]["identical_to_off"] == 2  # lossless: bitwise numerics, greedy
        w = r["workloads"][0]["summary"][c]
        assert w["identical_to_off"] == 3 and w["num_requests"] == 3
        rec = r["workloads"][0]["runs"][c][0]
        assert rec["speculative"]["num_drafts"] == rec["from_outputs"]["num_verifies"]
        assert rec["speculative"]["num_accepted_tokens"] == rec["from_outputs"]["num_accepted"]
        assert rec["speculative"]["num_accepted_tokens"] <= rec["speculative"]["num_draft_tokens"]
        assert f"| {c} |" in printed
    assert r["workloads"][0]["summary"]["off"]["speedup_vs_off"] == pytest.approx(1.0)


def test_bench_spec_refuses_a_bad_configuration(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    spec.add_args(parser)
    args = parser.parse_args(["--workload", str(tmp_path / "missing.json")])
    assert spec.main(args) == 2
    args = parser.parse_args(["--algorithms", "draft", "--workload", str(tmp_path / "missing.json")])
    assert spec.main(args) == 2
    assert "draft_model_path" in capsys.readouterr().err
