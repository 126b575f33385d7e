"""The fused CPU kernels (idleless/model/cpu_kernels.c) against the eager PyTorch / HF code they replace.

Element-wise kernels round where PyTorch rounds, so in bfloat16 they must give PyTorch's bits (rope, the
residual add, the KV write exactly; RMSNorm and SiLU up to float32 summation order / libm exp, checked as
>= 99% identical and the rest within one bfloat16 step). Attention and the merge are checked against a
float64 softmax computed by brute force.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from idleless.model import cpu_kernels
from idleless.model.layers import RotaryEmbedding

KERNELS = {dt: cpu_kernels.load(dt) for dt in (torch.float32, torch.bfloat16)}
pytestmark = pytest.mark.skipif(KERNELS[torch.float32] is None, reason="no C compiler for the CPU kernels")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def hf_rms_norm(x, w, eps):
    """transformers' LlamaRMSNorm.forward, verbatim in substance."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def assert_nearly_bitwise(ours, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        return
    same = (ours == ref).float().mean().item()
    assert same >= 0.99, f"only {same:.3%} of elements bit-identical"
    # the rest differ by rounding one float32 value the other way: one bfloat16 step (2^-7 relative)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2 ** -7, atol=1e-6)


@DTYPES
@pytest.mark.parametrize("n,h", [(1, 576), (7, 64), (33, 100)])
def test_rms_norm_matches_hf(dtype, n, h):
    k = KERNELS[dtype]
    g = _gen(n)
    x = (torch.randn(n, h, generator=g) * 3).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    assert_nearly_bitwise(k.rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5), dtype)
    # strided rows (the sampled rows of a batch are a view)
    big = (torch.randn(n, h + 8, generator=g)).to(dtype)
    assert_nearly_bitwise(k.rms_norm(big[:, :h], w, 1e-6), hf_rms_norm(big[:, :h].contiguous(), w, 1e-6), dtype)


@DTYPES
def test_rms_norm_with_residual_updates_it_like_the_eager_add(dtype):
    k = KERNELS[dtype]
    g = _gen(1)
    x = torch.randn(5, 64, generator=g).to(dtype)
    res = torch.randn(5, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    want_res = res + x  # eager add in the dtype: one rounding
    out = k.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, want_res)
    assert_nearly_bitwise(out, hf_rms_norm(want_res, w, 1e-5), dtype)


@DTYPES
def test_rope_matches_the_eager_rotation_bitwise(dtype):
    k = KERNELS[dtype]
    rope = RotaryEmbedding(16, 128, 10000.0, None)
    g = _gen(2)
    qkv = torch.randn(6, 9 * 16, generator=g).to(dtype)  # 5 q/k heads rotated, the v part after them
    pos = torch.tensor([0, 1, 5, 77, 127, 3])
    x = qkv[:, : 5 * 16].view(6, 5, 16)
    ref = RotaryEmbedding.apply(x.clone(), *rope.tables(pos, dtype))
    v_before = qkv[:, 5 * 16:].clone()
    k.rope(x, pos, rope.cos, rope.sin)
    assert torch.equal(x, ref)
    assert torch.equal(qkv[:, 5 * 16:], v_before)  # nothing written past the rotated heads


@DTYPES
def test_silu_mul_matches_eager(dtype):
    k = KERNELS[dtype]
    gu = (torch.randn(9, 2 * 96, generator=_gen(3)) * 4).to(dtype)
    gate, up = gu.split(96, dim=-1)
    assert_nearly_bitwise(k.silu_mul(gu), F.silu(gate) * up, dtype)


@DTYPES
def test_kv_write_is_index_copy(dtype):
    k = KERNELS[dtype]
    cache = torch.zeros(50, 2, 8, dtype=dtype)
    ref = cache.clone()
    qkv = torch.randn(4, 3 * 16, generator=_gen(4)).to(dtype)
    src = qkv[:, 16:32].view(4, 2, 8)  # strided rows, as k inside a fused qkv
    slots = torch.tensor([7, 0, 49, 12])
    k.kv_write(cache, src, slots)
    ref.index_copy_(0, slots, src)
    assert torch.equal(cache, ref)


