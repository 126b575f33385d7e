"""Sampler (idleless/model/sampler.py): truncation masks against brute force, penalties against
hand-computed values, draws against float64 reference distributions (chi-square), raw logprobs,
min_new_tokens, and seeded rows giving the same tokens in any batch composition."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from idleless.model.sampler import SamplingRow, apply_penalties, draw, sample, truncate
from idleless.sampling_params import SamplingParams

NEG = float("-inf")


def _row(params: SamplingParams, prompt=(5, 6), output=(), seed: int | None = 0) -> SamplingRow:
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, g, list(prompt), list(output))


def _rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g, dtype=torch.float32) * 2


def _trunc(row: torch.Tensor, k: int, p: float, m: float, **kw) -> torch.Tensor:
    return truncate(row.unsqueeze(0), [k], [p], [m], **kw)[0]


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
    if p >= 1.0:
        return set(keep), 1.0
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
    if min_p <= 0:
        return set(keep), 1.0
    probs = _probs(row, keep)
    top = max(probs.values())
    margin = min(abs(v - min_p * top) for v in probs.values())
    return {i for i, v in probs.items() if v >= min_p * top}, margin


def bf_distribution(logits: list[float], p: SamplingParams, prompt=(), output=(), eos=()) -> dict[int, float]:
    """The distribution a row samples from, in float64: penalties, the min_new_tokens ban,
    temperature, top-k, min-p, top-p, renormalised softmax."""
    x = list(logits)
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(output) < p.min_new_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = NEG
    x = [v / p.temperature for v in x]
    keep = {i for i, v in enumerate(x) if v > NEG} & bf_top_k(x, p.top_k)
    keep = bf_min_p(x, p.min_p, keep)[0]
    keep = bf_top_p(x, p.top_p, keep)[0]
    return _probs(x, keep)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > NEG).flatten().tolist())


def chi_square(counts: Counter, probs: dict[int, float]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected fewer than 5 times are pooled."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), "drew a token outside the support"
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for i, p in probs.items():
        if n * p >= 5:
            cells.append((counts.get(i, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(i, 0), pooled_exp + n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value at the standard-normal quantile z (3.719: p = 1e-4), by the
    Wilson-Hilferty approximation (Wilson & Hilferty 1931)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


# ---------------------------------------------------------------- truncation masks


@pytest.mark.parametrize("k", [1, 2, 3, 7, 8, 20, 0, -1])
def test_top_k_mask(k):
    for seed in range(30):
        row = _rows(1, 8, seed)[0]
        assert kept(_trunc(row.clone(), k, 1.0, 0.0)) == bf_top_k(row.double().tolist(), k)


def test_top_k_keeps_ties():
    row = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    assert kept(_trunc(row, 2, 1.0, 0.0)) == {1, 3}
    assert kept(_trunc(row, 3, 1.0, 0.0)) == {1, 2, 3, 4}  # the 3rd value ties with the 4th


@pytest.mark.parametrize("candidates", [1, 3, 1024])
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_mask(top_p, candidates):
    """Whether the nucleus is found among the candidates or by the full-sort fallback."""
    checked = 0
    for seed in range(60):
        row = _rows(1, 10, seed)[0]
        want, margin = bf_top_p(row.double().tolist(), top_p, set(range(10)))
        if margin < 1e-5:  # the cumulative sum lands on top_p within float32 rounding: ambiguous
            continue
        got = kept(_trunc(row.clone(), -1, top_p, 0.0, candidates=candidates))
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
        assert kept(_trunc(row.clone(), -1, 1.0, min_p)) == want


@pytest.mark.parametrize("k,top_p", [(3, 0.5), (5, 0.9), (2, 0.99)])
def test_top_k_then_top_p(k, top_p):
    """top-p applies to the distribution renormalized over the top-k survivors."""
    for seed in range(40):
        row = _rows(1, 10, seed)[0]
        r = row.double().tolist()
        want, margin = bf_top_p(r, top_p, bf_top_k(r, k))
        if margin < 1e-5:
            continue
        assert kept(_trunc(row.clone(), k, top_p, 0.0)) == want


@pytest.mark.parametrize("candidates", [2, 1024])
def test_mixed_truncation_settings_in_one_batch_match_brute_force(candidates):
    """Every row of one batch has its own top-k / min-p / top-p; each row's mask is the brute-force
    top-k, then min-p, then top-p over the survivors."""
    settings = [(-1, 1.0, 0.0), (3, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.2), (5, 0.8, 0.05),
                (0, 0.9, 0.3), (12, 0.3, 0.0), (1, 1.0, 0.0), (4, 1.0, 0.5), (-1, 0.95, 0.01)]
    R, V = 120, 12
    logits = _rows(R, V, 11)
    params = [settings[i % len(settings)] for i in range(R)]
    before = logits.clone()
    out = truncate(logits, [k for k, _, _ in params], [p for _, p, _ in params], [m for _, _, m in params],
                   candidates=candidates)
    assert torch.equal(logits, before)  # the input is not modified
    checked = 0
    for i, (k, p, m) in enumerate(params):
        r = logits[i].double().tolist()
        keep = bf_top_k(r, k)
        keep, m_margin = bf_min_p(r, m, keep)
        keep, p_margin = bf_top_p(r, p, keep)
        if m_margin < 1e-6 or p_margin < 1e-5:
            continue
        assert kept(out[i]) == keep, (i, k, p, m)
        assert torch.equal(out[i][out[i] > NEG], logits[i][out[i] > NEG])  # survivors unchanged
        checked += 1
    assert checked > 100


def test_truncation_always_keeps_the_most_likely_token():
    row = torch.tensor([0.0, 10.0, 9.999, -3.0])
    assert kept(_trunc(row, -1, 1e-9, 0.0)) == {1}
    assert kept(_trunc(row, 1, 1.0, 0.0)) == {1}
    assert 1 in kept(_trunc(row, -1, 1.0, 1.0))
    assert kept(_trunc(row, -1, 1e-9, 0.0, candidates=1)) == {1}


# ---------------------------------------------------------------- draws against the distribution


def test_draws_follow_the_softmax():
    """20,000 rows of the same logits, sharing one seeded generator, in one call: the token
    frequencies pass a chi-square test against the float64 softmax; and the same test rejects a
    wrong distribution (the softmax at temperature 1.3), so it has the power to notice."""
    base = [1.5, 0.2, -0.7, 0.9, 2.1, -2.0, 0.0, 1.1]
    n = 20000
    p = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(2024)
    rows = [SamplingRow(p, g, [], []) for _ in range(n)]
    counts = Counter(sample(torch.tensor([base] * n), rows, set()).next_ids)
    stat, df = chi_square(counts, _probs(base, set(range(8))))
    assert stat < chi_square_critical(df), (stat, df)
    wrong, df = chi_square(counts, _probs([v / 1.3 for v in base], set(range(8))))
    assert wrong > chi_square_critical(df)


def test_penalised_truncated_draws_follow_the_brute_force_distribution():
    """Four settings interleaved in one batch (penalties, min_new_tokens, top-k + top-p, min-p,
    temperature); each setting's 6,000 draws pass a chi-square test against its float64
    brute-force distribution and never leave its support."""
    base = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2, 0.8, -1.0, 1.9]
    prompt, output = [0, 3], [1, 1, 6]
    settings = [
        SamplingParams(temperature=0.7, top_k=6, top_p=0.85),
        SamplingParams(temperature=1.3, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=0.9, min_p=0.25, min_new_tokens=5, stop_token_ids=[9]),
        SamplingParams(temperature=0.5, top_p=0.7, min_p=0.1, repetition_penalty=0.8),
    ]
    per = 6000
    g = torch.Generator().manual_seed(7)
    rows = [SamplingRow(settings[i % 4], g, prompt, output) for i in range(per * 4)]
    ids = sample(torch.tensor([base] * (per * 4)), rows, {0}).next_ids
    for s, p in enumerate(settings):
        want = bf_distribution(base, p, prompt, output, eos=[0])
        counts = Counter(ids[s::4])
        stat, df = chi_square(counts, want)
        assert df >= 1 and stat < chi_square_critical(df), (s, stat, df, counts, want)


def test_samples_stay_in_the_truncated_set_with_the_right_frequencies():
    """Consecutive draws from one request's generator (one row per call)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -5.0]])
    p = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    r = _row(p, seed=123)
    trunc = _trunc(logits[0] / 0.7, 4, 0.9, 0.0)
    probs = torch.softmax(trunc, -1)
    counts = torch.zeros(6)
    n = 3000
    for _ in range(n):
        counts[sample(logits, [r], set()).next_ids[0]] += 1
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept(trunc)
    # 3000 draws: the standard error of a frequency is <= 0.0092; 0.04 is > 4 sigma
    assert torch.allclose(counts / n, probs, atol=0.04), (counts / n, probs)


