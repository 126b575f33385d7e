"""The ``mooncake`` KV transfer backend (issue 18): the same prefill (P) / decode (D) pair as
tests/test_disagg.py, on a tiny random model in one process, with the KV bytes read through Mooncake's
transfer engine (``mooncake-transfer-engine-non-cuda``, TCP on 127.0.0.1) instead of ZMQ frames.

D's tokens and logprobs must equal a colocated engine's bitwise (deterministic inference), only the
suffix D lacks travels, a KV dtype or backend mismatch is refused with a clear error, a read that
fails ends in the fallback with no slot leaked, and P frees every staging buffer (released by D, or
expired). The bytes P exposes are checked against its own pool by reading them with a third engine.
The tests that need the package skip without it; the start-up refusal and the packing do not.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import zmq

from idleless.disagg import mooncake, wire
from idleless.engine.request import Request
from test_disagg import (PROMPT, _core, _free_port, _idle_and_clean, _params, _remote, _run, _tokens,
                         assert_same_kv_bytes, other_scales_file, pull_twice_and_check)

needs_mooncake = pytest.mark.skipif(mooncake.missing_reason() is not None, reason="mooncake not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("pd-mooncake"))


@pytest.fixture(scope="module")
def colocated(model_dir):
    return _core(model_dir)


@pytest.fixture(scope="module")
def mc_prefill(model_dir):
    core = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                 disaggregation_transfer_backend="mooncake", disaggregation_timeout=10)
    yield core
    core.kv_connector.close()


def _mc_decode(model_dir, **kw):
    return _core(model_dir, disaggregation_mode="decode", disaggregation_transfer_backend="mooncake", **kw)


def _until_buffers_freed(prefill, limit_s=20.0):
    """Step P until its transfer thread holds no staging buffer (D's release travels asynchronously)."""
    deadline = time.monotonic() + limit_s
    while prefill.kv_connector.stats()["num_read_buffers"]:
        assert time.monotonic() < deadline, "P kept a staging buffer"
        prefill.step()
        time.sleep(0.01)


@needs_mooncake
def test_mooncake_decode_equals_colocated_bitwise_and_pulls_only_the_suffix(model_dir, colocated, mc_prefill):
    decode = _mc_decode(model_dir)
    st = pull_twice_and_check(decode, mc_prefill, colocated)
    assert st["transfer_backend"] == "mooncake"
    prefill = mc_prefill
    _until_buffers_freed(prefill)
    pst = prefill.kv_connector.stats()
    assert pst["num_read_released"] >= 2 and pst["num_read_expired"] == 0
    assert decode.kv_connector.stats()["num_quarantined"] == 0
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()


@needs_mooncake
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_mooncake_quantised_kv_equals_colocated(model_dir, kv):
    """int8 sends its per-token scales too; fp8 (static per-head scales, the same in both engines) its
    bytes alone (the buffer's size says so). D's tokens equal a colocated engine's of the same format,
    and D's cached bytes are P's."""
    q = {"kv_cache_dtype": kv, "skip_quantization_gate": True}
    colocated = _core(model_dir, **q)
    prefill = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                    disaggregation_transfer_backend="mooncake", disaggregation_timeout=10, **q)
    decode = _mc_decode(model_dir, **q)
    try:
        ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
        _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
        got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(),
                                                         kv_transfer_params=_remote(prefill))])])
        assert _tokens(got, "d") == _tokens(ref, "c")
        st = decode.kv_connector.stats()
        assert st["num_transfers"] == 1
        L, _, H, D = decode.scheduler.pool.k_cache.shape
        per_token = 2 * L * H * D + (2 * L * H * 4 if kv == "int8" else 0)  # one byte per element (+ scales)
        assert st["bytes_received"] == per_token * (len(PROMPT) - 1)
        assert_same_kv_bytes(decode, prefill, PROMPT[:-1])
        _until_buffers_freed(prefill)
        _idle_and_clean(decode)
        _idle_and_clean(prefill)
    finally:
        decode.kv_connector.close()
        prefill.kv_connector.close()


