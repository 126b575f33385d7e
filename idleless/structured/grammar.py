"""Grammars from ``StructuredOutput`` constraints, with xgrammar (Dong et al., "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models", arXiv 2411.15100): the grammar
engine SGLang and vLLM use, on CPU.

* ``check(spec)``: parse the constraint without a tokenizer (cheap), so the frontend answers a 400 for
  an invalid schema, regex or grammar before anything is queued.
* ``GrammarCache``: compiles a constraint against the model's vocabulary once (keyed by the
  ``StructuredOutput`` value, least recently used dropped past ``max_entries``), in a worker thread.
* ``TokenMasks``: the engine core's per-request grammar state. ``masks(plan)`` gives the sampler one
  batched token bitmask for a step's constrained sampled rows; each request's matcher first advances
  over the tokens committed since its last step (the sampling row's ``output_ids``: so the grammar
  follows exactly what the engine committed, with no call from the scheduler), then, for a speculative
  verify, over each proposed token in turn (row j is masked as if proposed[:j] were accepted; a
  proposed token the grammar rejects is masked out of its row, so the verify rejects it) and rolls
  back. ``drop(rids)`` forgets finished requests.

JSON is generated without free whitespace (xgrammar's ``any_whitespace=False``: ``", "`` and ``": "``
separators), so a model cannot stall in a run of blanks. A grammar at its end state allows only the
end-of-sequence ids (the plan's ``eos_ids``), so a completed grammar ends its request with finish
reason ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from idleless.structured.spec import StructuredOutput

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
MAX_TOKENIZER_INFOS = 4  # vocabularies kept per process (_tokenizer_info)
MAX_STATES = 1024  # request states kept before idle ones are dropped (TokenMasks._evict_idle)
IDLE_STEPS = 256


def _ebnf_literal(s: str) -> str:
    """``s`` as an xgrammar EBNF string literal (double quotes; backslash escapes, \\u for controls)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def build_grammar(spec: StructuredOutput):
    """The ``xgrammar.Grammar`` of a constraint (no tokenizer needed). Raises ValueError with the grammar
    engine's message when the schema, regex, grammar or tag is invalid."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(spec.value)))
        return xgr.Grammar.from_ebnf(spec.value)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) for bad input
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        # "[18:09:34] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the message
        raise ValueError(re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(e).__name__) from None


def check(spec: StructuredOutput) -> None:
    """Raise ValueError (the grammar engine's message) if ``spec`` cannot be compiled."""
    build_grammar(spec)


_INFOS: OrderedDict = OrderedDict()
_INFOS_LOCK = threading.Lock()


def _tokenizer_info(tokenizer_path: str, vocab_size: int):
    """(xgrammar module, its ``TokenizerInfo``) for an HF tokenizer directory and a logits width, built
    once per process and shared by every engine it builds (loading the HF tokenizer and scanning the
    vocabulary cost ~0.6-2.5 s of CPU for SmolLM2's 49,152 tokens; a test process builds hundreds of
    engines). Keyed by the directory, the width and tokenizer.json's mtime; the last
    ``MAX_TOKENIZER_INFOS`` are kept. Raises what the tokenizer load or xgrammar raises."""
    from idleless.text.tokenizer import auto_tokenizer_class

    path = os.path.realpath(tokenizer_path)
    try:
        mtime = os.stat(os.path.join(path, "tokenizer.json")).st_mtime_ns
    except OSError:
        mtime = None
    key = (path, vocab_size, mtime)
    with _INFOS_LOCK:
        hit = _INFOS.get(key)
        if hit is None:
            auto_tokenizer, xgr = auto_tokenizer_class(with_xgrammar=True)
            hf = auto_tokenizer.from_pretrained(tokenizer_path)
            hit = _INFOS[key] = (xgr, xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size))
            while len(_INFOS) > MAX_TOKENIZER_INFOS:
                _INFOS.popitem(last=False)
        _INFOS.move_to_end(key)
        return hit


