"""Text layer of the frontend: tokenizer + chat template, incremental detokenizer, stop strings.

The engine core never sees text. The frontend (offline ``Engine`` and the HTTP server) uses:

- :class:`Tokenizer`: a thin wrapper over a transformers tokenizer (we never write our own):
  ``encode`` / ``decode``, chat templates (``apply_chat_template`` / ``render_chat``), the set of
  end-of-sequence ids, per-token text/bytes for logprob display.
- :class:`IncrementalDetokenizer`: sampled ids -> text deltas that never split a UTF-8 character.
- :class:`StopStringMatcher`: text deltas -> text that can safely be shown, truncated at a stop string.
- :class:`TextStream`: the two combined, one per request.

Decoding never applies transformers' ``clean_up_tokenization_spaces`` heuristic (a WordPiece-era
post-processing step that deletes spaces before punctuation; it is not prefix-stable, so it cannot
be streamed, and transformers itself refuses it for BPE models). ``Tokenizer.decode`` and the
streaming classes therefore agree exactly.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

__all__ = [
    "Tokenizer",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "TextStream",
    "normalize_messages",
    "load_chat_template",
]

# transformers (and xgrammar, which imports it) is imported lazily from more than one thread: the grammar
# engine warms up in its worker thread while the engine loads its tokenizer. Two threads importing it at
# once can see a half-initialised module ("cannot import name 'AutoTokenizer'"), so both go through
# ``auto_tokenizer_class`` under one lock.
_HF_IMPORT_LOCK = threading.Lock()


def auto_tokenizer_class(with_xgrammar: bool = False):
    """transformers' ``AutoTokenizer``, imported under the module's import lock (thread-safe); with
    ``with_xgrammar`` also imports ``xgrammar`` under the same lock and returns (AutoTokenizer, xgrammar)."""
    with _HF_IMPORT_LOCK:
        from transformers import AutoTokenizer
        if not with_xgrammar:
            return AutoTokenizer
        import xgrammar
        return AutoTokenizer, xgrammar


_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by ByteLevel BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_LEVEL_DECODE = {c: b for b, c in _bytes_to_unicode().items()}


def _content_to_text(content: Any, index: int) -> str:
    """OpenAI message content (str, None or list of parts) -> one string.

    Text parts are joined with "\\n" (what vLLM does for string-format chat templates).
    Non-text parts raise ValueError: the models we serve are text-only.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ValueError(f"messages[{index}].content: parts must be objects, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(
                    f"messages[{index}].content: unsupported content part type {kind!r} (only 'text')"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content: a text part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of parts, got {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy chat messages with ``content`` flattened to a string (see ``_content_to_text``).

    Each message needs a string ``role``; other keys (``name``, ``tool_calls``, ...) pass through
    unchanged for templates that use them. Raises ValueError on malformed messages.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        m = dict(msg)
        m["content"] = _content_to_text(msg.get("content"), i)
        out.append(m)
    return out


class Tokenizer:
    """A transformers tokenizer plus what the serving frontend needs from it.

    Token ids are Python ints in ``[0, vocab_size)``; text is ``str``. The wrapped tokenizer is
    available as ``.hf``.

    Args:
        hf_tokenizer: a loaded transformers tokenizer (fast/``TokenizersBackend`` preferred).
        extra_eos_ids: more ids that end generation (e.g. from the model's generation config);
            they are added to ``eos_token_ids``.
        name_or_path: for error messages.
    """

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Optional[Iterable[int]] = None,
                 name_or_path: Optional[str] = None):
        self.hf = hf_tokenizer
        self.name_or_path = name_or_path or getattr(hf_tokenizer, "name_or_path", "") or "<tokenizer>"
        # The Rust tokenizer (fast path). decode goes straight to it: transformers' own decode adds
        # only the clean-up heuristic we deliberately skip (module docstring).
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        eos: set[int] = set()
        tok_eos = getattr(hf_tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            eos.add(tok_eos)
        for i in extra_eos_ids or ():
            eos.add(int(i))
        self.eos_token_ids: set[int] = eos
        self._one_cache: tuple[dict[int, str], dict[int, str]] = ({}, {})  # decode_one, by skip_special_tokens
        self._byte_level, self._byte_fallback, self._metaspace = self._inspect_backend()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str, extra_eos_ids: Optional[Iterable[int]] = None, **hf_kwargs: Any) -> "Tokenizer":
        """Load from an HF-style directory (tokenizer.json / tokenizer_config.json / chat template).

        End-of-sequence ids = the tokenizer's ``eos_token_id`` + ``eos_token_id`` (int or list) of
        ``generation_config.json`` and ``config.json`` if the directory has them + ``extra_eos_ids``.
        Whether a BOS token is added by ``encode`` is the tokenizer's own setting (``add_bos_token``
        / its post-processor); SmolLM2 adds none. Raises OSError if nothing loadable is there.
        """
        hf = auto_tokenizer_class().from_pretrained(path, **hf_kwargs)
        eos = set(int(i) for i in (extra_eos_ids or ()))
        if os.path.isdir(path):
            for fname in ("generation_config.json", "config.json"):
                fpath = os.path.join(path, fname)
                if not os.path.isfile(fpath):
                    continue
                try:
                    with open(fpath, encoding="utf-8") as f:
                        value = json.load(f).get("eos_token_id")
                except (OSError, ValueError, AttributeError):
                    continue
                if isinstance(value, int):
                    eos.add(value)
                elif isinstance(value, list):
                    eos.update(int(v) for v in value if isinstance(v, int))
        return cls(hf, extra_eos_ids=eos, name_or_path=path)

    def _inspect_backend(self) -> tuple[bool, bool, bool]:
        """(ByteLevel decoder?, byte-fallback model?, Metaspace '▁' pieces?) for ``id_to_bytes``."""
        if self._backend is None:
            return False, False, False
        try:
            spec = json.loads(self._backend.to_str())
        except Exception:  # pragma: no cover - exotic backends
            return False, False, False
        types: list[str] = []

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                if "type" in node:
                    types.append(str(node["type"]))
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(spec.get("decoder"))
        model = spec.get("model") or {}
        byte_fallback = bool(model.get("byte_fallback", False)) or "ByteFallback" in types
        metaspace = "Metaspace" in types or "\u2581" in json.dumps(spec.get("decoder"), ensure_ascii=False)
        return "ByteLevel" in types, byte_fallback, metaspace

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids that can appear: ``len(tokenizer)`` (base vocab + added tokens).

        The model's embedding may be larger (padded); ids beyond this are never produced by encode.
        """
        return len(self.hf)

    @property
    def bos_token_id(self) -> Optional[int]:
        return getattr(self.hf, "bos_token_id", None)

    @property
    def pad_token_id(self) -> Optional[int]:
        return getattr(self.hf, "pad_token_id", None)

    @property
    def chat_template(self) -> Optional[str]:
        return getattr(self.hf, "chat_template", None)

    def set_chat_template(self, template: str) -> None:
        """Replace the tokenizer's chat template (a Jinja string, e.g. from ``load_chat_template``)
        for every later render. Raises ValueError if the template does not parse as Jinja."""
        _check_jinja(template)
        self.hf.chat_template = template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids. ``add_special_tokens`` adds BOS/EOS only where the tokenizer is
        configured to (its ``add_bos_token`` / post-processor); for SmolLM2 it adds nothing.
        Raises TypeError for a non-str, ValueError for a str that is not valid Unicode (a lone
        UTF-16 surrogate such as JSON's "\\udfff", which has no UTF-8 form)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        try:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:
            check_unicode(text)  # the usual cause: raise the clear error
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text. Invalid or partial UTF-8 becomes U+FFFD; no space clean-up."""
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    def ids_decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """A function ``f(ids) -> decode(ids, skip_special_tokens)`` for a list of Python ints, with
        nothing between it and the Rust tokenizer when there is one (the incremental detokenizer
        decodes twice per token; ``decode``'s conversion of every id is most of a short decode)."""
        if self._backend is not None:
            return functools.partial(self._backend.decode, skip_special_tokens=skip_special_tokens)
        return functools.partial(self.decode, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id], skip_special_tokens)``, cached per id: the text of one token decoded
        alone (the incremental detokenizer needs it for every token it emits). Raises as ``decode``."""
        cache = self._one_cache[bool(skip_special_tokens)]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Ids -> vocabulary pieces (raw, e.g. 'Ġhello' for ByteLevel BPE, '▁hello' for SentencePiece)."""
        return list(self.hf.convert_ids_to_tokens([int(i) for i in ids]))

    def id_to_piece(self, token_id: int) -> str:
        """The decoded text of one token, for logprob display (special tokens included as text).

        Bytes-safe: a token holding part of a UTF-8 character gives U+FFFD instead of raising;
        use ``id_to_bytes`` for the exact bytes. Cached per id (``decode_one``'s cache).
        """
        return self.decode_one(int(token_id), skip_special_tokens=False)

    def id_to_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token contributes (OpenAI logprobs' ``bytes`` field).

        Exact for ByteLevel BPE (GPT-2 byte map) and SentencePiece byte-fallback pieces ('<0xAB>');
        otherwise the UTF-8 encoding of ``id_to_piece``. A Metaspace '▁' becomes a space (the
        decoder's stripping of the very first space of a text is not applied here).
        """
        token_id = int(token_id)
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is out of range (vocab_size={self.vocab_size})")
        added = getattr(self.hf, "added_tokens_decoder", None) or {}
        if token_id in added:  # added tokens are stored as plain text, not byte-mapped
            return str(getattr(added[token_id], "content", added[token_id])).encode("utf-8")
        if self._byte_level and all(c in _BYTE_LEVEL_DECODE for c in piece):
            return bytes(_BYTE_LEVEL_DECODE[c] for c in piece)
        if self._byte_fallback:
            m = _BYTE_FALLBACK_RE.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        if self._metaspace:
            return piece.replace("▁", " ").encode("utf-8")
        return self.id_to_piece(token_id).encode("utf-8")

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None, **template_kwargs: Any) -> str:
        """Render chat messages to the prompt string with the tokenizer's (Jinja) chat template.

        messages: list of ``{"role": str, "content": str | [{"type": "text", "text": str}, ...]}``;
        list content is flattened to a string first (``normalize_messages``). ``template_kwargs``
        go to transformers' ``apply_chat_template``: its own (``continue_final_message``: the last
        message is left open, the text ends with its content, no end-of-turn after it — needs
        ``add_generation_prompt=False``; ``documents``; ``tools``) and any other name, which the
        template sees as a variable (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``).
        Raises ValueError if the tokenizer has no chat template (and none is passed) or the messages
        are malformed.
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"tokenizer {self.name_or_path!r} has no chat template; use a plain completion "
                "prompt or pass chat_template explicitly"
            )
        msgs = normalize_messages(messages)
        text = self.hf.apply_chat_template(
            msgs, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=False, **template_kwargs,
        )
        if not isinstance(text, str):  # defensive: some versions return a list for batched input
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """Chat messages -> prompt token ids: ``encode(render_chat(...), add_special_tokens=False)``.

        Special tokens come from the template text itself (as transformers does), so BOS is not
        added twice. Errors as ``render_chat``.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos={sorted(self.eos_token_ids)})"


def load_chat_template(value: str) -> str:
    """A ``--chat-template`` value as a template string, as vLLM reads it: the contents of the file
    ``value`` names if there is one; else, when ``value`` holds Jinja's characters (``{``, ``}`` or a
    newline), ``value`` itself as an inline template with backslash escapes decoded (so ``\\n``
    typed on a command line is a newline). Raises ValueError for a value that looks like a path
    (no Jinja characters) but names no readable file, or a template that does not parse."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif any(c in value for c in "{}\n"):
        # backslashreplace keeps characters beyond latin-1 as escapes that unicode_escape decodes back
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not an inline Jinja template")
    _check_jinja(template)
    return template


