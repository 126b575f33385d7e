"""Layer-wise KV transfer (issue 18, item 2): the decode engine (D) pulls while the prefill engine (P)
still computes the prompt, and P sends each layer's KV of each chunk as soon as the layer has written
it. P and D run in one process on a tiny random model, stepped alternately, against a colocated
engine (C): deterministic inference is on, so D's tokens and logprobs must equal C's bitwise. Every
way the stream can end early (P aborts, P goes silent, no request under the id) must end D's request
(fallback or error) with no KV slot leaked on either side.
"""

from __future__ import annotations

import time

import pytest

from conftest import make_tiny_model
from idleless.disagg import wire
from idleless.engine.request import Request
from test_disagg import (PROMPT, PROMPT2, _core, _idle_and_clean, _params, _run, _tokens, assert_same_kv_bytes,
                         other_scales_file)

CHUNK = 24  # P's chunked prefill: PROMPT (57 tokens) is computed in 3 steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pdlw"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """C's tokens and logprobs for PROMPT and PROMPT2."""
    c = _core(model_dir)
    ref = _run([c], [(c, [Request("c1", PROMPT, _params()), Request("c2", PROMPT2, _params())])])
    return {"p1": _tokens(ref, "c1"), "p2": _tokens(ref, "c2")}


def _prefill(model_dir, **kw):
    return _core(model_dir, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                 chunked_prefill_size=CHUNK, **kw)


