"""OpenAI-compatible request and response models (pydantic v2) and the OpenAI error object.

Requests are parsed with ``parse_request(Model, body)``: any problem (not an object, wrong types,
values out of range) raises :class:`APIError` carrying the HTTP status and the OpenAI error object
``{"error": {"message", "type", "param", "code"}}``, so nothing malformed reaches the engine.

No silent drops. Every top-level name of a /v1/chat/completions, /v1/completions or /generate body
is one of three kinds (``_Checked.check_fields``):

- implemented: a field of the model, honoured (or refused with a 400 where a value cannot be);
- known and without effect on the output (``user``, ``metadata``, ``store``, ``service_tier``, ...:
  OpenAI's bookkeeping fields): accepted and ignored, as OpenAI's own API ignores them for output;
- known but not implemented (OpenAI's ``audio``, ...; vLLM's ``guided_whitespace_pattern``,
  ``use_beam_search``, ``bad_words``, ...; SGLang's ``structural_tag``, ``lora_path``, ...): a 400
  (``unsupported_parameter``) naming it in ``param``, unless its value asks for nothing (null, the
  field's default, an empty list) — so a client never gets an unconstrained 200 for a constrained
  request.

Output constraints (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``,
SGLang's ``regex`` / ``ebnf`` / ``json_schema``) are implemented: ``idleless.server.constraints``.

Any other name is a 400 (``unknown_parameter``) naming it, as OpenAI answers "Unrecognized request
argument supplied". The same holds for the keys of /generate's ``sampling_params``. Inside nested
objects (messages, content parts, ``stream_options``) unknown keys are ignored, and the other routes
(tokenize, detokenize, pins) ignore unknown names.

Sampling fields map onto :class:`idleless.engine.request.SamplingParams` via ``to_sampling_params``;
range checks on values (NaN, negative, out of range, ``logit_bias`` ids outside the vocabulary) are
``SamplingParams.validate``'s, done by the frontend before a request is queued
(``idleless.server.engine_client.EngineClient.check_request``).
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, model_serializer,
                      model_validator)

from idleless.engine.request import RequestError, SamplingParams
from idleless.sampling_params import MAX_LOGPROBS

# token ids are strict ints: pydantic's lax mode would turn true, 1.0 or "5" into ids
TokenIds = list[StrictInt]

MAX_N = 16  # choices per prompt (n); each is an engine request
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # top_logprobs, logprobs, prompt_logprobs, top_logprobs_num: vLLM's cap (20)
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_PROMPTS = 64  # prompts in one /v1/completions list
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # torch.Generator.manual_seed range, leaving room for seed + i
GREEDY_EPS = 1e-5  # a temperature below this is greedy (vLLM's convention)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def harden(params: SamplingParams) -> SamplingParams:
    """Server-side guards on top of ``SamplingParams.validate`` against values that are "valid"
    but overflow float32 in the sampler (logits / 1e-300 = inf -> NaN probabilities -> the whole
    engine step fails): a temperature in (0, 1e-5) becomes 0 (greedy); a repetition_penalty
    outside [0.01, 100] is refused (RequestError). Returns ``params`` (modified in place)."""
    t = params.temperature
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < GREEDY_EPS:
        params.temperature = 0.0
    rp = params.repetition_penalty
    lo, hi = REPETITION_PENALTY_RANGE
    if isinstance(rp, (int, float)) and not isinstance(rp, bool) and rp == rp and not lo <= rp <= hi:
        raise RequestError(f"repetition_penalty must be in [{lo}, {hi}], got {rp!r}", param="repetition_penalty",
                           code="invalid_value")
    return params


class APIError(Exception):
    """An error answered with ``status`` and the OpenAI error object (``body()``).

    type: ``invalid_request_error`` (400/404), ``authentication_error`` (401),
    ``server_error`` (500), ``service_unavailable_error`` (503). code: machine-readable reason
    (``context_length_exceeded``, ``model_not_found``, ``invalid_value``, ``invalid_api_key``,
    ``server_overloaded``, ...). ``headers``: extra response headers (``Retry-After`` on 503)."""

    def __init__(self, status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    @classmethod
    def from_request_error(cls, e: RequestError, param_names: Optional[dict[str, str]] = None) -> "APIError":
        """A RequestError (engine-side validation) as a 400; ``param_names`` renames engine params
        (``max_new_tokens`` -> ``max_tokens``) to the API's; ``queue_full`` becomes a 503."""
        param = (param_names or {}).get(e.param, e.param) if e.param else None
        msg = e.message
        if param and e.param and param != e.param:
            msg = msg.replace(e.param, param)
        if e.code == "queue_full":
            return cls(503, msg, code="server_overloaded", headers={"Retry-After": "1"})
        return cls(400, msg, param=param, code=e.code or "invalid_value")


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _loc_to_param(loc: tuple) -> Optional[str]:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        else:
            # pydantic puts union-member / function names into loc; keep only field names
            if any(ch in str(p) for ch in "[]()") or str(p) in ("str", "int", "list", "function-after"):
                continue
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or None


