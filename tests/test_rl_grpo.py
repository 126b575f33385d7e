"""The GRPO example (examples/grpo.py): its reward, advantages and loss against hand-computed values, and
two end-to-end steps on a tiny model (server rollouts, a training step, the weights pushed back by gloo),
where the trainer's logprobs equal the engine's exactly, the second step's rollouts coming from the first
step's pushed weights."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil

import pytest
import torch
from conftest import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_example", os.path.join(ROOT, "examples", "grpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


grpo = load_example()


def test_reward_reads_the_first_integer_and_the_format():
    assert grpo.reward("12", 12) == 1.5
    assert grpo.reward("The answer is 12.", 12) == 1.0
    assert grpo.reward("7 + 5 = 12", 12) == 0.5  # the first integer is what counts; the format is right
    assert grpo.reward("twelve", 12) == 0.0


def test_group_advantages_by_hand():
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), eps=0.0)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))  # mean 0.5, std 0.5
    adv = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    assert torch.equal(adv, torch.zeros(1, 4))


def test_grpo_loss_by_hand():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]])  # ratios 2 and 1
    ref = torch.tensor([[math.log(0.5), math.log(0.25)]])  # d = 0 and -log 2
    mask = torch.tensor([[1.0, 1.0]])
    loss, kl = grpo.grpo_loss(logp, old, ref, torch.tensor([1.0]), mask, clip=0.2, beta=0.1)
    k3 = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 at d = -log 2
    # token 1: min(2 * 1, 1.2 * 1) = 1.2; token 2: 1; loss = -mean(surrogate - beta * kl)
    assert loss.item() == pytest.approx(-((1.2 - 0.0) + (1.0 - 0.1 * k3)) / 2, rel=1e-6)
    assert kl.item() == pytest.approx(k3 / 2, rel=1e-6)
    loss.backward()
    assert logp.grad[0, 0] == 0.0  # clipped: no gradient through the first token's ratio


def test_pad_keeps_the_gradient_and_masks_the_padding():
    x = torch.tensor([0.5, -1.0], requires_grad=True)
    vals, mask = grpo.pad([x, [3.0], []], 3)
    assert vals.tolist() == [[0.5, -1.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert mask.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
    (vals * torch.tensor([[2.0, 3.0, 5.0]])).sum().backward()
    assert x.grad.tolist() == [2.0, 3.0]


def test_one_step_end_to_end(tmp_path, smollm2_dir):
    path = make_tiny_model(tmp_path, vocab_size=49152, tie=True)
    for name in os.listdir(smollm2_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    out = str(tmp_path / "run")
    assert grpo.main(["--model", path, "--steps", "2", "--prompts", "2", "--group-size", "3", "--out", out]) == 0
    recs = [json.loads(line) for line in open(out + ".jsonl")]
    assert [r["step"] for r in recs] == [1, 2] and [r["weight_version"] for r in recs] == ["step-1", "step-2"]
    assert all(r["mismatch_train"] == 0.0 for r in recs)  # the trainer's forward gave the rollout's logprobs
    assert os.path.getsize(out + ".png") > 0
