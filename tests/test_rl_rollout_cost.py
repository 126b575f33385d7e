"""``python -m idleless.rl.rollout_cost`` (the cost of alignment for rollouts): one JSON line per round and
engine, default kernels then deterministic ones, each with every sample's tokens counted."""

from __future__ import annotations

import json
import os
import shutil

from conftest import make_tiny_model

from idleless.rl import rollout_cost


def test_one_round_of_both_engines(tmp_path, smollm2_dir, capsys):
    path = make_tiny_model(tmp_path, vocab_size=49152, tie=True)
    for name in os.listdir(smollm2_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    assert rollout_cost.main(["--model", path, "--prompts", "2", "--group-size", "3", "--max-new-tokens", "4",
                              "--rounds", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["deterministic"], r["round"]) for r in lines] == [(False, 0), (True, 0)]
    assert all(r["tokens"] == 2 * 3 * 4 and r["cpu_s"] > 0 and r["wall_s"] > 0 for r in lines)
