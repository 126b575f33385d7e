"""Tensor parallelism (idleless.dist) against one rank, on tiny random float32 models through the offline
Engine: TP=2 samples the same greedy tokens and reports the same logprobs (sampled, top-k and prompt
logprobs, i.e. log-softmax of the logits) as TP=1 up to TOL; a size that does not divide the heads, and
quantised weights, are refused before any process starts; a killed worker ends the next step in an
error instead of a hang.

Tolerance: each row-parallel product (o_proj, down_proj) is the sum of two partial float32 dot products
instead of one, so the logits move in the last bits (~1e-6 relative); logprobs of these models are
O(10), hence TOL = 1e-4 absolute.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from conftest import make_tiny_model
from idleless.engine.engine import Engine
from idleless.sampling_params import SamplingParams

TOL = 1e-4


def _add_tokenizer(path: str, vocab_size: int) -> str:
    """A word-level tokenizer of ``vocab_size`` ids (<unk> 0, <s> 1, </s> 2, then t3, t4, ...) saved in
    ``path``, so the offline Engine can load the tiny model (prompts are given as ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def _engine(path: str, tp: int) -> Engine:
    return Engine(model=path, dtype="float32", kv_cache_memory="4MiB", num_threads=1, page_size=4,
                  chunked_prefill_size=16, tensor_parallel_size=tp)


def _close(engine: Engine) -> None:
    tp = engine.core.runner.tp
    if tp is not None:
        tp.close()


PROMPTS = [[5, 17, 3, 99], [42] * 9, list(range(10, 41))]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5,
                        prompt_logprobs=5)


@pytest.mark.parametrize("arch,tie,vocab", [
    ("qwen2", True, 251),
    pytest.param("llama", False, 256, marks=pytest.mark.slow),  # the untied lm_head; ~17 s on a loaded 2-core box
], ids=["qwen2-tied-bias-odd-vocab", "llama-untied"])
def test_tp2_equals_tp1(tmp_path, arch, tie, vocab):
    """Column-parallel q/k/v (with Qwen2's biases) and gate/up, row-parallel o/down, the vocabulary-
    parallel embedding and lm_head (tied, and a vocabulary of 251 that 2 ranks split 126 + 125 with one
    padded row), and KV heads split: 4 heads / 2 KV heads -> 2 / 1 per rank."""
    path = _add_tokenizer(make_tiny_model(tmp_path, arch=arch, tie=tie, vocab_size=vocab), vocab)
    ref = _engine(path, 1).generate(PROMPTS, PARAMS, use_tqdm=False)
    engine = _engine(path, 2)
    try:
        assert engine.core.runner.pool.k_cache.shape[2] == 1  # this rank's one KV head of two
        outs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        from idleless.rl.updates import WeightUpdateError
        name = "model.norm.weight"
        with pytest.raises(WeightUpdateError, match="not supported with --tp-size > 1"):
            engine.update_weights_from_tensor([(name, torch.ones(engine.core.runner.model_config.hidden_size))])
        assert engine.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].token_ids == outs[0].token_ids  # unchanged
    finally:
        _close(engine)
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=TOL, rtol=0)
        for a, b in zip(o.top_logprobs, r.top_logprobs):
            assert [t for t, _ in a] == [t for t, _ in b]
            torch.testing.assert_close(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]),
                                       atol=TOL, rtol=0)
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(r.prompt_token_ids)
        for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert abs(a.logprob - b.logprob) <= TOL and a.rank == b.rank


def test_size_not_dividing_the_heads_is_refused(tmp_path):
    path = make_tiny_model(tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"--tp-size 3 must divide .*num_attention_heads = 4, "
                                         r"num_key_value_heads = 2"):
        _engine(path, 3)
    with pytest.raises(ValueError, match=r"--tp-size 4 must divide the model's num_key_value_heads = 2"):
        _engine(path, 4)


def test_quantised_weights_are_refused_with_the_way_out(tmp_path):
    path = make_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="add --weight-dtype bf16"):
        Engine(model=path, dtype="float32", kv_cache_memory="4MiB", num_threads=1, weight_dtype="int8",
               tensor_parallel_size=2)


def test_killed_worker_ends_in_an_error_not_a_hang(tmp_path):
    from idleless.dist.group import TensorParallelError

    path = _add_tokenizer(make_tiny_model(tmp_path), 256)
    engine = _engine(path, 2)
    try:
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(engine.generate([5, 6, 7], greedy, use_tqdm=False).token_ids) == 4
        worker = engine.core.runner.tp.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        caught: list[BaseException] = []

        def run():
            try:
                engine.generate([8, 9, 10], greedy, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001
                caught.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)  # a hang would leave the thread running
        assert not t.is_alive()
        assert len(caught) == 1 and isinstance(caught[0], TensorParallelError)
        assert f"pid {worker.pid}) exited with code -{int(signal.SIGKILL)}" in str(caught[0])
    finally:
        _close(engine)


@pytest.mark.parametrize("script,message", [
    ("import sys; sys.exit(3)", "exited with code 3"),
    ("import pickle, sys, zmq; s = zmq.Context().socket(zmq.PUSH); s.connect(sys.argv[1]); "
     "s.send(pickle.dumps(('failed', 1, 'Traceback: boom'))); s.close(linger=2000); sys.exit(1)",
     "rank 1 failed to start:\nTraceback: boom"),
], ids=["exits", "reports-a-failure"])
def test_worker_start_failure_is_an_error(script, message):
    """Rank 0's wait for its workers ends in TensorParallelError when a worker exits or reports a failure
    (stand-in worker processes, so no model loads)."""
    import subprocess
    import sys

    import zmq

    from idleless.dist.group import TensorParallelError, TPGroup
    from idleless.dist.worker import TensorParallel

    ctx = zmq.Context()
    ready = ctx.socket(zmq.PULL)
    port = ready.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", script, f"tcp://127.0.0.1:{port}"])
    tp = TensorParallel(None, TPGroup(0, 2), None, (ctx, ready, []), [proc])
    try:
        with pytest.raises(TensorParallelError, match=message):
            tp.connect()
    finally:
        tp.close()
