"""Sampling: penalties, temperature, top-k / top-p / min-p, seeded per-request generators, logprobs.

A pure function of the logits, each request's parameters, its token history and its own
torch.Generator: the same seed gives the same tokens whatever else is in the batch.
Returned logprobs are the model's raw log-softmax, taken before penalties, temperature and
truncation (vLLM's default ``raw_logprobs``), so they do not change with sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from idleless.engine.request import Request


@dataclass
class SampleOutput:
    """next_ids [N]; logprobs[i] is the sampled token's raw logprob (None unless asked);
    top_logprobs[i] a list of (token_id, logprob), most likely first (None unless asked)."""

    next_ids: list[int]
    logprobs: list[Optional[float]]
    top_logprobs: list[Optional[list[tuple[int, float]]]]


def apply_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Penalise one logits row [V] in place. Repetition (HF / CTRL, arXiv 1909.05858) over prompt
    and generated tokens: positive logits divided by the penalty, negative ones multiplied.
    Frequency and presence (OpenAI API reference) over generated tokens: subtract
    frequency_penalty * count and presence_penalty * (count > 0)."""
    p = req.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(req.prompt_ids) | set(req.output_ids)), dtype=torch.int64)
        if ids.numel():
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        out = torch.tensor(req.output_ids, dtype=torch.int64)
        counts = torch.bincount(out, minlength=row.numel()).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def truncate(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (set to -inf) logits [V] outside top-k, the top-p nucleus (Holtzman et al.,
    arXiv 1904.09751) and below min_p * max probability (arXiv 2407.01082). Input is already
    divided by the temperature. Always keeps the most likely token."""
    if top_k > 0 and top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if min_p > 0:
        probs = torch.softmax(row, -1)
        row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # tokens after the nucleus is full
        drop[0] = False
        row = row.clone()
        row[order[drop]] = float("-inf")
    return row


def sample(logits: torch.Tensor, reqs: list[Request], eos_ids: set[int]) -> SampleOutput:
    """Sample one token per row. logits: float32 [N, V] for reqs[i] (len N).

    min_new_tokens masks eos and stop_token_ids until reached (unless ignore_eos skips only eos).
    Requests with temperature 0 (or top_k 1) take the argmax."""
    N = logits.shape[0]
    want_lp = any(r.params.logprobs or r.params.top_logprobs for r in reqs)
    raw_lp = torch.log_softmax(logits, -1) if want_lp else None
    plain_greedy = all(
        r.params.greedy and r.params.repetition_penalty == 1.0 and not r.params.frequency_penalty
        and not r.params.presence_penalty and len(r.output_ids) >= r.params.min_new_tokens
        for r in reqs)
    if plain_greedy:
        next_ids = logits.max(-1).indices.tolist()  # = argmax (first maximum), ~3x faster on CPU here
    else:
        next_ids = []
        for i, r in enumerate(reqs):
            p = r.params
            row = logits[i].clone()
            row = apply_penalties(row, r)
            if len(r.output_ids) < p.min_new_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                if banned:
                    row[torch.tensor(sorted(banned), dtype=torch.int64)] = float("-inf")
            if p.greedy:
                next_ids.append(int(row.argmax()))
                continue
            row = truncate(row / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = torch.softmax(row, -1)
            if not bool(torch.isfinite(probs).all()):  # overflow from extreme settings: fall back to argmax
                next_ids.append(int(row.nan_to_num(nan=float("-inf")).argmax()))
                continue
            next_ids.append(int(torch.multinomial(probs, 1, generator=r.generator)))
    logprobs: list[Optional[float]] = [None] * N
    tops: list[Optional[list[tuple[int, float]]]] = [None] * N
    if want_lp:
        for i, r in enumerate(reqs):
            if r.params.logprobs or r.params.top_logprobs:
                logprobs[i] = float(raw_lp[i, next_ids[i]])
            if r.params.top_logprobs:
                v, ix = torch.topk(raw_lp[i], r.params.top_logprobs)
                tops[i] = list(zip(ix.tolist(), v.tolist()))
    return SampleOutput(next_ids, logprobs, tops)
