"""W8A8's attention (``--activation-dtype int8``): q.k and P.V on int8 codes in ``chunk_attn`` (SageAttention,
arXiv 2410.02367), where the kernels take them (AVX-512 BF16 + VNNI, head_dim a multiple of 32).

Against a float64 implementation of the documented algorithm (q per row and head, k and v per key and kv
head quantised symmetrically; per chunk of 64 keys, w = p * s_v to 0..255 against the chunk's max); the
float-score kernel is far from that reference (the flag acts). A row's bits are those of the row alone, as a decode row,
split between a shared segment and its tail, and inside ``chunk_attn_layer``; an engine with int8 weights and
activations gives one request the same tokens and logprob bits alone, from the prefix cache, beside others
and with chunked prefill."""

from __future__ import annotations

import pytest
import torch

from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.request import Request
from idleless.model import cpu_kernels
from idleless.model.attention.base import AttnWork, Tails
from idleless.model.attention.invariant import ChunkedAttention

from conftest import TEST_THREADS, make_tiny_model
from test_deterministic import GREEDY, PROMPT, _drive, _others

I64 = torch.int64


def _kernels(d: int):
    k = cpu_kernels.load(torch.bfloat16)
    if k is None:
        pytest.skip("no C compiler: the fused kernels are off")
    if not k.chunk_attn_int8(d):
        pytest.skip("this CPU / build has no int8 scores in chunk_attn (AVX-512 BF16 + VNNI)")
    return k


def _q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's quantiser per last dimension, in float32 as the kernel: codes rint(x * (127 / amax))
    clamped to +-127 (0 where amax is 0), scale amax / 127."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return torch.round(xf * inv[..., None]).clamp(-127, 127), amax / 127


