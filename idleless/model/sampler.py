"""Sampling: penalties, temperature, top-k / top-p / min-p, seeded per-row draws, logprobs.

A pure function of the logits and, per row, the sampling parameters (logit bias included), the
token history and a torch.Generator: it knows nothing of engine requests. All rows that sample (temperature > 0) go
through one vectorised pass — penalties, temperature and truncation are batched tensor ops with
per-row parameter tensors (the shape of vLLM v1's ``Sampler`` and SGLang's sampler) — and then one
inverse-CDF draw that takes a single uniform number per row, so the same seed gives the same tokens
whatever else is in the batch. The engine keys that number by (seed, output position)
(``keyed_uniform``) rather than drawing it from a stream: a token then depends on its position's
probabilities and the seed only, never on how many numbers earlier steps consumed, which is what
lets a speculative verify (several positions in one step, some rejected) give the same tokens as
plain decoding.

Returned logprobs are the model's raw log-softmax, taken before penalties, temperature and
truncation (vLLM's default ``raw_logprobs``), so they do not change with sampling settings; they
come from ``token_logprobs``, which the runner also uses for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from idleless.sampling_params import SamplingParams

NEG_INF = float("-inf")
# top-p first looks for the nucleus among this many most likely tokens (a top-k, far cheaper than
# sorting the vocabulary); rows whose nucleus is larger fall back to a full sort.
TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingRow:
    """One row to sample: its parameters, its own generator, and its token history for penalties.

    generator: the row's torch.Generator (any device); None draws from torch's default generator.
    Rows may share a generator: they then draw from it in row order.
    prompt_ids: for repetition_penalty. output_ids: generated so far, for repetition, frequency
    and presence penalties and for min_new_tokens.
    seed: when set, the row's uniform is ``keyed_uniform(seed, len(output_ids))`` and ``generator``
    is not used.
    """

    params: SamplingParams
    generator: Optional[torch.Generator]
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: Optional[int] = None


@dataclass
class SampleOutput:
    """next_ids [N]; logprobs[i] is the sampled token's raw logprob (None unless asked);
    top_logprobs[i] a list of (token_id, logprob), most likely first (None unless asked)."""

    next_ids: list[int]
    logprobs: list[Optional[float]]
    top_logprobs: list[Optional[list[tuple[int, float]]]]


def _index(ix: list[int], n: int, device) -> Optional[torch.Tensor]:
    """Row indices as a tensor, or None when they are all n rows (no gather needed)."""
    return None if len(ix) == n else torch.tensor(ix, dtype=torch.int64, device=device)


def _take(x: torch.Tensor, ix: Optional[torch.Tensor]) -> torch.Tensor:
    return x if ix is None else x.index_select(0, ix)


def _put(x: torch.Tensor, ix: Optional[torch.Tensor], sub: torch.Tensor) -> torch.Tensor:
    """x with rows ix replaced by sub (a new tensor; sub itself when ix covers every row)."""
    return sub if ix is None else x.index_copy(0, ix, sub)


def _column(values: Sequence[float], dtype: torch.dtype, device) -> torch.Tensor:
    """Per-row parameters as a [R, 1] tensor that broadcasts over the vocabulary."""
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _token_index(seqs: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) int64 index pairs, flat, for every token of every sequence (repeats kept)."""
    toks = torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in seqs])
    rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s) for s in seqs]))
    return rows.to(device), toks.to(device)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's ``params.logit_bias`` (OpenAI's: token id -> bias) to logits [R, V] (float32), in
    place; returns logits. One indexed add over the (row, token) pairs of the rows that have a bias;
    the other rows are untouched. Ids outside [0, V) are skipped (SamplingParams.validate refuses
    them against the tokenizer's vocabulary first)."""
    V = logits.shape[1]
    r_ix: list[int] = []
    t_ix: list[int] = []
    bias: list[float] = []
    for j, r in enumerate(rows):
        for t, b in (r.params.logit_bias or {}).items():
            if 0 <= t < V:
                r_ix.append(j)
                t_ix.append(t)
                bias.append(b)
    if t_ix:
        dev = logits.device
        logits.index_put_((torch.tensor(r_ix, device=dev), torch.tensor(t_ix, device=dev)),
                          torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalise logits [R, V] (float32) in place, row r by rows[r]; returns logits.

    Repetition (HF / CTRL, arXiv 1909.05858) over the prompt and generated tokens: a seen token's
    positive logit is divided by the penalty, a negative one multiplied. Then frequency and presence
    (OpenAI API reference) over generated tokens only: subtract frequency_penalty * count and
    presence_penalty * (count > 0). Rows without penalties are untouched; the rest are penalised
    together (a [rows, V] seen-mask / count tensor, no loop over the vocabulary).
    """
    V, dev = logits.shape[1], logits.device
    rep = [j for j, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        r_ix, t_ix = _token_index([list(rows[j].prompt_ids) + list(rows[j].output_ids) for j in rep], dev)
        seen = torch.zeros(len(rep), V, dtype=torch.bool, device=dev)
        seen[r_ix, t_ix] = True
        ix = torch.tensor(rep, device=dev)
        sub = logits[ix]
        pen = _column([rows[j].params.repetition_penalty for j in rep], logits.dtype, dev)
        logits[ix] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    fp = [j for j, r in enumerate(rows)
          if (r.params.frequency_penalty or r.params.presence_penalty) and len(r.output_ids)]
    if fp:
        r_ix, t_ix = _token_index([rows[j].output_ids for j in fp], dev)
        counts = torch.zeros(len(fp), V, dtype=logits.dtype, device=dev)
        counts.index_put_((r_ix, t_ix), torch.ones(len(t_ix), dtype=logits.dtype, device=dev), accumulate=True)
        freq = _column([rows[j].params.frequency_penalty for j in fp], logits.dtype, dev)
        pres = _column([rows[j].params.presence_penalty for j in fp], logits.dtype, dev)
        ix = torch.tensor(fp, device=dev)
        logits[ix] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def ban_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_ids: set[int]) -> torch.Tensor:
    """min_new_tokens: set to -inf, in place, the eos ids (unless ignore_eos) and stop_token_ids of
    each row that has generated fewer than min_new_tokens tokens. logits [R, V]; returns logits.
    Ids outside [0, V) cannot be sampled and are skipped."""
    V = logits.shape[1]
    r_ix: list[int] = []
    t_ix: list[int] = []
    for j, r in enumerate(rows):
        p = r.params
        if len(r.output_ids) < p.min_new_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            toks = [t for t in sorted(banned) if 0 <= t < V]
            r_ix += [j] * len(toks)
            t_ix += toks
    if t_ix:
        logits[torch.tensor(r_ix, device=logits.device), torch.tensor(t_ix, device=logits.device)] = NEG_INF
    return logits


def truncate(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float],
             *, candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Mask (set to -inf) logits [R, V] float32, already divided by the temperature; row r by
    top_k[r], top_p[r], min_p[r]. Returns a new tensor; the input is not modified.

    In order: top-k keeps the logits >= the k-th largest (ties kept; k <= 0 or >= V disables);
    min-p (arXiv 2407.01082) drops probabilities below min_p * the largest (0 disables); top-p
    (Holtzman et al., arXiv 1904.09751) keeps the smallest most-likely-first set whose probability,
    renormalised over the survivors of the previous two, reaches top_p (1 disables). The most likely
    token is always kept. Each step runs only on the rows that use it. top-p first seeks the nucleus
    among the ``candidates`` most likely tokens (a top-k) and sorts the whole row only when the
    nucleus is larger.
    """
    R, V = logits.shape
    dev = logits.device
    out = logits
    k_rows = [j for j in range(R) if 0 < top_k[j] < V]
    if k_rows:
        ix = _index(k_rows, R, dev)
        sub = _take(out, ix)
        ks = [top_k[j] for j in k_rows]
        kth = sub.topk(max(ks), -1).values.gather(1, _column([k - 1 for k in ks], torch.int64, dev))
        out = _put(out, ix, sub.masked_fill(sub < kth, NEG_INF))
    m_rows = [j for j in range(R) if min_p[j] > 0]
    if m_rows:
        ix = _index(m_rows, R, dev)
        sub = _take(out, ix)
        probs = torch.softmax(sub, -1)
        floor = probs.amax(-1, keepdim=True) * _column([min_p[j] for j in m_rows], probs.dtype, dev)
        out = _put(out, ix, sub.masked_fill(probs < floor, NEG_INF))
    p_rows = [j for j in range(R) if top_p[j] < 1.0]
    if p_rows:
        ix = _index(p_rows, R, dev)
        sub = _take(out, ix)
        probs = torch.softmax(sub, -1)
        tp = _column([top_p[j] for j in p_rows], probs.dtype, dev)
        keep = _nucleus(probs, tp, min(candidates, V))
        out = _put(out, ix, sub.masked_fill(~keep, NEG_INF))
    return out


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask [R, V] of each row's top-p nucleus: the tokens, most likely first, whose preceding
    cumulative probability is below top_p [R, 1] (so the first always stays). Searched among the k
    most likely; rows whose k most likely do not reach top_p are sorted in full."""
    V = probs.shape[1]
    pv, pi = probs.topk(k, -1) if k < V else probs.sort(-1, descending=True)
    cum = pv.cumsum(-1)
    inside = (cum - pv) < top_p
    inside[:, 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, pi, inside)
    if k < V:
        # A row whose k most likely tokens reach top_p has its nucleus among them; the others sort.
        short = (cum[:, -1:] < top_p).squeeze(1).nonzero().squeeze(1)
        if short.numel():
            keep[short] = _nucleus(probs[short], top_p[short], V)
    return keep


_MASK64 = (1 << 64) - 1


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, position): two rounds of the
    SplitMix64 finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014) over the seed and the position, the top 53 bits as a float64. Any int seed
    (taken mod 2**64) and position >= 0."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for _ in range(2):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
    return (z >> 11) * (1.0 / (1 << 53))


def _uniforms(generators: Sequence[Optional[torch.Generator]], device,
              keys: Optional[Sequence[Optional[tuple[int, int]]]] = None) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row [R]: ``keyed_uniform(*keys[r])`` where a key is given,
    else from the row's generator (in row order, so rows sharing a generator draw one after
    another) or, for None, torch's default generator."""
    keys = keys or [None] * len(generators)
    u = [keyed_uniform(*k) if k is not None else
         float(torch.rand((), dtype=torch.float64, generator=g, device=g.device)) if g is not None else None
         for g, k in zip(generators, keys)]
    shared = [j for j, x in enumerate(u) if x is None]
    if shared:
        for j, x in zip(shared, torch.rand(len(shared), dtype=torch.float64).tolist()):
            u[j] = x
    return torch.tensor(u, dtype=torch.float64, device=device)


def draw(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]],
         keys: Optional[Sequence[Optional[tuple[int, int]]]] = None) -> torch.Tensor:
    """One token per row of probs [R, V] (non-negative, rows need not sum to 1): int64 [R].

    Inverse-CDF sampling: the first token whose cumulative probability (float64) exceeds u * total,
    u uniform in [0, 1): ``keyed_uniform(*keys[r])`` where keys[r] (seed, position) is given, else
    from generators[r] — one random number per row, so a row's token depends only on its
    probabilities and its key (or its generator's state), never on the other rows. Tokens of zero
    probability are never drawn.
    """
    R, V = probs.shape
    cdf = probs.to(torch.float64).cumsum(-1)
    total = cdf[:, -1:]
    u = _uniforms(generators, probs.device, keys).unsqueeze(1) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total: a token exists
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=V - 1)


