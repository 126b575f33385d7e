"""FastAPI routes of the OpenAI-compatible server, and SSE streaming.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, POST /generate (native: token ids in and out), POST /flush_cache, GET /server_info,
POST /v1/tokenize, POST /v1/detokenize.

Every error is the OpenAI error object ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (validated here, before the engine sees anything), 401 without the API key,
404/405 for unknown routes, 503 with ``Retry-After`` when overloaded or the engine is gone, 500
for an engine failure. Streams (``text/event-stream``) start only once the first output (or a
refusal) came back, so a refusal is still a proper status code; each choice ends with exactly one
``finish_reason``, then an optional usage chunk, then ``data: [DONE]``. A client that disconnects
(streaming or not) has its engine requests aborted at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from idleless.engine.request import RequestError, SamplingParams
from idleless.server.engine_client import EngineClient, EngineDeadError, Overloaded, Submission
from idleless.server.protocol import (PARAM_NAMES, APIError, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatLogprobs, ChatLogprobToken, ChatMessageOut,
                                      ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs,
                                      CompletionRequest, CompletionResponse, CompletionStreamChoice, DeltaMessage,
                                      DetokenizeRequest, GenerateRequest, ModelCard, ModelList, PromptTokensDetails,
                                      TokenizeRequest, TopLogprob, UsageInfo, MAX_PROMPTS, error_body, parse_request)
from idleless.telemetry.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from idleless.text.output import CompletionDelta, CompletionOutput
from idleless.text.tokenizer import check_unicode

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # -inf logprobs are sent as this (JSON has no infinity)


@dataclass
class ServerSettings:
    """What the routes need besides the engine client.

    model_names: names accepted in ``model`` (the first is reported); api_key: Bearer token
    required on every route but /health (None = open); system_fingerprint: sent with every response."""

    model_names: list[str]
    model_path: str = ""
    api_key: Optional[str] = None
    system_fingerprint: str = "idleless"
    extra_info: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.model_names[0]


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


# ------------------------------------------------------------------------------------------------
# ASGI helpers: auth, disconnect detection, SSE
# ------------------------------------------------------------------------------------------------
class APIKeyMiddleware:
    """Pure ASGI middleware (it must not wrap ``receive``): ``Authorization: Bearer <key>`` on every
    HTTP route except ``open_paths``; otherwise 401 with the OpenAI error object."""

    def __init__(self, app, api_key: str, metrics: Optional[ServerMetrics] = None,
                 open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.expected = api_key.encode()
        self.metrics = metrics
        self.open_paths = set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.open_paths:
            got = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    got = v
                    break
            scheme, _, token = got.partition(b" ")  # the scheme is case-insensitive (RFC 7235 section 2.1)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                if self.metrics is not None:
                    self.metrics.observe_rejected("unauthorized")
                msg = "missing API key (Authorization: Bearer ...)" if not got else "incorrect API key"
                resp = JSONResponse(error_body(msg, "authentication_error", None, "invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw):
    """Await ``aw`` unless the client disconnects first (then cancel it and raise ClientGone).
    The request body must have been read already."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001
        pass
    raise ClientGone()


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of already formatted ``data: ...\\n\\n`` strings.

    Unlike Starlette's StreamingResponse it watches ``receive`` for ``http.disconnect`` the whole
    time (uvicorn's ``send`` silently drops writes to a closed connection, so writing alone would
    only notice at the next token): on disconnect the iterator is cancelled and closed, which
    aborts its engine requests."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], headers: Optional[dict] = None):
        # no Response.__init__: it would declare Content-Length: 0
        self.status_code = 200
        self.background = None
        self.chunks = chunks
        hdrs = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                "x-accel-buffering": "no", **{k.lower(): v for k, v in (headers or {}).items()}}
        self.raw_headers = [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in hdrs.items()]

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump():
            try:
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.chunks.aclose()

        pump_task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not pump_task.done():
                pump_task.cancel()
            try:
                await pump_task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the client is gone or the stream broke; nothing to answer
                log.exception("stream ended with an error")


