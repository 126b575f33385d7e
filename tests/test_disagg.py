"""Prefill/decode disaggregation at the engine core (issue 18): a prefill engine (P) and a decode
engine (D) in one process on a tiny random model, stepped alternately, against a colocated engine
(C) as the reference. Deterministic inference is on, so D's tokens and logprobs must equal C's
bitwise. Failures (nobody listening, a refusal, garbage, a KV layout mismatch, an abort while the KV
is on its way) must end every request, leak no KV slot, and leave the pair usable.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import zmq

from conftest import make_tiny_model
from idleless.config import EngineConfig
from idleless.disagg import wire
from idleless.engine.core import EngineCore
from idleless.engine.request import Request, SamplingParams
from kv_invariants import check_ownership


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pd"))


def _core(model_dir, **kw) -> EngineCore:
    from idleless.model.runner import ModelRunner
    cfg = EngineConfig(model=model_dir, dtype="float32", kv_cache_memory="2MiB", num_threads=1,
                       enable_deterministic_inference=True, **kw)
    return EngineCore(cfg, runner=ModelRunner(cfg))


@pytest.fixture(scope="module")
def colocated(model_dir):
    return _core(model_dir)


@pytest.fixture(scope="module")
def prefill(model_dir):
    core = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0)
    yield core
    core.kv_connector.close()


def _params(n=8):
    return SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=True)


def _run(cores, reqs_by_core, limit_s=60.0):
    """Add requests, step every core in turn until all are idle; returns rid -> [outputs]."""
    outs: dict[str, list] = {}
    for core, reqs in reqs_by_core:
        for r in reqs:
            core.add_request(r)
    deadline = time.monotonic() + limit_s
    while any(c.has_work() for c in cores):
        assert time.monotonic() < deadline, "engines did not finish"
        for c in cores:
            for o in c.step():
                outs.setdefault(o.rid, []).append(o)
    return outs


def _tokens(outs, rid):
    return [t for o in outs[rid] for t in o.new_token_ids], [x for o in outs[rid] for x in (o.new_logprobs or [])]


def _remote(prefill_core):
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": prefill_core.kv_connector.port}


def _idle_and_clean(core):
    check_ownership(core.scheduler)
    assert not core.has_work()
    assert core.flush_cache()
    assert core.scheduler.pool.num_free_slots == core.scheduler.pool.num_slots


PROMPT = list(range(3, 60))
PROMPT2 = PROMPT[:40] + list(range(100, 130))  # shares 40 tokens with PROMPT


def assert_same_kv_bytes(decode, prefill, ids) -> None:
    """D's cached K/V of ``ids`` (and per-token scales, int8) are P's, byte for byte."""
    ends = []
    for core in (decode, prefill):
        pool, h = core.scheduler.pool, core.scheduler.cache.match_prefix(ids, hit=False)
        assert h.cached_len == len(ids)
        parts = [pool.k_cache[:, h.slots], pool.v_cache[:, h.slots]]
        if pool.k_scale is not None:
            parts += [pool.k_scale[:, h.slots], pool.v_scale[:, h.slots]]
        ends.append([t.contiguous().view(torch.uint8) for t in parts])
    assert len(ends[0]) == len(ends[1]) and all(torch.equal(a, b) for a, b in zip(*ends))


def pull_twice_and_check(decode, prefill, colocated) -> dict:
    """P prefills PROMPT, D pulls its KV and decodes; then PROMPT2, which shares 40 tokens with it, so D
    pulls only the suffix. Checks D's tokens against the colocated engine's (bitwise), the tokens and
    bytes counted, and the prefix hit at admission. Returns D's connector stats."""
    ref = _run([colocated], [(colocated, [Request("c1", PROMPT, _params()), Request("c2", PROMPT2, _params())])])
    colocated.flush_cache()

    # P prefills (and samples one token, as a router asks it to); D pulls the KV and decodes.
    _run([prefill], [(prefill, [Request("p1", PROMPT, _params(1))])])
    got = _run([decode, prefill], [(decode, [Request("d1", PROMPT, _params(), kv_transfer_params=_remote(prefill))])])
    assert _tokens(got, "d1") == _tokens(ref, "c1")
    st = decode.kv_connector.stats()
    assert st["num_transfers"] == 1 and st["num_tokens_received"] == len(PROMPT) - 1
    assert got["d1"][-1].cached_tokens == len(PROMPT) - 1  # the pulled prefix is a cache hit at admission
    pool = decode.scheduler.pool
    L, _, H, D = pool.k_cache.shape
    per_token = 2 * L * H * D * pool.k_cache.element_size()  # K and V in the stored dtype
    if pool.k_scale is not None:  # int8: a float32 scale per token, layer and KV head, for K and V
        per_token += 2 * L * H * 4
    assert st["bytes_received"] == per_token * (len(PROMPT) - 1)
    assert_same_kv_bytes(decode, prefill, PROMPT[:-1])

    # The second prompt shares 40 tokens with the first: D holds them and pulls only the rest.
    _run([prefill], [(prefill, [Request("p2", PROMPT2, _params(1))])])
    got = _run([decode, prefill], [(decode, [Request("d2", PROMPT2, _params(), kv_transfer_params=_remote(prefill))])])
    assert _tokens(got, "d2") == _tokens(ref, "c2")
    st = decode.kv_connector.stats()
    assert st["num_skipped_tokens"] == 40
    assert st["num_tokens_received"] == (len(PROMPT) - 1) + (len(PROMPT2) - 1 - 40)
    return st


