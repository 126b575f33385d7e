"""The fused glue and batch-invariant kernels built for this CPU (AVX2 intrinsics where it has them) against
a portable build of the same source (-march=x86-64: no AVX2, only the scalar loops): both must give the
same bits, and the portable build must meet the same references as the native one (HF RMSNorm, the eager
rotation, SiLU against float64), so the scalar path is checked on any machine.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from idleless.model.layers import RotaryEmbedding
from kernel_builds import cpu_has, native_and_portable, native_without_avx512_bf16


BUILDS = native_and_portable()
pytestmark = pytest.mark.skipif(not BUILDS, reason="no C compiler for the CPU kernels")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# widths around the vector steps (8 lanes, 16 for the sum of squares), and SmolLM2-135M's own
WIDTHS = [1, 7, 8, 15, 16, 17, 40, 100, 576]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _x(shape, seed, dtype, scale=3.0):
    """Values spanning many binades, with a zero, a denormal-sized and a huge entry in the first row."""
    x = torch.randn(*shape, generator=_gen(seed)) * scale
    flat = x.view(-1)
    flat[:3] = torch.tensor([0.0, 1e-39, 80.0])[: flat.numel()]
    return x.to(dtype)


@DTYPES
@pytest.mark.parametrize("h", WIDTHS)
def test_rms_norm_native_equals_portable_and_hf(dtype, h):
    native, portable = BUILDS[dtype]
    x = _x((5, h), h, dtype)
    w = _x((h,), h + 1, dtype, 1.0)
    res = _x((5, h), h + 2, dtype)
    outs = [k.rms_norm(x, w, 1e-5) for k in (native, portable)]
    assert torch.equal(outs[0], outs[1])
    res_n, res_p = res.clone(), res.clone()
    with_res = [native.rms_norm(x, w, 1e-5, res_n), portable.rms_norm(x, w, 1e-5, res_p)]
    assert torch.equal(res_n, res_p) and torch.equal(res_n, res + x)  # the eager add's one rounding
    assert torch.equal(with_res[0], with_res[1])
    # the portable build against HF's float32 normalisation, rounded once, times the weight
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(outs[1].float(), ref.float(), rtol=tol, atol=1e-6)


@DTYPES
@pytest.mark.parametrize("m", WIDTHS + [1536])
def test_silu_mul_native_equals_portable_and_float64(dtype, m):
    native, portable = BUILDS[dtype]
    gu = _x((4, 2 * m), m, dtype, 5.0)
    gu.view(-1)[3:6] = torch.tensor([-100.0, 100.0, -30.0]).to(dtype)[: gu.numel() - 3]  # exp's clamps
    outs = [k.silu_mul(gu) for k in (native, portable)]
    assert torch.equal(outs[0], outs[1])
    g, u = gu.double().split(m, dim=-1)
    silu = g / (1 + torch.exp(-g))
    if dtype == torch.float32:
        torch.testing.assert_close(outs[0].double(), silu * u, rtol=1e-6, atol=1e-30)
    else:  # silu rounded to bfloat16, then the product rounded: two half-steps of 2^-8
        torch.testing.assert_close(outs[0].double(), silu.to(dtype).double() * u, rtol=2 ** -8, atol=1e-30)
    if dtype == torch.bfloat16 and m >= 576:  # enough elements for a fraction: PyTorch's bits nearly always
        assert (outs[0] == F.silu(gu[:, :m]) * gu[:, m:]).float().mean() >= 0.99


def test_silu_mul_bf16_every_gate_against_float64():
    """silu_mul on bfloat16 reads silu from a table of all 65536 gate bit patterns: every pattern, in both
    builds, against float64 SiLU rounded to bfloat16 (u = 1: the product is the table entry). The table is
    computed with float32's exp (a few ulp): a float64 value within that of a bfloat16 rounding boundary
    may round the other way, so all finite gates are within one bfloat16 step (or, below -88 where float32's exp
    overflows, -0 for a float64 value under 1e-36) and nearly all equal; NaN gates give NaN."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gu = torch.cat([gates.view(64, 1024), torch.ones(64, 1024, dtype=torch.bfloat16)], 1)
    outs = [k.silu_mul(gu).view(-1) for k in BUILDS[torch.bfloat16]]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    g = gates.double()
    finite = torch.isfinite(g)
    ref = (g / (1 + torch.exp(-g))).to(torch.bfloat16)
    got = outs[0]
    assert torch.isnan(got[torch.isnan(g)]).all()
    exact = (got[finite].view(torch.int16) == ref[finite].view(torch.int16)).double().mean()
    assert exact >= 0.999
    steps = (got[finite].view(torch.int16).int() - ref[finite].view(torch.int16).int()).abs()
    tiny = (got[finite].double() - ref[finite].double()).abs() < 1e-36
    assert ((steps <= 1) | tiny).all()