def _adjusted(r: SamplingRow) -> bool:
    """Whether the row's logits change before its choice (a logit bias, penalties or a min_new_tokens
    ban)."""
    p = r.params
    return (bool(p.logit_bias) or p.repetition_penalty != 1.0 or bool(p.frequency_penalty)
            or bool(p.presence_penalty) or len(r.output_ids) < p.min_new_tokens)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A token bitmask int32 [M, ceil(V / 32)] (bit b of word w allows token 32 * w + b, least
    significant bit first: xgrammar's and vLLM's layout) as bool [M, V] (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_ids: set[int],
           token_mask: Optional[tuple[torch.Tensor, Sequence[int]]] = None) -> SampleOutput:
    """Sample one token per row. logits: [N, V] (float32 or bfloat16, upcast to float32 here), row i
    by rows[i] (len N); eos_ids: the model's end-of-sequence ids, banned by min_new_tokens.
    token_mask: (bitmask int32 [M, ceil(V / 32)], M distinct row indices): those rows may only choose
    tokens their bitmask allows (:func:`unpack_bitmask`; structured outputs); the disallowed logits
    become -inf before anything else (as a grammar mask in vLLM and SGLang), on a copy: the reported
    logprobs stay raw. Rows not listed are untouched.

    Greedy rows (temperature < 1e-5 or top_k 1) take the argmax (the first maximum) of their
    biased (:func:`apply_logit_bias`, first, as vLLM) and penalised logits; when every row is greedy
    with nothing to adjust that is one ``max`` over the raw logits. The other rows are penalised, divided by their temperatures, truncated
    (:func:`truncate`) and drawn (:func:`draw`) together. A row with no probabilities (an inf or NaN
    logit after the temperature) takes the argmax instead. Raises ValueError if len(rows) != N.
    """
    N, V = logits.shape
    if len(rows) != N:
        raise ValueError(f"{len(rows)} sampling rows for {N} rows of logits")
    dev = logits.device
    masked = {} if token_mask is None else {int(i): j for j, i in enumerate(token_mask[1])}
    plain = [r.params.greedy and not _adjusted(r) and i not in masked for i, r in enumerate(rows)]
    if all(plain):
        next_ids = logits.max(-1).indices  # = argmax (first maximum), and cheaper on CPU
    else:
        next_ids = torch.empty(N, dtype=torch.int64, device=dev)
        plain_ix = torch.tensor([i for i in range(N) if plain[i]], dtype=torch.int64, device=dev)
        if plain_ix.numel():
            next_ids[plain_ix] = logits[plain_ix].max(-1).indices
        work_ix = torch.tensor([i for i in range(N) if not plain[i]], dtype=torch.int64, device=dev)
        work = [r for r, pl in zip(rows, plain) if not pl]
        x = logits[work_ix].to(torch.float32)  # a copy: masks, biases, penalties and bans write into it
        if masked:
            pos = [(w, masked[i]) for w, i in enumerate(work_ix.tolist()) if i in masked]
            allowed = unpack_bitmask(token_mask[0][[m for _, m in pos]].to(dev), V)
            w_ix = torch.tensor([w for w, _ in pos], dtype=torch.int64, device=dev)
            x[w_ix] = x[w_ix].masked_fill(~allowed, NEG_INF)
        apply_logit_bias(x, work)
        apply_penalties(x, work)
        ban_stop_tokens(x, work, eos_ids)
        greedy = [j for j, r in enumerate(work) if r.params.greedy]
        sampled = [j for j, r in enumerate(work) if not r.params.greedy]
        ids = torch.empty(len(work), dtype=torch.int64, device=dev)
        if greedy:
            g_ix = torch.tensor(greedy, device=dev)
            ids[g_ix] = x[g_ix].argmax(-1)
        if sampled:
            s_ix = _index(sampled, len(work), dev)
            params = [work[j].params for j in sampled]
            s = _take(x, s_ix) / _column([p.temperature for p in params], torch.float32, dev)
            t = truncate(s, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
            tok = draw(torch.softmax(t, -1), [work[j].generator for j in sampled],
                       [None if work[j].seed is None else (work[j].seed, len(work[j].output_ids)) for j in sampled])
            # A row whose largest tempered logit is not finite (an inf logit, NaN, or every token banned)
            # has no probabilities; any other row's softmax is finite (truncation keeps its maximum).
            bad = ~torch.isfinite(s.amax(-1))
            if bool(bad.any()):  # overflow from extreme settings: fall back to the argmax
                tok = torch.where(bad, s.nan_to_num(nan=NEG_INF).argmax(-1), tok)
            if s_ix is None:
                ids = tok
            else:
                ids[s_ix] = tok
        next_ids[work_ix] = ids
    out = SampleOutput(next_ids.tolist(), [None] * N, [None] * N)
    _fill_logprobs(out, logits, rows)
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int],
                   with_rank: bool = False) -> tuple[list[float], list[list[tuple[int, float]]], Optional[list[int]]]:
    """The raw log-softmax entries of rows of logits: THE one function behind every logprob the engine
    reports, the sampled tokens' (``sample``) and the prompt tokens' (the runner), so a token's logprob
    is the same bits whichever of the two computes it from the same logits row.

    logits: [R, V] float32 (bfloat16 is upcast first); token_ids: int64 [R], the token row r scores;
    num_top[r]: how many of the most likely (token_id, logprob) pairs row r returns (0: none).
    Returns (logprobs [R] of token_ids; per row its top pairs, most likely first ([] where 0); ranks
    [R] when ``with_rank``, else None: 1 + the number of tokens strictly more likely than
    token_ids[r], vLLM's ``Logprob.rank``). Each row is its own log-softmax (max-subtracted, float32):
    rows do not affect one another, so callers may split rows into blocks of any size.
    """
    lp = torch.log_softmax(logits.to(torch.float32), -1)
    chosen = lp.gather(1, token_ids.unsqueeze(1))
    values = chosen.squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in values]
    k_max = min(max(num_top, default=0), lp.shape[1])
    if k_max:
        top_v, top_i = lp.topk(k_max, -1)
        for r, k in enumerate(num_top):
            if k:
                tops[r] = _top_pairs(lp[r], top_v[r], top_i[r], min(k, k_max))
    ranks = ((lp > chosen).sum(-1) + 1).tolist() if with_rank else None
    return values, tops, ranks