def test_decode_equals_colocated_bitwise_and_second_request_pulls_only_the_suffix(model_dir, colocated, prefill):
    decode = _core(model_dir, disaggregation_mode="decode")
    pull_twice_and_check(decode, prefill, colocated)
    assert decode.stats()["time"]["kv_transfer"] > 0 and prefill.stats()["time"]["kv_transfer"] > 0
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fallback", ["recompute", "error"])
def test_nobody_listening_times_out_into_the_fallback(model_dir, colocated, fallback):
    decode = _core(model_dir, disaggregation_mode="decode", disaggregation_timeout=0.3, pd_fallback=fallback)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": _free_port()}
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    got = _run([decode], [(decode, [Request("d", PROMPT, _params(), kv_transfer_params=params)])])
    if fallback == "recompute":
        assert _tokens(got, "d") == _tokens(ref, "c")
        assert decode.kv_connector.stats()["num_fallbacks"] == 1
    else:
        (out,) = got["d"]
        assert out.finished and out.code == "kv_transfer_timeout" and "within 0.3 s" in out.error
    _idle_and_clean(decode)
    decode.kv_connector.close()


def test_evicted_on_prefill_side_falls_back_and_the_pair_keeps_working(model_dir, colocated, prefill):
    decode = _core(model_dir, disaggregation_mode="decode")
    prefill.flush_cache()  # P holds nothing of the prompt: it answers with 0 tokens
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(), kv_transfer_params=_remote(prefill))])])
    assert _tokens(got, "d") == _tokens(ref, "c")
    assert decode.kv_connector.stats()["num_fallbacks"] == 1
    decode.flush_cache()
    _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
    got = _run([decode, prefill], [(decode, [Request("d2", PROMPT, _params(), kv_transfer_params=_remote(prefill))])])
    assert _tokens(got, "d2") == _tokens(ref, "c")
    assert decode.kv_connector.stats()["num_transfers"] == 1
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def test_kv_dtype_mismatch_is_refused_with_a_clear_error(model_dir, prefill):
    decode = _core(model_dir, disaggregation_mode="decode", kv_cache_dtype="int8")
    _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
    got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(), kv_transfer_params=_remote(prefill))])])
    (out,) = got["d"]
    assert out.code == "layout_mismatch" and "--kv-cache-dtype" in out.error
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


