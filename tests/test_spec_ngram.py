"""The ``ngram`` proposer (idleless.spec.ngram) against brute-force references.

``brute_lookup`` is prompt lookup by an O(n^2) scan of the request's tokens; ``BruteIndex`` keeps
the finished requests' documents whole and scans them at every guess. Records handed to the
proposer are stand-ins with the fields it reads (``rid``, ``prompt_ids``, ``output_ids``). The end
to end test drives an ``EngineCore`` over a tiny random Llama built here, speculation on vs off.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import TEST_THREADS, make_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from idleless.spec.ngram import BULK_SYNC, INDEX_WINDOWS, MAX_OCCURRENCES, MIN_PROB, NgramProposer, _suffix_keys


def rec(rid, prompt, output=()):
    return SimpleNamespace(rid=rid, prompt_ids=list(prompt), output_ids=list(output))


def brute_lookup(tokens, lo, hi, k):
    """(n, guesses): the longest suffix (lo..hi tokens) occurring earlier, its most recent earlier
    occurrence, and the k tokens copied after it (a copy running past the end reads its own guesses)."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == tokens[L - n:]:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[e + j])
                return n, ext[L:]
    return 0, []


class BruteIndex:
    """The suffix index by brute force: whole documents, oldest evicted first, scanned per guess."""

    def __init__(self, lo, hi, cap):
        self.windows = range(lo, min(hi, lo + INDEX_WINDOWS - 1) + 1)
        self.cap = cap
        self.docs = []  # (tokens, first position predicted)

    def finish(self, prompt, output):
        if not output or not self.cap:
            return
        tail = list(prompt[-(self.windows.stop - 1):])
        doc, start = tail + list(output), len(tail)
        if len(doc) > self.cap:
            cut = len(doc) - self.cap
            doc, start = doc[cut:], max(start - cut, 0)
        if max(start, self.windows.start) >= len(doc):
            return  # no token with a context: nothing to hold
        self.docs.append((doc, start))
        while sum(len(d) for d, _ in self.docs) > self.cap:
            self.docs.pop(0)

    def draft(self, context, k):
        ext, out, matched, prob = list(context), [], 0, 1.0
        while len(out) < k:
            for n in reversed(self.windows):
                nexts = [d[e] for d, s in self.docs for e in range(max(s, n), len(d))
                         if n <= len(ext) and d[e - n:e] == ext[len(ext) - n:]]
                if nexts:
                    break
            else:
                break
            counts = Counter(nexts[-MAX_OCCURRENCES:])
            best = max(counts.values())
            prob *= best / sum(counts.values())
            if prob < MIN_PROB:
                break
            matched = matched or n
            out.append(min(t for t, c in counts.items() if c == best))
            ext.append(out[-1])
        return matched, out


def brute_propose(tokens, lo, hi, k, index):
    """The documented rule: the longer matched suffix wins, a tie goes to prompt lookup."""
    if k == 0:
        return []
    n, draft = brute_lookup(tokens, lo, hi, k)
    n_index, d_index = index.draft(tokens, k)
    return d_index if n_index > n else draft


tokens_st = st.lists(st.integers(0, 3), max_size=40)
window_st = st.tuples(st.integers(1, 4), st.integers(0, 5)).map(lambda t: (t[0], t[0] + t[1]))


# ============================================================================ prompt lookup


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, window=window_st, k=st.integers(0, 9), split=st.integers(0, 40))
def test_prompt_lookup_equals_brute_force(tokens, window, k, split):
    """Any tokens, split anywhere into prompt + output: the guesses equal the O(n^2) search's."""
    lo, hi = window
    p = NgramProposer(lo, hi, max_index_tokens=0)
    r = rec("r", tokens[:split], tokens[split:])
    assert p.propose([r], [k]) == [brute_lookup(tokens, lo, hi, k)[1]]


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), window=window_st,
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=30), prompt_len=st.integers(1, 20), k=st.integers(1, 8))
def test_incremental_updates_equal_a_rebuild(tokens, window, chunks, prompt_len, k):
    """One proposer fed a request whose output grows by chunks answers, at every step, what a fresh
    proposer and the brute-force search answer for the same tokens."""
    lo, hi = window
    p = NgramProposer(lo, hi, max_index_tokens=0)
    P = min(prompt_len, len(tokens))
    end = P
    for c in chunks + [len(tokens)]:
        end = min(end, len(tokens))
        r = rec("r", tokens[:P], tokens[P:end])
        want = brute_lookup(tokens[:end], lo, hi, k)[1]
        assert p.propose([r], [k]) == [want]
        assert NgramProposer(lo, hi, max_index_tokens=0).propose([r], [k]) == [want]
        end += c


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 6), min_size=BULK_SYNC + 2, max_size=400), window=window_st,
       grow=st.lists(st.integers(1, 2 * BULK_SYNC), max_size=4), k=st.integers(1, 8))