def parse_request(model: type[BaseModel], body: Any):
    """Validate a decoded JSON body against ``model``; raises APIError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if issubclass(model, _Checked):
        model.check_fields(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _loc_to_param(tuple(err.get("loc", ())))
        msg = err.get("msg", "invalid value")
        if param:
            msg = f"{param}: {msg}"
        if len(e.errors()) > 1:
            msg += f" (and {len(e.errors()) - 1} more problem(s))"
        raise APIError(400, msg, param=param, code="invalid_type" if "type" in err.get("type", "") else "invalid_value") \
            from None


# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def _harmless(value: Any, off: tuple) -> bool:
    """Whether ``value`` asks for nothing: equal to one of ``off`` with the same type (so 1 is not
    True and 0 is not False)."""
    return any(type(value) is type(o) and value == o for o in off)


OFF = (None, [], {})  # values of a known-unsupported field that ask for nothing
OFF_BOOL = (None, False)


def unsupported_check(name: str, value: Any, unsupported: dict[str, tuple], ignored: frozenset = frozenset(),
                      param: Optional[str] = None) -> bool:
    """The no-silent-drop rule (module docstring) for one name that is not an implemented field:
    returns True if ``name`` is known and may be ignored (in ``ignored``, or in ``unsupported`` with a
    value that asks for nothing); raises APIError(400) naming ``param`` (default ``name``) otherwise."""
    param = param or name
    if name in ignored:
        return True
    off = unsupported.get(name)
    if off is None:
        raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                       code="unknown_parameter")
    if not _harmless(value, off):
        raise APIError(400, f"{param} is not supported by this server", param=param, code="unsupported_parameter")
    return True


_STRUCTURED = {name: OFF for name in (
    # vLLM's and SGLang's constraint fields not implemented (the rest are fields: idleless.server.constraints)
    "guided_whitespace_pattern", "structural_tag")}
# vLLM / SGLang sampling and serving extras we do not implement (both OpenAI routes)
_EXTRAS = {
    **_STRUCTURED,
    "use_beam_search": OFF_BOOL, "length_penalty": (None, 1.0, 1), "bad_words": OFF, "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": OFF_BOOL,
    "spaces_between_special_tokens": (None, True), "cache_salt": (None,),
    "vllm_xargs": (None,), "logits_processors": OFF, "return_hidden_states": OFF_BOOL,
    "lora_path": (None,), "mm_processor_kwargs": (None,), "no_stop_trim": OFF_BOOL, "custom_logit_processor": (None,),
}
# known fields that cannot change the output: OpenAI's bookkeeping, vLLM's request id
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                      "request_id"})


class _Checked(_Lenient):
    """A request body under the no-silent-drop rule: ``IGNORED`` names are accepted and ignored,
    ``UNSUPPORTED`` names (-> their values that ask for nothing) are refused unless harmless, any
    other name that is not a field is refused (``check_fields``)."""

    IGNORED: ClassVar[frozenset] = _IGNORED
    UNSUPPORTED: ClassVar[dict[str, tuple]] = _EXTRAS

    @classmethod
    def check_fields(cls, body: dict) -> None:
        """Raise APIError(400) naming the first field of ``body`` the rule refuses."""
        for name, value in body.items():
            if name not in cls.model_fields:
                unsupported_check(name, value, cls.UNSUPPORTED, cls.IGNORED)


class StreamOptions(_Lenient):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingRequest(_Checked):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM/SGLang extras)."""

    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = None  # strict, as OpenAI: "5" is a 400, not 5
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[TokenIds] = None
    ignore_eos: Optional[StrictBool] = False
    min_tokens: Optional[StrictInt] = 0
    n: Optional[StrictInt] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    include_stop_str_in_output: Optional[StrictBool] = False
    skip_special_tokens: Optional[StrictBool] = True
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    priority: Optional[StrictInt] = 0  # vLLM's: higher is admitted first and retracted last
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's: prefill/decode disaggregation (idleless.disagg)
    # output constraints (idleless.server.constraints): OpenAI's, vLLM's (new and older names), SGLang's
    response_format: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    regex: Optional[Any] = None
    ebnf: Optional[Any] = None
    json_schema: Optional[Any] = None

    def structured_output(self):
        """The request's one output constraint (a ``StructuredOutput``) or None; APIError(400) naming
        the field for an invalid schema, regex or grammar, or for two constraints at once."""
        from idleless.server import constraints as c

        def opt(kind, name):
            v = getattr(self, name)
            if v is None:
                return None
            return c.make(kind, c.schema_text(v, name) if kind == "json_schema" else v, name)

        c.check_backend(self.guided_decoding_backend, "guided_decoding_backend")
        return c.one_of([
            ("response_format", c.from_response_format(self.response_format)),
            ("structured_outputs", c.from_structured_outputs(self.structured_outputs)),
            ("guided_json", opt("json_schema", "guided_json")), ("guided_regex", opt("regex", "guided_regex")),
            ("guided_choice", opt("choice", "guided_choice")), ("guided_grammar", opt("ebnf", "guided_grammar")),
            ("regex", opt("regex", "regex")), ("ebnf", opt("ebnf", "ebnf")),
            ("json_schema", opt("json_schema", "json_schema"))])

    def _max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _check_prompt_logprobs(self) -> None:
        """vLLM's ``prompt_logprobs``: an int in [0, MAX_TOP_LOGPROBS], never with ``stream`` (as vLLM:
        the entries of the whole prompt come in one piece). APIError(400) otherwise."""
        pl = getattr(self, "prompt_logprobs", None)
        if pl is None:
            return
        if not 0 <= pl <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {pl}",
                           param="prompt_logprobs", code="invalid_value")
        if self.stream:
            raise APIError(400, "prompt_logprobs is not available with stream (use echo with logprobs on "
                           "/v1/completions)", param="prompt_logprobs", code="invalid_value")

    def to_sampling_params(self, logprobs: bool, top_logprobs: int, prompt_logprobs: Optional[int] = None,
                           scores_prompt: bool = False) -> SamplingParams:
        """The engine's SamplingParams (n kept; the client expands it). ``prompt_logprobs``: top k of
        the prompt's entries (None: none); ``scores_prompt``: the request returns the prompt's logprobs
        (echo or prompt_logprobs), so max_tokens 0 (score without generating) is allowed. Raises
        APIError(400) for fields we do not support; value ranges are checked later by
        SamplingParams.validate."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options", code="invalid_value")
        stop = self.stop if self.stop is not None else []
        if isinstance(stop, str):
            stop = [stop]
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop", code="invalid_value")
        for s in stop:
            if s == "" or len(s) > MAX_STOP_LEN:
                raise APIError(400, f"stop strings must be 1..{MAX_STOP_LEN} characters", param="stop",
                               code="invalid_value")
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", param="n", code="invalid_value")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise APIError(400, f"seed must be in [{SEED_MIN}, {SEED_MAX}]", param="seed", code="invalid_value")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs",
                           code="invalid_value")
        mnt = self._max_new_tokens()
        if mnt is not None and mnt < (0 if scores_prompt else 1):
            raise APIError(400, f"max_tokens must be >= 1 (or null for up to the context; 0 only to score the "
                           f"prompt: echo or prompt_logprobs), got {mnt}", param="max_tokens", code="invalid_value")

        def d(v, default):
            return default if v is None else v

        return self._harden(SamplingParams(
            temperature=d(self.temperature, 1.0), top_p=d(self.top_p, 1.0), top_k=d(self.top_k, -1),
            min_p=d(self.min_p, 0.0), repetition_penalty=d(self.repetition_penalty, 1.0),
            frequency_penalty=d(self.frequency_penalty, 0.0), presence_penalty=d(self.presence_penalty, 0.0),
            max_new_tokens=mnt, min_new_tokens=d(self.min_tokens, 0), seed=self.seed, stop=list(stop),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=d(self.skip_special_tokens, True), logprobs=logprobs, top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs, n=n, logit_bias=logit_bias_ids(self.logit_bias, "logit_bias"),
            structured_output=self.structured_output()))

    @staticmethod
    def _harden(params: SamplingParams) -> SamplingParams:
        try:
            return harden(params)
        except RequestError as e:
            raise APIError.from_request_error(e) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def logit_bias_ids(bias: Optional[dict], param: str) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) keyed by int ids; None for
    none. APIError(400) naming ``param`` for a key that is not an integer; the ids' range and the
    biases' are ``SamplingParams.validate``'s."""
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            raise APIError(400, f"{param}: keys must be token ids (integers), got {k!r}", param=param,
                           code="invalid_value") from None
    return out