@DTYPES
@pytest.mark.parametrize("d", [4, 16, 64, 128])
def test_rope_native_equals_portable_and_eager(dtype, d):
    native, portable = BUILDS[dtype]
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    qkv = _x((7, 14 * d), d, dtype)
    pos = torch.tensor([0, 1, 9, 63, 64, 300, 511])
    x0 = qkv[:, : 12 * d].view(7, 12, d)  # 9 q heads + 3 k heads, strided rows in a fused qkv
    ref = RotaryEmbedding.apply(x0.clone(), *rope.tables(pos, dtype))
    got = []
    for k in (native, portable):
        buf = qkv.clone()
        k.rope(buf[:, : 12 * d].view(7, 12, d), pos, rope.cos, rope.sin)
        assert torch.equal(buf[:, 12 * d:], qkv[:, 12 * d:])
        got.append(buf[:, : 12 * d].view(7, 12, d))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], ref)


@DTYPES
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (8, 2, 128), (8, 1, 40), (6, 3, 24), (4, 4, 12)])
def test_chunk_attn_native_equals_portable(dtype, H, Hkv, D):
    """The batch-invariant attention gives the same bits on both builds (causal tails over cached keys,
    a short last chunk; query heads per kv head 3, 4, 8, 2 and 1, head dims off the 32 / 8 vector
    blocks), stored softmax state included. On an AVX-512 BF16 CPU the native bfloat16 build sums q.k as
    VDPBF16PS pair chains for head dims that are multiples of 32 (another order, by design; checked against
    float64 by test_chunk_attn_dpbf16_meets_float64_and_is_invariant): there the build without it is checked."""
    native, portable = BUILDS[dtype]
    if dtype == torch.bfloat16 and D % 32 == 0 and cpu_has("avx512_bf16"):
        native = native_without_avx512_bf16()[dtype]
    g = _gen(11)
    kc = torch.randn(400, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(400, Hkv, D, generator=g).to(dtype)
    q = (torch.randn(50, H, D, generator=g) * 2).to(dtype)
    slots = torch.cat([torch.randperm(400, generator=g)[:150], torch.arange(200, 300)])
    key_off = torch.tensor([0, 150, 250])
    row_off = torch.tensor([0, 20, 50])
    rows = torch.cat([torch.arange(0, 20), torch.arange(20, 50)])
    limits = torch.cat([torch.arange(131, 151), torch.arange(71, 101)])
    outs, states = [], []
    for k in (native, portable):
        out = torch.empty(50, H, D, dtype=dtype)
        k.chunk_attn(q, kc, vc, key_off, slots, row_off, rows, limits, D ** -0.5, out)
        outs.append(out)
        state = (torch.full((50, H), float("-inf")), torch.zeros(50, H), torch.zeros(50, H, D))
        k.chunk_attn(q, kc, vc, key_off, slots, row_off, rows, None, D ** -0.5, None, state, True)
        states.append(state)
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*states))


@DTYPES
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_gguf_linear_native_equals_portable(dtype, fmt):
    """q41_linear / q80_linear: the scalar build's fmaf chains and lane tree give the AVX2 build's bits,
    for one row (the register decode) and for 37 rows (the panel tiling, a partial row tile), with
    float16 steps that include a subnormal and a zero."""
    from idleless.quant.formats import quantize_q4_1, quantize_q8_0

    native, portable = BUILDS[dtype]
    n, k = 45, 96
    w = _x((n, k), 21, torch.float32, 0.1)
    x = _x((37, k), 22, dtype)
    bias = _x((n,), 23, dtype)
    if fmt == "q4_1":
        qs, d, m = quantize_q4_1(w)
        d[0, 0], m[1, 1] = 1e-7, 0.0  # float16 subnormal step, zero minimum
        run = lambda kern, rows: kern.q41_linear(rows, qs, d, m, bias)
    else:
        q, d = quantize_q8_0(w)
        d[0, 0], d[2, 1] = 1e-7, 0.0
        run = lambda kern, rows: kern.q80_linear(rows, q, d, bias)
    for rows in (x[:1], x):
        assert torch.equal(run(native, rows), run(portable, rows))