def _top_pairs(row: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token_id, logprob) pairs of one log-softmax row [V] (float32), most likely first,
    equal values by ascending token id: a function of the row and k alone. ``topk`` orders equal values
    differently for different k, and a step's rows share one ``topk`` at the largest k asked, so a tie at
    a request's k-th place otherwise depended on the other requests' k (frequent in bf16).
    top_v / top_i: the row's ``topk`` at some k' >= k (its values are the same whatever k'), the fallback
    where the row has fewer than k comparable values (NaN)."""
    kth = top_v[k - 1]
    above = (row > kth).nonzero().squeeze(1)
    ids = torch.cat([above, (row == kth).nonzero().squeeze(1)[:k - above.numel()]])
    if ids.numel() < k:
        ids = top_i[:k]
    vals = row[ids]
    order = vals.sort(descending=True, stable=True).indices  # ids ascend within equal values
    return list(zip(ids[order].tolist(), vals[order].tolist()))


def _fill_logprobs(out: SampleOutput, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """``token_logprobs`` of the sampled tokens for the rows that asked: the chosen token's, and the
    top_logprobs most likely (token, logprob) pairs, most likely first."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs or r.params.top_logprobs]
    if not want:
        return
    chosen = torch.tensor([out.next_ids[i] for i in want], dtype=torch.int64, device=logits.device)
    values, tops, _ = token_logprobs(_take(logits, _index(want, len(rows), logits.device)), chosen,
                                     [rows[i].params.top_logprobs for i in want])
    for i, v, top in zip(want, values, tops):
        out.logprobs[i] = v
        if rows[i].params.top_logprobs:
            out.top_logprobs[i] = top