# engine param name -> API param name, for error messages
PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

PromptType = Union[str, list[str], TokenIds, list[TokenIds]]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a list
    of token-id lists (each is a prompt with ``n`` choices; choice index = prompt_index * n + i).
    ``max_tokens`` omitted = 16 (OpenAI's default); null = up to the context. ``logprobs``: number of
    top alternatives per token (0..20; 0 = only the sampled token's); with ``echo`` the prompt's tokens
    get entries too (the first null, as OpenAI), and ``max_tokens`` 0 scores the prompt without
    generating. ``prompt_logprobs`` (vLLM's): each choice's ``prompt_logprobs`` in vLLM's shape."""

    prompt: PromptType
    echo: Optional[bool] = False
    logprobs: Optional[StrictInt] = None  # strict: true or "3" is refused, not read as 1 or 3
    prompt_logprobs: Optional[StrictInt] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_EXTRAS, "add_special_tokens": (None, True)}

    def _max_new_tokens(self) -> Optional[int]:
        if "max_tokens" not in self.model_fields_set:
            return 16
        return self.max_tokens

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of is not supported (must equal n)", param="best_of",
                           code="unsupported_parameter")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs",
                           code="invalid_value")
        self._check_prompt_logprobs()
        want = self.logprobs is not None
        prompt_k = self.prompt_logprobs
        if prompt_k is None and self.echo and want:  # echo scores the prompt with the same k (vLLM)
            prompt_k = self.logprobs
        return self.to_sampling_params(want, self.logprobs or 0, prompt_k,
                                       scores_prompt=bool(self.echo) or prompt_k is not None)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    """One chat message; ``developer`` is treated as ``system``. ``content`` is a string, a list
    of text parts (joined with newlines) or, for an assistant turn with ``tool_calls`` only, null or
    absent, as OpenAI's API: any other message without content, or with an empty list, is a 400
    (ValueError at validation)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant turn's calls (content then usually null)
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if isinstance(self.content, list) and not self.content:
            raise ValueError("content must be a string or a non-empty list of text parts")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts)"
                             + (" or tool_calls" if self.role == "assistant" else ""))
        return self

    def to_template(self) -> dict:
        """The message for the chat template; a tool call's JSON ``arguments`` text becomes an object
        (templates render it with ``tojson``, as vLLM passes it)."""
        role = "system" if self.role == "developer" else self.role
        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        else:
            content = "\n".join(p.text for p in self.content)
        m: dict[str, Any] = {"role": role, "content": content}
        if self.name:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionCallIn(_Lenient):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallIn(_Lenient):
    """A call in an assistant message of the history (OpenAI's shape)."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def to_template(self) -> dict:
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # the template gets the text as it came
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(_Lenient):
    """One entry of ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"] = "function"
    function: FunctionDef


# apply_chat_template's own arguments: set by their own request fields, never through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class _ChatTemplateFields(_Lenient):
    """How the chat template renders ``messages`` (vLLM's fields): ``add_generation_prompt`` (default
    true) opens an assistant turn after them; ``continue_final_message`` instead leaves the final
    (assistant) message open so the reply continues its text (needs add_generation_prompt false);
    ``chat_template_kwargs``: more variables for the template (e.g. ``enable_thinking``);
    ``documents``: a list of objects the template sees as ``documents`` (retrieval-augmented
    templates)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[dict[str, Any]]] = None

    def template_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``Tokenizer.apply_chat_template`` for these messages. APIError(400)
        for continue_final_message with add_generation_prompt or without a final assistant message,
        and for chat_template_kwargs that name apply_chat_template's own arguments, and for a ``tool``
        message without ``tool_call_id`` (as OpenAI)."""
        for i, m in enumerate(self.messages or ()):
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, f"messages[{i}] has role 'tool' but no tool_call_id (the id of the call it "
                               "answers)", param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
        agp = self.add_generation_prompt is not False
        if self.continue_final_message and (agp or not self.messages or self.messages[-1].role != "assistant"):
            raise APIError(400, "continue_final_message needs add_generation_prompt=false and a final "
                           "assistant message", param="continue_final_message", code="invalid_value")
        extra = dict(self.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved} (use the request's own fields)",
                           param="chat_template_kwargs", code="invalid_value")
        kw: dict[str, Any] = {**extra, "add_generation_prompt": agp}
        if self.continue_final_message:
            kw["continue_final_message"] = True
        if self.documents is not None:
            kw["documents"] = self.documents
        return kw


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` (newer OpenAI name) wins over
    ``max_tokens``; both omitted or null = up to the context. ``logprobs`` (bool) with
    ``top_logprobs`` (0..20) alternatives per token. ``prompt_logprobs`` (vLLM's): the rendered
    prompt's entries in the response's ``prompt_logprobs``; then ``max_tokens`` 0 scores only.
    Template fields: :class:`_ChatTemplateFields`."""

    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    prompt_logprobs: Optional[StrictInt] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    IGNORED: ClassVar[frozenset] = _IGNORED | {"prediction"}
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_EXTRAS, "functions": OFF,
        "function_call": (None, "none", "auto"), "modalities": (None, ["text"]), "audio": (None,),
        "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,), "chat_template": (None,),
        "echo": OFF_BOOL, "add_special_tokens": OFF_BOOL}

    def _max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_mode(self) -> tuple[str, Optional[dict]]:
        """How the reply may call tools: (``none`` | ``auto`` | ``required`` | ``named``, the named
        tool's dict or None). No tools (or an empty list) is ``none``; ``tool_choice`` defaults to
        ``auto`` with tools, as OpenAI's. APIError(400) for a choice naming no listed tool, ``required``
        without tools, two tools of one name, or a tool whose parameters are not a valid JSON schema."""
        from idleless.server import constraints as c

        tools = self.tools or []
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        seen: set[str] = set()
        for i, t in enumerate(tools):
            if t.function.name in seen:  # a call could not say which of the two it means
                raise APIError(400, f"tools[{i}] repeats the function name {t.function.name!r}",
                               param=f"tools[{i}].function.name", code="invalid_value")
            seen.add(t.function.name)
            if t.function.parameters is not None:
                c.make("json_schema", t.function.parameters, f"tools[{i}].function.parameters")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}', param="tool_choice", code="invalid_value")
            named = [t for t in tools if t.function.name == name]
            if not named:
                raise APIError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice",
                               code="invalid_value")
            return "named", named[0].model_dump(exclude_none=True)
        if not tools:  # "auto" without tools asks for nothing
            if choice == "required":
                raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice", code="invalid_value")
            return "none", None
        return choice, None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
        self._check_prompt_logprobs()
        return self.to_sampling_params(bool(self.logprobs), self.top_logprobs or 0, self.prompt_logprobs,
                                       scores_prompt=self.prompt_logprobs is not None)