@DTYPES
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 1, 32), (6, 3, 40), (16, 1, 16)])
def test_decode_attn_native_equals_portable_and_float64(dtype, H, Hkv, D):
    """The decode kernel (AVX2: 8 keys per vector, lane = key) gives the scalar kernel's bits: requests
    with 0, 1, 7, 8, 9 and 300 keys (the 8-key blocks and the key-by-key rest), scattered slots, the
    log-sum-exp too; head dims off the 16-lane blocks (40) take the scalar kernel on both builds. And the
    portable build against a float64 softmax attention. On an AVX-512 BF16 CPU the native bfloat16 build
    takes the VDPBF16PS kernel for head dims that are multiples of 32 (q.k summed in another order): there
    the build without it must give the scalar bits, and the native kernel meets the float64 reference."""
    native, portable = BUILDS[dtype]
    dpbf16 = dtype == torch.bfloat16 and D % 32 == 0 and cpu_has("avx512_bf16")
    checked = native_without_avx512_bf16()[dtype] if dpbf16 else native
    g = _gen(H * D)
    lens = [0, 1, 7, 8, 9, 300]
    kc = torch.randn(1000, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(1000, Hkv, D, generator=g).to(dtype)
    q = (torch.randn(len(lens), H, D, generator=g) * 2).to(dtype)
    slots = torch.cat([torch.randperm(1000, generator=g)[:n] for n in lens])
    offsets = torch.tensor([0] + lens).cumsum(0)
    rows = torch.arange(len(lens))
    outs = []
    for k in (checked, portable, native):
        out = torch.full((len(lens), H, D), 7.0, dtype=torch.float32)
        lse = torch.full((len(lens), H), 7.0)
        k.decode_attn(q, rows, kc, vc, slots, offsets, D ** -0.5, out, rows, lse)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert dpbf16 or (torch.equal(outs[2][0], outs[1][0]) and torch.equal(outs[2][1], outs[1][1]))
    grp = H // Hkv
    for b, n in enumerate(lens):
        if n == 0:
            for o, l in outs[1:]:
                assert torch.all(o[b] == 0) and torch.all(l[b] == -float("inf"))
            continue
        s = slots[offsets[b]:offsets[b + 1]]
        kk = kc[s].double().repeat_interleave(grp, dim=1)  # [n, H, D]
        vv = vc[s].double().repeat_interleave(grp, dim=1)
        sc = torch.einsum("hd,nhd->hn", q[b].double(), kk) * D ** -0.5
        ref = torch.einsum("hn,nhd->hd", sc.softmax(-1), vv)
        for o, l in outs[1:]:
            torch.testing.assert_close(o[b].double(), ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(l[b].double(), sc.logsumexp(-1), rtol=1e-5, atol=1e-5)


@DTYPES
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_attn_q8_native_equals_portable(dtype, fmt):
    """The decode kernel over an 8-bit KV pool (AVX2: bytes through the format's table by a gather, the
    K scale in its score factor, V's scale in its weight (int8, per slot) or the output (fp8, per head))
    gives the scalar kernel's bits (the AVX2 build's on an AVX-512 BF16 CPU), output
    and log-sum-exp, for requests of 0, 1, 7, 8, 9 and 300 keys on scattered slots (its float64
    reference is tests/test_kv_dtype.py's)."""
    from idleless.cache.kv_pool import KVPool

    native, portable = BUILDS[dtype]
    if dtype == torch.bfloat16 and cpu_has("avx512_bf16"):  # the VDPBF16PS kernel there (test_kv_dtype.py)
        native = native_without_avx512_bf16()[dtype]
    H, Hkv, D = 9, 3, 64
    g = _gen(5)
    scales = None if fmt == "int8" else (torch.rand(1, Hkv, generator=g) / 50 + 0.01,
                                         torch.rand(1, Hkv, generator=g) / 50 + 0.004)
    pool = KVPool(1, Hkv, D, 1000, dtype, cache_dtype=fmt, kv_scales=scales)  # fp8: static per-head scales
    k, v = pool.layer_kv(0)
    k.write(torch.arange(1000), torch.randn(1000, Hkv, D, generator=g) * 4)
    v.write(torch.arange(1000), torch.randn(1000, Hkv, D, generator=g))
    lens = [0, 1, 7, 8, 9, 300]
    q = (torch.randn(len(lens), H, D, generator=g) * 2).to(dtype)
    slots = torch.cat([torch.randperm(1000, generator=g)[:n] for n in lens])
    offsets = torch.tensor([0] + lens).cumsum(0)
    rows = torch.arange(len(lens))
    outs = []
    for kern in (native, portable):
        out, lse = torch.full((len(lens), H, D), 7.0, dtype=dtype), torch.full((len(lens), H), 7.0)
        kern.decode_attn_q8(q, rows, k, v, slots, offsets, D ** -0.5, out, rows, lse)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0][1:], torch.full_like(outs[0][0][1:], 7.0))


