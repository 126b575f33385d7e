"""The ``ngram`` proposer: guesses copied from text already seen, no model.

Two sources of guesses:

* **Prompt lookup** (Saxena's prompt lookup decoding; vLLM's ``ngram``, SGLang's NGRAM): the longest
  suffix of the request's own tokens (prompt + output), of ``min_match`` to ``max_match`` tokens,
  that occurs earlier in them; the guesses are the tokens that followed its most recent earlier
  occurrence. The copy may run into the suffix itself and then on into its own guesses (an
  overlapping copy, as in LZ77), so a text repeating with period p yields full drafts, not p tokens.
  Per request, one dict maps the hash of every n-gram (each n in the window) to the end of its most
  recent occurrence; it is updated with the tokens appended since the last call, so a call costs
  O(new tokens x window sizes), not O(context). A request whose tokens are not an extension of what
  was seen (fewer tokens, another prompt length, or a changed boundary token: O(1) checks) is rebuilt.
* **Suffix index** over the outputs of finished requests (SuffixDecoding, arXiv 2411.04975; vLLM's
  ``suffix``): which token followed each context of ``min_match`` to
  ``min(max_match, min_match + INDEX_WINDOWS - 1)`` tokens, kept as sorted numpy runs of (context
  key, next token) entries (a log-structured merge). A draft walks greedily: at each step the longest
  indexed suffix of (tokens + guesses so far) gives its most frequent next token, while the product
  of the guesses' empirical probabilities (count / occurrences of the context) stays >= ``MIN_PROB``.
  The index holds at most ``max_index_tokens`` tokens (each finished request's output after a prompt
  tail as context) and evicts whole requests, oldest first.

N-grams are keyed by a 64-bit polynomial hash. Prompt lookup compares the tokens of a hit; in the
index a collision (rare) can only cost a wrong guess, never a wrong output: verification rejects it.

Rule between the two: the source whose first guess rests on the longer matched suffix wins; a tie
goes to prompt lookup (the request's own text predicts it better than other requests' outputs).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from idleless.spec.proposer import Proposer

# The suffix index stops a draft where the product of its guesses' empirical probabilities drops below
# this (the default of vLLM's suffix_decoding_min_token_prob).
MIN_PROB = 0.1
# Context lengths the suffix index keeps per indexed token (each costs 20 bytes per token).
INDEX_WINDOWS = 6
# A context's next-token frequencies are counted over at most its most recent occurrences in the index.
MAX_OCCURRENCES = 1024
# The suffix index merges its newest two sorted runs while the older is at most this times the newer.
MERGE_FACTOR = 4

# _sync indexes more new tokens than this at once with numpy (a prompt's first sync: 64 prompts of ~900
# tokens with windows 1-12 are 0.7M keys), fewer with a loop per token (a step's few new tokens).
BULK_SYNC = 32

_B = 0x9E3779B97F4A7C15  # odd multiplier of the polynomial n-gram hash (mod 2**64)
_MASK = (1 << 64) - 1


def _suffix_keys(tokens: list[int], end: int, windows: range) -> list[int]:
    """Hash keys of ``tokens[end - n:end]`` for n = windows.start, ... up to min(windows.stop - 1, end):
    sum over j < n of (tokens[end - 1 - j] + 1) * _B**j, mod 2**64."""
    h, keys = 0, []
    for n in range(1, min(windows.stop - 1, end) + 1):
        h = (h * _B + tokens[end - n] + 1) & _MASK
        if n >= windows.start:
            keys.append(h)
    return keys


def _window_hashes(tokens: list[int], start: int, windows: range) -> tuple[np.ndarray, list, list]:
    """(tokens as int64, keys, ends): per n in windows, the ``_suffix_keys`` hash (uint64) of tokens[e - n:e]
    for every end e >= start with n <= e, and those ends (int64), one array pair per n, n ascending."""
    t = np.asarray(tokens, dtype=np.int64)
    t1 = t.astype(np.uint64) + np.uint64(1)
    ends = np.arange(start, len(t))
    h = np.zeros(len(ends), np.uint64)
    keys, at = [], []
    for n in range(1, windows.stop):
        ends = ends[ends >= n]
        h = h[len(h) - len(ends):] * np.uint64(_B) + t1[ends - n]
        if n >= windows.start:
            keys.append(h)
            at.append(ends)
    return t, keys, at


def _context_keys(tokens: list[int], start: int, windows: range) -> tuple[np.ndarray, np.ndarray]:
    """Every (context, next token) of ``tokens`` for next positions e >= start: keys (uint64, the
    ``_suffix_keys`` hash of tokens[e - n:e], n in windows, n <= e) and the tokens at e (int64)."""
    t, keys, at = _window_hashes(tokens, start, windows)  # windows is never empty: one array pair at least
    return np.concatenate(keys), np.concatenate([t[e] for e in at])


def _end_keys(tokens: list[int], start: int, windows: range) -> tuple[list[int], list[int]]:
    """Every (key, end) of ``tokens`` for ends e in [start, len(tokens)): the ``_suffix_keys`` hash of
    tokens[e - n:e] for n in windows, n <= e, as Python ints, in the order ``_sync``'s loop visits
    them (e ascending, then n), so a dict built from them keeps each key's most recent end."""
    _, keys, at = _window_hashes(tokens, start, windows)
    keys, at = np.concatenate(keys), np.concatenate(at)
    order = np.argsort(at, kind="stable")  # e-major; within an end, n ascending (the concatenation's order)
    return keys[order].tolist(), at[order].tolist()