@needs_mooncake
def test_mooncake_kv_dtype_mismatch_is_refused_with_a_clear_error(model_dir, mc_prefill):
    decode = _mc_decode(model_dir, kv_cache_dtype="int8")
    _run([mc_prefill], [(mc_prefill, [Request("p", PROMPT, _params(1))])])
    got = _run([decode, mc_prefill], [(decode, [Request("d", PROMPT, _params(),
                                                        kv_transfer_params=_remote(mc_prefill))])])
    (out,) = got["d"]
    assert out.code == "layout_mismatch" and "--kv-cache-dtype" in out.error
    _idle_and_clean(decode)
    _idle_and_clean(mc_prefill)
    decode.kv_connector.close()


@needs_mooncake
def test_mooncake_fp8_scales_mismatch_is_refused_naming_the_scale(model_dir, tmp_path):
    q = {"kv_cache_dtype": "fp8_e4m3", "skip_quantization_gate": True}
    prefill = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                    disaggregation_transfer_backend="mooncake", disaggregation_timeout=10, **q)
    decode = _mc_decode(model_dir, quantization_param_path=other_scales_file(prefill, tmp_path / "kv.json"), **q)
    try:
        _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
        got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(),
                                                         kv_transfer_params=_remote(prefill))])])
        (out,) = got["d"]
        assert out.code == "layout_mismatch" and "fp8 KV scales differ" in out.error and "layer 1 V head 1" in out.error
        assert prefill.kv_connector.stats()["num_read_buffers"] == 0  # nothing exposed
        _idle_and_clean(decode)
        _idle_and_clean(prefill)
    finally:
        decode.kv_connector.close()
        prefill.kv_connector.close()


@needs_mooncake
def test_backend_mismatch_is_refused_and_a_tcp_pull_from_a_mooncake_prefill_works(model_dir, colocated, mc_prefill):
    tcp_prefill = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0)
    decode = _mc_decode(model_dir, pd_fallback="recompute")
    try:
        _run([tcp_prefill], [(tcp_prefill, [Request("p", PROMPT, _params(1))])])
        got = _run([decode, tcp_prefill], [(decode, [Request("d", PROMPT, _params(),
                                                             kv_transfer_params=_remote(tcp_prefill))])])
        (out,) = got["d"]  # an error even under recompute: the pair is misconfigured
        assert out.code == "backend_mismatch" and "--disaggregation-transfer-backend" in out.error
        _idle_and_clean(decode)
        _idle_and_clean(tcp_prefill)
    finally:
        decode.kv_connector.close()
        tcp_prefill.kv_connector.close()
    tcp_decode = _core(model_dir, disaggregation_mode="decode")  # a mooncake prefill engine still serves tcp
    ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
    colocated.flush_cache()
    _run([mc_prefill], [(mc_prefill, [Request("p", PROMPT, _params(1))])])
    got = _run([tcp_decode, mc_prefill], [(tcp_decode, [Request("d", PROMPT, _params(),
                                                                kv_transfer_params=_remote(mc_prefill))])])
    assert _tokens(got, "d") == _tokens(ref, "c")
    assert tcp_decode.kv_connector.stats()["num_transfers"] == 1
    assert mc_prefill.kv_connector.stats()["num_read_buffers"] == 0  # frames, no staging buffer
    _idle_and_clean(tcp_decode)
    _idle_and_clean(mc_prefill)
    tcp_decode.kv_connector.close()


