"""Deterministic inference (``enable_deterministic_inference``): a position's logits are a function of
the token ids before it and the weights only, bitwise, whatever shares the step.

Kernels: ``bi_linear`` and ``chunk_attn`` (and their PyTorch twins without the C kernels) against a
float64 reference, and a row's bits alone vs. inside any batch / split between calls. Engine: one greedy
request with logprobs on a tiny random Llama in bfloat16 gives the same token ids and logprobs alone,
again from the prefix cache, beside 15 requests of mixed lengths (some sharing its prefix, so shared
segments form), as one of n=3, after eviction and retraction on a tiny pool, with chunked prefill of 64 /
512 / off and page sizes 1 / 16, with and without the C kernels.
"""

from __future__ import annotations

import pytest
import torch

from idleless.cache.kv_pool import KVPool
from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.request import Request, SamplingParams
from idleless.model import cpu_kernels
from idleless.model.attention import CompositeAttention
from idleless.model.attention.composite import align_segments
from idleless.model.attention.invariant import CHUNK, ChunkedAttention, TorchChunkedAttention
from idleless.model.linear import InvariantLinearMethod, Linear, TiledLinearMethod

from conftest import TEST_THREADS, make_tiny_model
from kv_invariants import check_ownership

DTYPES = (torch.float32, torch.bfloat16)


def _kernels(dtype):
    k = cpu_kernels.load(dtype)
    if k is None:
        pytest.skip("no C compiler: the fused kernels are off")
    return k


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------
def _linear(method, n, k, dtype, bias, seed=0):
    lin = Linear(k, n, bias=bias, method=method)
    g = _gen(seed)
    lin.weight.data = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    if bias:
        lin.bias.data = torch.randn(n, generator=g).to(dtype)
    method.process_after_load(lin)
    return lin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["kernel", "tiled"])
@pytest.mark.parametrize("n,k,bias", [(576, 64, False), (37, 100, True), (200, 48, True)])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype, kind, n, k, bias):
    method = InvariantLinearMethod(_kernels(dtype)) if kind == "kernel" else TiledLinearMethod()
    lin = _linear(method, n, k, dtype, bias)
    x = torch.randn(300, k, generator=_gen(1)).to(dtype)
    full = lin(x)
    ref = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
    assert (full.double() - ref).abs().max().item() < tol
    for m in (1, 2, 3, 4, 5, 7, 11, 16, 17, 64, 65, 299):
        part = lin(x[:m])
        assert torch.equal(part, full[:m]), f"rows of a {m}-row batch differ from the 300-row batch"
    perm = torch.randperm(300, generator=_gen(2))
    assert torch.equal(lin(x[perm]), full[perm])  # other neighbours, other positions


def test_invariant_linear_is_one_fma_chain_per_element():
    """The kernel's contract, checked by hand: y = fma chain over k in order, rounded once."""
    kern = _kernels(torch.float32)
    lin = _linear(InvariantLinearMethod(kern), 20, 33, torch.float32, bias=True)
    x = torch.randn(3, 33, generator=_gen(3))
    y = lin(x)
    w, b = lin.weight.double(), lin.bias.double()
    import numpy as np
    for r in range(3):
        for c in range(20):
            acc = np.float32(0)
            for kk in range(33):  # fma: exact product and sum, rounded once, in float64 then to float32
                acc = np.float32(np.float64(x[r, kk].item()) * w[c, kk].item() + np.float64(acc))
            assert y[r, c].item() == np.float32(np.float64(acc) + b[c].item())


