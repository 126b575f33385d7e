"""Train-inference agreement (issue 16): after a weight update, the logprobs an engine with deterministic
inference returned for the tokens it sampled equal, bit for bit, the trainer's recomputation
(``SequenceScorer``: one lone forward of prompt + completion in the trainer's own runner, loaded with
the same new weights), whatever batching, chunked prefill, cache hits and retraction the rollouts went
through. A scorer on the old weights disagrees (the update did reach the engine).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from test_rl_updates import checkpoint

from idleless.config import EngineConfig
from idleless.engine.engine import Engine
from idleless.model.runner import ModelRunner
from idleless.rl.scoring import SequenceScorer, max_abs_diff
from idleless.sampling_params import SamplingParams

SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [SHARED + [30, 31], SHARED + [40], list(range(50, 90)), [7, 8], SHARED + [30, 31, 5]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_logprobs_equal_the_trainers_bitwise(tmp_path, smollm2_dir, dtype):
    a, b = make_tiny_model(tmp_path, seed=0), make_tiny_model(tmp_path, seed=1)
    # a small pool (retraction), chunks of 8 tokens, pages of 4, several requests at once
    cfg = dict(dtype=dtype, kv_cache_memory="48KiB", num_threads=TEST_THREADS, page_size=4,
               chunked_prefill_size=8, enable_deterministic_inference=True)
    engine = Engine(model=a, tokenizer=smollm2_dir, **cfg)
    engine.update_weights_from_tensor(checkpoint(b), weight_version="step-1")
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=i, logprobs=True, n=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    stats = engine.stats()
    assert stats["cached_tokens"] > 0 and stats["num_retractions"] > 0, stats  # the rollouts went through both

    trainer = ModelRunner(EngineConfig(model=a, tokenizer=smollm2_dir, **{**cfg, "kv_cache_memory": "64KiB"}))
    trainer.load_weights(checkpoint(b))
    scorer = SequenceScorer(trainer)
    old = SequenceScorer(ModelRunner(EngineConfig(model=a, tokenizer=smollm2_dir, **cfg)))
    for prompt, pair in zip(PROMPTS, outs):
        for o in pair:
            assert len(o.token_ids) == 24 and len(o.logprobs) == 24
            assert o.weight_versions == ["step-1"] * 24
            mine = scorer.logprobs(prompt, o.token_ids)
            assert torch.equal(mine, torch.tensor(o.logprobs, dtype=torch.float32))
            assert max_abs_diff(mine.tolist(), o.logprobs) == 0.0
            assert max_abs_diff(old.logprobs(prompt, o.token_ids).tolist(), o.logprobs) > 1e-3
    # all rollouts re-scored in one forward: the same bits
    pairs = [(prompt, o.token_ids) for prompt, pair in zip(PROMPTS, outs) for o in pair]
    for lp, o in zip(scorer.score(pairs), [o for pair in outs for o in pair]):
        assert torch.equal(lp, torch.tensor(o.logprobs, dtype=torch.float32))


def test_scorer_checks_its_input(tmp_path):
    runner = ModelRunner(EngineConfig(model=make_tiny_model(tmp_path), dtype="float32", kv_cache_memory="64KiB",
                                      num_threads=TEST_THREADS))
    scorer = SequenceScorer(runner)
    with pytest.raises(ValueError):
        scorer.logprobs([], [1, 2])
    with pytest.raises(ValueError):
        scorer.logprobs([1], [256])
    assert scorer.logprobs([1, 2], []).shape == (0,)
    assert [t.shape for t in scorer.score([([1, 2], []), ([3], [4, 5])])] == [(0,), (2,)]
    with pytest.raises(ValueError):
        max_abs_diff([0.0], [])