class GrammarCache:
    """Compiled grammars for one vocabulary, compiled in a worker thread and kept by constraint.

    ``tokenizer_path``: an HF tokenizer directory (loaded by ``warm`` or the first compile);
    ``vocab_size``: the model's logits width (the bitmask covers it;
    ids the tokenizer lacks are never allowed). ``get(spec)`` returns a Future of the compiled grammar
    (its exception is the compile error)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, max_entries: int = MAX_CACHED_GRAMMARS):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._compiler = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def _ready_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr, info = _tokenizer_info(self.tokenizer_path, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, spec: StructuredOutput):
        return self._ready_compiler().compile_grammar(build_grammar(spec))

    def warm(self) -> None:
        """Load the grammar engine and the vocabulary in the worker thread now (an engine calls this at
        start-up, so the first constrained request does not stall the step loop for the load); a
        directory without tokenizer files is skipped, and a failure is retried at the first compile.
        The load runs in a daemon thread: a process that exits meanwhile does not wait for it (an
        engine-core process stopped right after start-up waited 7-10 s for it at exit)."""
        if not any(os.path.exists(os.path.join(self.tokenizer_path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return

        def load():
            try:
                self._ready_compiler()
            except Exception as e:  # noqa: BLE001 - retried (and reported) by the first compile
                log.debug("grammar engine warm-up failed: %s", e)

        threading.Thread(target=load, name="grammar-warm", daemon=True).start()

    def get(self, spec: StructuredOutput) -> Future:
        fut = self._entries.get(spec)
        if fut is not None:
            self._entries.move_to_end(spec)
            return fut
        fut = self._pool.submit(self._compile, spec)
        self._entries[spec] = fut
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return fut


@dataclass
class _Matcher:
    """One request's grammar state: its compiled grammar (a Future until compiled), the matcher, and the
    committed tokens it has consumed. ``broken``: a committed token the grammar rejected, or the compile
    failed (``failed``): only the end-of-sequence ids are allowed from then on."""

    compiled: Future
    matcher: object = None
    consumed: list[int] = field(default_factory=list)
    broken: bool = False
    failed: bool = False  # the compile failed: only end-of-sequence is allowed
    last_step: int = 0  # the last step that scheduled it


def _set_only(bitmask: torch.Tensor, row: int, ids) -> None:
    """Row ``row`` of an int32 bitmask [M, W] allows exactly ``ids``."""
    bitmask[row].zero_()
    for t in ids:
        w, b = divmod(int(t), 32)
        if w < bitmask.shape[1]:
            v = (int(bitmask[row, w]) & 0xFFFFFFFF) | (1 << b)
            bitmask[row, w] = v - (1 << 32) if v >= 1 << 31 else v


class TokenMasks:
    """Per-request grammar matchers of the engine core and the step's token bitmask (module docstring)."""

    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.vocab_size = vocab_size
        self.cache = GrammarCache(tokenizer_path, vocab_size)
        self.cache.warm()
        self._states: dict[str, _Matcher] = {}
        self._step = 0

    def drop(self, rids) -> None:
        """Forget the grammar state of finished or aborted requests."""
        for rid in rids:
            self._states.pop(rid, None)

    def _evict_idle(self) -> None:
        """Past MAX_STATES states, forget those not scheduled in the last IDLE_STEPS steps: finished
        requests whose ids never reached a runner (an engine that went idle runs no plan), or live ones
        waiting long (they replay their committed tokens when next scheduled)."""
        if len(self._states) > MAX_STATES:
            for rid in [rid for rid, st in self._states.items() if st.last_step < self._step - IDLE_STEPS]:
                del self._states[rid]

    def _state(self, rid: str, spec: StructuredOutput) -> _Matcher:
        st = self._states.get(rid)
        if st is None:
            st = self._states[rid] = _Matcher(self.cache.get(spec))
        return st

    def _ready(self, st: _Matcher, output_ids, eos_ids) -> None:
        """Create the matcher (waiting for the compile if needed) and advance it over the committed
        tokens it has not seen; a committed history that is not an extension of what it saw (never the
        case for a target model's requests) restarts it."""
        import xgrammar as xgr

        if st.failed:
            return
        n = len(st.consumed)
        if st.matcher is None or list(output_ids[:n]) != st.consumed:
            try:
                compiled = st.compiled.result()
            except Exception as e:  # noqa: BLE001 - one bad constraint must not fail the whole step
                log.error("a structured output constraint failed to compile (%s); its request ends", e)
                st.broken = st.failed = True
                return
            st.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(eos_ids))
            st.consumed, st.broken, n = [], False, 0
        for tok in output_ids[n:]:
            st.consumed.append(int(tok))
            if not st.broken and not st.matcher.accept_token(int(tok)):
                log.warning("a committed token (%d) is outside its request's grammar; only end-of-sequence "
                            "is allowed from here", tok)
                st.broken = True

    def begin(self, plan) -> None:
        """Start compiling (worker thread) the constraints of ``plan``'s sampling requests not seen yet,
        so the compile overlaps the step's forward pass."""
        self._step += 1
        for r in plan.requests:
            if r.sampling is not None and r.sampling.params.structured_output is not None:
                self._state(r.rid, r.sampling.params.structured_output).last_step = self._step
        self._evict_idle()

    def masks(self, plan) -> Optional[tuple[torch.Tensor, list[int]]]:
        """(bitmask int32 [M, ceil(vocab_size / 32)], the M sampled-row indices it masks) for the
        constrained sampled rows of ``plan`` (rows numbered as ``runner.forward_batch_of`` orders them:
        per sampling request in plan order, num_sampled rows), or None when no row is constrained.
        Waits for compiles ``begin`` started; a constraint that fails to compile allows only the
        end-of-sequence ids (the frontend's ``check`` refuses such constraints before they get here)."""
        rows: list[tuple[int, object, int]] = []  # (first row, scheduled request, state)
        row = 0
        for r in plan.requests:
            spec = r.sampling.params.structured_output if r.sampling is not None else None
            if r.sampling is None:
                continue
            if spec is not None:
                rows.append((row, r, self._state(r.rid, spec)))
            row += r.num_sampled
        if not rows:
            return None
        import xgrammar as xgr

        eos = plan.eos_ids
        m = sum(r.num_sampled for _, r, _ in rows)
        bitmask = xgr.allocate_token_bitmask(m, self.vocab_size)
        index: list[int] = []
        i = 0
        for first, r, st in rows:
            self._ready(st, r.sampling.output_ids, eos)
            k = r.num_sampled
            index.extend(range(first, first + k))
            accepted = 0
            for j in range(k):
                if st.broken or st.matcher.is_terminated():
                    _set_only(bitmask, i + j, eos)
                else:
                    st.matcher.fill_next_token_bitmask(bitmask, i + j)
                if j == k - 1:
                    break
                if st.broken or st.matcher.is_terminated() or not st.matcher.accept_token(r.proposed[j]):
                    bitmask[i + j + 1:i + k] = bitmask[i + j]  # rows after a rejected guess are never used
                    break
                accepted += 1
            if accepted:
                st.matcher.rollback(accepted)
            i += k
        return bitmask, index