QUANT = {"skip_quantization_gate": True}  # the accuracy gate is tested in test_kv_dtype


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantised_kv_equals_colocated_bitwise(model_dir, kv):
    """int8 sends its per-token scales with the K/V; fp8's scales are static per (layer, K/V, KV head),
    the same in every engine that calibrated on the same model, so only the fp8 bytes travel (one per
    element: the byte count says no scale came). D's tokens and logprobs equal a colocated engine's of
    the same format bitwise, and D's cached bytes are P's."""
    q = {**QUANT, "kv_cache_dtype": kv}
    colocated = _core(model_dir, **q)
    prefill = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **q)
    decode = _core(model_dir, disaggregation_mode="decode", **q)
    try:
        if kv.startswith("fp8"):
            for core in (prefill, decode):
                assert core.scheduler.pool.k_scale is None
                assert torch.equal(core.scheduler.pool.k_head_scale, colocated.scheduler.pool.k_head_scale)
                assert torch.equal(core.scheduler.pool.v_head_scale, colocated.scheduler.pool.v_head_scale)
        pull_twice_and_check(decode, prefill, colocated)
        _idle_and_clean(decode)
        _idle_and_clean(prefill)
    finally:
        decode.kv_connector.close()
        prefill.kv_connector.close()


def other_scales_file(core, path, layer=1, head=1) -> str:
    """A --quantization-param-path file of ``core``'s fp8 scales with V of (``layer``, ``head``) doubled."""
    from idleless.quant import kv_scales
    pool = core.scheduler.pool
    v = pool.v_head_scale.clone()
    v[layer, head] *= 2
    kv_scales.save_scale_file(str(path), pool.k_head_scale, v, "fp8_e4m3")
    return str(path)


def test_fp8_kv_scales_mismatch_is_refused_naming_the_scale(model_dir, tmp_path):
    """Two fp8 engines whose static scales differ (one read another scale file) would read the same bytes
    as other values: the pull is refused (an error whatever the fallback, never rescaled), the message
    names the first differing scale, and neither side leaks a slot."""
    q = {**QUANT, "kv_cache_dtype": "fp8_e4m3"}
    prefill = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **q)
    decode = _core(model_dir, disaggregation_mode="decode", pd_fallback="recompute",
                   quantization_param_path=other_scales_file(prefill, tmp_path / "kv.json"), **q)
    try:
        _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
        d = Request("d", PROMPT, _params(), kv_transfer_params=_remote(prefill))
        (out,) = _run([decode, prefill], [(decode, [d])])["d"]
        assert out.finished and out.code == "layout_mismatch"
        assert "fp8 KV scales differ" in out.error and "layer 1 V head 1" in out.error
        v = decode.scheduler.pool.v_head_scale[1, 1].item()
        assert f"head 1 is {v!r} on the decode engine, {v / 2!r} on the prefill engine" in out.error
        assert "--quantization-param-path" in out.error
        st = decode.kv_connector.stats()
        assert st["num_errors"] == 1 and st["num_fallbacks"] == 0 and st["num_transfers"] == 0
        _idle_and_clean(decode)
        _idle_and_clean(prefill)
    finally:
        decode.kv_connector.close()
        prefill.kv_connector.close()


def test_layout_names_a_static_scale_difference_and_carries_no_scale_for_other_pools():
    """The layout's digest of fp8 scales changes with any one scale bit; the decode side, which checks a
    reply's layout without the peer's scales, still names the scales; int8 / plain pools carry none."""
    from idleless.cache.kv_pool import KVPool
    k, v = torch.full((2, 3), 0.01), torch.full((2, 3), 0.02)
    a = KVPool(2, 3, 4, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(k, v))
    k2 = k.clone()
    k2[1, 2] = torch.nextafter(k2[1, 2], torch.tensor(1.0))
    b = KVPool(2, 3, 4, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(k2, v))
    la, lb = wire.pool_layout(a), wire.pool_layout(b)
    assert la["token_scales"] is False and la["kv_scales"] != lb["kv_scales"]
    assert wire.layout_mismatch(la, dict(la)) is None
    why = wire.layout_mismatch(la, lb)
    assert "fp8 KV scales differ" in why and "first difference" not in why
    why = wire.layout_mismatch(la, lb, wire.pool_scales(a), wire.pool_scales(b))
    assert f"layer 1 K head 2 is {k2[1, 2].item()!r} on the peer, {k[1, 2].item()!r} on this engine" in why
    for pool, token_scales in ((KVPool(2, 3, 4, 8, torch.float32, cache_dtype="int8"), True),
                               (KVPool(2, 3, 4, 8, torch.float32), False)):
        layout = wire.pool_layout(pool)
        assert layout["token_scales"] is token_scales and layout["kv_scales"] is None
        assert wire.pool_scales(pool) is None