def test_a_weight_update_repacks_in_place_and_matches_a_fresh_load():
    """process_after_load again (what a weight update runs) writes the new panels into the packed copy
    it already has, bit-equal to packing the new weight from scratch; a changed shape gets a new tensor."""
    kern = _kernels(torch.float32)
    method = InvariantLinearMethod(kern)
    lin = _linear(method, 37, 100, torch.float32, bias=True)
    before = lin.bi
    lin.weight.data.copy_(torch.randn(37, 100, generator=_gen(5)))
    method.process_after_load(lin)
    assert lin.bi.data_ptr() == before.data_ptr()  # the same memory, re-packed
    fresh = _linear(InvariantLinearMethod(kern), 37, 100, torch.float32, bias=True)
    fresh.weight.data.copy_(lin.weight.data)
    fresh.bias.data.copy_(lin.bias.data)
    fresh.bi = None
    method.process_after_load(fresh)
    assert torch.equal(lin.bi, fresh.bi)
    x = torch.randn(5, 100, generator=_gen(6))
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    assert (lin(x).double() - ref).abs().max().item() < 1e-4  # the forward follows the new weight
    lin.bi = torch.empty(3, 100, 16)  # not this weight's shape: packed into a new tensor
    method.process_after_load(lin)
    assert torch.equal(lin.bi, fresh.bi)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
