"""One answer path for every generating route (chat, completions, /generate).

``answer(request, sub, stream, full, stream_format)``: without streaming, waits for every choice
and returns ``full(outputs)``; with streaming, waits for the first output (so a refusal is still a
proper status code), then returns an ``EventStreamResponse`` over ``sse_events``, the one SSE
generator: the format's opening chunks, one chunk per delta, its closing chunks, an in-band error
object if the engine fails mid-stream, and always ``data: [DONE]``. The routes differ only in their
``StreamFormat`` (how a delta becomes a chunk) and their ``full`` response.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable, Iterable, Optional, Protocol

from fastapi import Request
from fastapi.responses import Response

from idleless.engine.request import RequestError
from idleless.server.asgi import SSE_DONE, ClientGone, EventStreamResponse, sse, until_disconnect
from idleless.server.context import engine_unavailable
from idleless.server.engine_client import EngineDeadError, Submission
from idleless.server.protocol import PARAM_NAMES, APIError, PromptTokensDetails, UsageInfo, error_body
from idleless.text.output import CompletionDelta, CompletionOutput

log = logging.getLogger(__name__)


class StreamFormat(Protocol):
    """How one route writes its stream: ``opening()`` chunks before the first delta, ``delta(d)``
    the chunk for one delta (None: nothing worth sending), ``closing()`` chunks after the last."""

    def opening(self) -> Iterable[str]: ...

    def delta(self, d: CompletionDelta) -> Optional[str]: ...

    def closing(self) -> Iterable[str]: ...


def stream_error(message: str, code: str = "internal_error") -> str:
    """An OpenAI error object as an SSE event (headers are sent by then: errors go in-band)."""
    return sse(error_body(message, "server_error", None, code))


def engine_error(sub: Submission, index: int, message: str) -> APIError:
    """A choice the engine refused (400 with its code and param) or failed (500)."""
    code, param = sub.error_info(index)
    if code and code != "internal_error":
        return APIError.from_request_error(RequestError(message, param=param, code=code), PARAM_NAMES)
    return APIError(500, message, code="internal_error")


def usage_of(sub: Submission, n: int) -> UsageInfo:
    """Usage over the choices so far: each prompt counted once, cached tokens the least over its n
    choices (what every choice was served from the cache), completion tokens summed."""
    prompt = cached = completion = 0
    for pi in range(0, len(sub.states), n):
        group = sub.states[pi:pi + n]
        prompt += group[0].prompt_tokens
        cached += min(st.cached_tokens for st in group)
        completion += sum(len(st.token_ids) for st in group)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def first_delta(request: Request, sub: Submission) -> Optional[CompletionDelta]:
    """Wait for the first output (None if every choice finished without one); an engine refusal
    or a dead engine becomes an APIError; a disconnect closes the submission (ClientGone)."""
    try:
        d = await until_disconnect(request, sub.__anext__())
    except StopAsyncIteration:
        return None
    except ClientGone:
        sub.close()
        raise
    except EngineDeadError as e:
        sub.close()
        raise engine_unavailable(e) from None
    if d.error and not d.token_ids:
        sub.close()
        raise engine_error(sub, d.index, d.error)
    return d


async def collect(request: Request, sub: Submission) -> list[CompletionOutput]:
    """Every choice's final output, in choice order; the submission is closed on return. Raises
    APIError (a refused or failed choice, 500 ``engine_dead``), ClientGone."""
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


async def sse_events(first: Optional[CompletionDelta], sub: Submission, fmt: StreamFormat) -> AsyncIterator[str]:
    """The SSE body of a streamed answer; closes ``sub`` however it ends (which aborts what is
    unfinished when the client left). Deltas already queued when one arrives (a backlog, or the
    choices of one step) go out as one write: the same events, fewer sends and wake-ups."""
    parts: list[str] = []  # chunks of the deltas taken and not yet written
    try:
        for chunk in fmt.opening():
            yield chunk
        batch = [first] if first is not None else []
        while True:
            if not batch:
                try:
                    batch = [await sub.__anext__()]
                except StopAsyncIteration:
                    break
            batch += sub.ready()
            for d in batch:
                if d.error:
                    parts.append(stream_error(d.error))
                chunk = fmt.delta(d)
                if chunk is not None:
                    parts.append(chunk)
            batch = []
            if parts:
                out, parts = "".join(parts), []
                yield out
        for chunk in fmt.closing():
            yield chunk
    except EngineDeadError as e:
        yield stream_error(str(e), "engine_dead")
    except Exception as e:  # noqa: BLE001 - headers are sent; report in-band
        log.exception("stream failed")
        yield "".join(parts) + stream_error(f"internal error: {type(e).__name__}")
    finally:
        sub.close()
    yield SSE_DONE


async def answer(request: Request, sub: Submission, stream: bool,
                 full: Callable[[list[CompletionOutput]], Response],
                 stream_format: Callable[[], StreamFormat]) -> Response:
    """The response to a submitted generation: ``full(outputs)`` or a stream in
    ``stream_format()`` (built once the first output is in). A client that left gets 499 (nobody
    reads it); any error closes the submission."""
    try:
        if not stream:
            return full(await collect(request, sub))
        first = await first_delta(request, sub)
    except ClientGone:
        return Response(status_code=499)
    except BaseException:
        sub.close()
        raise
    return EventStreamResponse(sse_events(first, sub, stream_format()))
