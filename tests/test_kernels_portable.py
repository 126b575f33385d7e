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
    blocks), stored softmax state included."""
    native, portable = BUILDS[dtype]
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
    key's K scale in its score factor, V's scale in its weight) gives the scalar kernel's bits, output
    and log-sum-exp, for requests of 0, 1, 7, 8, 9 and 300 keys on scattered slots (its float64
    reference is tests/test_kv_dtype.py's)."""
    from idleless.cache.kv_pool import KVPool

    native, portable = BUILDS[dtype]
    H, Hkv, D = 9, 3, 64
    g = _gen(5)
    pool = KVPool(1, Hkv, D, 1000, dtype, cache_dtype=fmt)
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