def _legs(prefill, tid: str, prompt, rid: str):
    """The two requests a router starts at once: P's (one token, timed under ``tid``) and D's
    (layer-wise pull from P under ``tid``)."""
    p = Request("P" + rid, prompt, _params(1), kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    d = Request(rid, prompt, _params(), kv_transfer_params={
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.port,
        "transfer_id": tid, "layerwise": True})
    return p, d


def _until(cond, step, what: str, limit_s: float = 20.0):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, what
        step()


def _streamed(prefill, rid: str) -> None:
    """Run P's between-step work until D's pull has reached it and P streams ``rid``."""
    _until(lambda: "P" + rid in prefill.kv_connector.streamer.streams,
           lambda: prefill.kv_connector.poll(prefill), "P never paired the pull with its request")


def test_layers_reach_decode_while_prefill_computes_and_tokens_equal_colocated(model_dir, reference):
    prefill, decode = _prefill(model_dir), _core(model_dir, disaggregation_mode="decode")
    p_req, d_req = _legs(prefill, "t1", PROMPT, "d1")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    _streamed(prefill, "d1")

    # Before P computes its last layer in a step, D's socket must already hold that step's earlier
    # layers: the KV travels while P still computes (the wait is bounded; nothing is timed).
    d_sock = decode.kv_connector.pending["d1"].sock
    seen: list[bool] = []
    last = prefill.runner.model.layers[-1]
    pre = last.register_forward_pre_hook(lambda m, a: seen.append(bool(d_sock.poll(10_000))))
    try:
        got = _run([prefill, decode], [])
    finally:
        pre.remove()
    assert len(seen) == -(-len(PROMPT) // CHUNK) and all(seen)
    assert _tokens(got, "d1") == reference["p1"]

    st, ps = decode.kv_connector.stats(), prefill.kv_connector.stats()
    layout = wire.pool_layout(decode.scheduler.pool)
    L = layout["num_layers"]
    per_token = 2 * L * layout["num_kv_heads"] * layout["head_dim"] * 4  # K and V, float32
    assert st["num_layerwise"] == 1 and st["num_transfers"] == 1 and st["num_fallbacks"] == 0
    assert st["num_tokens_received"] == len(PROMPT) - 1
    assert st["bytes_received"] == per_token * (len(PROMPT) - 1) == ps["bytes_sent"]
    assert st["num_layer_messages"] == L * len(seen) == ps["num_layer_messages"]  # one per layer per chunk
    assert got["d1"][-1].cached_tokens == len(PROMPT) - 1  # the streamed prefix is a cache hit at admission
    assert ps["num_streams"] == 1 and ps["num_in_flight"] == 0  # streamed: nothing reserved for a later pull
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


def test_only_the_suffix_travels_and_what_prefill_held_goes_first(model_dir, reference):
    """D holds PROMPT2's first 20 tokens, P its first 40 (its own cache hit: never computed in a step):
    P sends [20, 40) in one message of all layers, then the rest layer by layer; D gets 20 .. end."""
    prefill, decode = _prefill(model_dir), _core(model_dir, disaggregation_mode="decode")
    _run([decode], [(decode, [Request("warm", PROMPT2[:20], _params(1))])])
    _run([prefill], [(prefill, [Request("pwarm", PROMPT[:40], _params(1))])])
    p_req, d_req = _legs(prefill, "t2", PROMPT2, "d2")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    _streamed(prefill, "d2")
    got = _run([prefill, decode], [])
    assert _tokens(got, "d2") == reference["p2"]
    st = decode.kv_connector.stats()
    assert st["num_skipped_tokens"] == 20 and st["num_tokens_received"] == len(PROMPT2) - 1 - 20
    assert st["num_transfers"] == 1 and st["num_fallbacks"] == 0
    L = wire.pool_layout(decode.scheduler.pool)["num_layers"]
    chunks = -(-(len(PROMPT2) - 40) // CHUNK)
    assert st["num_layer_messages"] == 1 + L * chunks
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


@pytest.mark.parametrize("fallback", ["recompute", "error"])
def test_prefill_gone_silent_mid_prefill_ends_the_request_and_frees_the_slots(model_dir, reference, fallback):
    """P sends the first chunk's layers, then never steps again (as when its process dies): D's
    request ends at D's timeout, by the fallback or with an error, and D's slots are free."""
    prefill = _prefill(model_dir)
    decode = _core(model_dir, disaggregation_mode="decode", disaggregation_timeout=1.0, pd_fallback=fallback)
    p_req, d_req = _legs(prefill, "t3", PROMPT, "d3")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    _streamed(prefill, "d3")
    prefill.step()  # the first chunk, layer by layer
    _until(lambda: decode.kv_connector.stats()["num_layer_messages"] > 0, decode.step, "no layer reached D")
    got = _run([decode], [])  # P is not stepped any more
    if fallback == "recompute":
        assert _tokens(got, "d3") == reference["p1"]
        assert decode.kv_connector.stats()["num_fallbacks"] == 1
    else:
        (out,) = got["d3"]
        assert out.finished and out.code == "kv_transfer_timeout"
    _idle_and_clean(decode)
    decode.kv_connector.close()
    assert prefill.abort("Pd3")
    _run([prefill], [])
    _idle_and_clean(prefill)
    prefill.kv_connector.close()


def test_prefill_aborting_mid_stream_is_an_error_reply_and_decode_recomputes(model_dir, reference):
    prefill, decode = _prefill(model_dir), _core(model_dir, disaggregation_mode="decode")
    p_req, d_req = _legs(prefill, "t4", PROMPT, "d4")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    _streamed(prefill, "d4")
    prefill.step()
    assert prefill.abort("Pd4")
    got = _run([prefill, decode], [])  # D's timeout (30 s) is not what ends it: P's ERR is
    assert _tokens(got, "d4") == reference["p1"]
    st = decode.kv_connector.stats()
    assert st["num_fallbacks"] == 1 and st["num_transfers"] == 0
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


def test_a_pull_before_its_request_waits_for_it_and_one_whose_request_never_comes_is_refused(
        model_dir, reference):
    prefill = _prefill(model_dir, disaggregation_timeout=0.5)
    decode = _core(model_dir, disaggregation_mode="decode")
    p_req, d_req = _legs(prefill, "t5", PROMPT, "d5")
    decode.add_request(d_req)  # D's pull first: P parks it until the request comes
    _until(lambda: prefill.kv_connector.stats()["num_parked"] == 1,
           lambda: prefill.kv_connector.poll(prefill), "the pull was not parked")
    prefill.add_request(p_req)
    assert "Pd5" in prefill.kv_connector.streamer.streams
    got = _run([prefill, decode], [])
    assert _tokens(got, "d5") == reference["p1"]
    assert decode.kv_connector.stats()["num_transfers"] == 1

    assert decode.flush_cache()  # D pulls PROMPT again
    _, orphan = _legs(prefill, "t-never", PROMPT, "d6")  # P never gets this transfer_id
    got = _run([prefill, decode], [(decode, [orphan])])
    assert _tokens(got, "d6") == reference["p1"]  # P's ERR after its 0.5 s, not D's 30 s: recomputed
    assert decode.kv_connector.stats()["num_fallbacks"] == 1
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


def test_a_pull_after_prefill_finished_gets_the_whole_prompt_in_one_message(model_dir, reference):
    prefill, decode = _prefill(model_dir), _core(model_dir, disaggregation_mode="decode")
    p_req, d_req = _legs(prefill, "t7", PROMPT, "d7")
    _run([prefill], [(prefill, [p_req])])
    got = _run([prefill, decode], [(decode, [d_req])])
    assert _tokens(got, "d7") == reference["p1"]
    st = decode.kv_connector.stats()
    assert st["num_layer_messages"] == 0 and st["num_transfers"] == 1
    assert st["num_tokens_received"] == len(PROMPT) - 1
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


def test_a_pull_arriving_mid_step_gets_the_layers_written_so_far_then_the_rest_one_by_one(tmp_path):
    """The prompt is one step (one chunk) and the pull reaches P during it, after P's layer 1: P
    joins the stream there, sending layers 0-1 in one message and layers 2 and 3 as they finish."""
    deep = make_tiny_model(tmp_path, num_hidden_layers=4)
    c = _core(deep)
    ref = _tokens(_run([c], [(c, [Request("c", PROMPT, _params())])]), "c")
    prefill = _core(deep, disaggregation_mode="prefill", disaggregation_bootstrap_port=0)
    decode = _core(deep, disaggregation_mode="decode")
    p_req, d_req = _legs(prefill, "t8", PROMPT, "d8")
    prefill.add_request(p_req)
    inbox = prefill.kv_connector._layerwise_in

    def pull_has_arrived(module, args):  # D's request (and pull) come while P's layer 1 is next
        decode.add_request(d_req)
        deadline = time.monotonic() + 10
        while inbox.empty():
            assert time.monotonic() < deadline, "the pull did not reach P"
            time.sleep(0.001)
    pre = prefill.runner.model.layers[1].register_forward_pre_hook(pull_has_arrived)
    try:
        prefill.step()  # the whole prompt: the pull joins after layer 1
    finally:
        pre.remove()
    got = _run([prefill, decode], [])
    assert _tokens(got, "d8") == ref
    st = decode.kv_connector.stats()
    assert st["num_layer_messages"] == 3 and st["num_transfers"] == 1 and st["num_fallbacks"] == 0
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantised_kv_streams_layer_by_layer(model_dir, kv):
    """int8 sends each layer's per-token scales with its K/V; fp8 (static per-head scales, the same in
    both engines) its bytes alone. D's tokens equal a colocated engine's of the same format, and D's
    cached bytes are P's."""
    q = {"kv_cache_dtype": kv, "skip_quantization_gate": True}  # the gate is tested elsewhere
    c = _core(model_dir, **q)
    ref = _tokens(_run([c], [(c, [Request("c", PROMPT, _params())])]), "c")
    prefill = _prefill(model_dir, **q)
    decode = _core(model_dir, disaggregation_mode="decode", **q)
    p_req, d_req = _legs(prefill, "t9", PROMPT, "d9")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    _streamed(prefill, "d9")
    got = _run([prefill, decode], [])
    assert _tokens(got, "d9") == ref
    st = decode.kv_connector.stats()
    assert st["num_transfers"] == 1 and st["num_fallbacks"] == 0 and st["num_layer_messages"] > 0
    pool = decode.scheduler.pool
    L, _, H, D = pool.k_cache.shape
    per_token = 2 * L * H * D + (2 * L * H * 4 if kv == "int8" else 0)  # one byte per element (+ int8's scales)
    assert st["bytes_received"] == per_token * (len(PROMPT) - 1)
    assert_same_kv_bytes(decode, prefill, PROMPT[:-1])
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


def test_fp8_scales_mismatch_refuses_the_layerwise_pull(model_dir, tmp_path):
    """D's fp8 scales differ from P's: the layer-wise pull is refused before any layer travels (an error
    whatever the fallback), the message names the scale, and D's slots are free again."""
    q = {"kv_cache_dtype": "fp8_e4m3", "skip_quantization_gate": True}
    prefill = _prefill(model_dir, **q)
    decode = _core(model_dir, disaggregation_mode="decode", pd_fallback="recompute",
                   quantization_param_path=other_scales_file(prefill, tmp_path / "kv.json", layer=0, head=0), **q)
    p_req, d_req = _legs(prefill, "t11", PROMPT, "d11")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    got = _run([prefill, decode], [])
    (out,) = got["d11"]
    assert out.finished and out.code == "layout_mismatch" and "layer 0 V head 0" in out.error
    st = decode.kv_connector.stats()
    assert st["num_layer_messages"] == 0 and st["num_errors"] == 1 and st["num_fallbacks"] == 0
    assert prefill.kv_connector.stats()["num_streams"] == 0
    _idle_and_clean(decode)
    _idle_and_clean(prefill)
    decode.kv_connector.close()
    prefill.kv_connector.close()


def test_a_closed_prefill_connection_ends_the_pull_at_once(model_dir):
    """P's transfer port closes mid-stream (its process died): D's pull fails on the closed
    connection, not at its 30 s timeout, and D's slots are free."""
    prefill = _prefill(model_dir)
    decode = _core(model_dir, disaggregation_mode="decode", pd_fallback="error")
    p_req, d_req = _legs(prefill, "t10", PROMPT, "d10")
    prefill.add_request(p_req)
    decode.add_request(d_req)
    _streamed(prefill, "d10")
    prefill.step()  # the first chunk, layer by layer
    _until(lambda: decode.kv_connector.stats()["num_layer_messages"] > 0, decode.step, "no layer reached D")
    prefill.kv_connector.close()  # P is not stepped again
    got = _run([decode], [], limit_s=20)  # D's timeout is 30 s: only the closed connection ends it in time
    (out,) = got["d10"]
    assert out.finished and out.code == "kv_transfer_failed" and "closed" in out.error
    _idle_and_clean(decode)
    decode.kv_connector.close()
