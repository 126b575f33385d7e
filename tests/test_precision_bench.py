"""``idleless bench precision`` on a tiny random Llama: the combination grammar, the quality rows
against the first row (which is its own reference), the speed run's counts, and the llama.cpp
row's refusal of a model that is not a GGUF file."""

import argparse

import pytest
import torch

from conftest import TEST_THREADS, make_tiny_model
from idleless.bench import precision
from idleless.quant.accuracy import text_token_ids


def _args(path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    precision.add_args(p)
    args = p.parse_args(["--model", path, "--dtype", "float32", "--threads", str(TEST_THREADS),
                         "--kv-cache-memory", "2MiB"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_parse_combo():
    assert precision.parse_combo("float") == {"weight_dtype": "bf16", "activation_dtype": "bf16",
                                              "kv_cache_dtype": "auto"}
    assert precision.parse_combo("w8a8+kv=int8") == {"weight_dtype": "int8", "activation_dtype": "int8",
                                                     "kv_cache_dtype": "int8"}
    with pytest.raises(ValueError, match="unknown precision"):
        precision.parse_combo("int3")


def test_quality_rows_and_speed(tmp_path):
    path = make_tiny_model(tmp_path, seed=1)
    ids = text_token_ids(path, 256)
    rows = precision.quality_rows(_args(path, combos="float,int8+kv=int8"), ids)
    ref, q = rows
    assert ref["kl_mean"] == 0 and ref["top1"] == 1 and q["kl_mean"] > 0
    assert q["linear_bytes"] < ref["linear_bytes"] / 3  # int8 codes + a float32 scale per row vs float32
    assert q["kv_tokens"] > 3 * ref["kv_tokens"]  # 16 + 4 bytes per head row vs 64
    from idleless.model.runner import ModelRunner
    runner = ModelRunner(precision._config(_args(path), "auto"))
    s = precision.speed(runner, precision._speed_ids(ids, 400), 400, 16, 4)
    assert set(s) == {"prefill_tok_s", "prefill_tok_s_cpu", "decode_tok_s", "decode_tok_s_cpu"}
    assert all(v > 0 for v in s.values())
    assert runner.pool.num_free_slots == runner.pool.num_slots  # every slot given back


def test_speed_rows_report_medians_and_ratios_paired_by_round():
    """Row medians over the rounds, and each row's ratio to the first row's figure of the same round
    (median over rounds; hand-computed here): a round where both rows ran slow does not move the ratio."""
    run = lambda p, d: {"prefill_tok_s": p, "prefill_tok_s_cpu": p / 2, "decode_tok_s": d, "decode_tok_s_cpu": d}
    runs = {"float": [run(100, 10), run(60, 10), run(110, 8)], "w8a8": [run(150, 20), run(90, 12), run(176, 8)]}
    ref, w = precision.summarise(runs)
    assert ref["prefill_tok_s"] == 100 and ref["prefill_x_first"] == 1 and ref["decode_x_first"] == 1
    assert w["prefill_tok_s"] == 150 and w["decode_tok_s"] == 12 and w["prefill_tok_s_cpu"] == 75
    assert w["prefill_x_first"] == pytest.approx(1.5)  # rounds 1.5, 1.5, 1.6
    assert w["decode_x_first"] == pytest.approx(1.2)  # rounds 2.0, 1.2, 1.0
    assert w["runs"] == runs["w8a8"]
    assert "| w8a8 | 150 | 75 | 12.0 | 12.0 | 1.50 | 1.20 | - |" == precision._speed_md(w)
    runs["float"][1]["steal_share"] = 0.2  # a row shows its median steal only where every run measured it
    assert "steal_share" not in precision.summarise(runs)[0]
    for r, st in zip(runs["float"], (0.01, 0.2, 0.03)):
        r["steal_share"] = st
    ref = precision.summarise(runs)[0]
    assert ref["steal_share"] == 0.03 and precision._speed_md(ref).endswith("| 3.0% |")


def test_decode_speed_is_the_median_step(monkeypatch):
    """One step the hypervisor stole (5 s beside 0.1 s steps) leaves batch-1 decode at 10 tok/s: the
    median step, not the total over the steps (hand-computed; a fake clock advanced by each forward)."""
    clock = [0.0]
    steps = iter([0.1, 0.1, 5.0, 0.1, 0.1])
    prefill_s = 2.0

    class Pool:
        num_slots = 100

        def alloc(self, *a):
            return torch.arange(100)

        def free(self, slots):
            pass

    def forward(runner, ids, slots, start, rows):
        clock[0] += prefill_s if len(ids) > 1 else next(steps)
        return torch.zeros(1, 8)

    monkeypatch.setattr(precision, "forward_range", forward)
    monkeypatch.setattr(precision.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(precision.time, "process_time", lambda: clock[0] / 2)
    runner = type("R", (), {"pool": Pool()})()
    s = precision.speed(runner, list(range(50)), 40, 4, 5, prefill_repeats=3)
    assert s["prefill_tok_s"] == pytest.approx(20) and s["prefill_tok_s_cpu"] == pytest.approx(40)
    assert s["decode_tok_s"] == pytest.approx(10) and s["decode_tok_s_cpu"] == pytest.approx(20)


@pytest.mark.parametrize("flag", ["--combos", "--speed-combos"])
def test_unknown_combinations_are_refused_before_anything_loads(flag, capsys):
    parser = argparse.ArgumentParser()
    precision.add_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "float,bogus"])
    assert "bogus" in capsys.readouterr().err
    name = flag[2:].replace("-", "_")
    assert getattr(parser.parse_args([flag, "float,,w8a8+kv=int8"]), name) == "float,w8a8+kv=int8"
    assert getattr(parser.parse_args([flag, ","]), name) == ""  # no rows (a bare comma crashed after loading)


def test_llamacpp_needs_a_gguf(tmp_path):
    with pytest.raises(ValueError, match="GGUF"):
        precision._gguf_path(make_tiny_model(tmp_path))


@pytest.mark.parametrize("flag", ["--repeats", "--prefill-repeats", "--prefill-tokens", "--decode-prompt",
                                  "--decode-steps", "--threads"])
@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_counts_must_be_positive(flag, value, capsys):
    """A count of 0 used to end in statistics' or an index error after minutes of loading: argparse refuses it."""
    parser = argparse.ArgumentParser()
    precision.add_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, value])
    assert flag in capsys.readouterr().err
    assert getattr(parser.parse_args([flag, "3"]), flag[2:].replace("-", "_")) == 3