def brute_attention(q, keys, vals, scale):
    """float64 softmax attention of one query row q [H, D] over keys/vals [L, Hkv, D] -> (out, lse)."""
    H, D = q.shape
    G = H // keys.shape[1]
    kk = keys.double().repeat_interleave(G, dim=1)  # [L, H, D]
    s = torch.einsum("hd,lhd->hl", q.double(), kk) * scale
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[:, None])
    return torch.einsum("hl,lhd->hd", p, vals.double().repeat_interleave(G, dim=1)), lse


@DTYPES
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 16), (4, 1, 32)])
def test_decode_attention_matches_brute_force(dtype, H, Hkv, D):
    k = KERNELS[dtype]
    g = _gen(H * D)
    kc = torch.randn(64, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(64, Hkv, D, generator=g).to(dtype)
    q = torch.randn(5, H, D, generator=g).to(dtype)
    tables = [torch.randperm(64, generator=g)[:n] for n in (1, 17, 40)]  # scattered slots, lengths 1..40
    q_rows = torch.tensor([4, 0, 2])
    out_rows = torch.tensor([1, 2, 0])
    slots = torch.cat(tables)
    offsets = torch.tensor([0, 1, 18, 58])
    out = torch.full((3, H, D), float("nan"))
    lse = torch.full((3, H), float("nan"))
    k.decode_attn(q, q_rows, kc, vc, slots, offsets, D ** -0.5, out, out_rows, lse)
    out_t = torch.zeros(3, H, D, dtype=dtype)
    k.decode_attn(q, q_rows, kc, vc, slots, offsets, D ** -0.5, out_t, out_rows)
    tol = 1e-5 if dtype == torch.float32 else 1e-5  # float32 math on the same inputs either way
    for b in range(3):
        ref_o, ref_l = brute_attention(q[q_rows[b]], kc[tables[b]], vc[tables[b]], D ** -0.5)
        r = out_rows[b]
        torch.testing.assert_close(out[r].double(), ref_o, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[r].double(), ref_l, rtol=tol, atol=tol)
        torch.testing.assert_close(out_t[r], ref_o.to(dtype), rtol=2 ** -7, atol=1e-5)


@DTYPES
def test_merge_of_two_key_sets_is_attention_over_their_union(dtype):
    """Attention over keys A then merged with keys B equals attention over A+B (the cascade identity)."""
    k = KERNELS[dtype]
    g = _gen(9)
    H, Hkv, D = 6, 2, 16
    kc = torch.randn(40, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(40, Hkv, D, generator=g).to(dtype)
    q = torch.randn(2, H, D, generator=g).to(dtype)
    a, b = torch.arange(0, 25), torch.arange(25, 40)
    rows = torch.tensor([0, 1])
    out = torch.zeros(2, H, D)
    lse = torch.full((2, H), float("-inf"))
    for part in (a, b):  # each part's (o, lse) merged in; the first lands in empty rows
        o = torch.empty(2, H, D, dtype=dtype)
        o_l = torch.empty(2, H)
        o_f = torch.empty(2, H, D)
        k.decode_attn(q, rows, kc, vc, part.repeat(2), torch.tensor([0, len(part), 2 * len(part)]), D ** -0.5,
                      o_f, rows, o_l)
        o.copy_(o_f)
        k.merge(out, lse, o, o_l, rows, rows)
    for r in range(2):
        ref_o, ref_l = brute_attention(q[r], kc, vc, D ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(out[r].double(), ref_o, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[r].double(), ref_l, rtol=1e-5, atol=1e-5)


AMX = KERNELS[torch.bfloat16] is not None and KERNELS[torch.bfloat16].has_amx


def _ragged_call(k, q, kc, vc, items, merge, out, lse, limits=None):
    """items: [(slots [L], rows [R])]; limits: per item a list of R visible-key counts, or None."""
    ko = torch.tensor([0] + [len(s) for s, _ in items]).cumsum(0)
    ro = torch.tensor([0] + [len(r) for _, r in items]).cumsum(0)
    lim = None if limits is None else torch.tensor([n for lst in limits for n in lst])
    work = torch.empty(k.ragged_work_bytes(ko.diff().tolist(), kc.shape[1], kc.shape[2]), dtype=torch.uint8)
    k.ragged_attn(q, kc, vc, ko, torch.cat([s for s, _ in items]), ro, torch.cat([r for _, r in items]), lim,
                  q.shape[2] ** -0.5, out, lse, merge, work)


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 1, 32), (8, 2, 128)])
def test_ragged_attention_matches_brute_force(H, Hkv, D):
    """Segments (all keys visible) and causal tails (row j sees limits[j] keys) in one call, against a
    float64 softmax: scattered slots, query rows strided in a fused qkv tensor, key counts that are not
    multiples of 16 or 32 and above one 256-key softmax chunk (online rescaling), partial 16-row
    blocks, a row that sees no key. Tolerance: probabilities are rounded to bfloat16 (2^-9 relative)
    before the P V tile product, so outputs within 2^-7 of the float64 ones; lse in float32 (1e-3)."""
    k = KERNELS[torch.bfloat16]
    g = _gen(H + D)
    kc = torch.randn(1200, Hkv, D, generator=g).bfloat16()
    vc = torch.randn(1200, Hkv, D, generator=g).bfloat16()
    qkv = (torch.randn(120, H + 2 * Hkv, D, generator=g) * 2).bfloat16()  # peaky softmax: the max moves
    q = qkv[:, :H]
    perm = torch.randperm(1200, generator=g)
    items = [(perm[:700], torch.arange(0, 13)),  # a long shared segment, 13 rows
             (perm[700:709], torch.tensor([20, 15, 17])),  # 9 keys, rows out of order
             (perm[709:742], torch.arange(30, 63)),  # a causal tail: 33 new tokens over 0 prior keys
             (torch.arange(800, 1100), torch.arange(70, 120))]  # 250 prior keys + 50 new, contiguous slots
    limits = [[10 ** 6] * 13, [9, 9, 0], [j + 1 for j in range(33)], [250 + j + 1 for j in range(50)]]
    out = torch.full((120, H, D), float("nan"))
    lse = torch.full((120, H), float("nan"))
    _ragged_call(k, q, kc, vc, items, False, out, lse, limits)
    for (slots, rows), lim in zip(items, limits):
        for r, n in zip(rows.tolist(), lim):
            if n == 0:  # sees nothing: an empty result, lse -inf
                assert not out[r].any() and bool((lse[r] == float("-inf")).all())
                continue
            ref_o, ref_l = brute_attention(q[r], kc[slots[:n]], vc[slots[:n]], D ** -0.5)
            torch.testing.assert_close(out[r].double(), ref_o, rtol=0, atol=2 ** -7)
            torch.testing.assert_close(lse[r].double(), ref_l, rtol=0, atol=1e-3)


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU")
def test_ragged_merge_of_a_tail_and_segments_is_attention_over_all_keys():
    """The cascade identity on the ragged kernel: tails written, then a system-prompt segment and two
    document segments (disjoint rows: one call) merged in, equals attention over each request's whole
    key list; a call whose work buffer is too small is refused before anything is written."""
    k = KERNELS[torch.bfloat16]
    g = _gen(5)
    H, Hkv, D = 6, 2, 64
    kc = torch.randn(600, Hkv, D, generator=g).bfloat16()
    vc = torch.randn(600, Hkv, D, generator=g).bfloat16()
    q = torch.randn(4, H, D, generator=g).bfloat16()
    system, docs, tails = torch.arange(0, 300), [torch.arange(300, 340), torch.arange(340, 400)], \
        [torch.arange(400 + 20 * i, 410 + 20 * i) for i in range(4)]
    out = torch.empty(4, H, D)
    lse = torch.empty(4, H)
    _ragged_call(k, q, kc, vc, [(tails[i], torch.tensor([i])) for i in range(4)], False, out, lse)
    _ragged_call(k, q, kc, vc, [(system, torch.arange(4))], True, out, lse)
    _ragged_call(k, q, kc, vc, [(docs[0], torch.tensor([0, 1])), (docs[1], torch.tensor([2, 3]))], True, out, lse)
    for i in range(4):
        keys = torch.cat([system, docs[i // 2], tails[i]])
        ref_o, ref_l = brute_attention(q[i], kc[keys], vc[keys], D ** -0.5)
        torch.testing.assert_close(out[i].double(), ref_o, rtol=0, atol=2 ** -7)
        torch.testing.assert_close(lse[i].double(), ref_l, rtol=0, atol=1e-3)
    before = out.clone()
    with pytest.raises(ValueError, match="work buffer"):
        k.ragged_attn(q, kc, vc, torch.tensor([0, 300]), system, torch.tensor([0, 4]), torch.arange(4), None,
                      0.125, out, lse, True, torch.empty(100, dtype=torch.uint8))
    assert torch.equal(out, before)


def test_bad_layout_is_refused():
    k = KERNELS[torch.float32]
    with pytest.raises(ValueError):
        k.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-5)  # columns, not rows
    with pytest.raises(ValueError):
        k.silu_mul(torch.randn(3, 8, dtype=torch.bfloat16))  # wrong dtype for these kernels


def test_without_a_compiler_the_kernels_are_off(tmp_path, monkeypatch, caplog):
    """No usable C compiler: load() gives None with a warning (the model then runs its eager path)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("IDLELESS_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
    monkeypatch.setattr(cpu_kernels, "_LIB", {})
    assert cpu_kernels.load(torch.bfloat16) is None
    assert "eager path" in caplog.text


def test_an_unwritable_kernel_cache_falls_back_to_eager(tmp_path, monkeypatch, caplog):
    """The cache's kernels/ path is taken by a file (as for a read-only cache): a warning, no crash."""
    (tmp_path / "kernels").write_text("not a folder")
    monkeypatch.setenv("IDLELESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_LIB", {})
    assert cpu_kernels.load(torch.float32) is None
    assert "cannot write the kernel cache" in caplog.text


def test_a_built_library_is_readable_by_other_users(tmp_path, monkeypatch):
    monkeypatch.setenv("IDLELESS_CACHE_DIR", str(tmp_path))
    so = cpu_kernels.build_library()
    assert so is not None and so.stat().st_mode & 0o777 == 0o755


def test_an_index_of_another_dtype_is_refused():
    """The C code reads indices as raw int64: an int32 slot list must be an error, not a stray write."""
    k = KERNELS[torch.float32]
    cache = torch.zeros(8, 1, 4)
    with pytest.raises(ValueError):
        k.kv_write(cache, torch.ones(2, 1, 4), torch.tensor([1, 2], dtype=torch.int32))
    assert not cache.any()


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
def test_amx_linear_matches_f_linear(m):
    """Decode-sized linear layers on AMX against F.linear on the same bfloat16 weights: both sum the
    exact bfloat16 products in float32 and round once, so they agree to one bfloat16 step (summation
    order aside) for any row count up to 64 (padded row tiles), with a bias, with strided rows."""
    k = KERNELS[torch.bfloat16]
    g = _gen(m)
    n, kdim = 96, 160
    w = torch.randn(n, kdim, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, kdim + 32, generator=g).bfloat16()[:, 16:16 + kdim]  # rows kdim + 32 apart
    packed = k.amx_pack_weight(w)
    for b in (None, bias):
        ours = k.amx_linear(x, packed, n, b)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # float32 sums of exact products
        torch.testing.assert_close(ours.float(), ref, rtol=2 ** -7, atol=1e-3)
        assert (ours == F.linear(x, w, b)).float().mean() >= 0.99
    with pytest.raises(ValueError):
        k.amx_linear(torch.zeros(65, kdim).bfloat16(), packed, n)  # more rows than a decode batch
    assert k.amx_pack_weight(torch.zeros(40, 64).bfloat16()) is None  # N not a multiple of 32
