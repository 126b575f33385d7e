"""The streamed-token path's cheaper pieces keep their behaviour (issue 15, item 4).

- ``Submission.ready`` hands out exactly what ``__anext__`` would, in order, and leaves an error to it;
- ``sse_events`` writes the same bytes as one event per delta, however the deltas are grouped;
- ``Tokenizer.decode_one`` / ``ids_decoder`` equal ``Tokenizer.decode``;
- ``idleless bench stream-cost``'s replay core streams the text of the ids it echoes, through the
  real frontend (no timing is asserted).
"""

from __future__ import annotations

import asyncio
import types

import pytest

from idleless.server.engine_client import EngineDeadError, Submission
from idleless.server.streaming import sse_events, stream_error
from idleless.text.output import CompletionDelta


class _Client:
    def __init__(self):
        self.closed = []

    def _close(self, sub):
        self.closed.append(sub)


def _sub(n_choices: int) -> Submission:
    states = [types.SimpleNamespace(finished=False, index=i) for i in range(n_choices)]
    return Submission(_Client(), states, 0.0)


def _d(index: int, text: str, final: bool = False, error=None) -> CompletionDelta:
    return CompletionDelta(rid=f"r{index}", index=index, text=text, token_ids=[len(text)],
                           finish_reason="length" if final else None, error=error)


async def _drain_anext(sub: Submission) -> list:
    got = []
    try:
        async for d in sub:
            got.append(d)
    except EngineDeadError as e:
        got.append(e)
    return got


def _fill(sub: Submission, items) -> None:
    for it in items:
        sub.queue.put_nowait(it)


def test_ready_takes_what_anext_would_in_order_and_leaves_errors_to_it():
    async def run():
        items = [_d(0, "a"), _d(1, "b"), _d(0, "c", final=True), _d(1, "d"), _d(1, "e"), EngineDeadError("gone"),
                 _d(1, "never")]
        ref, sub = _sub(2), _sub(2)
        _fill(ref, items)
        expected = await _drain_anext(ref)  # the reference: __anext__ alone
        assert [type(x) for x in expected] == [CompletionDelta] * 5 + [EngineDeadError]
        _fill(sub, items[:4])
        assert sub.ready() == items[:4]  # all four, in order; choice 0 finished
        assert sub.ready() == []  # nothing queued: no waiting
        _fill(sub, items[4:])
        assert sub.ready() == expected[4:5]  # up to the error
        with pytest.raises(EngineDeadError):
            await sub.__anext__()  # the error ready() met is raised next, then the iteration is over
        with pytest.raises(StopAsyncIteration):
            await sub.__anext__()

    asyncio.run(run())


def test_ready_stops_once_every_choice_finished():
    async def run():
        sub = _sub(1)
        _fill(sub, [_d(0, "x"), _d(0, "y", final=True), _d(0, "late")])
        assert [d.text for d in sub.ready()] == ["x", "y"]
        with pytest.raises(StopAsyncIteration):
            await sub.__anext__()

    asyncio.run(run())


class _Fmt:
    """A stream format that writes every field it is given (so any lost or reordered delta shows)."""

    def opening(self):
        yield "data: open\n\n"

    def delta(self, d: CompletionDelta):
        if d.text == "skip":
            return None
        if d.text == "boom":
            raise ValueError("format failed")
        return f"data: {d.index}:{d.text}:{d.finish_reason}\n\n"

    def closing(self):
        yield "data: close\n\n"


def _reference(first, items, fmt) -> str:
    """One event per delta, as the stream was written before deltas were grouped."""
    out = list(fmt.opening())
    for d in ([first] if first is not None else []) + items:
        if d.error:
            out.append(stream_error(d.error))
        chunk = fmt.delta(d)
        if chunk is not None:
            out.append(chunk)
    return out + list(fmt.closing())


async def _body(first, sub, fmt, feed) -> tuple[list[str], bool]:
    """Run sse_events, putting ``feed`` batches on the queue whenever it waits; (writes, closed)."""
    gen = sse_events(first, sub, fmt)
    writes = []
    batches = list(feed)

    async def producer():
        for b in batches:
            await asyncio.sleep(0.01)
            _fill(sub, b)

    task = asyncio.create_task(producer())
    async for chunk in gen:
        writes.append(chunk)
    await task
    return writes, sub.closed


@pytest.mark.parametrize("grouping", [[1, 1, 1, 1, 1, 1], [6], [2, 3, 1], [1, 5]])
def test_sse_events_writes_the_same_bytes_however_deltas_arrive(grouping):
    items = [_d(0, "He"), _d(1, "llo"), _d(0, "skip"), _d(1, " wor", error="in-band"), _d(0, "ld", final=True),
             _d(1, "!", final=True)]
    batches, i = [], 0
    for g in grouping:
        batches.append(items[i:i + g])
        i += g
    first = _d(0, "first")
    writes, closed = asyncio.run(_body(first, _sub(2), _Fmt(), batches))
    ref = _reference(first, items, _Fmt())
    assert "".join(writes[:-1]) == "".join(ref)
    assert writes[-1] == "data: [DONE]\n\n"
    assert closed
    # one write per batch that has a chunk (each batch lands while the stream waits), besides the
    # opening, the first delta, the closing and [DONE]
    assert len(writes) == 4 + sum(any(d.text != "skip" for d in b) for b in batches)


