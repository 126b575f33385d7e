"""Logprobs in the shapes of the OpenAI API (chat: per-token objects; completions: parallel lists)."""

from __future__ import annotations

from typing import Optional

from idleless.server.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob
from idleless.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # -inf (and NaN) logprobs are sent as this: JSON has no infinity


def clamp_logprob(x: float) -> float:
    """``x``, or LOGPROB_FLOOR for -inf, NaN and anything below it."""
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(tok: Tokenizer, token_ids: list[int], logprobs: Optional[list[float]],
                  tops: Optional[list[list[tuple[int, float]]]]) -> Optional[ChatLogprobs]:
    """Chat logprobs of ``token_ids`` (None when none were asked for): token piece, logprob, UTF-8
    bytes and the top alternatives of each."""
    if logprobs is None:
        return None
    content = []
    for i, t in enumerate(token_ids[:len(logprobs)]):
        top = []
        if tops is not None and i < len(tops):
            top = [TopLogprob(token=tok.id_to_piece(a), logprob=clamp_logprob(b), bytes=list(tok.id_to_bytes(a)))
                   for a, b in tops[i]]
        content.append(ChatLogprobToken(token=tok.id_to_piece(t), logprob=clamp_logprob(logprobs[i]),
                                        bytes=list(tok.id_to_bytes(t)), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tok: Tokenizer, token_ids: list[int], logprobs: Optional[list[float]],
                        tops: Optional[list[list[tuple[int, float]]]],
                        offset: int) -> tuple[Optional[CompletionLogprobs], int]:
    """Legacy completions logprobs of ``token_ids`` with ``text_offset`` counted from ``offset``
    (characters of the choice's text before these tokens); returns them (None when none were asked
    for) and the offset after them."""
    if logprobs is None:
        return None, offset
    out = CompletionLogprobs()
    for i, t in enumerate(token_ids[:len(logprobs)]):
        piece = tok.id_to_piece(t)
        out.tokens.append(piece)
        out.token_logprobs.append(clamp_logprob(logprobs[i]))
        if tops is not None and i < len(tops):
            out.top_logprobs.append({tok.id_to_piece(a): clamp_logprob(b) for a, b in tops[i]})
        else:
            out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(piece)
    return out, offset