def test_draw_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 3.0], [1.0, 0.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        ids = draw(probs, [g] * 4).tolist()
        assert ids[0] == 2 and ids[1] in (0, 3) and ids[2] == 3 and ids[3] == 0


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed():
    row = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    out = apply_penalties(row, [_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3, 3, 5])])
    # seen: 0, 1, 3, 5 -> positive / 2, negative * 2, zero stays; 2 and 4 untouched
    assert out[0].tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 0.0]


def test_frequency_and_presence_penalties_hand_computed():
    row = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = _row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[0, 2], output=[1, 3, 3])
    out = apply_penalties(row, [r])
    # generated tokens only (the prompt's 0 and 2 are not penalized): 1 once, 3 twice
    assert out[0].tolist() == pytest.approx([2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25, -2.0])


def test_all_penalties_together_hand_computed():
    row = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    p = SamplingParams(repetition_penalty=1.25, frequency_penalty=-0.5, presence_penalty=1.0)
    out = apply_penalties(row, [_row(p, prompt=[0], output=[3, 3, 3])])
    # repetition over {0, 3} first, then -(-0.5 * 3) - 1.0 on token 3
    assert out[0].tolist() == pytest.approx([1.6, -1.0, 0.5, 2.4 + 1.5 - 1.0])


def test_penalties_of_different_rows_in_one_batch_hand_computed():
    """Each row is penalised by its own settings and history; a row without penalties is untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0],
                           [2.0, -1.0, 0.5, 3.0],
                           [2.0, -1.0, 0.5, 3.0],
                           [2.0, -1.0, 0.5, 3.0]])
    rows = [_row(SamplingParams(repetition_penalty=2.0), prompt=[1], output=[0]),
            _row(SamplingParams(), prompt=[0, 1, 2], output=[3, 3]),
            _row(SamplingParams(frequency_penalty=1.0), prompt=[0], output=[2, 2, 2, 1]),
            _row(SamplingParams(repetition_penalty=0.5, presence_penalty=2.0), prompt=[], output=[3])]
    out = apply_penalties(logits, rows)
    want = [[1.0, -2.0, 0.5, 3.0],
            [2.0, -1.0, 0.5, 3.0],
            [2.0, -2.0, -2.5, 3.0],
            [2.0, -1.0, 0.5, 6.0 - 2.0]]
    assert torch.allclose(out, torch.tensor(want), rtol=0, atol=1e-6), out


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    assert sample(logits, [_row(SamplingParams(temperature=0), prompt=[0], output=[1])], set()).next_ids == [1]
    greedy_rep = _row(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0], output=[1])
    assert sample(logits, [greedy_rep], set()).next_ids == [2]  # 3.0 / 1.5 = 2.0 < 2.5
    greedy_freq = _row(SamplingParams(temperature=0, frequency_penalty=0.3), prompt=[0], output=[1, 1])
    assert sample(logits, [greedy_freq], set()).next_ids == [2]  # 3.0 - 0.6 = 2.4 < 2.5


# ---------------------------------------------------------------- greedy, logprobs, min_new_tokens


def test_greedy_takes_the_first_maximum():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 1.0, 5.0]])
    plain = [_row(SamplingParams(temperature=0)), _row(SamplingParams(top_k=1))]
    assert sample(logits, plain, set()).next_ids == [1, 0]
    # the same through the penalised path (a presence penalty on an unrelated token)
    adjusted = [_row(SamplingParams(temperature=0, presence_penalty=0.5), output=[3]),
                _row(SamplingParams(top_k=1, presence_penalty=0.5), output=[2])]
    assert sample(logits, adjusted, set()).next_ids == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(dtype):
    logits = _rows(3, 12, 7).to(dtype)
    raw = torch.log_softmax(logits.double(), -1)
    settings = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.3, top_p=0.5, top_k=4, min_p=0.1, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.7, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=True,
                       top_logprobs=3),
    ]
    for p in settings:
        rows = [_row(p, prompt=[0, 1, 2], output=[3, 3], seed=s) for s in range(3)]
        out = sample(logits, rows, set())
        for i in range(3):
            tok = out.next_ids[i]
            assert out.logprobs[i] == pytest.approx(float(raw[i, tok]), abs=1e-5)
            v, ix = torch.topk(raw[i], 3)
            assert [t for t, _ in out.top_logprobs[i]] == ix.tolist()
            assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(v.tolist(), abs=1e-5)
    # rows that did not ask get None, even in a batch where another asked; top_logprobs differ per row
    rows = [_row(SamplingParams(temperature=0)), _row(SamplingParams(temperature=0, logprobs=True)),
            _row(SamplingParams(temperature=0.8, top_logprobs=5))]
    out = sample(logits, rows, set())
    assert out.logprobs[0] is None and out.top_logprobs[0] is None
    assert out.logprobs[1] is not None and out.top_logprobs[1] is None
    assert out.logprobs[2] == pytest.approx(float(raw[2, out.next_ids[2]]), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[2]] == torch.topk(raw[2], 5).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_blocks_eos_and_stop_ids(temperature):
    logits = torch.tensor([[0.0, 0.0, 20.0, 19.0, 18.0, 0.0]])  # eos (2) then stop id (3) most likely
    p = SamplingParams(temperature=temperature, min_new_tokens=2, stop_token_ids=[3], max_new_tokens=10)
    for seed in range(5):
        assert sample(logits, [_row(p, output=[], seed=seed)], {2}).next_ids == [4]
        assert sample(logits, [_row(p, output=[4], seed=seed)], {2}).next_ids == [4]
    if temperature == 0:
        assert sample(logits, [_row(p, output=[4, 4])], {2}).next_ids == [2]  # reached: eos allowed
        ignore = SamplingParams(temperature=0, min_new_tokens=2, ignore_eos=True, stop_token_ids=[3])
        assert sample(logits, [_row(ignore, output=[])], {2}).next_ids == [2]  # only the stop id is banned
    # an eos id outside the logits' vocabulary cannot be drawn and is skipped, not an error
    assert sample(logits, [_row(p, output=[])], {2, 10_000}).next_ids == [4]


# ---------------------------------------------------------------- seeds and batch composition


TARGETS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3),
    SamplingParams(temperature=3.0, top_p=0.97, presence_penalty=0.2),  # nucleus > 1024: full sort
    SamplingParams(temperature=1.1, top_k=50, min_p=0.02, presence_penalty=0.5),
    SamplingParams(temperature=0.6, top_p=0.5, top_k=300, min_new_tokens=4, stop_token_ids=[7]),
]


def _run(target_params, position: int, others: list[tuple[SamplingParams, int | None]], logits_seq, dtype):
    """The target row (seed 42) at ``position`` among ``others`` (params, seed; None = no generator)
    for len(logits_seq) decode steps; each row's output grows by its own tokens. Returns the
    target's tokens."""
    specs = list(others)
    specs.insert(position, (target_params, 42))
    gens = [None if seed is None else torch.Generator().manual_seed(seed) for _, seed in specs]
    outputs = [[] for _ in specs]
    got = []
    for step, target_logits in enumerate(logits_seq):
        other_logits = _rows(len(specs), target_logits.numel(), 1000 + step)
        logits = other_logits.clone()
        logits[position] = target_logits
        rows = [SamplingRow(p, g, [3, 5, 7], list(o)) for (p, _), g, o in zip(specs, gens, outputs)]
        ids = sample(logits.to(dtype), rows, {0}).next_ids
        for o, t in zip(outputs, ids):
            o.append(t)
        got.append(ids[position])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", range(len(TARGETS)))
