"""Logprobs in the shapes clients expect: the OpenAI API's (chat: per-token objects; completions:
parallel lists, echoed prompts included), vLLM's ``prompt_logprobs`` and SGLang's meta_info lists."""

from __future__ import annotations

from typing import Optional

from idleless.server.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob, VllmLogprob
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


def echo_logprobs(tok: Tokenizer, prompt_ids: list[int], entries: list, with_top: bool) -> CompletionLogprobs:
    """Completions logprobs of an echoed prompt: one entry per prompt token, ``text_offset`` from 0.
    ``entries``: the engine's ``PromptLogprob`` list from position 0 (``None`` first: the first token
    has no logprob, null as OpenAI sends it); ``with_top``: top_logprobs dicts (else null entries)."""
    out = CompletionLogprobs()
    offset = 0
    for t, e in zip(prompt_ids, entries):
        piece = tok.id_to_piece(t)
        out.tokens.append(piece)
        out.token_logprobs.append(None if e is None else clamp_logprob(e.logprob))
        out.top_logprobs.append({tok.id_to_piece(a): clamp_logprob(b) for a, b in e.top}
                                if e is not None and with_top else None)
        out.text_offset.append(offset)
        offset += len(piece)
    return out


def joined(head: Optional[CompletionLogprobs], tail: Optional[CompletionLogprobs]) -> Optional[CompletionLogprobs]:
    """``head``'s entries followed by ``tail``'s (either may be None)."""
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(tokens=head.tokens + tail.tokens,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + tail.text_offset)


def vllm_prompt_logprobs(tok: Tokenizer, entries: Optional[list]) -> Optional[list[Optional[dict[int, VllmLogprob]]]]:
    """vLLM's ``prompt_logprobs`` of the engine's ``PromptLogprob`` entries: per entry None (position 0)
    or {token id: VllmLogprob} with the prompt token first, then the top k not already in."""
    if entries is None:
        return None
    out: list[Optional[dict[int, VllmLogprob]]] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {e.token_id: VllmLogprob(logprob=clamp_logprob(e.logprob), rank=e.rank,
                                     decoded_token=tok.id_to_piece(e.token_id))}
        for rank, (t, v) in enumerate(e.top, 1):
            if t not in d:
                d[t] = VllmLogprob(logprob=clamp_logprob(v), rank=rank, decoded_token=tok.id_to_piece(t))
        out.append(d)
    return out


def sglang_logprobs(tok: Optional[Tokenizer], pairs: list[tuple[Optional[float], int]]) -> list[list]:
    """SGLang's token logprobs: ``[logprob, token_id, text]`` per (logprob, id) pair (logprob None where
    there is none: the prompt's first token); text is the token's when ``tok`` is given
    (``return_text_in_logprobs``), else None."""
    return [[None if lp is None else clamp_logprob(lp), t, tok.id_to_piece(t) if tok is not None else None]
            for lp, t in pairs]


def sglang_input_logprobs(tok: Optional[Tokenizer], prompt_ids: list[int], start: int, entries: list,
                          with_top: bool) -> dict:
    """meta_info's ``input_token_logprobs`` from prompt position ``start`` on (``sglang_logprobs``
    shape; position 0 has no logprob: ``[None, id, text]``) and, with ``with_top``,
    ``input_top_logprobs`` (per position its top k in that shape; None at position 0), from the
    engine's ``PromptLogprob`` entries of positions start, start + 1, ..."""
    ids = prompt_ids[start:start + len(entries)]
    out = {"input_token_logprobs": sglang_logprobs(tok, [(None if e is None else e.logprob, t)
                                                         for e, t in zip(entries, ids)])}
    if with_top:
        out["input_top_logprobs"] = [None if e is None else sglang_logprobs(tok, [(v, t) for t, v in e.top])
                                     for e in entries]
    return out