def sse(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------
def build_app(client: EngineClient, settings: ServerSettings, metrics: Optional[ServerMetrics] = None) -> FastAPI:
    """The FastAPI app over a started EngineClient. ``metrics`` defaults to a new ServerMetrics."""
    metrics = metrics or client.metrics or ServerMetrics(settings.model_name)
    tok = client.tokenizer
    app = FastAPI(title="Idleless", version="0.1.0",
                  description="OpenAI-compatible LLM server (see idleless.server.app)")
    app.state.client = client
    app.state.settings = settings
    app.state.metrics = metrics
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, metrics=metrics)

    # -- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status == 503:
            metrics.observe_rejected("overloaded")
        elif 400 <= e.status < 500:
            metrics.observe_rejected("bad_request")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None, code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(str(e.errors()[:1]), "invalid_request_error", None, "invalid_value"),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", None, "internal_error"),
                            status_code=500)

    # -- helpers -------------------------------------------------------------------------------
    async def read_json(request: Request) -> Any:
        body = await request.body()
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None

    # No token decodes to more characters than the longest vocabulary piece, so a text longer than
    # limit_tokens * that many characters cannot fit: refuse it before paying for tokenization.
    try:
        max_piece = max((len(p) for p in tok.hf.get_vocab()), default=64) or 64
    except Exception:  # noqa: BLE001 - tokenizers without get_vocab
        max_piece = 256
    max_chars = client.limit_tokens * max_piece
    big_text = 16384  # characters; longer texts are tokenized in a worker thread, off the event loop

    def too_long(chars: int, param: str) -> APIError:
        return APIError(400, f"the {param} has {chars} characters, more than {client.limit_tokens} tokens can "
                        f"hold (context length / KV pool limit {client.limit_tokens} tokens)", param=param,
                        code="context_length_exceeded")

    async def encode(text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if len(text) > max_chars:
            raise too_long(len(text), param)
        try:
            if len(text) > big_text:
                return await asyncio.to_thread(tok.encode, text, add_special_tokens)
            return tok.encode(text, add_special_tokens)
        except ValueError as e:  # not valid Unicode (a lone surrogate)
            raise APIError(400, f"the {param}: {e}", param=param, code="invalid_value") from None

    async def render_chat(msgs: list[dict], **kwargs) -> list[int]:
        chars = sum(len(m["content"]) for m in msgs)
        if chars > max_chars:
            raise too_long(chars, "messages")
        for i, m in enumerate(msgs):  # name the message, not a position in the rendered template
            try:
                check_unicode(m["content"], f"messages[{i}].content")
            except ValueError as e:
                raise APIError(400, str(e), param="messages", code="invalid_value") from None
        try:
            if chars > big_text:
                return await asyncio.to_thread(tok.apply_chat_template, msgs, **kwargs)
            return tok.apply_chat_template(msgs, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages", code="invalid_value") \
                from None

    def check_model(name: Optional[str]) -> str:
        if name is None or name in settings.model_names:
            return name or settings.model_name
        raise APIError(400, f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                       param="model", code="model_not_found")

    def submit(prompts: list[list[int]], params: SamplingParams) -> Submission:
        try:
            return client.submit(prompts, params)
        except RequestError as e:
            raise APIError.from_request_error(e, PARAM_NAMES) from None
        except Overloaded as e:
            raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"}) from None

    def engine_error(sub: Submission, index: int, message: str) -> APIError:
        code, param = sub.error_info(index)
        if code and code != "internal_error":
            return APIError.from_request_error(RequestError(message, param=param, code=code), PARAM_NAMES)
        return APIError(500, message, code="internal_error")

    async def first_delta(request: Request, sub: Submission) -> Optional[CompletionDelta]:
        """Wait for the first output (None if every choice finished without one); an engine refusal
        or a dead engine becomes an APIError; a disconnect closes the submission."""
        try:
            d = await until_disconnect(request, sub.__anext__())
        except StopAsyncIteration:
            return None
        except ClientGone:
            sub.close()
            raise
        except EngineDeadError as e:
            sub.close()
            raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"}) from None
        if d.error and not d.token_ids:
            sub.close()
            raise engine_error(sub, d.index, d.error)
        return d

    async def collect(request: Request, sub: Submission) -> list[CompletionOutput]:
        try:
            outs = await until_disconnect(request, sub.collect())
        except EngineDeadError as e:
            raise APIError(500, str(e), code="engine_dead") from None
        finally:
            sub.close()
        for o in outs:
            if o.error:
                raise engine_error(sub, o.index, o.error)
        return outs

    async def chain(first: Optional[CompletionDelta], sub: Submission) -> AsyncIterator[CompletionDelta]:
        if first is not None:
            yield first
        async for d in sub:
            yield d

    def usage_of(sub: Submission, n: int) -> UsageInfo:
        prompt = cached = completion = 0
        for pi in range(0, len(sub.states), n):
            group = sub.states[pi:pi + n]
            prompt += group[0].prompt_tokens
            cached += min(st.cached_tokens for st in group)
            completion += sum(len(st.token_ids) for st in group)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def lp(x: float) -> float:
        return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR

    def chat_logprobs(token_ids, logprobs, tops) -> Optional[ChatLogprobs]:
        if logprobs is None:
            return None
        content = []
        for i, t in enumerate(token_ids[:len(logprobs)]):
            top = []
            if tops is not None and i < len(tops):
                top = [TopLogprob(token=tok.id_to_piece(a), logprob=lp(b), bytes=list(tok.id_to_bytes(a)))
                       for a, b in tops[i]]
            content.append(ChatLogprobToken(token=tok.id_to_piece(t), logprob=lp(logprobs[i]),
                                            bytes=list(tok.id_to_bytes(t)), top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion_logprobs(token_ids, logprobs, tops, offset: int) -> tuple[Optional[CompletionLogprobs], int]:
        if logprobs is None:
            return None, offset
        out = CompletionLogprobs()
        for i, t in enumerate(token_ids[:len(logprobs)]):
            piece = tok.id_to_piece(t)
            out.tokens.append(piece)
            out.token_logprobs.append(lp(logprobs[i]))
            if tops is not None and i < len(tops):
                out.top_logprobs.append({tok.id_to_piece(a): lp(b) for a, b in tops[i]})
            else:
                out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(piece)
        return out, offset

    def stream_error(message: str, code: str = "internal_error") -> str:
        return sse(error_body(message, "server_error", None, code))

    # -- OpenAI routes -------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await read_json(request))
        model = check_model(req.model)
        params = req.sampling_params()
        msgs = [m.to_template() for m in req.messages]
        kwargs = {"add_generation_prompt": bool(req.add_generation_prompt)}
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        ids = await render_chat(msgs, **kwargs)
        sub = submit([ids], params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fp = settings.system_fingerprint
        try:
            if not req.stream:
                outs = await collect(request, sub)
                choices = [ChatChoice(index=o.index, message=ChatMessageOut(content=o.text),
                                      logprobs=chat_logprobs(o.token_ids, o.logprobs, o.top_logprobs),
                                      finish_reason=o.finish_reason, matched_stop=o.matched_stop) for o in outs]
                resp = ChatCompletionResponse(id=rid, model=model, system_fingerprint=fp, choices=choices,
                                              usage=usage_of(sub, params.n))
                return Response(resp.model_dump_json(), media_type="application/json")
            first = await first_delta(request, sub)
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            sub.close()
            raise
        created = int(time.time())
        include_usage, continuous = req.include_usage, req.continuous_usage

        def chunk(choices, usage=None):
            return sse(ChatCompletionChunk(id=rid, created=created, model=model, system_fingerprint=fp,
                                           choices=choices, usage=usage))

        async def gen():
            try:
                for st in sub.states:
                    yield chunk([ChatStreamChoice(index=st.index, delta=DeltaMessage(role="assistant", content=""))])
                async for d in chain(first, sub):
                    if d.error:
                        yield stream_error(d.error)
                    lps = chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)
                    if not d.text and d.finish_reason is None and lps is None:
                        continue
                    c = ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text or None) if d.text
                                         else DeltaMessage(), logprobs=lps, finish_reason=d.finish_reason,
                                         matched_stop=d.matched_stop)
                    yield chunk([c], usage_of(sub, params.n) if include_usage and continuous else None)
                if include_usage:
                    yield chunk([], usage_of(sub, params.n))
            except EngineDeadError as e:
                yield stream_error(str(e), "engine_dead")
            except Exception as e:  # noqa: BLE001 - headers are sent; report in-band
                log.exception("chat stream failed")
                yield stream_error(f"internal error: {type(e).__name__}")
            finally:
                sub.close()
            yield SSE_DONE

        return EventStreamResponse(gen())

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await read_json(request))
        model = check_model(req.model)
        params = req.sampling_params()
        p = req.prompt
        if isinstance(p, str):
            texts, prompts = [p], [await encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            if len(p) > MAX_PROMPTS:
                raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt",
                               code="invalid_value")
            texts, prompts = list(p), [await encode(x) for x in p]
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
                    try:
                        client.check_request(ids, params)
                    except RequestError as e:
                        raise APIError.from_request_error(e, PARAM_NAMES) from None
                    t = tok.decode(ids, skip_special_tokens=False)
                echo_texts.append(t)
        sub = submit(prompts, params)
        n = params.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        fp = settings.system_fingerprint

        def echo_of(index: int) -> str:
            return echo_texts[index // n] if req.echo else ""

        try:
            if not req.stream:
                outs = await collect(request, sub)
                choices = []
                for o in outs:
                    echo = echo_of(o.index)
                    lps, _ = completion_logprobs(o.token_ids, o.logprobs, o.top_logprobs, len(echo))
                    choices.append(CompletionChoice(index=o.index, text=echo + o.text, logprobs=lps,
                                                    finish_reason=o.finish_reason, matched_stop=o.matched_stop))
                resp = CompletionResponse(id=rid, model=model, system_fingerprint=fp, choices=choices,
                                          usage=usage_of(sub, n))
                return Response(resp.model_dump_json(), media_type="application/json")
            first = await first_delta(request, sub)
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            sub.close()
            raise
        created = int(time.time())
        include_usage, continuous = req.include_usage, req.continuous_usage

        def chunk(choices, usage=None):
            return sse(CompletionChunk(id=rid, created=created, model=model, system_fingerprint=fp,
                                       choices=choices, usage=usage))

        async def gen():
            offsets = {st.index: 0 for st in sub.states}
            try:
                if req.echo:
                    for st in sub.states:
                        e = echo_of(st.index)
                        offsets[st.index] = len(e)
                        yield chunk([CompletionStreamChoice(index=st.index, text=e)])
                async for d in chain(first, sub):
                    if d.error:
                        yield stream_error(d.error)
                    lps, offsets[d.index] = completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs,
                                                                offsets[d.index])
                    if lps is None:
                        offsets[d.index] += len(d.text)
                    if not d.text and d.finish_reason is None and lps is None:
                        continue
                    c = CompletionStreamChoice(index=d.index, text=d.text, logprobs=lps,
                                               finish_reason=d.finish_reason, matched_stop=d.matched_stop)
                    yield chunk([c], usage_of(sub, n) if include_usage and continuous else None)
                if include_usage:
                    yield chunk([], usage_of(sub, n))
            except EngineDeadError as e:
                yield stream_error(str(e), "engine_dead")
            except Exception as e:  # noqa: BLE001
                log.exception("completion stream failed")
                yield stream_error(f"internal error: {type(e).__name__}")
            finally:
                sub.close()
            yield SSE_DONE

        return EventStreamResponse(gen())

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=settings.model_path, max_model_len=client.limit_tokens)
                 for name in settings.model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """OpenAI's model retrieve: the card of a served name, else a 404 error object."""
        if model not in settings.model_names:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        card = ModelCard(id=model, root=settings.model_path, max_model_len=client.limit_tokens)
        return Response(card.model_dump_json(), media_type="application/json")

    # -- native and admin routes ---------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        """Native generation: ``{"input_ids": [...]} | {"text": "..."}, "sampling_params": {...},
        "stream": bool}`` -> ``{"text", "output_ids", "meta_info"}`` (a list of those when n > 1);
        streamed as SSE deltas of the same shape, then ``data: [DONE]``."""
        req = parse_request(GenerateRequest, await read_json(request))
        if (req.input_ids is None) == (req.text is None):
            raise APIError(400, "give exactly one of input_ids and text", param="input_ids", code="invalid_value")
        try:
            params = req.params()
        except (TypeError, ValueError) as e:
            raise APIError(400, f"bad sampling_params: {e}", param="sampling_params", code="invalid_value") from None
        ids = list(req.input_ids) if req.input_ids is not None else await encode(req.text, "text")
        sub = submit([ids], params)

        def meta(rid, reason, matched, prompt, cached, completion, lps=None, ids_=None):
            m = {"id": rid, "finish_reason": None if reason is None else {"type": reason, "matched": matched},
                 "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}
            if lps is not None:
                m["output_token_logprobs"] = [[lp(a), b] for a, b in zip(lps, ids_)]
            return m

        try:
            if not req.stream:
                outs = await collect(request, sub)
                res = [{"index": o.index, "text": o.text, "output_ids": o.token_ids,
                        "meta_info": meta(o.rid, o.finish_reason, o.matched_stop, o.prompt_tokens, o.cached_tokens,
                                          o.completion_tokens, o.logprobs, o.token_ids)} for o in outs]
                return JSONResponse(res[0] if len(res) == 1 else res)
            first = await first_delta(request, sub)
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            sub.close()
            raise

        async def gen():
            try:
                async for d in chain(first, sub):
                    if d.error:
                        yield stream_error(d.error)
                    yield sse({"index": d.index, "text": d.text, "output_ids": d.token_ids,
                               "meta_info": meta(d.rid, d.finish_reason, d.matched_stop, d.prompt_tokens,
                                                 d.cached_tokens, d.completion_tokens, d.logprobs, d.token_ids)})
            except EngineDeadError as e:
                yield stream_error(str(e), "engine_dead")
            except Exception as e:  # noqa: BLE001
                log.exception("generate stream failed")
                yield stream_error(f"internal error: {type(e).__name__}")
            finally:
                sub.close()
            yield SSE_DONE

        return EventStreamResponse(gen())

    @app.get("/health")
    async def health():
        if await client.healthy():
            return Response(status_code=200)
        return JSONResponse(error_body("the engine core is not answering", "service_unavailable_error", None,
                                       "engine_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        stats, ok = None, False
        if not client.dead:
            try:
                stats = await client.control("stats", timeout=5.0)
                ok = True
            except Exception:  # noqa: BLE001 - still export the frontend's metrics
                pass
        metrics.update_core(stats, ok)
        metrics.set_inflight(client.num_inflight)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            ok = await client.control("flush_cache", timeout=30.0)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        if not ok:
            raise APIError(400, "cannot flush the cache while requests are running", code="requests_running")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.get("/server_info")
    async def server_info():
        info = client.info
        try:
            stats = await client.control("stats", timeout=5.0)
        except Exception:  # noqa: BLE001
            stats = None
        return JSONResponse({
            "model": settings.model_name, "model_path": settings.model_path, "dtype": info.dtype,
            "context_length": info.context_length, "kv_slots": info.kv_slots, "vocab_size": info.vocab_size,
            "max_running_requests": info.max_running_requests, "max_inflight": client.max_inflight,
            "num_inflight": client.num_inflight, "engine_pid": info.pid, "load_seconds": info.load_seconds,
            "system_fingerprint": settings.system_fingerprint, "stats": stats, **settings.extra_info})

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_request(TokenizeRequest, await read_json(request))
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            ids = await render_chat([m.to_template() for m in req.messages],
                                    add_generation_prompt=bool(req.add_generation_prompt))
        else:
            ids = await encode(req.prompt, "prompt", bool(req.add_special_tokens))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": client.limit_tokens})

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await read_json(request))
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < client.info.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {client.info.vocab_size})",
                           param="tokens", code="invalid_value")
        return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

    return app