@needs_mooncake
@pytest.mark.parametrize("fallback", ["recompute", "error"])
def test_a_failed_read_ends_in_the_fallback_and_leaks_nothing(model_dir, colocated, fallback, monkeypatch):
    """P's reply names a Mooncake session nobody serves: D's read fails, the request falls back (or
    errors), its pages are freed, and the receive buffer is let go after the quarantine."""
    monkeypatch.setattr(mooncake, "QUARANTINE_S", 0.2)
    decode = _mc_decode(model_dir, pd_fallback=fallback, disaggregation_timeout=20)
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
        colocated.flush_cache()
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port}
        decode.add_request(Request("d", PROMPT, _params(), kv_transfer_params=params))
        ident, kind, raw = fake.recv_multipart()
        head = wire.decode_header(raw)
        assert kind == wire.PULL and head["transfer"] == "mooncake" and head["hold_s"] > 20
        n = head["want"] - head["skip"]
        n -= n % decode.scheduler.pool.page_size
        info = {"session": f"127.0.0.1:{_free_port()}", "addr": 4096, "read_id": "x",
                "nbytes": mooncake.pack_nbytes(wire.pool_layout(decode.scheduler.pool), n)}
        fake.send_multipart([ident, wire.KV, wire.encode_header({"rid": "d", "start": head["skip"], "num_tokens": n,
                                                                 "layout": head["layout"], "mooncake": info})])
        got = _run([decode], [], limit_s=60)
        if fallback == "recompute":
            assert _tokens(got, "d") == _tokens(ref, "c")
            assert decode.kv_connector.stats()["num_fallbacks"] == 1
        else:
            (out,) = got["d"]
            assert out.code == "kv_transfer_failed" and "mooncake read" in out.error
        assert not fake.poll(200)  # a failed read releases nothing: P's hold ends it
        _idle_and_clean(decode)
        deadline = time.monotonic() + 10
        while decode.kv_connector.stats()["num_quarantined"]:
            assert time.monotonic() < deadline, "the receive buffer stayed quarantined"
            decode.kv_connector.poll(decode)
            time.sleep(0.05)
    finally:
        fake.close(0)
        decode.kv_connector.close()


@needs_mooncake
def test_a_read_past_the_deadline_falls_back_and_its_buffer_waits_for_the_read(model_dir, colocated, monkeypatch):
    """The read stalls (held on an event) past D's deadline: the request falls back at the deadline,
    its pages are freed, and the receive buffer stays quarantined until the read has returned."""
    import threading
    monkeypatch.setattr(mooncake, "QUARANTINE_S", 0.2)
    prefill = _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                    disaggregation_transfer_backend="mooncake", disaggregation_timeout=10)
    decode = _mc_decode(model_dir, disaggregation_timeout=1.0)
    gate = threading.Event()
    real_read = decode.kv_connector._timed_read

    def stalled_read(*args):
        gate.wait(30)
        return real_read(*args)

    monkeypatch.setattr(decode.kv_connector, "_timed_read", stalled_read)
    try:
        ref = _run([colocated], [(colocated, [Request("c", PROMPT, _params())])])
        colocated.flush_cache()
        _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
        got = _run([decode, prefill], [(decode, [Request("d", PROMPT, _params(),
                                                         kv_transfer_params=_remote(prefill))])])
        assert _tokens(got, "d") == _tokens(ref, "c")  # recomputed after the deadline
        st = decode.kv_connector.stats()
        assert st["num_fallbacks"] == 1 and st["num_transfers"] == 0 and st["num_quarantined"] == 1
        _idle_and_clean(decode)
        time.sleep(0.5)
        decode.kv_connector.poll(decode)
        assert decode.kv_connector.stats()["num_quarantined"] == 1  # the read has not returned
        gate.set()
        deadline = time.monotonic() + 20
        while decode.kv_connector.stats()["num_quarantined"]:
            assert time.monotonic() < deadline, "the receive buffer stayed quarantined"
            decode.kv_connector.poll(decode)
            time.sleep(0.05)
        _idle_and_clean(prefill)
    finally:
        gate.set()
        decode.kv_connector.close()
        prefill.kv_connector.close()


