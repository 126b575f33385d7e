"""OpenAI routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}] (and POST
/v1/responses, registered from ``routes_responses``)."""

from __future__ import annotations

import time
import uuid
from json.encoder import encode_basestring
from typing import Callable, Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from idleless.server import routes_responses
from idleless.server.asgi import sse
from idleless.server.chat_tools import ToolPlan, ToolStream
from idleless.server.context import ServerContext
from idleless.server.engine_client import Submission
from idleless.server.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, joined, vllm_prompt_logprobs
from idleless.server.protocol import (MAX_PROMPTS, APIError, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatMessageOut, ChatStreamChoice, CompletionChoice,
                                      CompletionChunk, CompletionRequest, CompletionResponse, CompletionStreamChoice,
                                      DeltaMessage, ModelCard, ModelList, parse_request)
from idleless.server.streaming import answer, usage_of
from idleless.text.output import CompletionDelta
from idleless.text.tokenizer import Tokenizer


def _json(model) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _json_scalar(value) -> Optional[str]:
    """``value`` (None, a str or an int) as JSON, written as pydantic writes it (non-ASCII as is);
    None for any other type (the caller then builds the chunk with pydantic)."""
    if value is None:
        return "null"
    if type(value) is str:
        return encode_basestring(value)
    if type(value) is int:
        return str(value)
    return None


class PlainChunks:
    """The common streamed chunk of one stream — one choice, no logprobs, no usage, no tool calls —
    written as a string from a ``data: {...,"choices":[{"index":`` head built once per stream, instead
    of a chunk model and ``model_dump_json`` per token. The head is pydantic's own JSON of
    ``chunk_cls`` with no choices (so ``id``, ``object``, ``created``, ``model`` and
    ``system_fingerprint`` are written exactly as the model writes them), and the choice's fields
    follow the order of ``ChatStreamChoice`` / ``CompletionStreamChoice``: the SSE line equals
    ``sse(chunk_cls(...))`` of the same values, byte for byte (OpenAI's chunk objects:
    https://platform.openai.com/docs/api-reference/chat-streaming).

    Raises ValueError when ``chunk_cls``'s JSON does not end with ``choices`` then ``usage`` (the
    model changed shape: the head would be wrong)."""

    _TAIL = '],"usage":null}'

    def __init__(self, chunk_cls, rid: str, created: int, model: str, fingerprint: Optional[str]):
        js = chunk_cls(id=rid, created=created, model=model, system_fingerprint=fingerprint,
                       choices=[]).model_dump_json()
        if not js.endswith(self._TAIL):
            raise ValueError(f"{chunk_cls.__name__} JSON does not end with choices, usage: {js!r}")
        self.head = "data: " + js[:-len(self._TAIL)] + '{"index":'

    def line(self, index: int, body: str, finish_reason: Optional[str], matched_stop) -> Optional[str]:
        """The SSE line of one choice: ``body`` the choice's JSON members between ``index`` and
        ``logprobs`` (``"text":...`` or ``"delta":{...}``); None when ``index``, ``finish_reason`` or
        ``matched_stop`` has a type this writer does not know (write that chunk with pydantic)."""
        fr, ms = _json_scalar(finish_reason), _json_scalar(matched_stop)
        if type(index) is not int or fr is None or ms is None:
            return None
        return (f'{self.head}{index},{body},"logprobs":null,"finish_reason":{fr},"matched_stop":{ms}}}]'
                ',"usage":null}\n\n')