class _Lookup:
    """One request's prompt-lookup state: its tokens as seen so far and ``ends``: n-gram key ->
    end (exclusive) of the n-gram's most recent occurrence, over every end in [1, len(tokens) - 1]
    (every occurrence with at least one token after it)."""

    __slots__ = ("tokens", "prompt_len", "ends")

    def __init__(self, prompt_len: int):
        self.tokens: list[int] = []
        self.prompt_len = prompt_len
        self.ends: dict[int, int] = {}


def _merge(a: tuple, b: tuple, min_serial: int) -> tuple:
    """One run of runs ``a`` (older) and ``b``'s entries of documents >= min_serial. A run is
    (keys uint64 sorted, next tokens int32, document serials int64, last serial); within a key its
    entries are oldest first. O(len(a) + len(b)): b's entries go after a's equal keys."""
    at = np.searchsorted(a[0], b[0], "right") + np.arange(len(b[0]))
    from_b = np.zeros(len(a[0]) + len(b[0]), bool)
    from_b[at] = True
    merged = []
    for x, y in zip(a[:3], b[:3]):
        out = np.empty(len(from_b), x.dtype)
        out[from_b] = y
        out[~from_b] = x
        merged.append(out)
    live = merged[2] >= min_serial
    return (*(m if live.all() else m[live] for m in merged), b[3])