@needs_mooncake
def test_the_exposed_bytes_are_the_pool_slots_and_an_unreleased_buffer_expires(model_dir, mc_prefill):
    """A raw mooncake pull: the buffer P names holds exactly its pool's K/V of the matched slots (read
    here with a third transfer engine, compared with P's pool); nobody releases it, so it expires
    after hold_s and P holds no buffer."""
    prefill = mc_prefill
    prefill.flush_cache()
    _run([prefill], [(prefill, [Request("p", PROMPT, _params(1))])])
    layout = wire.pool_layout(prefill.scheduler.pool)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{prefill.kv_connector.port}")
    reader = mooncake.MooncakeEngine("127.0.0.1", 5)
    try:
        want = len(PROMPT) - 1
        sock.send_multipart([wire.PULL, wire.encode_header({"rid": "r", "token_ids": PROMPT, "skip": 0, "want": want,
                                                            "layout": layout, "transfer": "mooncake",
                                                            "hold_s": 1.0})])
        deadline = time.monotonic() + 20
        while not sock.poll(10):
            assert time.monotonic() < deadline, "no reply to the pull"
            prefill.step()
        kind, raw = sock.recv_multipart()
        head = wire.decode_header(raw)
        assert kind == wire.KV
        n, info = head["num_tokens"], head["mooncake"]
        assert n == want - want % prefill.scheduler.pool.page_size and info["nbytes"] == mooncake.pack_nbytes(layout, n)
        buf = torch.empty(info["nbytes"], dtype=torch.uint8)
        reader.register(buf)
        assert reader.read(info["session"], buf, info["addr"]) == 0
        reader.unregister(buf)
        k, v = mooncake.unpack(buf, layout, n)
        slots = prefill.scheduler.cache.match_prefix(PROMPT[:n], hit=False).slots
        pool = prefill.scheduler.pool
        assert torch.equal(k, pool.k_cache[:, slots]) and torch.equal(v, pool.v_cache[:, slots])
        assert prefill.kv_connector.stats()["num_read_buffers"] == 1
        expired = prefill.kv_connector.stats()["num_read_expired"]
        _until_buffers_freed(prefill)
        assert prefill.kv_connector.stats()["num_read_expired"] == expired + 1
        _idle_and_clean(prefill)
    finally:
        sock.close(0)


def test_pack_and_unpack_round_trip_a_quantised_layout():
    torch.manual_seed(0)
    L, n, H, D = 3, 5, 2, 3  # odd sizes: the scales start at an offset not a multiple of 4
    layout = {"num_layers": L, "num_kv_heads": H, "head_dim": D, "dtype": "int8", "quantized": True,
              "token_scales": True}
    parts = [torch.randint(-128, 128, (L, n, H, D), dtype=torch.int8) for _ in range(2)]
    parts += [torch.rand(L, n, H, dtype=torch.float32) for _ in range(2)]
    buf = mooncake.pack(parts)
    assert buf.numel() == mooncake.pack_nbytes(layout, n) == 2 * L * n * H * D + 2 * L * n * H * 4
    for got, want in zip(mooncake.unpack(buf, layout, n), parts):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="expected"):
        mooncake.unpack(buf[:-1], layout, n)
    # fp8: static per-head scales, not per token: the bytes alone
    fp8 = {**layout, "dtype": "float8_e4m3fn", "token_scales": False}
    parts = [torch.randint(0, 256, (L, n, H, D), dtype=torch.uint8).view(torch.float8_e4m3fn) for _ in range(2)]
    buf = mooncake.pack(parts)
    assert buf.numel() == mooncake.pack_nbytes(fp8, n) == 2 * L * n * H * D
    got = mooncake.unpack(buf, fp8, n)
    assert len(got) == 2
    for g, w in zip(got, parts):
        assert g.dtype == torch.float8_e4m3fn and torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_mooncake_without_the_package_is_refused_at_start_naming_pip(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install mooncake-transfer-engine-non-cuda"):
        _core(model_dir, disaggregation_mode="decode", disaggregation_transfer_backend="mooncake")
    with pytest.raises(ValueError, match="pip install mooncake-transfer-engine-non-cuda"):
        _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
              disaggregation_transfer_backend="mooncake")