class GenerateRequest(_Checked):
    """POST /generate (native): ``input_ids`` (token ids) or ``text``; ``sampling_params`` uses the
    engine's names (max_new_tokens, temperature, top_p, top_k, min_p, penalties, stop,
    stop_token_ids, ignore_eos, min_new_tokens, seed, n, logprobs, top_logprobs, ...).

    Logprobs as SGLang's /generate: ``return_logprob`` returns the output tokens' logprobs and, from
    prompt position ``logprob_start_len`` on (-1, the default: none of the prompt), the prompt's;
    ``top_logprobs_num`` alternatives per position (0..20); ``return_text_in_logprobs`` adds each
    token's text. The prompt's entries are set with these, not in ``sampling_params``.

    ``sampling_params`` may set one output constraint, as SGLang's: ``regex``, ``ebnf`` or
    ``json_schema`` (the schema's JSON text). ``priority``: higher is admitted first.

    SGLang's names this server does not implement are refused (module docstring): at the top level
    (``image_data``, ``lora_path``, ``return_hidden_states``, ...) and in
    ``sampling_params`` (``structural_tag``, ``custom_params``, ...)."""

    IGNORED: ClassVar[frozenset] = frozenset({"log_metrics"})
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {name: (None,) for name in (
        "image_data", "audio_data", "video_data", "input_embeds", "lora_path", "lora_id", "custom_logit_processor",
        "session_params", "token_ids_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room",
        "data_parallel_rank", "modalities")} | {"return_hidden_states": OFF_BOOL}
    SAMPLING_UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **{k: OFF for k in ("structural_tag", "custom_params", "stop_regex")},
        "no_stop_trim": OFF_BOOL, "spaces_between_special_tokens": (None, True), "sampling_seed": (None,)}
    SAMPLING_IGNORED: ClassVar[frozenset] = frozenset({"stream_interval"})  # streaming granularity only
    # SGLang's output constraints in sampling_params -> our kinds (json_schema is the schema's JSON text)
    SAMPLING_CONSTRAINTS: ClassVar[dict[str, str]] = {"regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema"}

    input_ids: Optional[TokenIds] = None
    text: Optional[str] = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: Optional[bool] = False
    rid: Optional[str] = None
    return_logprob: Optional[StrictBool] = False
    logprob_start_len: Optional[StrictInt] = -1
    top_logprobs_num: Optional[StrictInt] = 0
    return_text_in_logprobs: Optional[StrictBool] = False
    priority: Optional[StrictInt] = 0  # SGLang's: higher is admitted first and retracted last

    def _structured_output(self):
        """SGLang's one constraint among sampling_params' regex, ebnf and json_schema (or None)."""
        from idleless.server import constraints as c

        found = []
        for k, kind in self.SAMPLING_CONSTRAINTS.items():
            v = self.sampling_params.get(k)
            if v is not None:
                name = f"sampling_params.{k}"
                found.append((name, c.make(kind, c.schema_text(v, name) if kind == "json_schema" else v, name)))
        return c.one_of(found)

    def params(self) -> SamplingParams:
        allowed = set(SamplingParams.__dataclass_fields__) - {"prompt_logprobs", "prompt_logprobs_start",
                                                              "structured_output"}
        constraint = self._structured_output()
        if {"prompt_logprobs", "prompt_logprobs_start"} & set(self.sampling_params):
            raise APIError(400, "set the prompt's logprobs with return_logprob and logprob_start_len (SGLang's "
                           "fields), not in sampling_params", param="sampling_params", code="invalid_value")
        start, top = self.logprob_start_len, self.top_logprobs_num
        if start is None or start < -1:
            raise APIError(400, f"logprob_start_len must be -1 (none of the prompt) or a prompt position >= 0, "
                           f"got {start}", param="logprob_start_len", code="invalid_value")
        if top is None or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                           param="top_logprobs_num", code="invalid_value")
        for k, v in self.sampling_params.items():
            if k not in allowed and k not in self.SAMPLING_CONSTRAINTS:
                unsupported_check(k, v, self.SAMPLING_UNSUPPORTED, self.SAMPLING_IGNORED, f"sampling_params.{k}")
        types = {"temperature": float, "top_p": float, "min_p": float, "repetition_penalty": float,
                 "frequency_penalty": float, "presence_penalty": float, "top_k": int, "max_new_tokens": int,
                 "min_new_tokens": int, "seed": int, "n": int, "top_logprobs": int, "ignore_eos": bool,
                 "include_stop_str_in_output": bool, "skip_special_tokens": bool, "logprobs": bool}
        kw = {}
        for k, v in self.sampling_params.items():
            if k not in allowed:
                continue
            if k == "logit_bias":
                if v is not None and not isinstance(v, dict):
                    raise APIError(400, "sampling_params.logit_bias must be an object of token id -> bias",
                                   param="sampling_params.logit_bias", code="invalid_type")
                kw[k] = logit_bias_ids(v, "sampling_params.logit_bias")
                continue
            t = types.get(k)
            if v is None and k in ("max_new_tokens", "seed"):
                kw[k] = None
                continue
            if t is bool and not isinstance(v, bool) or t is int and (not isinstance(v, int) or isinstance(v, bool)) \
                    or t is float and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise APIError(400, f"sampling_params.{k} must be {t.__name__}", param=f"sampling_params.{k}",
                               code="invalid_type")
            kw[k] = v
        stop = kw.get("stop", [])
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in stop) \
                or len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, "sampling_params.stop must be a string or a list of non-empty strings",
                           param="sampling_params.stop", code="invalid_value")
        kw["stop"] = stop
        sti = kw.get("stop_token_ids", [])
        if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
            raise APIError(400, "sampling_params.stop_token_ids must be a list of ints",
                           param="sampling_params.stop_token_ids", code="invalid_type")
        if self.return_logprob:
            kw.update(logprobs=True, top_logprobs=top)
            if start >= 0:
                kw.update(prompt_logprobs=top, prompt_logprobs_start=start)
        p = _SamplingRequest._harden(SamplingParams(**kw, structured_output=constraint))
        if not 1 <= p.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}]", param="sampling_params.n", code="invalid_value")
        if p.seed is not None and not SEED_MIN <= p.seed <= SEED_MAX:
            raise APIError(400, "seed out of range", param="sampling_params.seed", code="invalid_value")
        return p