class _SuffixIndex:
    """(context key, next token) entries of finished requests' tokens, 20 bytes each, in sorted runs
    oldest first, each more than MERGE_FACTOR times the next (the newest two merge until so: each
    entry is merged O(log) times, a lookup searches O(log) runs). Holds at most ``max_tokens``
    tokens of whole documents, evicting the oldest: an evicted document's entries are skipped at once,
    dropped when their run merges or is wholly evicted (so only the oldest run holds evicted entries,
    and all runs together hold at most about 4/3 of the entries of ``max_tokens`` tokens)."""

    def __init__(self, windows: range, max_tokens: int):
        self.windows = windows
        self.max_tokens = max_tokens
        self.runs: list[tuple] = []
        self.docs: deque[tuple[int, int]] = deque()  # (serial, tokens held), oldest first
        self.size = 0  # tokens held
        self.next_serial = 0
        self.min_serial = 0  # documents before it are evicted

    def add(self, tokens: list[int], start: int) -> None:
        """Index ``tokens[e]`` after its contexts for every e >= start (the last ``max_tokens``
        tokens only), then evict the oldest documents until at most ``max_tokens`` tokens are held."""
        if len(tokens) > self.max_tokens:
            cut = len(tokens) - self.max_tokens
            tokens, start = tokens[cut:], max(start - cut, 0)
        keys, nexts = _context_keys(tokens, max(start, self.windows.start), self.windows)
        if not len(keys):
            return
        serial = self.next_serial
        self.next_serial += 1
        order = np.argsort(keys, kind="stable")
        self.runs.append((keys[order], nexts[order].astype(np.int32), np.full(len(keys), serial, np.int64), serial))
        self.docs.append((serial, len(tokens)))
        self.size += len(tokens)
        while self.size > self.max_tokens:
            old, n = self.docs.popleft()
            self.size -= n
            self.min_serial = old + 1
        while self.runs and self.runs[0][3] < self.min_serial:
            self.runs.pop(0)
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= MERGE_FACTOR * len(self.runs[-1][0]):
            newest = self.runs.pop()
            self.runs[-1] = _merge(self.runs[-1], newest, self.min_serial)

    def num_entries(self) -> int:
        """Entries stored, evicted ones not yet dropped included."""
        return sum(len(run[0]) for run in self.runs)

    def _next_tokens(self, queries: list[int]) -> tuple[int, np.ndarray]:
        """(index into ``queries`` of the last key with live entries, their next tokens, oldest
        first); (-1, empty) if none has."""
        q = np.asarray(queries, dtype=np.uint64)
        spans = [(nexts, serials, np.searchsorted(keys, q, "left"), np.searchsorted(keys, q, "right"))
                 for keys, nexts, serials, _ in self.runs]
        for i in reversed(range(len(queries))):
            parts = [nexts[lo[i]:hi[i]][serials[lo[i]:hi[i]] >= self.min_serial]
                     for nexts, serials, lo, hi in spans if hi[i] > lo[i]]
            found = np.concatenate(parts) if parts else ()
            if len(found):
                return i, found
        return -1, ()

    def draft(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """(length of the context the first guess rests on, up to ``k`` guesses) after ``context``;
        (0, []) when no suffix of it is indexed or its best guess is below MIN_PROB. Each guess is the
        most frequent next token (ties: the smallest id) of the longest indexed suffix of context +
        guesses, over its last MAX_OCCURRENCES occurrences."""
        ext = list(context[-(self.windows.stop - 1):])
        out: list[int] = []
        matched, prob = 0, 1.0
        while len(out) < k:
            i, found = self._next_tokens(_suffix_keys(ext, len(ext), self.windows))
            if i < 0:
                break
            toks, counts = np.unique(found[-MAX_OCCURRENCES:], return_counts=True)
            j = int(counts.argmax())
            prob *= counts[j] / counts.sum()
            if prob < MIN_PROB:
                break
            matched = matched or self.windows.start + i
            out.append(int(toks[j]))
            ext.append(out[-1])
        return matched, out


class NgramProposer(Proposer):
    """Prompt lookup over each request's own tokens plus a suffix index over finished requests'
    outputs (module docstring: algorithms and the rule between them).

    min_match, max_match: shortest and longest suffix matched, in tokens (1 <= min <= max; ValueError
    otherwise); max_index_tokens: most tokens the suffix index holds (0 turns it off).
    Memory: up to (max_match - min_match + 1) dict entries (about 100 bytes each) per token of each
    request with state; 20 bytes per window per token held in the suffix index (min(INDEX_WINDOWS,
    max_match - min_match + 1) windows), up to about 4/3 of that before evicted entries are dropped.
    ``stats()``: proposals, guessed tokens and accepted guesses per source, and the index's size."""

    name = "ngram"

    def __init__(self, min_match: int, max_match: int, max_index_tokens: int = 1_000_000):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"ngram match window must satisfy 1 <= min <= max, got {min_match}, {max_match}")
        if max_index_tokens < 0:
            raise ValueError(f"max_index_tokens must be >= 0, got {max_index_tokens}")
        self.windows = range(min_match, max_match + 1)
        self.index = _SuffixIndex(range(min_match, min(max_match, min_match + INDEX_WINDOWS - 1) + 1),
                                  max_index_tokens)
        self._reqs: dict[str, _Lookup] = {}
        self._source: dict[str, str] = {}  # rid -> source of its last proposal
        self._stats = {f"{s}_{c}": 0 for s in ("prompt", "index") for c in ("proposals", "tokens", "accepted")}

    def propose(self, requests: Sequence, max_tokens: Sequence[int]) -> list[list[int]]:
        out = []
        for rec, k in zip(requests, max_tokens):
            self._source.pop(rec.rid, None)
            if k <= 0:
                out.append([])
                continue
            st = self._sync(rec)
            n, draft = self._prompt_lookup(st, k)
            source = "prompt"
            if n < self.index.windows.stop - 1 and self.index.size:
                n_index, d_index = self.index.draft(st.tokens, k)
                if n_index > n:
                    source, draft = "index", d_index
            if draft:
                self._source[rec.rid] = source
                self._stats[f"{source}_proposals"] += 1
                self._stats[f"{source}_tokens"] += len(draft)
            out.append(draft)
        return out

    def _prompt_lookup(self, st: _Lookup, k: int) -> tuple[int, list[int]]:
        """(matched suffix length, up to ``k`` guesses) from the request's own tokens; (0, []) if
        no suffix of ``min_match`` to ``max_match`` tokens occurs earlier."""
        toks, L = st.tokens, len(st.tokens)
        keys = _suffix_keys(toks, L, self.windows)
        for i in reversed(range(len(keys))):
            n = self.windows.start + i
            e = st.ends.get(keys[i])
            if n < L and e is not None and toks[e - n:e] == toks[L - n:]:
                draft: list[int] = []
                for j in range(e, e + k):
                    draft.append(toks[j] if j < L else draft[j - L])
                return n, draft
        return 0, []

    def _sync(self, rec) -> _Lookup:
        """The request's state, brought up to its current tokens (rebuilt if they do not extend it)."""
        prompt, output = rec.prompt_ids, rec.output_ids
        st = self._reqs.get(rec.rid)
        seen = len(st.tokens) if st is not None else 0
        if st is None or not self._extends(st, prompt, output):
            st = self._reqs[rec.rid] = _Lookup(len(prompt))
            seen = 0
        st.tokens += (prompt + output) if not seen else output[seen - len(prompt):]
        toks, ends, windows = st.tokens, st.ends, self.windows
        if len(toks) - seen > BULK_SYNC:  # a prompt's first sync: numpy, not a loop per token
            ends.update(zip(*_end_keys(toks, max(seen, 1), windows)))
            return st
        for e in range(max(seen, 1), len(toks)):
            for key in _suffix_keys(toks, e, windows):
                ends[key] = e
        return st

    @staticmethod
    def _extends(st: _Lookup, prompt: list[int], output: list[int]) -> bool:
        """Whether prompt + output extends the tokens ``st`` has seen (which always hold the whole
        prompt): same prompt length, no fewer tokens, and the same first, last-prompt and last-seen
        tokens (O(1); a rewrite keeping all of those is not detected)."""
        P, seen = len(prompt), len(st.tokens)
        if st.prompt_len != P or seen > P + len(output):
            return False
        if not seen:
            return True
        last = output[seen - 1 - P] if seen > P else prompt[-1]
        return last == st.tokens[-1] and (not P or (prompt[0] == st.tokens[0] and prompt[-1] == st.tokens[P - 1]))

    def observe(self, request, num_proposed: int, num_accepted: int) -> None:
        source = self._source.pop(request.rid, None)
        if source is not None:
            self._stats[f"{source}_accepted"] += num_accepted

    def finish(self, request) -> None:
        """Drop the request's state and add its output (after a prompt tail as context) to the suffix index."""
        self._reqs.pop(request.rid, None)
        self._source.pop(request.rid, None)
        if request.output_ids and self.index.max_tokens:
            tail = list(request.prompt_ids[-(self.index.windows.stop - 1):])
            self.index.add(tail + list(request.output_ids), len(tail))

    def stats(self) -> dict:
        """``{prompt,index}_proposals`` (requests given guesses), ``{prompt,index}_tokens`` (guesses),
        ``{prompt,index}_accepted`` (guesses the target accepted), ``index_size`` (tokens held),
        ``index_entries`` ((context, next token) entries stored)."""
        return {**self._stats, "index_size": self.index.size, "index_entries": self.index.num_entries()}