def _ref_attention(q, K, V, limits, scale):
    """float64 softmax attention: row r sees K[:limits[r]]. q [R, H, D], K/V [L, Hkv, D]."""
    H, Hkv = q.shape[1], K.shape[1]
    K = K.double().repeat_interleave(H // Hkv, 1)
    V = V.double().repeat_interleave(H // Hkv, 1)
    s = torch.einsum("rhd,khd->rhk", q.double(), K) * scale
    mask = torch.arange(K.shape[0])[None, :] < torch.as_tensor(limits)[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rhk,khd->rhd", s.softmax(-1), V)


def _backend(kind, dtype, H, D):
    return ChunkedAttention(_kernels(dtype), H, D) if kind == "kernel" else TorchChunkedAttention(H, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_chunked_attention_matches_float64_and_splits_fold_alike(dtype, kind):
    H, Hkv, D, S, L = 6, 2, 32, 600, 200
    g = _gen(4)
    kc, vc = torch.randn(S, Hkv, D, generator=g).to(dtype), torch.randn(S, Hkv, D, generator=g).to(dtype)
    slots = torch.randperm(S, generator=g)[:L]
    q = torch.randn(L, H, D, generator=g).to(dtype)
    be = _backend(kind, dtype, H, D)
    from idleless.model.attention.base import AttnWork, Tails
    full = be.forward(q, kc, vc, 0, be.prepare(AttnWork(Tails([0], [L], [0], [slots]))), None, None)
    ref = _ref_attention(q, kc[slots], vc[slots], torch.arange(1, L + 1), D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (full.double() - ref).abs().max().item() < tol
    # row 150 alone, as a decode row (149 earlier keys), equals its row of the causal prefill
    one = be.forward(q[150:151], kc, vc, 0, be.prepare(AttnWork(Tails([0], [1], [150], [slots[:151]]))), None, None)
    assert torch.equal(one[0], full[150])
    # the same row with its first 128 keys as a shared segment (rows 0 and 1 of a 2-row batch)
    qq = torch.stack([q[150], q[150]])
    work = AttnWork(Tails([0, 1], [1, 1], [22, 22], [slots[128:151], slots[128:151]]),
                    [(torch.tensor([0, 1]), slots[:128])])
    two = be.forward(qq, kc, vc, 0, be.prepare(work), None, None)
    assert torch.equal(two[0], full[150]) and torch.equal(two[1], full[150])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 32), (6, 6, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunk_attn_layer_is_the_per_call_sequence_bitwise(dtype, H, Hkv, D, threads):
    """One ``chunk_attn_layer`` call (the decode graph's and ``ChunkedAttention.forward``'s) gives the bits of
    ``chunk_attn`` called per call through a state filled with (-inf, 0, 0): a 13-row shared segment, then
    two groups in one call, then the tails (decode rows, one 5-token causal extend whose rows pair up in the
    two-row tiles with different limits, and a row no segment holds), and stays within float64's reach."""
    kern = _kernels(dtype)
    g = _gen(9)
    S, T = 1200, 19
    kc, vc = torch.randn(S, Hkv, D, generator=g).to(dtype), torch.randn(S, Hkv, D, generator=g).to(dtype)
    perm = torch.randperm(S, generator=g)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)
    shared, grp_a, grp_b = perm[:192], perm[192:320], perm[320:384]
    seg0 = (i64([0, 192]), shared.clone(), i64([0, 13]), torch.arange(13), None)
    seg1 = (i64([0, 128, 192]), torch.cat([grp_a, grp_b]), i64([0, 6, 13]), i64([0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11, 12]),
            None)
    # tails: rows 0..12 decode (own keys after their segments), rows 13..17 one extend, row 18 alone
    tails, rows, limits, key_off = [], [], [], [0]
    own = perm[384:]
    at = 0
    for r in range(13):
        n = 3 + 7 * r
        tails.append(own[at:at + n]); at += n
        rows.append([r]); limits.append([n])
    ext = own[at:at + 70]; at += 70
    tails.append(ext); rows.append(list(range(13, 18))); limits.append([66, 67, 68, 69, 70])
    tails.append(own[at:at + 100]); rows.append([18]); limits.append([100])
    for t in tails:
        key_off.append(key_off[-1] + t.numel())
    tail = (i64(key_off), torch.cat(tails), i64([0] + list(torch.tensor([len(r) for r in rows]).cumsum(0))),
            i64(sum(rows, [])), i64(sum(limits, [])))
    calls = [seg0, seg1, tail]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        state = (torch.full((T, H), float("-inf")), torch.zeros(T, H), torch.zeros(T, H, D))
        want = torch.empty(T, H, D, dtype=dtype)
        for i, (ko, sl, ro, r, lim) in enumerate(calls):
            last = i == len(calls) - 1
            kern.chunk_attn(q, kc, vc, ko, sl, ro, r, lim, D ** -0.5, want if last else None, state, not last)
        got = torch.full((T, H, D), 7.0, dtype=dtype)
        kern.chunk_attn_layer(q, kc, vc, calls, D ** -0.5, got)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    # against float64: each row's whole key list (its segments, then its tail)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    seg_of = {r: [shared] for r in range(13)}
    for r in range(13):
        seg_of[r].append(grp_a if r in (0, 2, 4, 6, 8, 10) else grp_b)
    for item, (rs, lims) in enumerate(zip(rows, limits)):
        for r, lim in zip(rs, lims):
            keys = torch.cat(seg_of.get(r, []) + [tails[item][:lim]])
            ref = _ref_attention(q[r:r + 1], kc[keys], vc[keys], [keys.numel()], D ** -0.5)
            assert (got[r:r + 1].double() - ref).abs().max().item() < tol


def test_align_segments_keeps_each_request_tiled():
    segs = [([0, 1, 2], 0, 150), ([0, 1], 150, 260)]
    shared = [260, 260, 150, 0]
    out, sh = align_segments(segs, shared, 64)
    assert out == [([0, 1, 2], 0, 128), ([0, 1], 128, 256)]
    assert sh == [256, 256, 128, 0]
    assert align_segments([([0, 1], 0, 40)], [40, 40], 64) == ([], [0, 0])


@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_composite_rows_are_batch_invariant_with_shared_segments(kind):
    """A request's attention output through the deterministic composite: alone == beside requests
    that share 150 of its prefix (a segment forms, aligned to 128) and beside unrelated ones."""
    dtype, H, Hkv, D = torch.bfloat16, 4, 2, 16
    pool = KVPool(1, Hkv, D, 2048, dtype, "cpu", 1)
    kern = _kernels(dtype) if kind == "kernel" else None
    comp = CompositeAttention(pool, H, Hkv, D, None, kern, deterministic=True)
    g = _gen(5)
    pool.k_cache[0].copy_(torch.randn(2048, Hkv, D, generator=g).to(dtype))
    pool.v_cache[0].copy_(torch.randn(2048, Hkv, D, generator=g).to(dtype))
    own = torch.arange(0, 200)  # the request: 199 cached tokens + 1 new
    q_own = torch.randn(1, H, D, generator=g).to(dtype)

    def run(reqs):  # reqs: (slot_table, prefix_len, q rows)
        meta = comp.prepare([t.numel() - p for t, p, _ in reqs], [p for _, p, _ in reqs], [t for t, _, _ in reqs])
        q = torch.cat([x for _, _, x in reqs])
        loc = torch.cat([t[p:] for t, p, _ in reqs])
        kv_k, kv_v = pool.k_cache[0][loc].clone(), pool.v_cache[0][loc].clone()  # rewrite what is there
        return comp.forward(q, kv_k, kv_v, 0, meta, loc), meta

    alone, _ = run([(own, 199, q_own)])
    sharer = torch.cat([own[:150], torch.arange(1000, 1030)])
    other = torch.arange(1500, 1570)
    batch, meta = run([(sharer, 179, torch.randn(1, H, D, generator=g).to(dtype)), (own, 199, q_own),
                       (other, 60, torch.randn(10, H, D, generator=g).to(dtype))])
    assert any(p.segments for _, p in meta.parts), "a shared segment should form"
    assert torch.equal(batch[1], alone[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graph_calls_chunk_attn_by_address_with_merged_segments(det_model, dtype):
    """Four decode rows: all share 64 tokens, rows 0-1 and rows 2-3 share 130 each (after alignment, a
    64-key segment for all four, then two disjoint 64-key segments that ``prepare`` merges into one call).
    The decode graph (chunk_attn called by address, the softmax state in its own buffers) gives the
    module path's hidden states bitwise, and each row's hidden state equals that row decoded alone."""
    from idleless.model.runner import ForwardBatch, ModelRunner

    if cpu_kernels.load(getattr(torch, dtype)) is None:
        pytest.skip("no C compiler: the fused kernels are off")
    runner = ModelRunner(EngineConfig(model=det_model, dtype=dtype, kv_cache_memory=str(2048 * TINY_BYTES),
                                      num_threads=TEST_THREADS, enable_deterministic_inference=True))
    pool, graph = runner.pool, runner.decode_graph
    assert graph is not None
    common = pool.alloc(0, 0, 64)
    groups = [torch.cat([common, pool.alloc(0, 0, 66)]) for _ in range(2)]
    tables = [torch.cat([groups[i // 2], pool.alloc(0, 0, 3 + i)]) for i in range(4)]
    ids = lambda n, seed: torch.tensor(_ids(n, seed))
    prefill = [t[:-1] for t in tables]  # every prompt but its last token, one extend each
    for i, t in enumerate(prefill):
        runner.model.hidden_states(ids(t.numel(), 40 + i), torch.arange(t.numel()), runner.backend,
                                   runner.backend.prepare([t.numel()], [0], [t]), t, torch.tensor([0]))
    last = torch.stack([t[-1] for t in tables])
    pos = torch.tensor([t.numel() - 1 for t in tables])
    tok = ids(4, 50)

    def decode(rows):
        b = ForwardBatch(tok[rows], pos[rows], last[rows], [1] * len(rows), pos[rows].tolist(),
                         [tables[r] for r in rows], torch.arange(len(rows)))
        return b, runner.backend.prepare(b.extend_lens, b.prefix_lens, b.slot_tables)

    b, meta = decode([0, 1, 2, 3])
    (part, plan), = meta.parts
    assert meta.alone and [int(c.key_offsets.numel()) - 1 for c in plan.segments] == [1, 2]
    module_calls = []
    runner.backend.forward = lambda *a: module_calls.append(a) or type(runner.backend).forward(runner.backend, *a)
    got = graph.hidden_states(b.input_ids, b.positions, meta, b.out_cache_loc, b.sample_rows)
    del runner.backend.forward
    assert not module_calls, "the graph should call chunk_attn itself"
    want = runner.model.hidden_states(b.input_ids, b.positions, runner.backend, meta, b.out_cache_loc,
                                      b.sample_rows)
    assert torch.equal(got, want)
    for r in range(4):
        b1, m1 = decode([r])
        assert torch.equal(graph.hidden_states(b1.input_ids, b1.positions, m1, b1.out_cache_loc, b1.sample_rows)[0],
                           got[r])


# ---------------------------------------------------------------------------------------------
# the engine: one request's tokens and logprobs under every batch, cache and chunking condition
# ---------------------------------------------------------------------------------------------
VOCAB = 256
TINY_BYTES = KVPool.bytes_per_token(2, 2, 16, torch.bfloat16)


@pytest.fixture(scope="module")
def det_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("det"), max_position_embeddings=1024)


def _ids(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=_gen(seed)).tolist()


PROMPT = _ids(150, 7)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logprobs=True)


def _core(model, kernels: bool, slots: int = 4096, **kw) -> EngineCore:
    cfg = dict(model=model, dtype="bfloat16", kv_cache_memory=str(slots * TINY_BYTES), num_threads=TEST_THREADS,
               enable_deterministic_inference=True, disable_cpu_kernels=not kernels)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def _drive(core: EngineCore, reqs: list[Request]) -> dict[str, tuple[list[int], list[float]]]:
    for r in reqs:
        core.add_request(r)
    out: dict[str, tuple[list[int], list[float]]] = {r.rid: ([], []) for r in reqs}
    steps = 0
    while core.has_work():
        steps += 1
        assert steps < 5000
        for o in core.step():
            out[o.rid][0].extend(o.new_token_ids)
            out[o.rid][1].extend(o.new_logprobs or [])
        check_ownership(core.scheduler)
    return out


def _others(n=15, seed=100):
    """Mixed traffic: some share 130 or 70 of PROMPT's tokens (shared segments), some unrelated;
    lengths 5 .. 300."""
    reqs = []
    for i in range(n):
        if i % 3 == 0:
            ids = PROMPT[:130] + _ids(5 + 7 * i, seed + i)
        elif i % 3 == 1:
            ids = PROMPT[:70] + _ids(20 * i, seed + i)
        else:
            ids = _ids(5 + 20 * i, seed + i)
        reqs.append(Request(f"o{i}", ids, SamplingParams(temperature=0.8, seed=i, max_new_tokens=5 + i)))
    return reqs


@pytest.fixture(scope="module", params=["kernel", "torch"])
def reference(request, det_model):
    """(kernels?, PROMPT's greedy ids and logprobs alone on a fresh engine)."""
    kernels = request.param == "kernel"
    if kernels and cpu_kernels.load(torch.bfloat16) is None:
        pytest.skip("no C compiler: the fused kernels are off")
    core = _core(det_model, kernels)
    ref = _drive(core, [Request("p", PROMPT, GREEDY)])["p"]
    assert len(ref[0]) == 24 and len(ref[1]) == 24
    return kernels, ref


def test_alone_again_from_the_prefix_cache_and_beside_others(det_model, reference):
    kernels, ref = reference
    core = _core(det_model, kernels)
    assert _drive(core, [Request("p", PROMPT, GREEDY)])["p"] == ref
    assert _drive(core, [Request("p2", PROMPT, GREEDY)])["p2"] == ref  # its whole prompt is cached now
    others = _others()
    out = _drive(core, others[:7] + [Request("p3", PROMPT, GREEDY)] + others[7:])
    assert out["p3"] == ref
    core.flush_cache()
    out = _drive(core, _others(seed=300)[:4] + [Request("p4", PROMPT + ref[0][:5], GREEDY)])
    # the same request continued: its first 5 generated tokens fed back are a prompt; the next ones agree
    assert out["p4"][0][:19] == ref[0][5:]
    assert out["p4"][1][:19] == ref[1][5:]


def test_n3_copies_each_give_the_solo_answer(det_model, reference):
    kernels, ref = reference
    core = _core(det_model, kernels)
    out = _drive(core, [Request(f"c{i}", PROMPT, GREEDY) for i in range(3)])
    assert all(v == ref for v in out.values())


@pytest.mark.parametrize("chunk,page", [(64, 1), (512, 16), (0, 1), (64, 16)])
def test_chunked_prefill_and_page_size_change_nothing(det_model, reference, chunk, page):
    kernels, ref = reference
    core = _core(det_model, kernels, chunked_prefill_size=chunk, page_size=page)
    out = _drive(core, _others()[:5] + [Request("p", PROMPT, GREEDY)])
    assert out["p"] == ref


def test_eviction_and_retraction_on_a_tiny_pool_change_nothing(det_model, reference):
    kernels, ref = reference
    core = _core(det_model, kernels, slots=700)
    out = _drive(core, [Request("p", PROMPT, GREEDY)] + _others(seed=500))
    assert out["p"] == ref
    out = _drive(core, _others(seed=700) + [Request("p2", PROMPT, GREEDY)])
    assert out["p2"] == ref
    assert core.scheduler.stats.num_retractions > 0, "the pool should have been too small for the batch"


# ---- helper H3 (issue 11 on AVX-512 BF16): head_dim 64, where the bfloat16 chunk_attn takes VDPBF16PS ----
@pytest.fixture(scope="module")
def det_model_d64(tmp_path_factory) -> str:
    """SmolLM2's head shape (head_dim 64, 3 query heads per KV head) in a tiny model: on an AVX-512 BF16 CPU
    the bfloat16 kernels sum q.k and every linear as VDPBF16PS pair chains (the other tests' head_dim 16
    keeps chunk_attn on its fmaf chains)."""
    return make_tiny_model(tmp_path_factory.mktemp("det64"), max_position_embeddings=1024, hidden_size=96,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=64, intermediate_size=160)


def test_head_dim_64_alone_beside_others_and_chunked_change_nothing(det_model_d64):
    """One greedy request with logprobs on the head_dim-64 model gives the same tokens and logprob bits alone,
    again from the prefix cache, beside 15 mixed requests (shared segments), as one of n=3, and with
    chunked prefill of 64 and page size 16."""
    if cpu_kernels.load(torch.bfloat16) is None:
        pytest.skip("no C compiler: the fused kernels are off")
    slots = 4096 * KVPool.bytes_per_token(2, 2, 64, torch.bfloat16) // TINY_BYTES
    ref = _drive(_core(det_model_d64, True, slots=slots), [Request("p", PROMPT, GREEDY)])["p"]
    assert len(ref[0]) == 24
    core = _core(det_model_d64, True, slots=slots)
    assert _drive(core, [Request("p", PROMPT, GREEDY)])["p"] == ref
    assert _drive(core, [Request("p2", PROMPT, GREEDY)])["p2"] == ref
    others = _others()
    out = _drive(core, others[:7] + [Request("p3", PROMPT, GREEDY)] + others[7:])
    assert out["p3"] == ref
    out = _drive(core, [Request(f"c{i}", PROMPT, GREEDY) for i in range(3)])
    assert all(v == ref for v in out.values())
    core = _core(det_model_d64, True, slots=slots, chunked_prefill_size=64, page_size=16)
    assert _drive(core, _others()[:5] + [Request("p", PROMPT, GREEDY)])["p"] == ref


# ---- the default (issue 11: invariant by default in bfloat16) ----
def test_the_default_resolves_on_in_half_precision_and_off_in_float32(caplog):
    """``enable_deterministic_inference`` None (the default) is on in bfloat16, off in float32 and float16, and
    off with a log line for a sliding-window model and for fp8 weights with bf16 activations (int8 ones too
    where the kernels lack q8p_linear); an explicit True / False wins."""
    from idleless.model.runner import resolve_deterministic

    assert resolve_deterministic(None, torch.bfloat16, None) and not resolve_deterministic(None, torch.float16, None)
    assert not resolve_deterministic(None, torch.float32, None)
    assert resolve_deterministic(True, torch.float32, None) and not resolve_deterministic(False, torch.bfloat16, None)
    with caplog.at_level("INFO", logger="idleless.model.runner"):
        assert not resolve_deterministic(None, torch.bfloat16, 4096)
    assert "sliding-window" in caplog.text
    assert resolve_deterministic(True, torch.bfloat16, 4096)  # the attention backend then refuses it
    # fp8 weights with bf16 activations, and int8 ones without q8p_linear: off by default (no invariant
    # prefill kernel), on when asked; int8 with q8p_linear (the same kernel in both modes): on
    for w in ("int8", "fp8"):
        assert not resolve_deterministic(None, torch.bfloat16, None, w, "bf16")
        assert resolve_deterministic(True, torch.bfloat16, None, w, "bf16")
    assert resolve_deterministic(None, torch.bfloat16, None, "int8", "bf16", has_q8p=True)
    assert not resolve_deterministic(None, torch.bfloat16, None, "fp8", "bf16", has_q8p=True)
    assert not resolve_deterministic(False, torch.bfloat16, None, "int8", "bf16", has_q8p=True)
    for w, a in (("int4", "bf16"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int8")):
        assert resolve_deterministic(None, torch.bfloat16, None, w, a)


def test_cli_default_enable_and_disable_flags():
    """No flag leaves the choice to the dtype (None); SGLang's --enable-deterministic-inference sets True,
    --disable-deterministic-inference False; the last one given wins."""
    import argparse

    from idleless.config import add_cli_args, config_from_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    det = lambda *a: config_from_args(parser.parse_args(list(a))).enable_deterministic_inference  # noqa: E731
    assert det() is None
    assert det("--enable-deterministic-inference") is True
    assert det("--disable-deterministic-inference") is False
    assert det("--disable-deterministic-inference", "--enable-deterministic-inference") is True


def test_default_bf16_engine_gives_the_deterministic_answer_beside_others(det_model, reference):
    """With no flag, a bfloat16 engine runs the batch-invariant kernels: the probe's greedy ids and logprob
    bits beside 15 mixed requests (and from the cache) equal the explicitly deterministic engine's answer
    alone; --disable-deterministic-inference leaves them to the default kernels."""
    kernels, ref = reference
    core = _core(det_model, kernels, enable_deterministic_inference=None)
    assert core.runner.deterministic
    others = _others()
    assert _drive(core, others[:9] + [Request("p", PROMPT, GREEDY)] + others[9:])["p"] == ref
    assert _drive(core, [Request("p2", PROMPT, GREEDY)])["p2"] == ref
    assert not _core(det_model, kernels, enable_deterministic_inference=False).runner.deterministic
    assert not _core(det_model, kernels, dtype="float32", enable_deterministic_inference=None).runner.deterministic


def test_a_sliding_window_model_loads_by_default_and_is_refused_when_asked(tmp_path):
    """A Mistral-style model (sliding window) in bfloat16 loads with the default kernels (no batch-invariant
    attention for a window yet), and an explicit --enable-deterministic-inference is a clear error."""
    path = make_tiny_model(tmp_path, arch="mistral", sliding_window=8)
    core = _core(path, cpu_kernels.load(torch.bfloat16) is not None, enable_deterministic_inference=None)
    assert not core.runner.deterministic
    out = _drive(core, [Request("p", PROMPT[:20], GREEDY)])["p"]
    assert len(out[0]) == 24
    with pytest.raises(ValueError, match="sliding-window"):
        _core(path, False, enable_deterministic_inference=True)