class TokenizeRequest(_ChatTemplateFields):
    """POST /v1/tokenize: ``prompt`` text, or chat ``messages`` rendered with the chat template (with
    the template fields of :class:`_ChatTemplateFields`)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True


class DetokenizeRequest(_Lenient):
    model: Optional[str] = None
    tokens: TokenIds


DEFAULT_PIN_TTL_S = 600.0
MAX_PIN_ID_LEN = 256


class PinPrefixRequest(_Lenient):
    """POST /pin_prefix: keep a prefix's KV in the prefix cache for ``ttl_s`` seconds. Exactly one of
    ``text`` (tokenized as a completion prompt is) and ``input_ids``; ``pin_id`` names the pin
    (re-pinning an id replaces its pin; default: a new id)."""

    text: Optional[str] = None
    input_ids: Optional[TokenIds] = None
    ttl_s: StrictFloat = DEFAULT_PIN_TTL_S  # strict: ints pass, "10" and true do not
    pin_id: Optional[str] = Field(default=None, min_length=1, max_length=MAX_PIN_ID_LEN)


class UnpinPrefixRequest(_Lenient):
    """POST /unpin_prefix: release the pin ``pin_id`` before its TTL runs out."""

    pin_id: str = Field(min_length=1, max_length=MAX_PIN_ID_LEN)


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts. prompt_tokens counts each prompt once (not once per choice);
    prompt_tokens_details.cached_tokens: prompt tokens served by the radix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token: with echo the prompt's (the
    first has no logprob: null, as OpenAI) and then the generated ones."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class VllmLogprob(BaseModel):
    """One token of vLLM's ``prompt_logprobs`` dicts (keyed by token id): its logprob, its rank (1 =
    the most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: per prompt token None (the first) or {token id: VllmLogprob} holding the
# prompt token and the top k
VllmPromptLogprobs = list[Optional[dict[int, VllmLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[VllmPromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # a prefill engine's: where to pull the KV


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class FunctionCallDelta(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="plain")
    def _ser(self) -> dict:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class ToolCallDelta(BaseModel):
    """A streamed piece of a tool call: ``index`` always; ``id``, ``type`` and the function's name in
    the call's first piece only; then pieces of ``function.arguments`` that concatenate to its JSON."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _ser(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    prompt_logprobs: Optional[VllmPromptLogprobs] = None  # vLLM's: one rendered prompt for all choices
    kv_transfer_params: Optional[dict[str, Any]] = None  # a prefill engine's: where to pull the KV


class DeltaMessage(BaseModel):
    """A streamed chat delta; unset (None) fields are left out of the JSON, as OpenAI does."""

    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None

    @model_serializer(mode="plain")
    def _ser(self) -> dict:
        out = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "idleless"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