class ChatStream:
    """Chat completion chunks: an assistant role delta per choice first, then content deltas with
    their logprobs (and tool-call deltas under ``tools``: ``chat_tools.ToolStream``); usage per chunk
    (``continuous_usage_stats``) and/or at the end (``include_usage``)."""

    def __init__(self, tok: Tokenizer, sub: Submission, n: int, rid: str, model: str, fingerprint: str,
                 include_usage: bool, continuous_usage: bool, tools: Optional[ToolPlan] = None):
        self.tok, self.sub, self.n = tok, sub, n
        self.rid, self.model, self.fingerprint = rid, model, fingerprint
        self.created = int(time.time())
        self.include_usage, self.continuous = include_usage, continuous_usage
        self.tools = {st.index: ToolStream(tools or ToolPlan()) for st in sub.states}
        self.plain = PlainChunks(ChatCompletionChunk, rid, self.created, model, fingerprint)

    def _chunk(self, choices, usage=None) -> str:
        return sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                       system_fingerprint=self.fingerprint, choices=choices, usage=usage))

    def opening(self) -> Iterable[str]:
        for st in self.sub.states:
            yield (self.plain.line(st.index, '"delta":{"role":"assistant","content":""}', None, None)
                   or self._chunk([ChatStreamChoice(index=st.index,
                                                    delta=DeltaMessage(role="assistant", content=""))]))

    def delta(self, d: CompletionDelta) -> Optional[str]:
        lps = chat_logprobs(self.tok, d.token_ids, d.logprobs, d.top_logprobs)
        ts = self.tools[d.index]
        text, calls = ts.feed(d.text, d.finish_reason is not None)
        if not text and not calls and d.finish_reason is None and lps is None:
            return None
        reason = ts.finish_reason(d.finish_reason)
        usage = usage_of(self.sub, self.n) if self.include_usage and self.continuous else None
        if not calls and lps is None and usage is None and type(text) is str:
            body = '"delta":{"content":' + encode_basestring(text) + "}" if text else '"delta":{}'
            line = self.plain.line(d.index, body, reason, d.matched_stop)
            if line is not None:
                return line
        c = ChatStreamChoice(index=d.index, delta=DeltaMessage(content=text or None, tool_calls=calls or None),
                             logprobs=lps, finish_reason=reason, matched_stop=d.matched_stop)
        return self._chunk([c], usage)

    def closing(self) -> Iterable[str]:
        if self.include_usage:
            yield self._chunk([], usage_of(self.sub, self.n))