def _ref(q, K, V, limits, scale, int8: bool):
    """float64 attention, row r seeing K[:limits[r]]; q [R, H, D], K/V [L, Hkv, D] bf16. int8: the kernel's
    documented algorithm (cpu_kernels.c, int8 attention) — scores of the codes, then per chunk of 64 keys the
    running-max softmax with w = p * s_v quantised to 0..255 against the chunk's max w, P.V on the V codes."""
    grp = q.shape[1] // K.shape[1]
    if not int8:
        s = torch.einsum("rhd,khd->rhk", q.double(), K.double().repeat_interleave(grp, 1)) * scale
        mask = torch.arange(K.shape[0])[None, :] < torch.as_tensor(limits)[:, None]
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.einsum("rhk,khd->rhd", s.softmax(-1), V.double().repeat_interleave(grp, 1))
    (qc, sq), (kc, sk), (vc, sv) = _q8(q), _q8(K), _q8(V)
    rep = lambda t: t.double().repeat_interleave(grp, 1)  # noqa: E731  kv heads -> query heads
    s = torch.einsum("rhd,khd->rhk", qc.double(), rep(kc)) * rep(sk).T[None] * sq.double()[..., None] * scale
    R, H, D = q.shape
    m = torch.full((R, H), float("-inf"), dtype=torch.float64)
    l, acc = torch.zeros(R, H, dtype=torch.float64), torch.zeros(R, H, D, dtype=torch.float64)
    lim = torch.as_tensor(limits)
    for c0 in range(0, int(lim.max()), 64):
        c1 = min(c0 + 64, K.shape[0])
        x = s[:, :, c0:c1].masked_fill(~(torch.arange(c0, c1)[None, :] < lim[:, None])[:, None, :], float("-inf"))
        seen = lim > c0  # rows that see a key of this chunk
        mn = torch.maximum(m, x.amax(-1))
        a = torch.where(m > float("-inf"), torch.exp(m - mn), 0.0)
        p = torch.exp(x - mn[..., None])
        w = p * rep(sv[c0:c1]).T[None]
        wm = w.amax(-1, keepdim=True)
        u = torch.round(w * torch.where(wm > 0, 255 / wm, 0.0)).clamp(0, 255)
        pv = torch.einsum("rhk,khd->rhd", u, rep(vc[c0:c1])) * wm / 255
        keep = seen[:, None]
        l = torch.where(keep, l * a + p.sum(-1), l)
        acc = torch.where(keep[..., None], acc * a[..., None] + pv, acc)
        m = torch.where(keep, mn, m)
    return acc / l[..., None]


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 32), (4, 4, 128), (20, 20, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_attention_matches_float64_of_its_algorithm(H, Hkv, D, threads):
    kern = _kernels(D)
    g = torch.Generator().manual_seed(H * D)
    S, L = 700, 300
    kc = torch.randn(S, Hkv, D, generator=g).bfloat16()
    vc = torch.randn(S, Hkv, D, generator=g).bfloat16()
    slots = torch.randperm(S, generator=g)[:L]
    q = (torch.randn(L, H, D, generator=g) * 2).bfloat16()
    limits = torch.arange(1, L + 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {}
        for int8 in (True, False):
            got[int8] = torch.empty(L, H, D, dtype=torch.bfloat16)
            kern.chunk_attn(q, kc, vc, torch.tensor([0, L]), slots, torch.tensor([0, L]), torch.arange(L), limits,
                            D ** -0.5, got[int8], None, False, int8)
    finally:
        torch.set_num_threads(before)
    ref = _ref(q, kc[slots], vc[slots], limits, D ** -0.5, True)
    err8 = (got[True].double() - ref).abs().max().item()
    err_float = (got[False].double() - ref).abs().max().item()
    assert err8 < 1e-2
    assert err_float > 3 * err8, "bf16 attention should be far from the int8 reference: is the flag ignored?"


def test_int8_attention_rows_fold_alike_alone_split_and_in_one_layer_call():
    """Row 150 of a causal prefill: alone as a decode row, with its first 128 keys as a shared segment, and
    through ``chunk_attn_layer`` (segment + tail) — the same bits; a NaN query row changes no other row."""
    H, Hkv, D, S, L = 9, 3, 64, 600, 200
    kern = _kernels(D)
    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(S, Hkv, D, generator=g).bfloat16(), torch.randn(S, Hkv, D, generator=g).bfloat16()
    slots = torch.randperm(S, generator=g)[:L]
    q = torch.randn(L, H, D, generator=g).bfloat16()
    be = ChunkedAttention(kern, H, D, int8_attention=True)
    assert be.int8_attention
    full = be.forward(q, kc, vc, 0, be.prepare(AttnWork(Tails([0], [L], [0], [slots]))), None, None)
    one = be.forward(q[150:151], kc, vc, 0, be.prepare(AttnWork(Tails([0], [1], [150], [slots[:151]]))), None, None)
    assert torch.equal(one[0], full[150])
    qq = torch.stack([q[150], q[150]])
    work = AttnWork(Tails([0, 1], [1, 1], [22, 22], [slots[128:151], slots[128:151]]),
                    [(torch.tensor([0, 1]), slots[:128])])
    two = be.forward(qq, kc, vc, 0, be.prepare(work), None, None)  # the one-call path (chunk_attn_layer)
    assert torch.equal(two[0], full[150]) and torch.equal(two[1], full[150])
    be._one_call = False  # per call through a state (chunk_attn with store)
    two = be.forward(qq, kc, vc, 0, be.prepare(work), None, None)
    assert torch.equal(two[0], full[150]) and torch.equal(two[1], full[150])
    bad = q.clone()
    bad[7, 2, 5] = float("nan")
    again = be.forward(bad, kc, vc, 0, be.prepare(AttnWork(Tails([0], [L], [0], [slots]))), None, None)
    keep = torch.ones(L, dtype=torch.bool)
    keep[7] = False
    assert torch.equal(again[keep], full[keep])


def test_the_flag_is_off_where_not_asked_and_on_the_torch_twin():
    kern = _kernels(64)
    assert not ChunkedAttention(kern, 9, 64).int8_attention
    assert not ChunkedAttention(kern, 6, 48, int8_attention=True).int8_attention  # head_dim not a multiple of 32
    f32 = cpu_kernels.load(torch.float32)
    assert not ChunkedAttention(f32, 9, 64, int8_attention=True).int8_attention


@pytest.fixture(scope="module")
def w8a8_model(tmp_path_factory) -> str:
    """SmolLM2's head shape (head_dim 64, 3 query heads per KV head) in a tiny model."""
    return make_tiny_model(tmp_path_factory.mktemp("w8a8"), max_position_embeddings=1024, hidden_size=96,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=64, intermediate_size=160)


def _core(model, **kw) -> EngineCore:
    cfg = dict(model=model, dtype="bfloat16", kv_cache_memory="64MiB", num_threads=TEST_THREADS,
               enable_deterministic_inference=True, weight_dtype="int8", activation_dtype="int8",
               skip_quantization_gate=True)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def test_w8a8_engine_gives_one_answer_alone_cached_beside_others_and_chunked(w8a8_model):
    _kernels(64)
    core = _core(w8a8_model)
    assert core.runner.backend.extend_backend.int8_attention
    ref = _drive(core, [Request("p", PROMPT, GREEDY)])["p"]
    assert len(ref[0]) == 24
    assert _drive(core, [Request("p2", PROMPT, GREEDY)])["p2"] == ref  # its whole prompt is cached now
    others = _others()
    out = _drive(core, others[:7] + [Request("p3", PROMPT, GREEDY)] + others[7:])
    assert out["p3"] == ref
    core = _core(w8a8_model, chunked_prefill_size=64, page_size=16)
    assert _drive(core, _others()[:5] + [Request("p", PROMPT, GREEDY)])["p"] == ref
    # and the int8 scores are in those bits: the same engine with float scores answers otherwise
    core = _core(w8a8_model)
    core.runner.backend.extend_backend.int8_attention = False  # the one backend of every part when deterministic
    plain = _drive(core, [Request("p", PROMPT, GREEDY)])["p"]
    assert plain[1] != ref[1]


def test_int8_attention_reads_only_keys_a_row_sees_and_keeps_nan():
    """Keys past every row's limit (and items without rows) are neither read nor quantised: a slot index
    far out of range there changes nothing (it crashed the first build); a NaN in a value a row sees gives
    that row NaN, as bf16 attention does (VMAXPS had dropped it: the row came out finite)."""
    H, Hkv, D, S = 9, 3, 64, 200
    kern = _kernels(D)
    g = torch.Generator().manual_seed(11)
    kc, vc = torch.randn(S, Hkv, D, generator=g).bfloat16(), torch.randn(S, Hkv, D, generator=g).bfloat16()
    q = torch.randn(12, H, D, generator=g).bfloat16()
    slots = torch.randperm(S, generator=g)[:150]
    ko, ro = torch.tensor([0, 20, 150, 150]), torch.tensor([0, 0, 12, 12])  # items 0 and 2 have no rows
    rows, lims = torch.arange(12), torch.arange(1, 13) * 5  # item 1's rows see at most 60 of its 130 keys

    def run(sl, v):
        out = torch.empty(12, H, D, dtype=torch.bfloat16)
        kern.chunk_attn(q, kc, v, ko, sl, ro, rows, lims, D ** -0.5, out, None, False, True)
        return out

    want = run(slots, vc)
    bad = slots.clone()
    bad[:20] = 10 ** 9  # item 0's keys: no row
    bad[20 + 61:] = 10 ** 9  # item 1's keys past every row's limit
    assert torch.equal(run(bad, vc), want)
    v = vc.clone()
    v[slots[20 + 30], 1, 7] = float("nan")  # key 30 of item 1: rows with limit > 30 see it, in KV head 1
    got = run(slots, v)
    sees = lims > 30
    assert got[sees][:, 3:6].isnan().all() and not got[~sees].isnan().any()  # query heads 3..5 read KV head 1
    assert not got[:, :3].isnan().any() and not got[:, 6:].isnan().any()


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("bad", [61, -1])
def test_a_limit_outside_its_items_keys_is_refused_before_anything_is_read(int8, bad):
    """A row's limit past its item's key count (or negative) made both paths read past the item (garbage, or a
    segfault for large ones): ValueError, the output untouched."""
    kern = _kernels(64)
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(100, 3, 64, generator=g).bfloat16(), torch.randn(100, 3, 64, generator=g).bfloat16()
    q = torch.randn(4, 9, 64, generator=g).bfloat16()
    out = torch.full((4, 9, 64), 7.0, dtype=torch.bfloat16)
    lims = torch.tensor([1, 20, bad, 60])
    with pytest.raises(ValueError, match="limit"):
        kern.chunk_attn(q, kc, vc, torch.tensor([0, 60]), torch.arange(60), torch.tensor([0, 4]), torch.arange(4),
                        lims, 64 ** -0.5, out, None, False, int8)
    assert (out == 7).all()
    calls = [(torch.tensor([0, 60]), torch.arange(60), torch.tensor([0, 4]), torch.arange(4), lims)]
    with pytest.raises(ValueError, match="limit"):
        kern.chunk_attn_layer(q, kc, vc, calls, 64 ** -0.5, out, int8_attention=int8)