def test_seeded_rows_give_the_same_tokens_in_any_batch_composition(target, dtype):
    """The same row (params + seed) alone and inside batches of other sizes and orders, next to
    greedy rows (plain and penalised), other seeded rows and rows without a generator, draws the
    same tokens. V = 2048 so that top-p runs both its candidate search and its full-sort fallback."""
    V, steps = 2048, 12
    logits_seq = [_rows(1, V, 500 + s)[0] for s in range(steps)]
    p = TARGETS[target]
    greedy, greedy_pen = SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.3)
    compositions = [
        (0, []),
        (1, [(SamplingParams(temperature=1.0), 1), (greedy, 2), (SamplingParams(temperature=0.5, top_p=0.9), 3)]),
        (3, [(greedy, 1), (greedy, 2), (greedy, 3)]),
        (0, [(greedy_pen, 1), (SamplingParams(temperature=2.0, top_k=5, min_p=0.1), 9)]),
        (2, [(SamplingParams(temperature=0.5, top_p=0.9), 3), (greedy, 2), (SamplingParams(temperature=1.0), 1)]),
        (4, [(SamplingParams(temperature=0.9), None)] * 4 + [(p, 42)] * 3),  # even the same params and seed
        (1, [(SamplingParams(top_p=0.3, frequency_penalty=1.0), 5)]),
    ]
    alone = _run(p, 0, [], logits_seq, dtype)
    for position, others in compositions[1:]:
        assert _run(p, position, others, logits_seq, dtype) == alone, (position, others)
    # and the seed matters
    other_seed = [SamplingRow(p, torch.Generator().manual_seed(43), [3, 5, 7], [])]
    assert [sample(x.unsqueeze(0).to(dtype), other_seed, {0}).next_ids[0] for x in logits_seq] != alone