def test_sse_events_reports_in_band_after_the_chunks_already_taken():
    items = [_d(0, "a"), _d(0, "boom"), _d(0, "b", final=True)]
    writes, _ = asyncio.run(_body(None, _sub(1), _Fmt(), [items]))
    body = "".join(writes)
    assert body.startswith("data: open\n\ndata: 0:a:None\n\n")  # the chunk before the failure is written
    assert "internal error: ValueError" in body and body.endswith("data: [DONE]\n\n")
    assert "0:b:" not in body


def test_sse_events_engine_death_mid_stream():
    writes, _ = asyncio.run(_body(None, _sub(1), _Fmt(), [[_d(0, "a"), EngineDeadError("core died")]]))
    body = "".join(writes)
    assert body.startswith("data: open\n\ndata: 0:a:None\n\n")
    assert "core died" in body and "engine_dead" in body and body.endswith("data: [DONE]\n\n")


def test_decode_one_and_ids_decoder_equal_decode(smollm2_dir):
    from idleless.text.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2_dir)
    ids = tok.encode("Grüße, 世界! <|im_end|> ok") + sorted(tok.eos_token_ids)
    for skip in (True, False):
        dec = tok.ids_decoder(skip)
        for i in ids:
            assert tok.decode_one(i, skip) == tok.decode([i], skip_special_tokens=skip)
            assert tok.decode_one(i, skip) == tok.decode([i], skip_special_tokens=skip)  # cached
        for a in range(len(ids)):
            assert dec(ids[a:]) == tok.decode(ids[a:], skip_special_tokens=skip)


def test_bench_stream_cost_replays_text_through_the_real_frontend(smollm2_dir, tmp_path):
    """Tiny run of the bench: every stream's text is the echoed prompt ids' text (the tokenizer's
    decode of them: SmolLM2 decodes prefix-stably), no errors; the report has every stage."""
    import json

    from idleless.bench import stream_cost
    from idleless.text.tokenizer import Tokenizer

    out = tmp_path / "r.json"
    args = types.SimpleNamespace(model=smollm2_dir, streams=3, max_tokens=12, prompt_tokens=20, step_ms=0.0,
                                 route="completions", repeats=1, http="auto", loop="asyncio", output=str(out))
    assert stream_cost.main(args) == 0
    res = json.loads(out.read_text())
    (r,) = res["rounds"]
    assert r["errors"] == 0 and r["tokens"] == 36
    tok = Tokenizer.load(smollm2_dir)
    ids = stream_cost.passage_ids(tok, 20 + stream_cost.STREAM_SHIFT * 3)
    expected = sum(len(tok.decode(ids[stream_cost.STREAM_SHIFT * i:][:12])) for i in range(3))
    assert r["chars"] == expected
    assert set(r["us_per_token"]) >= {"core: serialise + send", "receive + unpickle", "route", "detokenize",
                                       "SSE format", "HTTP write", "frontend: process CPU", "other"}


def test_dumps_messages_reads_back_with_plain_pickle_as_equal_messages():
    """Every field of a RequestOutput survives the compact form (against the plain pickle of the
    same list); subclasses and other messages keep the ordinary pickling."""
    import pickle

    from idleless.engine.messages import ControlReply, CoreReady, ErrorOutput, dumps_messages
    from idleless.engine.request import FinishReason, PromptLogprob, RequestOutput

    msgs = [RequestOutput("a", [5, 6], FinishReason.STOP, 6, [-0.5, -0.25], [[(5, -0.5)], [(6, -0.25), (1, -2.0)]],
                          [None, PromptLogprob(3, -1.0, 2, [(4, -0.5)])], 7, 3, 2, "why", [1, 0]),
            RequestOutput("b", [9]),
            ErrorOutput("c", [], FinishReason.ABORT, error="refused", code="invalid_value", param="n"),
            ControlReply(4, True, {"x": [1, 2]}),
            CoreReady(1, "/m", "float32", 100, 64, 128, 16, 8, [2], 0.5)]
    back = pickle.loads(dumps_messages(msgs))
    assert back == pickle.loads(pickle.dumps(msgs)) == msgs
    assert [type(m) for m in back] == [type(m) for m in msgs]
    assert back[0].finish_reason is FinishReason.STOP and isinstance(back[0].prompt_logprobs[1], PromptLogprob)
    assert len(dumps_messages(msgs[:2] * 32)) < len(pickle.dumps(msgs[:2] * 32, protocol=pickle.HIGHEST_PROTOCOL))