def test_garbage_on_the_transfer_port_is_refused_and_pulls_still_work(model_dir, colocated, prefill):
    port = prefill.kv_connector.port
    with socket.create_connection(("127.0.0.1", port)) as raw:  # not even ZMTP
        raw.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n" * 10)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        for frames in ([b"PULL", b"{not json"], [b"PULL", b'{"token_ids": [1, 2], "skip": 5, "want": 1}'],
                       [b"HELLO"], [b"PULL", b'{"token_ids": "x", "skip": 0, "want": 0}']):
            sock.send_multipart(frames)
            deadline = time.monotonic() + 10
            while not sock.poll(10):  # the message may still be on its way: step until the reply is out
                assert time.monotonic() < deadline, "no reply to a bad pull"
                prefill.step()
            kind, head = sock.recv_multipart()
            assert kind == wire.ERR and wire.decode_header(head)["code"] == "bad_request"
    finally:
        sock.close(0)
    assert prefill.kv_connector.stats()["num_bad_messages"] == 4
    decode = _core(model_dir, disaggregation_mode="decode")
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
    got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(), kv_transfer_params=_remote(prefill))])])
    assert _tokens(got, "d") == _tokens(ref, "c")
    assert decode.kv_connector.stats()["num_transfers"] == 1
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def test_abort_while_waiting_for_kv_frees_everything(model_dir, prefill):
    decode = _core(model_dir, disaggregation_mode="decode")
    _run([decode], [(decode, [Request("warm", PROMPT[:20], _params(1))])])  # D holds a prefix: the pull locks it
    decode.add_request(Request("d", PROMPT, _params(), kv_transfer_params=_remote(prefill)))
    assert decode.kv_connector.stats()["num_pending"] == 1
    assert decode.abort("d")
    outs = decode.step()
    assert [(o.rid, o.finish_reason.value) for o in outs] == [("d", "abort")]
    _idle_and_clean(decode)
    decode.kv_connector.close()


def test_bad_kv_transfer_params_are_a_request_error(model_dir):
    from idleless.errors import RequestError
    decode = _core(model_dir, disaggregation_mode="decode")
    for bad in ({"do_remote_prefill": True, "remote_host": "", "remote_port": 1},
                {"do_remote_prefill": True, "remote_host": "h", "remote_port": 0},
                {"do_remote_prefill": True, "remote_host": "h", "remote_port": "80"}):
        with pytest.raises(RequestError, match="kv_transfer_params"):
            decode.add_request(Request("d", PROMPT, _params(), kv_transfer_params=bad))
    assert not decode.has_work()
    decode.kv_connector.close()


def test_config_refuses_unknown_modes():
    with pytest.raises(ValueError, match="disaggregation_mode"):
        EngineConfig(disaggregation_mode="both")
    with pytest.raises(ValueError, match="pd_fallback"):
        EngineConfig(pd_fallback="retry")
    with pytest.raises(ValueError, match="disaggregation_timeout"):
        EngineConfig(disaggregation_timeout=0)


def test_prefill_engine_answers_where_to_pull_and_fan_out_carries_the_params():
    from idleless.disagg.http import prefill_reply
    from idleless.text.output import fan_out
    p = EngineConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=9123)
    assert prefill_reply(p, {"do_remote_decode": True}) == {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                                                            "remote_port": 9123}
    assert prefill_reply(p, None) is None and prefill_reply(p, {}) is None
    assert prefill_reply(EngineConfig(), {"do_remote_decode": True}) is None  # not a prefill engine
    wild = EngineConfig(disaggregation_mode="prefill", disaggregation_bootstrap_host="0.0.0.0")
    assert prefill_reply(wild, {"do_remote_decode": True})["remote_host"] is None  # the router fills it in
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}
    reqs = [r for _, r in fan_out("b", [[5, 6], [7]], SamplingParams(n=2), None, 0, params)]
    assert len(reqs) == 4 and all(r.kv_transfer_params == params for r in reqs)


