"""The one admission rule (idleless.engine.admission.check_request) against hand-computed cases:
the frontend and the engine both call it, so these cases are what both accept and refuse."""

from __future__ import annotations

import pytest

from idleless.engine.admission import AdmissionLimits, check_request
from idleless.errors import RequestError
from idleless.sampling_params import SamplingParams

# 100 ids, 50 positions, 40 KV slots: a request may hold 40 tokens in all
LIMITS = AdmissionLimits(vocab_size=100, context_length=50, kv_slots=40)


def refused(ids, params, limits=LIMITS) -> RequestError:
    with pytest.raises(RequestError) as ei:
        check_request(ids, params, limits)
    return ei.value


@pytest.mark.parametrize("limits,expected", [
    (AdmissionLimits(100, 50, 40), 40),        # the KV pool binds
    (AdmissionLimits(100, 20, 40), 20),        # the context binds
    (AdmissionLimits(100, 50, 40, 15), 25),    # 40 slots - 15 pinned
    (AdmissionLimits(100, 30, 40, 5), 30),     # 35 left after pins, the context still binds
])
def test_max_seq_len(limits, expected):
    assert limits.max_seq_len == expected


def test_effective_max_new_tokens():
    ten = list(range(10))
    assert check_request(ten, SamplingParams(max_new_tokens=30), LIMITS) == 30  # 10 + 30 = 40: fits exactly
    assert check_request(ten, SamplingParams(max_new_tokens=1), LIMITS) == 1
    p = SamplingParams(max_new_tokens=None)
    assert check_request(ten, p, LIMITS) == 30  # None: everything the limit leaves
    assert p.max_new_tokens is None  # pure: params untouched
    assert check_request(list(range(39)), SamplingParams(max_new_tokens=None), LIMITS) == 1


def test_over_the_limit():
    ten = list(range(10))
    e = refused(ten, SamplingParams(max_new_tokens=31))  # 41 > 40
    assert (e.param, e.code) == ("max_tokens", "context_length_exceeded")
    assert "41 exceeds the limit of 40 tokens" in e.message and "KV pool 40 tokens" in e.message
    e = refused(list(range(40)), SamplingParams(max_new_tokens=None))  # no room for one output token
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    assert "at most 39 prompt tokens" in e.message


def test_pinned_tokens_lower_the_limit():
    pinned = AdmissionLimits(100, 50, 40, pinned_tokens=15)  # 25 tokens per request
    ten = list(range(10))
    assert check_request(ten, SamplingParams(max_new_tokens=15), pinned) == 15
    assert check_request(ten, SamplingParams(max_new_tokens=None), pinned) == 15
    e = refused(ten, SamplingParams(max_new_tokens=16), pinned)
    assert (e.param, e.code) == ("max_tokens", "context_length_exceeded") and "15 of them pinned" in e.message
    e = refused(list(range(25)), SamplingParams(max_new_tokens=1), pinned)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    # everything pinned: nothing fits, and the message does not go negative
    e = refused([1], SamplingParams(max_new_tokens=1), AdmissionLimits(100, 50, 40, pinned_tokens=40))
    assert e.code == "context_length_exceeded" and "at most 0 prompt tokens" in e.message


@pytest.mark.parametrize("ids", [[], [100], [-1], [5, True], [1.0], ["7"], [None]])
def test_bad_prompts(ids):
    e = refused(ids, SamplingParams(max_new_tokens=1))
    assert (e.param, e.code) == ("prompt", "invalid_prompt")


def test_bad_sampling_values_and_rule_order():
    e = refused([1, 2], SamplingParams(temperature=-1.0, max_new_tokens=1))
    assert (e.param, e.code) == ("temperature", "invalid_value")
    e = refused([1, 2], SamplingParams(stop_token_ids=[100], max_new_tokens=1))  # vocabulary-checked
    assert (e.param, e.code) == ("stop_token_ids", "invalid_value")
    # the prompt is checked before the parameters, the parameters before the length
    assert refused([], SamplingParams(temperature=-1.0)).code == "invalid_prompt"
    assert refused(list(range(45)), SamplingParams(temperature=-1.0)).code == "invalid_value"