def _check_jinja(template: str) -> None:
    """Raise ValueError if ``template`` is not valid Jinja syntax."""
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None


def check_unicode(text: str, what: str = "text") -> None:
    """Raise ValueError if ``text`` has no UTF-8 form: a lone UTF-16 surrogate (JSON may escape one,
    "\\udfff"), which tokenizers reject with an opaque TypeError. The message names ``what``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
                         f"character {e.start}") from None


class IncrementalDetokenizer:
    """Sampled token ids -> text deltas, never splitting a UTF-8 character.

    The prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` (itself from HF
    ``TextStreamer``): keep a short id window ``ids[prefix_offset:]``; on each ``add`` decode
    ``ids[prefix_offset:read_offset]`` (text already emitted) and ``ids[prefix_offset:]``; the delta
    is the extra suffix. While the new text ends in U+FFFD (a character still incomplete) or adds
    nothing, it is held back; otherwise it is emitted and the window slides
    (``prefix_offset = read_offset; read_offset = len(ids)``). Decoding a window, not a prefix of the
    text, is what makes tokenizers with context-dependent decoding (SentencePiece's '▁' leading-space
    rule) come out right, and it costs O(window) per token, not O(sequence).

    The window starts with the last ``context_tokens`` prompt ids (vLLM uses 5), so the first output
    token is decoded in context: for a SentencePiece/Metaspace tokenizer "▁Paris" after a prompt
    yields " Paris" (as ``decode(prompt + out)`` would), not "Paris".

    Guarantee: ``"".join(deltas) + flush() == decode(ctx + out)[len(decode(ctx)):]`` where ctx is
    that prompt tail; for prefix-stable decoders (ByteLevel BPE: SmolLM2, Llama 3, Qwen2, GPT-2) or
    an empty prompt this is exactly ``tokenizer.decode(out)``. No delta ends in a partial character.
    Exceptions, both only for output that is not valid UTF-8: (1) if more than
    ``max_pending_tokens`` consecutive tokens leave the text ending in U+FFFD, the pending text is
    emitted anyway so the window (and the cost per token) stays bounded; (2) tokenizers' ByteFallback
    decoder (Llama 2 style '<0xAB>' pieces) renders a whole run of byte tokens as U+FFFDs when the run
    is invalid, so a byte already emitted as a valid character may later show as U+FFFD in the full
    decode. A step whose text ends mid-character emits the longest run of its ids that ends on a
    whole character and holds the rest, so a delta never contains the U+FFFD of an unfinished
    character however many ids a step brings (a speculative verify brings several).

    Args:
        tokenizer: ``Tokenizer``.
        prompt_ids: the request's prompt ids (only the tail is kept).
        skip_special_tokens: drop special tokens (eos, <|im_end|>, ...) from the text.
        context_tokens: how many prompt ids to decode as context (vLLM: 5).
        max_pending_tokens: held-back tokens before a forced emit (>= 4: one UTF-8 character spans
            at most 4 byte tokens).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 context_tokens: int = 5, max_pending_tokens: int = 16):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pending_tokens = max(4, int(max_pending_tokens))
        ctx = [int(i) for i in list(prompt_ids)[-context_tokens:]] if context_tokens > 0 else []
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text: Optional[str] = None  # cache of decode(ids[prefix:read])
        self.num_output_tokens = 0
        # of lists of ints (add converts); None for a tokenizer-less state that never decodes
        self._decode = tokenizer.ids_decoder(skip_special_tokens) if tokenizer is not None else None

    def _window_text(self) -> str:
        """decode(ids[prefix:read]): the text already emitted of the window. After a step that
        emitted one id the window holds just that id, whose text alone is cached by the tokenizer."""
        if self._read_offset - self._prefix_offset == 1:
            return self.tokenizer.decode_one(self._ids[self._prefix_offset], self.skip_special_tokens)
        return self._decode(self._ids[self._prefix_offset:self._read_offset])

    def _slide(self, to: Optional[int] = None) -> None:
        # Emit ids[read:to] (default: all): drop ids left of the old read offset so memory stays
        # O(window); the emitted ids become the next window's context.
        to = len(self._ids) if to is None else to
        drop = self._read_offset
        self._ids = self._ids[drop:]
        self._prefix_offset = 0
        self._read_offset = to - drop
        self._prefix_text = None

    @property
    def num_pending(self) -> int:
        """Ids added whose text is still held back (the tail of an unfinished character)."""
        return len(self._ids) - self._read_offset

    def _complete(self, text: str, prefix_text: str) -> bool:
        return len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT_CHAR)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append sampled ids (any number, may be empty); return the newly final text ('' if held).

        A multi-id add (a speculative verify's accepted run) whose text ends mid-character emits
        its longest prefix of ids that ends on a whole character and holds the rest, so repeated
        runs that each end mid-character never pile up past ``max_pending_tokens``.
        """
        new_ids = [int(new_ids)] if isinstance(new_ids, int) else [int(i) for i in new_ids]
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        if self._prefix_text is None:
            self._prefix_text = self._window_text()
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix_offset:])
        if self._complete(new_text, prefix_text):
            delta = new_text[len(prefix_text):]
            self._slide()
            return delta
        for end in range(len(self._ids) - 1, len(self._ids) - len(new_ids), -1):
            text = self._decode(self._ids[self._prefix_offset:end])
            if self._complete(text, prefix_text):
                self._slide(end)
                return text[len(prefix_text):]
        if len(self._ids) - self._read_offset <= self.max_pending_tokens:
            return ""
        delta = new_text[len(prefix_text):]
        self._slide()
        return delta

    def flush(self) -> str:
        """End of the request: return whatever is held back (may contain U+FFFD)."""
        if len(self._ids) == self._read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._window_text()
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(self._prefix_text):]
        self._slide()
        return delta


class StopStringMatcher:
    """Apply stop strings to a stream of text deltas.

    ``feed(delta) -> (emit, matched)``: ``emit`` is text that can no longer become part of a stop
    string; the longest suffix of the text so far that is a prefix of some stop string is held
    back. Matches spanning deltas (token boundaries) are found because the held-back text is
    searched together with the new delta. On a match, ``emit`` ends right before the stop string
    (or right after it with ``include_in_output``), ``matched`` is the stop string, and every
    later ``feed`` returns ``("", None)``.

    Which stop wins when several occur: the one that is complete first in the text (smallest end
    position), ties broken by the earliest start (the longer string). This is what a
    character-by-character scan finds, so the result does not depend on how the text is split
    into deltas. Cost per feed: O(len(delta) + held) * number of stops.

    ``feed(delta, can_match=False)`` feeds text that may not complete a stop string (vLLM's
    ``min_tokens`` rule: text of the first min_tokens tokens never ends a request): no stop found
    ending inside it counts, but one that starts in it and ends in a later delta does (as vLLM's
    ``StopChecker``, which searches only from ``stop_check_offset`` minus the stop's length).

    ``flush()`` returns the held-back text when the request ends without a stop.
    Raises ValueError for an empty stop string.
    """

    def __init__(self, stops: Optional[Sequence[str]] = None, include_in_output: bool = False):
        if isinstance(stops, str):
            stops = [stops]
        stops = list(stops or [])
        for s in stops:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got {type(s).__name__}")
            if s == "":
                raise ValueError("stop strings must be non-empty")
        self.stops: list[str] = list(dict.fromkeys(stops))
        self.include_in_output = include_in_output
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._prefixes: set[str] = {s[:k] for s in self.stops for k in range(1, len(s))}
        self._held = ""
        self._floor = 0  # leading characters of _held that no stop may end in (fed with can_match=False)
        self.matched: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def feed(self, text: str, can_match: bool = True) -> tuple[str, Optional[str]]:
        """Consume a text delta; return (text safe to emit, matched stop string or None).
        ``can_match=False``: no stop may end inside this delta (see the class docstring)."""
        if self.matched is not None:
            return "", None
        if not text:
            return "", None
        if not self.stops:
            return text, None
        buf = self._held + text
        floor = self._floor if can_match else len(buf)
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for s in self.stops:
            i = buf.find(s, max(0, floor - len(s) + 1))  # the first occurrence ending after the floor
            if i >= 0:
                key = (i + len(s), i, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            end, start, s = best
            self.matched = s
            self._held = ""
            return (buf[:end] if self.include_in_output else buf[:start]), s
        hold = 0
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-k:] in self._prefixes:
                hold = k
                break
        self._floor = max(0, floor - (len(buf) - hold))
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], None
        self._held = ""
        return buf, None

    def flush(self) -> str:
        """Return (and clear) the held-back text; '' after a match."""
        held, self._held, self._floor = self._held, "", 0
        return "" if self.matched is not None else held


class TextStream:
    """Per-request text state: ``IncrementalDetokenizer`` followed by ``StopStringMatcher``, with
    the token ids each piece of text comes from.

    ``feed(new_ids, stop_token=False) -> (text_delta, matched_stop_or_None)``; ``finish() -> str``
    flushes both stages at the end of the request. ``.text`` is all text emitted, ``.output_ids``
    the ids that belong to the output, ``.num_released`` how many of them (a prefix) the emitted
    text covers, ``.matched_stop`` the stop string that ended it (or None).

    Output rules (vLLM's ``IncrementalDetokenizer.update`` and ``StopChecker``):

    - ``stop_token=True``: the last of ``new_ids`` ended the request as a stop token (an eos id or a
      ``stop_token_ids`` entry). It stays in ``output_ids`` (vLLM keeps it in ``token_ids`` and
      logprobs) but its text is not in the output unless ``include_stop_str_in_output``; stop
      strings are not looked for in its text.
    - Stop strings: the output ends before the first stop string complete in the text (after it
      with ``include_stop_str_in_output``); ``output_ids`` ends with the id whose text completed it
      (ids after it are dropped) and further feeds return ``("", None)`` (the caller aborts the
      engine request).
    - ``min_tokens``: a stop string that is complete within the text of the first ``min_tokens``
      ids does not end the request (vLLM's ``min_tokens``); one completed later does, even if it
      started earlier.

    Alignment: text goes out only at token boundaries. ``num_released`` grows exactly when the
    text of those ids is emitted: ids whose text the detokenizer holds back (an unfinished UTF-8
    character, an empty special token) or whose text may begin a stop string are held with it, so
    a streamed chunk can carry its ids' entries (logprobs) next to their text. Where the
    detokenizer emits several ids' text at once they go out together. After ``finish`` (or a stop
    string) every id of ``output_ids`` is released.

    Args:
        tokenizer, prompt_ids, skip_special_tokens: for the ``IncrementalDetokenizer``.
        stop, include_stop_str_in_output: for the ``StopStringMatcher`` and the stop token.
        min_tokens: output ids whose text cannot complete a stop string (>= 0).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Optional[Sequence[str]] = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self.matcher = StopStringMatcher(stop, include_in_output=include_stop_str_in_output)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = max(0, int(min_tokens))
        self.text = ""
        self.output_ids: list[int] = []
        self.num_released = 0
        self.matched_stop: Optional[str] = None
        self.finished = False
        self._detok_held = 0  # ids fed to the detokenizer whose text it still holds back
        self._units: list[tuple[int, int]] = []  # (ids, chars) of detokenized text not yet emitted, in order
        self._safe = ""  # text the matcher let through that does not yet reach a unit's end

    def feed(self, new_ids: Sequence[int], stop_token: bool = False) -> tuple[str, Optional[str]]:
        """Consume sampled ids; return (newly emitted text, the stop string that matched or None)."""
        if self.matched_stop is not None or self.finished:
            return "", None
        new_ids = [int(new_ids)] if isinstance(new_ids, int) else [int(i) for i in new_ids]
        last = new_ids.pop() if stop_token and new_ids else None
        # One id at a time when stop strings exist (the id completing a stop, and min_tokens, need it).
        groups = [[i] for i in new_ids] if self.matcher.stops else ([new_ids] if new_ids else [])
        emit = ""
        for g in groups:
            self.output_ids.extend(g)
            piece, matched = self._add(g, len(self.output_ids) > self.min_tokens)
            if matched is not None:
                emit += self._safe + piece
                self._end_units()
                self.matched_stop = matched
                self.text += emit
                return emit, matched
            emit += self._release(piece)
        if last is not None:
            self.output_ids.append(last)
            if self.include_stop:
                emit += self._release(self._add([last], False)[0])
            else:
                self._detok_held += 1  # no text: it goes out with the last piece
        self.text += emit
        return emit, None

    def finish(self) -> str:
        """Flush held-back text at the end of the request (a stop string found in it still
        truncates) and release every output id."""
        if self.finished or self.matched_stop is not None:
            self.finished = True
            return ""
        self.finished = True
        emit, matched = self.matcher.feed(self.detokenizer.flush(), len(self.output_ids) > self.min_tokens)
        if matched is not None:
            self.matched_stop = matched
        else:
            emit += self.matcher.flush()
        emit = self._safe + emit
        self._end_units()
        self.text += emit
        return emit

    def _add(self, ids: list[int], can_match: bool) -> tuple[str, Optional[str]]:
        """Detokenize ``ids`` and pass the text to the matcher; record the unit it forms."""
        self._detok_held += len(ids)
        piece = self.detokenizer.add(ids)
        if piece:
            held = self.detokenizer.num_pending  # a partial character's ids stay for the next unit
            self._units.append((self._detok_held - held, len(piece)))
            self._detok_held = held
        return self.matcher.feed(piece, can_match)

    def _release(self, piece: str) -> str:
        """The text of the units that ``piece`` (what the matcher let through) completes."""
        self._safe += piece
        k = taken = 0
        while k < len(self._units) and taken + self._units[k][1] <= len(self._safe):
            self.num_released += self._units[k][0]
            taken += self._units[k][1]
            k += 1
        del self._units[:k]
        out, self._safe = self._safe[:taken], self._safe[taken:]
        return out

    def _end_units(self) -> None:
        self._units.clear()
        self._safe = ""
        self._detok_held = 0
        self.num_released = len(self.output_ids)