def test_the_transfer_thread_sends_while_the_prefix_stays_locked_until_the_step_thread_unlocks(
        model_dir, colocated, prefill):
    """The pull is matched and locked on P's step thread, then sent with no further step of P; the
    prefix stays locked (a flush or memory release must wait: has_work) until P's next between-step
    call unlocks it."""
    decode = _core(model_dir, disaggregation_mode="decode")
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    prefill.flush_cache()
    _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
    cache = prefill.scheduler.cache
    assert cache.protected_size == 0
    sent_before = prefill.kv_connector.stats()["bytes_sent"]
    decode.add_request(Request("d", PROMPT, _params(), kv_transfer_params=_remote(prefill)))
    deadline = time.monotonic() + 20
    while prefill.kv_connector.stats()["num_in_flight"] == 0:  # the pull reaches P's step thread
        assert time.monotonic() < deadline
        prefill.step()
    assert cache.protected_size > 0 and prefill.has_work()
    while decode.kv_connector.stats()["num_pending"]:  # P does not step: its transfer thread sends
        assert time.monotonic() < deadline, "the transfer thread did not send"
        decode.step()
    assert decode.kv_connector.stats()["num_transfers"] == 1
    assert cache.protected_size > 0 and prefill.has_work()  # unlocked on the step thread only
    got = _run([decode, prefill], [])
    assert cache.protected_size == 0 and not prefill.has_work()
    assert _tokens(got, "d") == _tokens(ref, "c")
    st = prefill.kv_connector.stats()
    assert st["num_in_flight"] == 0
    assert st["bytes_sent"] - sent_before == decode.kv_connector.stats()["bytes_received"]
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def _prefill_until_done(prefill, req):
    """Step P until ``req`` has finished (its reservation, if any, keeps P busy afterwards)."""
    prefill.add_request(req)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline
        if any(o.rid == req.rid and o.finished for o in prefill.step()):
            return


def test_a_reservation_is_sent_by_the_transfer_thread_alone_and_unlocked_on_the_step_thread(
        model_dir, colocated, prefill):
    """A prefill with a router's transfer_id locks its prefix when it finishes; the pull naming that id
    is answered by the transfer thread with no step of P at all, and P's next step unlocks it."""
    decode = _core(model_dir, disaggregation_mode="decode")
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    prefill.flush_cache()
    cache = prefill.scheduler.cache
    _prefill_until_done(prefill, Request("p", PROMPT, _params(1),
                                         kv_transfer_params={"do_remote_decode": True, "transfer_id": "r-1"}))
    assert cache.protected_size > 0 and prefill.has_work()  # reserved for the pull
    assert not prefill.flush_cache()
    decode.add_request(Request("d", PROMPT, _params(), kv_transfer_params={**_remote(prefill), "transfer_id": "r-1"}))
    deadline = time.monotonic() + 20
    while decode.kv_connector.stats()["num_pending"]:  # P never steps
        assert time.monotonic() < deadline, "the transfer thread did not serve the reservation"
        decode.step()
    assert decode.kv_connector.stats()["num_transfers"] == 1 and cache.protected_size > 0
    got = _run([decode, prefill], [])
    assert cache.protected_size == 0 and not prefill.has_work()
    assert _tokens(got, "d") == _tokens(ref, "c")
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def test_an_unpulled_reservation_expires_and_is_unlocked(model_dir, prefill, monkeypatch):
    from idleless.disagg import prefill as prefill_side
    monkeypatch.setattr(prefill_side, "RESERVE_S", 0.2)
    prefill.flush_cache()
    _prefill_until_done(prefill, Request("p", PROMPT, _params(1),
                                         kv_transfer_params={"do_remote_decode": True, "transfer_id": "r-2"}))
    assert prefill.scheduler.cache.protected_size > 0
    _run([prefill], [])  # steps until the reservation has expired and come back
    assert prefill.scheduler.cache.protected_size == 0
    _idle_and_clean(prefill)


