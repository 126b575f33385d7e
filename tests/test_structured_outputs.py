"""Structured outputs in the engine: the sampler's token mask against a brute force, and a tiny random
model (SmolLM2's tokenizer, so the grammar sees a real 49152-token vocabulary) whose constrained
outputs always parse — JSON that validates against its schema (jsonschema), regex full matches,
one of the choices — while free requests in the same batch get the tokens they get alone, also with
speculative decoding (ngram) proposing tokens the grammar rejects."""

from __future__ import annotations

import json
import os
import re
import shutil

import jsonschema
import pytest
import torch

from conftest import TEST_THREADS, make_tiny_model
from idleless.config import EngineConfig
from idleless.engine.request import FinishReason, Request, SamplingParams
from idleless.model.sampler import SamplingRow, sample, unpack_bitmask
from idleless.structured import StructuredOutput
from idleless.structured.grammar import check

pytestmark = pytest.mark.timeout(600)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "ok", "n", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "maybe so"]


# ----------------------------------------------------------------------------------- the sampler
def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [M, V] -> int32 bitmask [M, ceil(V / 32)], bit b of word w = token 32 w + b (by hand)."""
    M, V = allowed.shape
    W = (V + 31) // 32
    out = torch.zeros(M, W, dtype=torch.int64)
    for m in range(M):
        for t in allowed[m].nonzero().flatten().tolist():
            out[m, t // 32] |= 1 << (t % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_unpack_bitmask_round_trips():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(5, 100, generator=g) < 0.3
    allowed[0, 31] = allowed[0, 63] = True  # the sign bits
    assert torch.equal(unpack_bitmask(_pack(allowed), 100), allowed)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_masks_only_the_listed_rows(temperature):
    g = torch.Generator().manual_seed(1)
    V = 70
    logits = torch.randn(4, V, generator=g)
    rows = [SamplingRow(SamplingParams(temperature=temperature, seed=i), None, [], [], seed=i) for i in range(4)]
    allowed = torch.rand(2, V, generator=g) < 0.2
    allowed[:, 5] = True
    free = sample(logits, rows, set())
    out = sample(logits, rows, set(), (_pack(allowed), [3, 1]))
    assert out.next_ids[0] == free.next_ids[0] and out.next_ids[2] == free.next_ids[2]
    for row, m in ((3, 0), (1, 1)):
        assert allowed[m, out.next_ids[row]]
        if temperature == 0.0:  # the brute force: the largest allowed logit
            best = max((logits[row, t].item(), t) for t in range(V) if allowed[m, t])[1]
            assert out.next_ids[row] == best


# ------------------------------------------------------------------------------------ the checks
@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'),
    StructuredOutput("regex", "[a-"), StructuredOutput("ebnf", "root ::= undefined_rule"),
    StructuredOutput("ebnf", "root ::= \"a"),
])
def test_check_refuses_invalid_constraints(spec):
    with pytest.raises(ValueError):
        check(spec)


def test_check_accepts_valid_constraints():
    for spec in (StructuredOutput.of_json_schema(SCHEMA), StructuredOutput("regex", REGEX),
                 StructuredOutput.of_choice(CHOICES), StructuredOutput("json_object"),
                 StructuredOutput("ebnf", 'root ::= "x" [0-9]+')):
        check(spec)


# ------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer files."""
    path = make_tiny_model(tmp_path_factory.mktemp("structured"), vocab_size=49152, eos_token_id=2, bos_token_id=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(smollm2_dir, f)):
            shutil.copy(os.path.join(smollm2_dir, f), path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    from idleless.text.tokenizer import Tokenizer
    return Tokenizer.load(model_dir)


def _core(model_dir, **kw):
    from idleless.engine.core import EngineCore
    return EngineCore(EngineConfig(model=model_dir, dtype="float32", kv_cache_memory="16MiB",
                                   num_threads=TEST_THREADS, **kw))


def _run(core, reqs: list[Request]) -> dict[str, tuple[list[int], FinishReason]]:
    for r in reqs:
        core.add_request(r)
    ids: dict[str, list[int]] = {r.rid: [] for r in reqs}
    fin = {}
    while core.has_work():
        for o in core.step():
            ids[o.rid] += o.new_token_ids
            if o.finished:
                fin[o.rid] = o.finish_reason
    return {rid: (ids[rid], fin[rid]) for rid in ids}


def _text(tok, ids):
    return tok.decode([t for t in ids if t != 2])


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


SPECS = {"json": StructuredOutput.of_json_schema(SCHEMA), "regex": StructuredOutput("regex", REGEX),
         "choice": StructuredOutput.of_choice(CHOICES)}


def _requests(tok, tag: str, temperature: float, seeds=range(3), free: bool = True) -> list[Request]:
    prompt = tok.encode("Give me the answer:")
    reqs = []
    for kind, spec in SPECS.items():
        for s in seeds:
            reqs.append(Request(f"{tag}-{kind}-{s}", prompt, SamplingParams(
                temperature=temperature, seed=s, max_new_tokens=80, structured_output=spec)))
    if free:
        reqs += [Request(f"{tag}-free-{s}", prompt, SamplingParams(temperature=temperature, seed=s, max_new_tokens=12))
                 for s in seeds]
    return reqs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_always_parse_and_free_ones_are_unchanged(model_dir, tok, temperature):
    core = _core(model_dir)
    seeds = range(4) if temperature else range(1)
    out = _run(core, _requests(tok, "t", temperature, seeds))
    for rid, (ids, reason) in out.items():
        kind = rid.split("-")[1]
        if kind == "free":
            continue
        text = _text(tok, ids)
        assert reason == FinishReason.STOP and ids[-1] == 2, (rid, text)  # the grammar ended it
        assert _valid(kind, text), (rid, text)
    alone = _run(_core(model_dir), [r for r in _requests(tok, "t", temperature, seeds) if "free" in r.rid])
    assert {k: v for k, v in out.items() if "free" in k} == alone


def test_constraints_under_speculative_decoding(model_dir, tok):
    """ngram speculation proposes the earlier wave's answers, free ones included (which the grammar
    rejects): the constrained outputs equal those without speculation, token for token (greedy)."""
    ref = _run(_core(model_dir), _requests(tok, "a", 0.0, range(1)))
    core = _core(model_dir, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                 speculative_disable_adaptive=True)
    first = _run(core, _requests(tok, "a", 0.0, range(1)))
    again = _run(core, _requests(tok, "a", 0.0, range(1)))
    assert first == ref and again == ref
    assert core.stats()["speculative"]["num_draft_tokens"] > 0


def test_grammar_state_is_dropped_when_requests_finish(model_dir, tok):
    """A finished request's matcher is dropped when the next executed plan names it finished."""
    core = _core(model_dir)
    _run(core, _requests(tok, "d", 0.0, range(1), free=False))
    assert core.runner.token_masks._states  # the last to finish is named in no executed plan yet
    _run(core, [Request("next", [5, 6], SamplingParams(temperature=0.0, max_new_tokens=1))])
    assert core.runner.token_masks._states == {}
