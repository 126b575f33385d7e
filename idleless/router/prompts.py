"""What the router reads of a request body: the text (for the approximate tree) and the prompt's
token ids the engine will see (for the exact index), rendered with the engines' tokenizer and chat
template the way the server does (``idleless.server.protocol``'s ``to_template`` /
``template_kwargs``). A body it cannot render gets no token ids: routing then ignores its prefix
(the engine will answer with its own error)."""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("idleless.router")


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def template_messages(body: dict) -> list[dict]:
    """Chat ``messages`` as the server hands them to the template (developer -> system, list
    content joined with newlines, ``name`` kept). Raises TypeError/KeyError on malformed input."""
    out = []
    for m in body["messages"]:
        role = "system" if m["role"] == "developer" else m["role"]
        d = {"role": role, "content": _content(m.get("content"))}
        if m.get("name"):
            d["name"] = m["name"]
        out.append(d)
    return out


def route_text(body: dict) -> str:
    """The request's text: a completion's prompt (a list of prompts: the first), or the chat
    messages' contents one after another. Empty when there is none."""
    try:
        if "messages" in body:
            return "".join(f"{m['role']}: {m['content']}\n" for m in template_messages(body))
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    except (TypeError, KeyError, AttributeError):
        return ""


class PromptTokenizer:
    """``tokens(body)``: the prompt token ids an engine with the same ``Tokenizer`` (and chat template)
    computes for this body, or None when it cannot tell (a malformed body, a batch of prompts)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokens(self, body: dict) -> Optional[list[int]]:
        try:
            if "messages" in body:
                kw = dict(body.get("chat_template_kwargs") or {})
                kw["add_generation_prompt"] = body.get("add_generation_prompt") is not False
                if body.get("continue_final_message"):
                    kw["continue_final_message"] = True
                if body.get("documents") is not None:
                    kw["documents"] = body["documents"]
                return self.tokenizer.apply_chat_template(template_messages(body), **kw)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, body.get("add_special_tokens", True) is not False)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        except Exception as e:  # noqa: BLE001 - routing must not fail on what the engine will reject
            log.debug("cannot tokenize a request for routing: %s", e)
        return None
