"""The flags SGLang and vLLM users type: each alias parses to the same EngineConfig as the canonical
flag, the memory fraction maps onto kv_cache_memory as documented, tensor parallelism other than 1
and fractions out of range are refused at parse time, and every engine flag of `idleless serve` and
`idleless generate` carries help text. No model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from idleless import config as config_mod
from idleless.cli import build_parser
from idleless.config import EngineConfig, config_from_args

PROMPT = "hi"
# (alias argv, canonical argv, the field and value both must set)
PAIRS = [
    (["--model-path", "/m/x.gguf"], ["--model", "/m/x.gguf"], "model", "/m/x.gguf"),
    (["--tokenizer-path", "/t"], ["--tokenizer", "/t"], "tokenizer", "/t"),
    (["--random-seed", "7"], ["--seed", "7"], "seed", 7),
    (["--max-model-len", "4096"], ["--context-length", "4096"], "context_length", 4096),
    (["--max-num-seqs", "8"], ["--max-running-requests", "8"], "max_running_requests", 8),
    (["--max-num-batched-tokens", "512"], ["--max-prefill-tokens", "512"], "max_prefill_tokens", 512),
    (["--block-size", "16"], ["--page-size", "16"], "page_size", 16),
    (["--mem-fraction-static", "0.25"], ["--kv-cache-memory", "0.25"], "kv_cache_memory", "0.25"),
    (["--gpu-memory-utilization", "0.5"], ["--kv-cache-memory", "0.5"], "kv_cache_memory", "0.5"),
    (["--tp-size", "1"], [], None, None),
    (["-tp", "1"], [], None, None),
    (["--tensor-parallel-size", "1"], [], None, None),
]


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    extra = [PROMPT] if command == "generate" else []
    return build_parser().parse_args([command, *extra, *argv])


def subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
@pytest.mark.parametrize("alias,canonical,name,value", PAIRS, ids=[" ".join(p[0]) for p in PAIRS])
def test_alias_gives_the_same_config(command, alias, canonical, name, value):
    a, c = config_from_args(parse(command, alias)), config_from_args(parse(command, canonical))
    assert a == c
    if name is not None:
        assert getattr(a, name) == value and getattr(a, name) != getattr(EngineConfig(), name)
    else:
        assert a == config_from_args(parse(command, []))  # the command's defaults (serve has its own step budget)


def test_aliases_combine_and_the_last_flag_wins():
    args = ["--model-path", "/m", "--max-num-seqs", "3", "--max-model-len", "100", "--random-seed", "5",
            "--mem-fraction-static", "0.2", "--kv-cache-memory", "1GiB"]
    cfg = config_from_args(parse("serve", args))
    assert cfg == dataclasses.replace(EngineConfig(), model="/m", max_running_requests=3, context_length=100, seed=5,
                                      kv_cache_memory="1GiB", max_prefill_tokens=1024)  # serve's step budget
    assert config_from_args(parse("serve", ["--kv-cache-memory", "1GiB", "--mem-fraction-static", "0.2"])) \
        .kv_cache_memory == "0.2"


def test_mem_fraction_is_that_share_of_available_ram(monkeypatch):
    monkeypatch.setattr(config_mod, "available_memory_bytes", lambda: 8 * 1024**3)
    cfg = config_from_args(parse("serve", ["--mem-fraction-static", "0.25"]))
    assert cfg.kv_cache_bytes() == 2 * 1024**3  # 0.25 x 8 GiB, by hand
    cfg = config_from_args(parse("serve", ["--gpu-memory-utilization", "0.9"]))
    assert cfg.kv_cache_bytes() == pytest.approx(0.9 * 8 * 1024**3)


@pytest.mark.parametrize("value", ["0", "0.95", "1", "2GiB", "-0.1", "nan", "abc"])
def test_mem_fraction_out_of_range_is_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse("serve", ["--mem-fraction-static", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--mem-fraction-static" in err and "fraction in (0, 0.9]" in err and "--kv-cache-memory" in err


@pytest.mark.parametrize("flag", ["-tp", "--tp-size", "--tensor-parallel-size"])
def test_tensor_parallel_size_aliases(flag):
    assert config_from_args(parse("serve", [flag, "2"])).tensor_parallel_size == 2


@pytest.mark.parametrize("flag", ["-tp", "--tp-size", "--tensor-parallel-size"])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_tensor_parallel_size_below_1_is_a_clear_error(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse("serve", [flag, value])
    assert e.value.code == 2
    assert "must be an integer >= 1" in capsys.readouterr().err


def test_enable_metrics_is_accepted_and_changes_nothing():
    args = parse("serve", ["--enable-metrics"])
    assert args.enable_metrics is True
    assert config_from_args(args) == config_from_args(parse("serve", []))


def test_python_m_idleless_server_takes_the_aliases():
    from idleless.server import launch
    p = argparse.ArgumentParser()
    launch.add_args(p)
    args = p.parse_args(["--model-path", "/m", "--max-num-seqs", "4", "-tp", "1", "--enable-metrics"])
    assert config_from_args(args) == dataclasses.replace(EngineConfig(), model="/m", max_running_requests=4,
                                                         max_prefill_tokens=launch.SERVE_MAX_NUM_BATCHED_TOKENS)


def test_every_field_has_help():
    for f in dataclasses.fields(EngineConfig):
        assert isinstance(f.metadata.get("help"), str) and len(f.metadata["help"]) > 10, f.name


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_flag_has_help(command):
    p = subparser(command)
    for action in p._actions:
        assert action.help and action.help.strip(), action.option_strings or action.dest
    flags = {s for a in p._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags
        assert set(f.metadata["aliases"]) <= flags


def test_serve_help_lists_the_aliases_with_their_text():
    out = subprocess.run([sys.executable, "-m", "idleless.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for piece in ("--model MODEL, --model-path MODEL", "--seed SEED, --random-seed SEED",
                  "--max-running-requests MAX_RUNNING_REQUESTS, --max-num-seqs MAX_RUNNING_REQUESTS",
                  "--mem-fraction-static FRACTION, --gpu-memory-utilization FRACTION",
                  "--tensor-parallel-size N, --tp-size N, -tp N", "--enable-metrics",
                  "token budget of one step: prefill chunks + decode tokens (default: 1024 for serve)",
                  "most draft tokens per request per step (default: 6)"):
        assert piece in text, piece


def test_serve_flags_pickle_for_dp_replicas():
    """`serve --dp N` spawns replica processes with the parsed flags, so they must pickle (a lambda as
    the subcommand's func made `idleless serve --dp 2` crash at start-up)."""
    import pickle
    args = build_parser().parse_args(["serve", "--dp", "2", "--port", "30200"])
    back = pickle.loads(pickle.dumps(args))
    assert back.dp == 2 and back.port == 30200 and back.func is args.func
