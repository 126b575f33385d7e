"""The trainer's kernel policy (idleless.rl.policy): its own differentiable forward gives, bit for bit, the
logprobs an engine with deterministic inference returned for the tokens it sampled, whatever batching,
chunked prefill, prefix-cache hits and retraction the rollouts went through; after an optimiser step whose
weights are pushed into the engine, the next rollouts agree with it again (its packed kernel weights follow
the step; its HF-named tensors are what the engine loads).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from test_rl_updates import checkpoint

from idleless.config import EngineConfig
from idleless.engine.engine import Engine
from idleless.rl.policy import KernelPolicy
from idleless.sampling_params import SamplingParams

SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [SHARED + [30, 31], SHARED + [40], list(range(50, 120)), [7, 8], SHARED + [30, 31, 5]]


def rollouts(engine, seed: int):
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed + i, logprobs=True, n=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    return [(p, o) for p, pair in zip(PROMPTS, outs) for o in pair]


def test_policy_logprobs_equal_the_rollouts_bitwise_before_and_after_a_step(tmp_path, smollm2_dir):
    a, b = make_tiny_model(tmp_path, seed=0, tie=True), make_tiny_model(tmp_path, seed=1, tie=True)
    # a small pool (retraction), chunks of 8 tokens, pages of 4, several requests at once
    cfg = dict(dtype="float32", num_threads=TEST_THREADS, enable_deterministic_inference=True)
    engine = Engine(model=a, tokenizer=smollm2_dir, kv_cache_memory="48KiB", page_size=4, chunked_prefill_size=8,
                    **cfg)
    engine.update_weights_from_tensor(checkpoint(b), weight_version="step-0")
    before = engine.stats()
    seqs = rollouts(engine, 0)
    stats = engine.stats()
    assert stats["cached_tokens"] > before["cached_tokens"] and stats["num_retractions"] > 0, stats

    policy = KernelPolicy(EngineConfig(model=a, kv_cache_memory="32KiB", **cfg))
    policy.load_weights(checkpoint(b))
    lps = policy.logprobs([(p, o.token_ids) for p, o in seqs])  # all rollouts in one training batch
    for (p, o), lp in zip(seqs, lps):
        assert lp.requires_grad and len(o.token_ids) == 24
        assert torch.equal(lp.detach(), torch.tensor(o.logprobs, dtype=torch.float32))
    alone = policy.logprobs([(seqs[3][0], seqs[3][1].token_ids)])[0]  # a sequence alone: the same bits
    assert torch.equal(alone.detach(), lps[3].detach())

    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    (-sum(lp.sum() for lp in lps)).backward()
    opt.step()
    engine.update_weights_from_tensor(policy.named_tensors(), weight_version="step-1")
    seqs = rollouts(engine, 100)
    with torch.no_grad():
        lps = policy.logprobs([(p, o.token_ids) for p, o in seqs])
    for (p, o), lp in zip(seqs, lps):
        assert o.weight_versions == ["step-1"] * 24
        assert torch.equal(lp, torch.tensor(o.logprobs, dtype=torch.float32))


def test_policy_refuses_what_it_cannot_train(tmp_path):
    path = make_tiny_model(tmp_path)
    base = dict(model=path, dtype="float32", kv_cache_memory="32KiB", num_threads=TEST_THREADS)
    with pytest.raises(ValueError, match="deterministic"):
        KernelPolicy(EngineConfig(**base))
    with pytest.raises(ValueError, match="quantised"):
        KernelPolicy(EngineConfig(**base, enable_deterministic_inference=True, weight_dtype="int4"))
    policy = KernelPolicy(EngineConfig(**base, enable_deterministic_inference=True))
    with pytest.raises(ValueError):
        policy.logprobs([([], [1])])
    with pytest.raises(ValueError):
        policy.logprobs([([1], [256])])
    assert [t.shape for t in policy.logprobs([([1, 2], []), ([3], [4, 5])])] == [(0,), (2,)]