def test_a_long_prompts_bulk_sync_equals_the_loop_and_brute_force(tokens, window, grow, k):
    """More than BULK_SYNC new tokens at once are indexed with numpy (``_end_keys``): the per-request
    table equals the one the loop over ``_suffix_keys`` builds (same keys, same most recent ends, same
    order), and the guesses equal the brute-force search's, also after later growth by either path."""
    lo, hi = window
    windows = range(lo, hi + 1)
    P = len(tokens) // 3
    p = NgramProposer(lo, hi, max_index_tokens=0)
    end = max(P, len(tokens) - sum(grow))  # the first call: prompt and output so far in one sync
    for g in [0] + grow:
        end = min(end + g, len(tokens))
        r = rec("r", tokens[:P], tokens[P:end])
        assert p.propose([r], [k]) == [brute_lookup(tokens[:end], lo, hi, k)[1]]
        want = {}
        for e in range(1, end):
            for key in _suffix_keys(tokens[:end], e, windows):
                want[key] = e
        got = p._reqs["r"].ends
        assert got == want and list(got) == list(want)


@pytest.mark.parametrize("change", ["truncated", "last_replaced", "regrown", "prompt_replaced", "prompt_longer"])
def test_tokens_that_do_not_extend_the_last_call_are_rebuilt(change):
    """A request whose tokens are no extension of the ones seen last (retracted and re-admitted with
    other tokens, or a reused rid) is answered from its current tokens alone."""
    prompt = [5, 6, 7, 8, 5, 6]
    out = [7, 9, 5, 6, 9, 1, 5]
    p = NgramProposer(1, 4, max_index_tokens=0)
    assert p.propose([rec("r", prompt, out)], [4]) == [brute_lookup(prompt + out, 1, 4, 4)[1]]
    new_prompt, new_out = {
        "truncated": (prompt, out[:3]),
        "last_replaced": (prompt, out[:-1] + [6]),
        "regrown": (prompt, out[:4] + [8, 3, 3, 5, 6]),
        "prompt_replaced": ([9, 9, 1, 2, 3, 1], out),
        "prompt_longer": (prompt + [1], out),
    }[change]
    assert p.propose([rec("r", new_prompt, new_out)], [4]) == [brute_lookup(new_prompt + new_out, 1, 4, 4)[1]]


def test_max_tokens_per_request_are_respected():
    """Each request gets at most its own max_tokens guesses; 0 gets [] (a batch answers in order)."""
    toks = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    p = NgramProposer(1, 3, max_index_tokens=0)
    got = p.propose([rec("a", toks), rec("b", toks), rec("c", toks), rec("d", [1, 2, 3])], [0, 2, 9, 5])
    assert got == [[], [4, 5], [4, 5, 6, 7, 1, 2, 3, 4, 5], []]


def test_periodic_text_yields_a_full_draft():
    """The copy runs into the suffix and on into its own guesses: period 3 gives 7 guesses, not 3."""
    p = NgramProposer(2, 5, max_index_tokens=0)
    assert p.propose([rec("r", [1, 2, 3, 1, 2, 3, 1])], [7]) == [[2, 3, 1, 2, 3, 1, 2]]


def test_finish_drops_request_state():
    p = NgramProposer(1, 3)
    r = rec("r", [1, 2, 1], [2])
    p.propose([r], [3])
    assert "r" in p._reqs
    p.finish(r)
    assert "r" not in p._reqs and not p._source


def test_bad_windows_raise():
    for lo, hi in [(0, 3), (4, 3)]:
        with pytest.raises(ValueError, match="window"):
            NgramProposer(lo, hi)
    with pytest.raises(ValueError, match="max_index_tokens"):
        NgramProposer(1, 3, max_index_tokens=-1)


# ============================================================================ suffix index


def test_index_proposes_a_continuation_learnt_from_a_finished_request():
    """A finished request's output, met again after 3 of its tokens in a request whose own tokens
    have no such match, is guessed from the index; stats count it under the index, and its accepted
    guesses once observed."""
    p = NgramProposer(1, 6)
    p.finish(rec("old", [90, 91], [10, 11, 12, 13, 14, 15, 16, 17]))
    new = rec("new", [50, 51, 52, 10, 11, 12])
    assert p.propose([new], [4]) == [[13, 14, 15, 16]]
    p.observe(new, 4, 3)
    st_ = p.stats()
    assert (st_["index_proposals"], st_["index_tokens"], st_["index_accepted"]) == (1, 4, 3)
    assert st_["prompt_proposals"] == 0 and st_["index_size"] == 2 + 8


def test_index_follows_the_most_frequent_continuation_and_stops_below_min_prob():
    """After [1, 2]: 3 seen twice, 4 once, so 3 (p = 2/3); after [1, 2, 3]: 5 or 6, each 1/2, so the
    draft's probability 1/3 still passes; then 11 distinct continuations of [7, 8] (1/11 < MIN_PROB)
    give no guess at all."""
    assert MIN_PROB > 1 / 11
    p = NgramProposer(1, 3)
    for i, out in enumerate([[1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4]]):
        p.finish(rec(f"d{i}", [0], out))
    assert p.propose([rec("q", [9, 1, 2])], [3]) == [[3, 5]]  # after 5: nothing follows [2, 3, 5]
    for i in range(11):
        p.finish(rec(f"e{i}", [0], [7, 8, 20 + i]))
    assert p.propose([rec("q2", [9, 7, 8])], [3]) == [[]]


