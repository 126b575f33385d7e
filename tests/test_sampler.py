"""Sampler (idleless/model/sampler.py): truncation masks against brute force, penalties against
hand-computed values, raw logprobs, min_new_tokens, seeded generators."""

from __future__ import annotations

import math

import pytest
import torch

from idleless.engine.request import Request, SamplingParams
from idleless.model.sampler import apply_penalties, sample, truncate

NEG = float("-inf")


def _req(params: SamplingParams, prompt=(5, 6), output=(), seed: int = 0) -> Request:
    r = Request("r", list(prompt), params)
    r.output_ids = list(output)
    r.generator = torch.Generator().manual_seed(seed)
    return r


def _rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g, dtype=torch.float32) * 2


# ---------------------------------------------------------------- brute-force references (float64)


def bf_top_k(row: list[float], k: int) -> set[int]:
    if k <= 0 or k >= len(row):
        return set(range(len(row)))
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, x in enumerate(row) if x >= kth}


def _probs(row: list[float], keep: set[int]) -> dict[int, float]:
    m = max(row[i] for i in keep)
    e = {i: math.exp(row[i] - m) for i in keep}
    z = sum(e.values())
    return {i: v / z for i, v in e.items()}


def bf_top_p(row: list[float], p: float, keep: set[int]) -> tuple[set[int], float]:
    """Smallest most-likely-first set whose probability reaches p (renormalized over ``keep``).
    Also returns how close the decision came to the threshold (to skip float-rounding ties)."""
    probs = _probs(row, keep)
    order = sorted(probs, key=lambda i: -probs[i])
    out, cum, margin = set(), 0.0, 1.0
    for i in order:
        margin = min(margin, abs(cum - p))
        if cum >= p:
            break
        out.add(i)
        cum += probs[i]
    return out, margin


def bf_min_p(row: list[float], min_p: float, keep: set[int]) -> tuple[set[int], float]:
    probs = _probs(row, keep)
    top = max(probs.values())
    margin = min(abs(v - min_p * top) for v in probs.values())
    return {i for i, v in probs.items() if v >= min_p * top}, margin


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > NEG).flatten().tolist())


# ---------------------------------------------------------------- truncation masks


@pytest.mark.parametrize("k", [1, 2, 3, 7, 8, 20, 0, -1])
def test_top_k_mask(k):
    for seed in range(30):
        row = _rows(1, 8, seed)[0]
        assert kept(truncate(row.clone(), k, 1.0, 0.0)) == bf_top_k(row.double().tolist(), k)


def test_top_k_keeps_ties():
    row = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    assert kept(truncate(row, 2, 1.0, 0.0)) == {1, 3}
    assert kept(truncate(row, 3, 1.0, 0.0)) == {1, 2, 3, 4}  # the 3rd value ties with the 4th


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_mask(top_p):
    checked = 0
    for seed in range(60):
        row = _rows(1, 10, seed)[0]
        want, margin = bf_top_p(row.double().tolist(), top_p, set(range(10)))
        if margin < 1e-5:  # the cumulative sum lands on top_p within float32 rounding: ambiguous
            continue
        got = kept(truncate(row.clone(), -1, top_p, 0.0))
        assert got == want, (seed, top_p)
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.3, 0.7, 1.0])
def test_min_p_mask(min_p):
    for seed in range(60):
        row = _rows(1, 10, seed)[0]
        want, margin = bf_min_p(row.double().tolist(), min_p, set(range(10)))
        if margin < 1e-6 and min_p < 1.0:
            continue
        assert kept(truncate(row.clone(), -1, 1.0, min_p)) == want


@pytest.mark.parametrize("k,top_p", [(3, 0.5), (5, 0.9), (2, 0.99)])
def test_top_k_then_top_p(k, top_p):
    """top-p applies to the distribution renormalized over the top-k survivors."""
    for seed in range(40):
        row = _rows(1, 10, seed)[0]
        r = row.double().tolist()
        want, margin = bf_top_p(r, top_p, bf_top_k(r, k))
        if margin < 1e-5:
            continue
        assert kept(truncate(row.clone(), k, top_p, 0.0)) == want


def test_truncation_always_keeps_the_most_likely_token():
    row = torch.tensor([0.0, 10.0, 9.999, -3.0])
    assert kept(truncate(row, -1, 1e-9, 0.0)) == {1}
    assert kept(truncate(row, 1, 1.0, 0.0)) == {1}
    assert 1 in kept(truncate(row, -1, 1.0, 1.0))


def test_samples_stay_in_the_truncated_set_with_the_right_frequencies():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -5.0]])
    p = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    r = _req(p, seed=123)
    trunc = truncate(logits[0] / 0.7, 4, 0.9, 0.0)
    probs = torch.softmax(trunc, -1)
    counts = torch.zeros(6)
    n = 3000
    for _ in range(n):
        counts[sample(logits, [r], set()).next_ids[0]] += 1
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept(trunc)
    # 3000 draws: the standard error of a frequency is <= 0.0092; 0.04 is > 4 sigma
    assert torch.allclose(counts / n, probs, atol=0.04), (counts / n, probs)


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])
    r = _req(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3, 3, 5])
    out = apply_penalties(row.clone(), r)
    # seen: 0, 1, 3, 5 -> positive / 2, negative * 2, zero stays; 2 and 4 untouched
    assert out.tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 0.0]