class CompletionStream:
    """Text completion chunks: text deltas with their logprobs (``text_offset`` counted per choice);
    with echo (``echo_of(index)`` the prompt's text, None without echo) a choice's first chunk starts
    with its echoed prompt and, with ``echo_logprobs``, the prompt's logprob entries (its
    ``RequestState`` has them by its first delta); usage as in ChatStream."""

    def __init__(self, tok: Tokenizer, sub: Submission, n: int, rid: str, model: str, fingerprint: str,
                 include_usage: bool, continuous_usage: bool, echo_of: Optional[Callable[[int], str]],
                 echo_logprobs: bool = False):
        self.tok, self.sub, self.n = tok, sub, n
        self.rid, self.model, self.fingerprint = rid, model, fingerprint
        self.created = int(time.time())
        self.include_usage, self.continuous = include_usage, continuous_usage
        self.echo_of = echo_of
        self.echo_logprobs = echo_logprobs
        self.offsets = {st.index: 0 for st in sub.states}  # characters sent so far, per choice
        self.echoed: set[int] = set()
        self.plain = PlainChunks(CompletionChunk, rid, self.created, model, fingerprint)

    def _chunk(self, choices, usage=None) -> str:
        return sse(CompletionChunk(id=self.rid, created=self.created, model=self.model,
                                   system_fingerprint=self.fingerprint, choices=choices, usage=usage))

    def opening(self) -> Iterable[str]:
        return ()

    def _echo(self, index: int):
        """The echoed prompt text and its logprobs (None without them) of choice ``index``."""
        self.echoed.add(index)
        text = self.echo_of(index)
        self.offsets[index] = len(text)
        if not self.echo_logprobs:
            return text, None
        st = self.sub.states[index]
        return text, echo_logprobs(self.tok, st.prompt_ids, st.prompt_logprobs or [], st.params.top_logprobs > 0)

    def delta(self, d: CompletionDelta) -> Optional[str]:
        head, head_lps = ("", None) if self.echo_of is None or d.index in self.echoed else self._echo(d.index)
        lps, self.offsets[d.index] = completion_logprobs(self.tok, d.token_ids, d.logprobs, d.top_logprobs,
                                                         self.offsets[d.index])
        if lps is None:
            self.offsets[d.index] += len(d.text)
        lps = joined(head_lps, lps)
        text = head + d.text
        if not text and d.finish_reason is None and lps is None:
            return None
        usage = usage_of(self.sub, self.n) if self.include_usage and self.continuous else None
        if lps is None and usage is None and type(text) is str:
            line = self.plain.line(d.index, '"text":' + encode_basestring(text), d.finish_reason, d.matched_stop)
            if line is not None:
                return line
        c = CompletionStreamChoice(index=d.index, text=text, logprobs=lps, finish_reason=d.finish_reason,
                                   matched_stop=d.matched_stop)
        return self._chunk([c], usage)

    def closing(self) -> Iterable[str]:
        if self.include_usage:
            yield self._chunk([], usage_of(self.sub, self.n))


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add the OpenAI routes to ``app``: these and the Responses API (``routes_responses``)."""
    settings, tok = ctx.settings, ctx.tok
    routes_responses.register(app, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await ctx.read_json(request))
        model = ctx.check_model(req.model)
        params = req.sampling_params()
        kwargs = req.template_kwargs()
        tools, params = ToolPlan.of(req, params, ctx.tool_parser, tok.chat_template, kwargs)
        ids = await ctx.render_chat([m.to_template() for m in req.messages], **kwargs)
        sub = ctx.submit([ids], params, req.priority or 0, req.kv_transfer_params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fp = settings.system_fingerprint

        def full(outs):
            choices = []
            for o in outs:
                content, calls, reason = tools.reply(o.text, o.finish_reason)
                choices.append(ChatChoice(index=o.index, message=ChatMessageOut(content=content, tool_calls=calls),
                                          logprobs=chat_logprobs(tok, o.token_ids, o.logprobs, o.top_logprobs),
                                          finish_reason=reason, matched_stop=o.matched_stop))
            return _json(ChatCompletionResponse(id=rid, model=model, system_fingerprint=fp, choices=choices,
                                                usage=usage_of(sub, params.n),
                                                prompt_logprobs=vllm_prompt_logprobs(tok, outs[0].prompt_logprobs),
                                                kv_transfer_params=ctx.kv_transfer_reply(req.kv_transfer_params)))

        return await answer(request, sub, bool(req.stream), full, lambda: ChatStream(
            tok, sub, params.n, rid, model, fp, req.include_usage, req.continuous_usage, tools))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await ctx.read_json(request))
        model = ctx.check_model(req.model)
        params = req.sampling_params()
        p = req.prompt
        if isinstance(p, str):
            texts, prompts = [p], [await ctx.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            if len(p) > MAX_PROMPTS:
                raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt",
                               code="invalid_value")
            texts, prompts = list(p), [await ctx.encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            texts, prompts = [None] * len(p), [list(x) for x in p]
        elif p:
            texts, prompts = [None], [list(p)]
        else:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt", code="invalid_value")
        echo_texts = []
        if req.echo:
            for t, ids in zip(texts, prompts):
                if t is None:
                    ctx.check_request(ids, params)  # before decoding ids that may be out of the vocabulary
                    t = tok.decode(ids, skip_special_tokens=False)
                echo_texts.append(t)
        sub = ctx.submit(prompts, params, req.priority or 0, req.kv_transfer_params)
        n = params.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        fp = settings.system_fingerprint
        echo_lps = bool(req.echo) and params.logprobs  # the prompt's entries lead each choice's logprobs

        def echo_of(index: int) -> str:
            return echo_texts[index // n] if req.echo else ""

        def full(outs):
            choices = []
            for o in outs:
                echo = echo_of(o.index)
                lps, _ = completion_logprobs(tok, o.token_ids, o.logprobs, o.top_logprobs, len(echo))
                if echo_lps:
                    lps = joined(echo_logprobs(tok, o.prompt_token_ids, o.prompt_logprobs or [],
                                               params.top_logprobs > 0), lps)
                choices.append(CompletionChoice(
                    index=o.index, text=echo + o.text, logprobs=lps, finish_reason=o.finish_reason,
                    matched_stop=o.matched_stop,
                    prompt_logprobs=vllm_prompt_logprobs(tok, o.prompt_logprobs) if req.prompt_logprobs is not None
                    else None))
            return _json(CompletionResponse(id=rid, model=model, system_fingerprint=fp, choices=choices,
                                            usage=usage_of(sub, n),
                                            kv_transfer_params=ctx.kv_transfer_reply(req.kv_transfer_params)))

        return await answer(request, sub, bool(req.stream), full, lambda: CompletionStream(
            tok, sub, n, rid, model, fp, req.include_usage, req.continuous_usage, echo_of if req.echo else None,
            echo_lps))

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=settings.model_path, max_model_len=ctx.client.limit_tokens)
                 for name in settings.model_names]
        return _json(ModelList(data=cards))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """OpenAI's model retrieve: the card of a served name, else a 404 error object."""
        if model not in settings.model_names:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        return _json(ModelCard(id=model, root=settings.model_path, max_model_len=ctx.client.limit_tokens))