# ---- helper H1 (issue 11): the panel tiling's k passes, chunk_attn's decode rows ----


@DTYPES
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_gguf_linear_k_passes_native_equals_portable_and_rows_alone(dtype, fmt):
    """At k = 1632 (over 1.5 GGUF_KB: passes of 512, 512, 512, 96 with the lane chains carried between
    them) the panel tiling gives the scalar build's bits, a row's bits alone (the register decode, one
    pass) equal its bits in batches of 8 and 40, and the product is within float32's bound of a float64
    product of the held weights."""
    from idleless.quant.formats import dequantize_q8_0, quantize_q4_1, quantize_q8_0, unpack_q4

    native, portable = BUILDS[dtype]
    n, k = 37, 1632
    w = torch.randn(n, k, generator=_gen(31)) * k ** -0.5
    x = (torch.randn(40, k, generator=_gen(32)) * 2).to(dtype)
    if fmt == "q4_1":
        qs, d, m = quantize_q4_1(w)
        held = (d.double()[..., None] * unpack_q4(qs).double() + m.double()[..., None]).reshape(n, k)
        run = lambda kern, rows: kern.q41_linear(rows, qs, d, m, None)
    else:
        q, d = quantize_q8_0(w)
        held = dequantize_q8_0(q, d).double()
        run = lambda kern, rows: kern.q80_linear(rows, q, d, None)
    y = run(native, x)
    assert torch.equal(y, run(portable, x))
    alone = torch.cat([run(native, x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(run(native, x[:8]), alone[:8]) and torch.equal(y, alone)
    ref = x.double() @ held.T
    bound = k * 2.0 ** -23 * (x.double().abs() @ held.abs().T) + (2.0 ** -8 if dtype == torch.bfloat16 else 0) * ref.abs()
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


# ---- helper H3 (issue 11 on AVX-512 BF16): bi_linear and chunk_attn as VDPBF16PS pair chains ----
DPBF16 = cpu_has("avx512_bf16")


@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (37, 100, True), (40, 33, True)])
def test_bi_linear_bf16_rows_alone_native_float64_and_portable(n, k, bias):
    """bfloat16 bi_linear, native build (VDPBF16PS pair chains on an AVX-512 BF16 CPU for even k; k = 33 keeps
    the fmaf chain): every row's bits are the same alone, in batches of 2 to 300 at any position of the
    register tiles (6 rows x 4 panels, leftover rows one at a time) and with other neighbours; the product
    is within float32's summation bound of a float64 product plus one bf16 rounding; the build without
    AVX-512 BF16 (the fmaf chains) gives the portable build's bits."""
    native, portable = BUILDS[torch.bfloat16]
    g = _gen(n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = (torch.randn(300, k, generator=g) * 2).to(torch.bfloat16)
    run = lambda kern, rows: kern.bi_linear(rows, kern.bi_pack_weight(w), n, b)
    full = run(native, x)
    alone = torch.cat([run(native, x[i:i + 1]) for i in range(300)])
    assert torch.equal(full, alone)
    for m0, m in ((0, 2), (1, 5), (3, 7), (5, 13), (64, 65), (1, 299)):
        assert torch.equal(run(native, x[m0:m0 + m]), full[m0:m0 + m]), (m0, m)
    perm = torch.randperm(300, generator=_gen(7))
    assert torch.equal(run(native, x[perm]), full[perm])
    xs = x.double()
    ref = xs @ w.double().T + (b.double() if bias else 0)
    bound = k * 2.0 ** -23 * (xs.abs() @ w.double().abs().T) + 2.0 ** -8 * ref.abs() + 1e-30
    assert ((full.double() - ref).abs() <= bound).all()
    checked = native_without_avx512_bf16()[torch.bfloat16] if DPBF16 else native
    assert torch.equal(run(checked, x), run(portable, x))


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 1, 32), (6, 3, 40)])
def test_chunk_attn_bf16_rows_alone_splits_and_float64(H, Hkv, D):
    """bfloat16 chunk_attn, native build (q.k as VDPBF16PS pair chains on an AVX-512 BF16 CPU for head dims
    that are multiples of 32; 40 keeps the fmaf chains): a query row's bits are the same alone as in a call
    with 40 causal rows and a second item, and the same when its first 128 keys are a shared segment
    folded by an earlier call (stored state) and the rest a tail; the output meets a float64 softmax
    attention within bfloat16's rounding."""
    native, _ = BUILDS[torch.bfloat16]
    bf = torch.bfloat16
    g = _gen(H * D + 1)
    S, L, R = 700, 300, 40
    kc, vc = torch.randn(S, Hkv, D, generator=g).to(bf), torch.randn(S, Hkv, D, generator=g).to(bf)
    q = (torch.randn(R + 5, H, D, generator=g) * 2).to(bf)
    slots = torch.randperm(S, generator=g)
    s1, s2 = slots[:L], slots[L:L + 77]
    limits = torch.arange(L - R + 1, L + 1)  # rows 0..39: causal over the last 40 positions
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
    full = torch.zeros(R + 5, H, D, dtype=bf)
    native.chunk_attn(q, kc, vc, i64(0, L, L + 77), torch.cat([s1, s2]), i64(0, R, R + 5), torch.arange(R + 5),
                      torch.cat([limits, torch.full((5,), 77)]), D ** -0.5, full)
    for r in (0, 1, 17, 39):
        one = torch.zeros(R + 5, H, D, dtype=bf)
        native.chunk_attn(q, kc, vc, i64(0, L), s1, i64(0, 1), i64(r), limits[r:r + 1], D ** -0.5, one)
        assert torch.equal(one[r], full[r]), r
    st = (torch.full((R + 5, H), float("-inf")), torch.zeros(R + 5, H), torch.zeros(R + 5, H, D))
    split = torch.zeros(R + 5, H, D, dtype=bf)
    native.chunk_attn(q, kc, vc, i64(0, 128), s1[:128], i64(0, R), torch.arange(R), None, D ** -0.5, None, st, True)
    native.chunk_attn(q, kc, vc, i64(0, L - 128), s1[128:], i64(0, R), torch.arange(R), limits - 128, D ** -0.5,
                      split, st, False)
    assert torch.equal(split[:R], full[:R])
    grp = H // Hkv
    K = kc[s1].double().repeat_interleave(grp, 1)
    V = vc[s1].double().repeat_interleave(grp, 1)
    sc = torch.einsum("rhd,khd->rhk", q[:R].double(), K) * D ** -0.5
    sc = sc.masked_fill(~(torch.arange(L)[None, :] < limits[:, None])[:, None, :], float("-inf"))
    ref = torch.einsum("rhk,khd->rhd", sc.softmax(-1), V)
    torch.testing.assert_close(full[:R].double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not DPBF16, reason="bi_q41_linear needs a CPU with AVX-512 BF16")
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (37, 64, True)])
def test_bi_q41_linear_rows_alone_and_float64(n, k, bias):
    """The batch-invariant Q4_1 x bfloat16 kernel (VDPBF16PS per block, then d and m by fma): every row's bits
    are the same alone, in batches of 2 to 300 at any position of the 6 x 4 register tiles and with other
    neighbours; the product is within float32's summation bound of a float64 product with the held weights
    (d q + m, exact: nothing rounded to bf16) plus one bf16 rounding; the portable build has no such kernel
    (has_bi_q41 False, and the call raises)."""
    from idleless.quant.formats import quantize_q4_1, unpack_q4

    native, portable = BUILDS[torch.bfloat16]
    assert native.has_bi_q41 and not portable.has_bi_q41
    g = _gen(n * k)
    qs, d, m = quantize_q4_1(torch.randn(n, k, generator=g) * k ** -0.5)
    held = (d.double()[..., None] * unpack_q4(qs).double() + m.double()[..., None]).reshape(n, k)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = (torch.randn(300, k, generator=g) * 2).to(torch.bfloat16)
    packed = native.bi_q41_pack(qs, d, m)
    full = native.bi_q41_linear(x, packed, n, b)
    assert torch.equal(full, torch.cat([native.bi_q41_linear(x[i:i + 1], packed, n, b) for i in range(300)]))
    for m0, mm in ((0, 2), (1, 5), (3, 7), (5, 13), (64, 65), (1, 299)):
        assert torch.equal(native.bi_q41_linear(x[m0:m0 + mm], packed, n, b), full[m0:m0 + mm]), (m0, mm)
    perm = torch.randperm(300, generator=_gen(9))
    assert torch.equal(native.bi_q41_linear(x[perm], packed, n, b), full[perm])
    xs = x.double()
    ref = xs @ held.T + (b.double() if bias else 0)
    bound = k * 2.0 ** -23 * (xs.abs() @ held.abs().T) + 2.0 ** -8 * ref.abs() + 1e-30
    assert ((full.double() - ref).abs() <= bound).all()
    assert torch.equal(native.bi_q41_pack(qs, d, m, out=packed), packed)  # re-packed in place, same bytes
    with pytest.raises(ValueError):
        portable.bi_q41_linear(x, packed, n, b)


