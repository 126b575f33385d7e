"""How far a precision combination moves the model: next-token distributions on a fixed built-in text
against a reference model's (issue 14). One measurement for the start-up accuracy gate (``gate``) and
``idleless bench precision``.

The text (``TEXT``, a few hundred tokens) runs through a ``ModelRunner`` in extends of ``chunk``
tokens, so later extends attend to K/V read back from the (possibly quantised) KV cache. Per position
p the reference distribution P_p and the measured one Q_p give KL(P_p || Q_p) =
sum_v P_p(v) (log P_p(v) - log Q_p(v)) in nats (the direction of the KL term of Hinton et al.'s
distillation and of llama.cpp's ``perplexity --kl-divergence``), and top-1 agreement: whether the
argmax tokens are equal.
"""

from __future__ import annotations

import os

import torch

from idleless.model.runner import ForwardBatch

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels of cables, and each new problem meant a new physical arrangement of the hardware. The stored "
    "program changed that: instructions became data, held in the same memory as the numbers they worked "
    "on, and a machine could be given a new task by loading a new sequence of words. Assemblers turned "
    "mnemonic names into those words, and compilers turned formulas into whole sequences of them. Each "
    "layer hid the one beneath it, and each let more people build larger systems without understanding "
    "every wire. Operating systems then hid the machine itself, sharing one processor among many programs "
    "and giving each the illusion of its own memory. Networks joined machines into systems that no single "
    "person could see whole, and the web turned those systems into a place where billions of people read, "
    "write and trade. Today language models are trained on much of that written record. They predict the "
    "next word of a text from the words before it, and in doing so they learn grammar, facts and some "
    "habits of reasoning. Serving such a model means keeping its weights and the keys and values of every "
    "conversation in memory, and moving them to the arithmetic units fast enough that nobody waits. Fewer "
    "bits per number mean less to move, so the same machine answers more people at once, provided the "
    "answers stay as good as before. Measuring that is the point of this benchmark."
)

#: tokens per extend of the logits pass
CHUNK = 64
#: ids of the text for a model without tokenizer.json: its first UTF-8 bytes
BYTE_TOKENS = 300
#: rows of the KL computed at a time (float64 [rows, vocab] temporaries)
KL_BLOCK = 32


def text_token_ids(tokenizer_path: str, vocab_size: int) -> list[int]:
    """``TEXT`` as token ids of the model's tokenizer: ``tokenizer_path``/tokenizer.json through the
    ``tokenizers`` library (what transformers' fast tokenizers wrap; its post-processor decides special
    tokens; SmolLM2 adds none), each id modulo ``vocab_size`` (a tokenizer lent to a model with a smaller
    vocabulary, as the tests do, still gives valid ids). A directory without tokenizer.json (the tests' tiny random models) gets
    the text's first ``BYTE_TOKENS`` UTF-8 bytes, each modulo ``vocab_size``: a fixed sequence of valid ids. Raises
    what ``tokenizers.Tokenizer.from_file`` raises for a broken file."""
    path = os.path.join(tokenizer_path, "tokenizer.json")
    if not os.path.isfile(path):
        return [b % vocab_size for b in TEXT.encode()[:BYTE_TOKENS]]
    from tokenizers import Tokenizer

    return [i % vocab_size for i in Tokenizer.from_file(path).encode(TEXT).ids]


def forward_range(runner, ids: list[int], slots: torch.Tensor, start: int, rows: torch.Tensor) -> torch.Tensor:
    """One extend of one request: ``ids`` at positions start.. (K/V written to ``slots[start:]``, the
    prefix read from ``slots[:start]``; slots int64). Returns float32 logits [len(rows), vocab] of
    ``rows`` (int64 indices into ids)."""
    n = len(ids)
    batch = ForwardBatch(torch.tensor(ids), torch.arange(start, start + n), slots[start:start + n], [n], [start],
                         [slots[:start + n]], rows)
    return runner.forward(batch)


def next_token_logits(runner, ids: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of every position of ``ids`` through ``runner`` in extends of
    ``chunk`` tokens (KV slots taken from ``runner.pool`` and freed after). Raises MemoryError when the
    pool's free slots cannot hold len(ids) tokens."""
    pool = runner.pool
    slots = pool.alloc(0, 0, len(ids))
    if slots is None:
        raise MemoryError(f"the KV pool has {pool.num_free_slots} free slots; {len(ids)} tokens need more "
                          "(raise --kv-cache-memory)")
    try:
        return torch.cat([forward_range(runner, ids[a:a + chunk], slots, a, torch.arange(len(ids[a:a + chunk])))
                          for a in range(0, len(ids), chunk)])
    finally:
        pool.free(slots)


def compare(logits: torch.Tensor, ref: torch.Tensor, ids: list[int] | None = None) -> dict:
    """logits, ref: [P, vocab] (any float dtype) of the same P positions; computed in float64.

    Returns ``kl_mean`` / ``kl_max`` (KL(softmax(ref) || softmax(logits)) per position, nats),
    ``top1`` (share of positions whose argmax agrees, 0..1) and, given ``ids`` (the P token ids
    whose next-token logits these are), ``perplexity`` of ids[1:] under ``logits``."""
    kls, nll = [], []
    for a in range(0, logits.shape[0], KL_BLOCK):
        lp, rp = logits[a:a + KL_BLOCK].double().log_softmax(-1), ref[a:a + KL_BLOCK].double().log_softmax(-1)
        kls.append((rp.exp() * (rp - lp)).sum(-1))
        if ids is not None:
            nxt = torch.tensor(ids[a + 1:a + 1 + lp.shape[0]])
            nll.append(-lp[:len(nxt)].gather(1, nxt[:, None]).squeeze(1))
    kl = torch.cat(kls)
    out = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1": float((logits.argmax(-1) == ref.argmax(-1)).double().mean())}
    if ids is not None:
        out["perplexity"] = float(torch.cat(nll).mean().exp())
    return out