def test_bf16_logits_sample_as_their_float32_upcast():
    logits = _rows(6, 300, 4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.9, top_p=0.9, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=20, repetition_penalty=1.1)]

    def run(x):
        rows = [SamplingRow(params[i % 3], torch.Generator().manual_seed(i), [1, 2], [3]) for i in range(6)]
        return sample(x, rows, set())

    a, b = run(logits), run(logits.float())
    assert a.next_ids == b.next_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


def test_rows_without_a_generator_draw_from_torchs_default_generator():
    logits = _rows(3, 40, 5)
    rows = [_row(SamplingParams(temperature=1.0), seed=None) for _ in range(3)]
    torch.manual_seed(0)
    first = [sample(logits, rows, set()).next_ids for _ in range(5)]
    torch.manual_seed(0)
    assert [sample(logits, rows, set()).next_ids for _ in range(5)] == first


# ---------------------------------------------------------------- edges and structure


def test_extreme_settings_do_not_crash_the_sampler():
    """A temperature of 1e-259 (fuzzer-found) overflowed the logits and crashed the whole step:
    it is greedy now, and non-finite probabilities fall back to the argmax."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert sample(logits, [_row(SamplingParams(temperature=1e-259))], set()).next_ids == [1]
    r2 = _row(SamplingParams(temperature=1e-30, top_k=2))  # not greedy by the rule
    assert sample(logits, [r2], set()).next_ids == [1]
    # an infinite logit makes the probabilities NaN: that row takes the argmax, its neighbour samples
    inf = torch.tensor([[1.0, float("inf"), 2.0], [0.0, 0.0, 50.0]])
    rows = [_row(SamplingParams(temperature=0.7, top_p=0.9)), _row(SamplingParams(temperature=1.0))]
    assert sample(inf, rows, set()).next_ids == [1, 2]


def test_rows_must_match_the_logits():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [_row(SamplingParams())], set())


def test_sampler_does_not_import_the_engine():
    """Data flows engine -> runner -> sampler: the sampler's own imports never name the engine."""
    import ast
    import idleless.model.sampler as mod
    tree = ast.parse(open(mod.__file__).read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [m for m in names if m.startswith("idleless.engine")], names


def test_keyed_uniform_is_a_pure_function_spread_evenly():
    from idleless.model.sampler import keyed_uniform
    assert keyed_uniform(7, 3) == keyed_uniform(7, 3)
    vals = [keyed_uniform(s, p) for s in (0, 1, 2**63 - 1, -5) for p in range(2500)]
    assert all(0.0 <= v < 1.0 for v in vals)
    assert len(set(vals)) == len(vals)
    # chi-square over 20 equal bins, 10,000 values (a pure function: the same values on every run);
    # 43.8 is the 0.999 quantile of chi-square with 19 degrees of freedom
    counts = Counter(int(v * 20) for v in vals)
    expected = len(vals) / 20
    assert sum((counts[b] - expected) ** 2 / expected for b in range(20)) < 43.8
    # neighbouring seeds and positions are not correlated: lag-1 correlation near 0
    xs = [keyed_uniform(11, p) for p in range(5000)]
    m = sum(xs) / len(xs)
    cov = sum((a - m) * (b - m) for a, b in zip(xs, xs[1:])) / (len(xs) - 1)
    assert abs(cov / (1 / 12)) < 0.05


def test_a_seeded_rows_token_depends_on_its_position_and_probabilities_only():
    """Rows with a seed take keyed_uniform(seed, len(output_ids)): the inverse-CDF token of that
    number, whatever rows are beside it and in whatever order (a verify's rows and a decode's agree)."""
    from idleless.model.sampler import keyed_uniform
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, None, [1], [2] * (i % 3), seed=100 + i // 3) for i in range(6)]
    out = sample(logits, rows, set()).next_ids
    for i, r in enumerate(rows):
        cdf = torch.softmax(logits[i].double(), -1).cumsum(-1)
        u = keyed_uniform(r.seed, len(r.output_ids))
        assert out[i] == int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                                right=True))
        assert sample(logits[i:i + 1], [r], set()).next_ids == [out[i]]  # alone
    rev = sample(logits.flip(0), rows[::-1], set()).next_ids
    assert rev[::-1] == out


def test_top_logprobs_of_a_row_do_not_depend_on_the_other_rows_k():
    """A row's top pairs are its k most likely tokens, ties by ascending token id, whatever k the other rows
    of the call ask for (a breaker found torch.topk's tie order change with k: a greedy request's
    top_logprobs changed beside a request asking for 20). Brute force: sort by (-logprob, id)."""
    from idleless.model.sampler import token_logprobs

    g = torch.Generator().manual_seed(3)
    row = torch.randint(0, 4, (1, 300), generator=g).float()  # few distinct values: ties everywhere
    lp = torch.log_softmax(row, -1)[0]
    for k in (1, 2, 3, 5, 17):
        want = sorted(range(300), key=lambda i: (-float(lp[i]), i))[:k]
        alone = token_logprobs(row, torch.tensor([0]), [k])[1][0]
        beside = token_logprobs(row.repeat(3, 1), torch.tensor([0, 1, 2]), [40, k, 300])[1][1]
        assert [t for t, _ in alone] == [t for t, _ in beside] == want
        assert [v for _, v in alone] == [float(lp[i]) for i in want]
    nan_row = torch.full((1, 8), float("nan"))
    assert len(token_logprobs(nan_row, torch.tensor([0]), [3])[1][0]) == 3