@pytest.mark.skipif(not (DPBF16 and cpu_has("avx512vbmi")), reason="q8p_linear needs AVX-512 BF16 and VBMI")
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (37, 64, True), (16 * 6 * 2 + 16 * 5 + 9, 12, False)])
def test_q8p_linear_rows_alone_and_float64(n, k, bias):
    """int8 weights x bfloat16 on the packed layout (VDPBF16PS pair chain, codes decoded in registers for up to
    4 rows, through a per-thread buffer above): every row's bits are the same alone, in batches of 2 to 300
    at any position and with other neighbours (both paths, the full 6-panel tiles and the last narrower one);
    within float32's summation bound of the float64 product with the held codes times the scale, plus one
    bf16 rounding; unpack_q8 gives the codes back; the portable build has no such kernel."""
    from idleless.quant.formats import quantize_rows, unpack_q8

    native, portable = BUILDS[torch.bfloat16]
    assert native.has_q8p and not portable.has_q8p
    g = _gen(n + k)
    q, s = quantize_rows(torch.randn(n, k, generator=g), torch.int8)
    held = q.double() * s.double()[:, None]
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = (torch.randn(300, k + 8, generator=g) * 2).to(torch.bfloat16)[:, :k]  # strided rows
    packed = native.q8_pack(q)
    assert torch.equal(unpack_q8(packed, n), q) and torch.equal(unpack_q8(packed, n, 17, n - 3), q[17:n - 3])
    full = native.q8p_linear(x, packed, s, b)
    assert torch.equal(full, torch.cat([native.q8p_linear(x[i:i + 1], packed, s, b) for i in range(300)]))
    for m0, mm in ((0, 2), (1, 3), (3, 4), (5, 5), (2, 7), (5, 13), (64, 65), (1, 299)):
        assert torch.equal(native.q8p_linear(x[m0:m0 + mm], packed, s, b), full[m0:m0 + mm]), (m0, mm)
    perm = torch.randperm(300, generator=_gen(9))
    assert torch.equal(native.q8p_linear(x[perm], packed, s, b), full[perm])
    out = torch.empty(3, n, dtype=torch.bfloat16)
    assert native.q8p_linear(x[:3], packed, s, b, out=out) is out and torch.equal(out, full[:3])
    xs = x.double()
    ref = xs @ held.T + (b.double() if bias else 0)
    bound = k * 2.0 ** -23 * (xs.abs() @ held.abs().T) + 2.0 ** -8 * ref.abs() + 1e-30
    assert ((full.double() - ref).abs() <= bound).all()
    bad = q.clone()
    bad[0, 0] = -128
    with pytest.raises(ValueError):
        native.q8_pack(bad)
    with pytest.raises(ValueError):
        portable.q8p_linear(x, packed, s, b)