def test_index_counts_the_most_recent_occurrences_only():
    """Frequencies come from a context's last MAX_OCCURRENCES occurrences: an older majority is outvoted."""
    p = NgramProposer(1, 1)
    p.finish(rec("old", [0], [5, 6] * (MAX_OCCURRENCES // 2 + 200)))
    p.finish(rec("new", [0], [5, 7] * (MAX_OCCURRENCES // 2 + 100)))
    assert p.propose([rec("q", [9, 5])], [1]) == [[7]]


def test_index_size_is_bounded_and_the_oldest_request_is_evicted():
    p = NgramProposer(1, 4, max_index_tokens=30)
    p.finish(rec("a", [1], [40, 41, 42, 43, 44, 45]))
    assert p.propose([rec("q", [40, 41])], [2]) == [[42, 43]]
    for i in range(5):
        p.finish(rec(f"f{i}", [1], [60 + i] * 5))
        assert p.stats()["index_size"] <= 30
    assert p.propose([rec("q2", [40, 41])], [2]) == [[]]


@settings(max_examples=120, deadline=None)
@given(docs=st.lists(st.tuples(tokens_st, st.lists(st.integers(0, 3), max_size=30)), max_size=25),
       queries=st.lists(tokens_st, min_size=1, max_size=6), window=window_st,
       cap=st.integers(0, 120), k=st.integers(0, 8))
def test_proposals_equal_brute_force_with_the_index(docs, queries, window, cap, k):
    """Finished requests (evicted past ``cap`` tokens) then queries: every proposal equals the brute
    force of both sources and the rule between them; the index holds at most ``cap`` tokens and at
    most 4/3 of their entries."""
    lo, hi = window
    p, brute = NgramProposer(lo, hi, max_index_tokens=cap), BruteIndex(lo, hi, cap)
    for i, (prompt, out) in enumerate(docs):
        p.finish(rec(f"d{i}", prompt, out))
        brute.finish(prompt, out)
        size = sum(len(d) for d, _ in brute.docs)
        assert p.stats()["index_size"] == size <= cap
        assert p.stats()["index_entries"] <= len(brute.windows) * cap * 4 / 3
    for j, q in enumerate(queries):
        assert p.propose([rec(f"q{j}", q[:3], q[3:])], [k]) == [brute_propose(q, lo, hi, k, brute)]


def test_the_longer_match_wins_and_a_tie_goes_to_prompt_lookup():
    p = NgramProposer(1, 6)
    p.finish(rec("old", [0], [3, 4, 5, 30, 31]))
    # own tokens match [5] (then 8); the index matches [3, 4, 5] (then 30)
    assert p.propose([rec("a", [5, 8, 3, 4, 5])], [2]) == [[30, 31]]
    # own tokens match [3, 4, 5] too (then 8): a tie
    assert p.propose([rec("b", [3, 4, 5, 8, 3, 4, 5])], [2]) == [[8, 3]]
    st_ = p.stats()
    assert (st_["index_proposals"], st_["prompt_proposals"]) == (1, 1)


# ============================================================================ end to end


def test_engine_greedy_equal_with_ngram_speculation(tmp_path):
    """EngineCore with speculative_algorithm='ngram' (fixed draft length): greedy outputs equal plain
    decoding's token for token; the same prompts sent again are guessed from the suffix index."""
    from idleless.config import EngineConfig
    from idleless.engine.core import EngineCore
    from idleless.engine.request import Request, SamplingParams

    model = make_tiny_model(tmp_path)
    base = [3 + (i * 37) % 250 for i in range(24)]
    prompts = [base + base[:8], base[5:] + base[5:15], [7, 8, 9, 7, 8, 9, 7], base[::-1]]
    lens = [20, 13, 9, 17]

    def run(core, tag):
        out = {}
        for i, (pr, n) in enumerate(zip(prompts, lens)):
            core.add_request(Request(f"{tag}{i}", pr, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)))
            out[f"{tag}{i}"] = []
        while core.has_work():
            for o in core.step():
                out[o.rid] += o.new_token_ids
        return [out[f"{tag}{i}"] for i in range(len(prompts))]

    cfg = dict(model=model, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS)
    refs = run(EngineCore(EngineConfig(**cfg)), "ref")
    core = EngineCore(EngineConfig(**cfg, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                                   speculative_disable_adaptive=True))
    assert run(core, "a") == refs
    assert run(core, "b") == refs  # the first wave's outputs are in the index now
    st_ = core.stats()["speculative"]
    assert st_["algorithm"] == "ngram" and st_["num_draft_tokens"] > 0
    inner = st_["proposer"]
    assert inner["index_proposals"] > 0 and inner["index_accepted"] > 0
    assert inner["prompt_proposals"] > 0
    assert not core.proposer.inner._reqs