def test_frequency_and_presence_penalties_hand_computed():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    r = _req(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[0, 2], output=[1, 3, 3])
    out = apply_penalties(row.clone(), r)
    # generated tokens only (the prompt's 0 and 2 are not penalized): 1 once, 3 twice
    assert out.tolist() == pytest.approx([2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25, -2.0])


def test_all_penalties_together_hand_computed():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=1.25, frequency_penalty=-0.5, presence_penalty=1.0)
    r = _req(p, prompt=[0], output=[3, 3, 3])
    out = apply_penalties(row.clone(), r)
    # repetition over {0, 3} first, then -(-0.5 * 3) - 1.0 on token 3
    assert out.tolist() == pytest.approx([1.6, -1.0, 0.5, 2.4 + 1.5 - 1.0])


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    assert sample(logits, [_req(SamplingParams(temperature=0), prompt=[0], output=[1])], set()).next_ids == [1]
    greedy_rep = _req(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0], output=[1])
    assert sample(logits, [greedy_rep], set()).next_ids == [2]  # 3.0 / 1.5 = 2.0 < 2.5
    greedy_freq = _req(SamplingParams(temperature=0, frequency_penalty=0.3), prompt=[0], output=[1, 1])
    assert sample(logits, [greedy_freq], set()).next_ids == [2]  # 3.0 - 0.6 = 2.4 < 2.5


# ---------------------------------------------------------------- logprobs, min_new_tokens, seeds


def test_logprobs_are_raw_log_softmax():
    logits = _rows(3, 12, 7)
    raw = torch.log_softmax(logits, -1)
    settings = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.3, top_p=0.5, top_k=4, min_p=0.1, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.7, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=True,
                       top_logprobs=3),
    ]
    for p in settings:
        reqs = [_req(p, prompt=[0, 1, 2], output=[3, 3], seed=s) for s in range(3)]
        out = sample(logits, reqs, set())
        for i in range(3):
            tok = out.next_ids[i]
            assert out.logprobs[i] == pytest.approx(float(raw[i, tok]), abs=1e-6)
            v, ix = torch.topk(raw[i], 3)
            assert [t for t, _ in out.top_logprobs[i]] == ix.tolist()
            assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(v.tolist(), abs=1e-6)
    # requests that did not ask get None, even in a batch where another asked
    out = sample(logits[:2], [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0, logprobs=True))],
                 set())
    assert out.logprobs[0] is None and out.top_logprobs[0] is None
    assert out.logprobs[1] is not None and out.top_logprobs[1] is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_blocks_eos_and_stop_ids(temperature):
    logits = torch.tensor([[0.0, 0.0, 20.0, 19.0, 18.0, 0.0]])  # eos (2) then stop id (3) most likely
    p = SamplingParams(temperature=temperature, min_new_tokens=2, stop_token_ids=[3], max_new_tokens=10)
    for seed in range(5):
        assert sample(logits, [_req(p, output=[], seed=seed)], {2}).next_ids == [4]
        assert sample(logits, [_req(p, output=[4], seed=seed)], {2}).next_ids == [4]
    if temperature == 0:
        assert sample(logits, [_req(p, output=[4, 4])], {2}).next_ids == [2]  # reached: eos allowed
        ignore = SamplingParams(temperature=0, min_new_tokens=2, ignore_eos=True, stop_token_ids=[3])
        assert sample(logits, [_req(ignore, output=[])], {2}).next_ids == [2]  # only the stop id is banned


def test_seeded_sampling_does_not_depend_on_the_batch():
    logits = _rows(4, 50, 3)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    alone_req = _req(p, seed=42)
    alone = [sample(logits[1:2], [alone_req], set()).next_ids[0] for _ in range(21)]
    batch = [_req(SamplingParams(temperature=1.0), seed=1), _req(p, seed=42), _req(SamplingParams(temperature=0)),
             _req(SamplingParams(temperature=0.5), seed=2)]
    got = [sample(logits, batch, set()).next_ids[1] for _ in range(21)]
    assert got == alone
    other = _req(p, seed=43)
    assert [sample(logits[1:2], [other], set()).next_ids[0] for _ in range(21)] != alone


def test_extreme_settings_do_not_crash_the_sampler():
    """A temperature of 1e-259 (fuzzer-found) overflowed the logits and crashed the whole step:
    it is greedy now, and non-finite probabilities fall back to the argmax."""
    from idleless.engine.request import Request, SamplingParams
    from idleless.model.sampler import sample
    import torch
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    r = Request("x", [0], SamplingParams(temperature=1e-259))
    r.generator = torch.Generator().manual_seed(0)
    assert sample(logits, [r], set()).next_ids == [1]
    r2 = Request("y", [0], SamplingParams(temperature=1e-30, top_k=2))  # not greedy by the rule, overflows
    r2.generator = torch.Generator().manual_seed(0)
    assert sample(logits, [r2], set()).next_ids == [1]
