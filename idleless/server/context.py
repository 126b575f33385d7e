"""What every route needs: the engine client, the settings, the metrics, and the input helpers
(JSON body, tokenization, chat rendering, model name, submission) that turn bad input into APIError."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request

from idleless.disagg.http import prefill_reply
from idleless.engine.request import RequestError, SamplingParams
from idleless.server.engine_client import EngineClient, EngineDeadError, Overloaded, Submission
from idleless.server.protocol import PARAM_NAMES, APIError
from idleless.server.tool_calls import make_parser
from idleless.telemetry.metrics import ServerMetrics
from idleless.text.tokenizer import check_unicode

# Texts longer than this many characters are tokenized in a worker thread, off the event loop.
BIG_TEXT_CHARS = 16384


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


def engine_unavailable(e: EngineDeadError) -> APIError:
    """A dead (or stopping) engine core as a 503 the client may retry later."""
    return APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"})


class ServerContext:
    """The routes' shared state and input helpers. ``max_chars``: no text longer than this can fit
    (``limit_tokens`` times the longest vocabulary piece), so it is refused before tokenization.
    ``tool_parser``: the ``--tool-call-parser``'s parser (None when unset)."""

    def __init__(self, client: EngineClient, settings: ServerSettings, metrics: ServerMetrics):
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.tok = client.tokenizer
        try:
            max_piece = max((len(p) for p in self.tok.hf.get_vocab()), default=64) or 64
        except Exception:  # noqa: BLE001 - tokenizers without get_vocab
            max_piece = 256
        self.max_chars = client.limit_tokens * max_piece
        name = getattr(client.config, "tool_call_parser", None)
        self.tool_parser = make_parser(name) if name else None  # ValueError for an unknown name

    async def read_json(self, request: Request) -> Any:
        """The decoded JSON body; APIError(400, code ``invalid_json``) when it does not parse."""
        body = await request.body()
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None

    def too_long(self, chars: int, param: str) -> APIError:
        limit = self.client.limit_tokens
        return APIError(400, f"the {param} has {chars} characters, more than {limit} tokens can hold (context "
                        f"length / KV pool limit {limit} tokens)", param=param, code="context_length_exceeded")

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text``; APIError(400) naming ``param`` when it is too long or not valid Unicode."""
        if len(text) > self.max_chars:
            raise self.too_long(len(text), param)
        try:
            if len(text) > BIG_TEXT_CHARS:
                return await asyncio.to_thread(self.tok.encode, text, add_special_tokens)
            return self.tok.encode(text, add_special_tokens)
        except ValueError as e:  # not valid Unicode (a lone surrogate)
            raise APIError(400, f"the {param}: {e}", param=param, code="invalid_value") from None

    async def render_chat(self, msgs: list[dict], **kwargs) -> list[int]:
        """Apply the chat template to ``msgs`` (template dicts); APIError(400, param ``messages``)
        for too long a text, invalid Unicode (naming the message) or a template error."""
        chars = sum(len(m["content"]) for m in msgs)
        if chars > self.max_chars:
            raise self.too_long(chars, "messages")
        for i, m in enumerate(msgs):  # name the message, not a position in the rendered template
            try:
                check_unicode(m["content"], f"messages[{i}].content")
            except ValueError as e:
                raise APIError(400, str(e), param="messages", code="invalid_value") from None
        try:
            if chars > BIG_TEXT_CHARS:
                return await asyncio.to_thread(self.tok.apply_chat_template, msgs, **kwargs)
            return self.tok.apply_chat_template(msgs, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages", code="invalid_value") \
                from None

    def check_model(self, name: Optional[str]) -> str:
        """The served model name for a request's ``model`` (None = the default); else a 404 (as OpenAI
        and vLLM: the model is a resource that does not exist)."""
        settings = self.settings
        if name is None or name in settings.model_names:
            return name or settings.model_name
        raise APIError(404, f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                       param="model", code="model_not_found")

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's admission rule, as a 400 (for work done before submitting, e.g. echo)."""
        try:
            self.client.check_request(prompt_ids, params)
        except RequestError as e:
            raise APIError.from_request_error(e, PARAM_NAMES) from None

    def kv_transfer_reply(self, params: Optional[dict]) -> Optional[dict]:
        """A prefill engine's ``kv_transfer_params`` answer (``idleless.disagg.http.prefill_reply``)."""
        return prefill_reply(self.client.config, params)

    def submit(self, prompts: list[list[int]], params: SamplingParams, priority: int = 0,
               kv_transfer_params: Optional[dict] = None) -> Submission:
        """``EngineClient.submit`` (``priority``: higher is admitted first) with its refusals as APIErrors: 400 (RequestError), 503 (overloaded
        or draining, Retry-After 1; engine gone, Retry-After 5)."""
        try:
            if kv_transfer_params and self.client.config.disaggregation_mode == "null":
                raise APIError(400, "kv_transfer_params needs a server started with --disaggregation-mode prefill "
                                    "or decode", param="kv_transfer_params", code="unsupported_parameter")
            return self.client.submit(prompts, params, priority, kv_transfer_params)
        except RequestError as e:
            raise APIError.from_request_error(e, PARAM_NAMES) from None
        except Overloaded as e:
            raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
