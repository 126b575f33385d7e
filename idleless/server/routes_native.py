"""Native routes: POST /generate (token ids in and out), POST /v1/tokenize, POST /v1/detokenize
(also at /tokenize and /detokenize)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from idleless.server.asgi import sse
from idleless.server.context import ServerContext
from idleless.server.engine_client import Submission
from idleless.server.logprobs import sglang_input_logprobs, sglang_logprobs
from idleless.server.protocol import APIError, DetokenizeRequest, GenerateRequest, TokenizeRequest, parse_request
from idleless.server.streaming import answer
from idleless.text.output import CompletionDelta, CompletionOutput
from idleless.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class LogprobMeta:
    """The logprobs /generate's meta_info reports, in SGLang's shape (``[logprob, token_id, text]``):
    ``output_token_logprobs`` (and ``output_top_logprobs`` with top alternatives) whenever logprobs
    were asked for; with ``return_logprob`` also ``input_token_logprobs`` (and ``input_top_logprobs``)
    from prompt position ``start`` (-1: none of the prompt, empty lists). ``tok``: the tokenizer when
    each entry carries its text (``return_text_in_logprobs``), else None."""

    return_logprob: bool
    start: int
    top: bool
    tok: Optional[Tokenizer]

    def output(self, ids: list[int], logprobs: Optional[list[float]], tops) -> dict:
        if logprobs is None:
            return {}
        m = {"output_token_logprobs": sglang_logprobs(self.tok, list(zip(logprobs, ids)))}
        if tops is not None:
            m["output_top_logprobs"] = [sglang_logprobs(self.tok, [(v, t) for t, v in top]) for top in tops]
        return m

    def input(self, prompt_ids: list[int], entries: Optional[list]) -> dict:
        """The prompt's lists (empty when none were asked for); {} without return_logprob."""
        if not self.return_logprob:
            return {}
        return sglang_input_logprobs(self.tok, prompt_ids, max(self.start, 0), entries or [], self.top)


def _meta(rid, reason, matched, prompt, cached, completion, versions) -> dict:
    """SGLang's meta_info; ``weight_version``: the engine's weight version that sampled the last token
    (SGLang's field), ``output_token_weight_versions``: the one of each output token."""
    return {"id": rid, "finish_reason": None if reason is None else {"type": reason, "matched": matched},
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
            "weight_version": versions[-1] if versions else None, "output_token_weight_versions": versions}


def _generate_result(o: CompletionOutput, lp: LogprobMeta) -> dict:
    meta = _meta(o.rid, o.finish_reason, o.matched_stop, o.prompt_tokens, o.cached_tokens, o.completion_tokens,
                 o.weight_versions)
    meta.update(lp.input(o.prompt_token_ids, o.prompt_logprobs))
    meta.update(lp.output(o.token_ids, o.logprobs, o.top_logprobs))
    return {"index": o.index, "text": o.text, "output_ids": o.token_ids, "meta_info": meta}


class GenerateStream:
    """/generate's stream: each delta in the shape of a whole result (text, output_ids, meta_info); a
    choice's first delta carries the prompt's logprobs (its ``RequestState`` has them by then)."""

    def __init__(self, sub: Submission, lp: LogprobMeta):
        self.sub, self.lp = sub, lp
        self.started: set[int] = set()

    def opening(self) -> Iterable[str]:
        return ()

    def delta(self, d: CompletionDelta) -> Optional[str]:
        meta = _meta(d.rid, d.finish_reason, d.matched_stop, d.prompt_tokens, d.cached_tokens, d.completion_tokens,
                     d.weight_versions)
        if d.index not in self.started:
            self.started.add(d.index)
            st = self.sub.states[d.index]
            meta.update(self.lp.input(st.prompt_ids, st.prompt_logprobs))
        meta.update(self.lp.output(d.token_ids, d.logprobs, d.top_logprobs))
        return sse({"index": d.index, "text": d.text, "output_ids": d.token_ids, "meta_info": meta})

    def closing(self) -> Iterable[str]:
        return ()


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add the native routes to ``app``."""
    client, tok = ctx.client, ctx.tok

    @app.post("/generate")
    async def generate(request: Request):
        """Native generation: ``{"input_ids": [...]} | {"text": "..."}, "sampling_params": {...},
        "stream": bool}`` (+ SGLang's ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
        ``return_text_in_logprobs``) -> ``{"text", "output_ids", "meta_info"}`` (a list of those when
        n > 1); streamed as SSE deltas of the same shape, then ``data: [DONE]``."""
        req = parse_request(GenerateRequest, await ctx.read_json(request))
        if (req.input_ids is None) == (req.text is None):
            raise APIError(400, "give exactly one of input_ids and text", param="input_ids", code="invalid_value")
        try:
            params = req.params()
        except (TypeError, ValueError) as e:
            raise APIError(400, f"bad sampling_params: {e}", param="sampling_params", code="invalid_value") from None
        ids = list(req.input_ids) if req.input_ids is not None else await ctx.encode(req.text, "text")
        sub = ctx.submit([ids], params, req.priority or 0)

        lp = LogprobMeta(bool(req.return_logprob), req.logprob_start_len, params.top_logprobs > 0,
                         tok if req.return_text_in_logprobs else None)

        def full(outs):
            res = [_generate_result(o, lp) for o in outs]
            return JSONResponse(res[0] if len(res) == 1 else res)

        return await answer(request, sub, bool(req.stream), full, lambda: GenerateStream(sub, lp))

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_request(TokenizeRequest, await ctx.read_json(request))
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            ids = await ctx.render_chat([m.to_template() for m in req.messages], **req.template_kwargs())
        else:
            ids = await ctx.encode(req.prompt, "prompt", bool(req.add_special_tokens))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": client.limit_tokens})

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await ctx.read_json(request))
        ctx.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < client.info.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {client.info.vocab_size})",
                           param="tokens", code="invalid_value")
        return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})
