"""Reference helpers for the engine tests: transformers' forward pass as ground truth.

    load_hf(path)                              -> AutoModelForCausalLM in float32, eager attention
    hf_logits(model, ids)                      -> float32 logits [len(ids), vocab] of one full sequence
    hf_greedy(model, prompt, n)                -> transformers' greedy continuation (full recompute per step)
    check_greedy(model, prompt, ours, ...)     -> asserts ``ours`` is transformers' greedy continuation

``check_greedy`` teacher-forces: one forward over prompt + ours gives, at every step i, the logits
transformers computes for the prefix prompt + ours[:i]. If ours[i] is their argmax at every step, ours
*is* transformers' greedy output (by induction on i), at the cost of one forward instead of len(ours).
A divergence is accepted only where transformers' own top-2 logits are within ``tie`` of each other
and ours took the runner-up; nothing after it is compared (the two continuations may differ from
there on).
"""

from __future__ import annotations

import torch


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    # eager attention: an implementation independent of the SDPA call our backend makes
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([list(ids)], dtype=torch.int64)).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int, eos: set[int] = frozenset()) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = int(hf_logits(model, seq)[-1].argmax())
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


def check_greedy(model, prompt: list[int], ours: list[int], tie: float = 1e-3, logits: torch.Tensor | None = None,
                 what: str = "") -> int:
    """Assert ``ours`` is transformers' greedy continuation of ``prompt`` (see the module doc).
    Returns the number of tokens verified (len(ours) unless a tie let the outputs part)."""
    assert ours, f"{what}: no tokens generated"
    if logits is None:
        logits = hf_logits(model, list(prompt) + list(ours[:-1]))
    steps = logits[len(prompt) - 1: len(prompt) - 1 + len(ours)]
    for i, tok in enumerate(ours):
        top2 = torch.topk(steps[i], 2)
        best, second = int(top2.indices[0]), int(top2.indices[1])
        if tok == best:
            continue
        gap = float(top2.values[0] - top2.values[1])
        assert tok == second and gap < tie, (
            f"{what}: step {i}: ours {tok}, transformers' greedy {best} (top-2 gap {gap:.3g}, not a tie); "
            f"ours so far {ours[: i + 1]}")
        return i
    return len(ours)