def test_a_decode_engine_that_needs_no_pull_releases_the_reservation(model_dir, colocated, prefill, monkeypatch):
    """D already holds the prompt: it pulls nothing and says so (DONE), and P unlocks the reserved
    prefix long before the reservation would expire; D's tokens still equal the colocated engine's."""
    from idleless.disagg import prefill as prefill_side
    monkeypatch.setattr(prefill_side, "RESERVE_S", 300.0)
    decode = _core(model_dir, disaggregation_mode="decode")
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    _run([decode], [(decode, [Request("warm", PROMPT, _params(1))])])  # D caches the prompt itself
    prefill.flush_cache()
    _prefill_until_done(prefill, Request("p", PROMPT, _params(1),
                                         kv_transfer_params={"do_remote_decode": True, "transfer_id": "r-3"}))
    assert prefill.scheduler.cache.protected_size > 0
    got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(),
                                                     kv_transfer_params={**_remote(prefill), "transfer_id": "r-3"})])],
               limit_s=60)  # P steps until the DONE has come and its reservation is unlocked
    assert _tokens(got, "d") == _tokens(ref, "c")
    st = decode.kv_connector.stats()
    assert st["num_released"] == 1 and st["num_pulls"] == 0
    assert prefill.scheduler.cache.protected_size == 0 and not prefill.has_work()
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def test_ttft_split_has_four_disjoint_parts_within_the_measured_ttft(model_dir, prefill):
    """With a router's transfer_id, P times the request and sends its queue and prefill seconds with
    the KV; D adds transfer and first decode. The parts are disjoint intervals of [arrival at P, D's
    first token], so on one clock (one process here) their sum is at most that span."""
    decode = _core(model_dir, disaggregation_mode="decode")
    prefill.flush_cache()
    t_arrival = time.monotonic()
    p_req = Request("p", PROMPT, _params(1), kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1"})
    assert p_req.arrival_time >= t_arrival
    _prefill_until_done(prefill, p_req)
    params = {**_remote(prefill), "transfer_id": "t-1"}
    decode.add_request(Request("d", PROMPT, _params(), kv_transfer_params=params))
    first_token_at = None
    deadline = time.monotonic() + 60
    while decode.has_work() or prefill.has_work():
        assert time.monotonic() < deadline
        for core in (decode, prefill):
            for o in core.step():
                if o.rid == "d" and o.new_token_ids and first_token_at is None:
                    first_token_at = time.monotonic()
    split = decode.kv_connector.stats()["ttft_split"]
    assert split["count"] == 1
    (rec,) = split["recent"]
    parts = [rec[k] for k in ("queue_s", "prefill_s", "transfer_s", "first_decode_s")]
    assert all(v is not None and v >= 0 for v in parts), rec
    assert rec["prefill_s"] > 0 and rec["transfer_s"] > 0 and rec["first_decode_s"] > 0
    assert sum(parts) <= first_token_at - p_req.arrival_time
    assert all(split["observed"][p] == 1 for p in ("queue", "prefill", "transfer", "first_decode"))
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


def test_split_stats_buckets_and_peer_timings():
    from idleless.disagg import timing
    s = timing.SplitStats(keep=2)
    values = [0.003, 0.3, 7.0]
    for v in values:
        s.add({"queue_s": v, "prefill_s": None, "transfer_s": v, "first_decode_s": 2 * v})
    snap = s.snapshot()
    for i, bound in enumerate(timing.BUCKETS):  # cumulative counts, by brute force
        assert snap["counts"]["queue"][i] == sum(v <= bound for v in values)
        assert snap["counts"]["first_decode"][i] == sum(2 * v <= bound for v in values)
    assert snap["count"] == 3 and snap["observed"]["prefill"] == 0 and snap["observed"]["transfer"] == 3
    assert snap["sums"]["transfer"] == sum(values) and len(snap["recent"]) == 2
    assert timing.prefill_parts(10.0, 12.5, 13.0) == {"queue_s": 2.5, "prefill_s": 0.5}
    assert timing.valid_prefill_parts({"queue_s": 1, "prefill_s": 0.25}) == {"queue_s": 1.0, "prefill_s": 0.25}
    for bad in (None, [], {"queue_s": 1}, {"queue_s": -1, "prefill_s": 0}, {"queue_s": True, "prefill_s": 0},
                {"queue_s": float("inf"), "prefill_s": 0}, {"queue_s": "1", "prefill_s": 0}):
        assert timing.valid_prefill_parts(bad) is None
