"""Quantised KV cache (issue 14): the pool's formats (int8 with per-token scales, fp8 with static
per-head scales), capacity, the calibration pass and the scale file, attention over the stored format
against float64 attention over the same dequantised K/V, the kernels' builds against each other, and the
engine's radix hits / chunked prefill / retraction over an fp8 cache against a cold run."""

import json

import pytest
import torch

from idleless.cache.kv_pool import KVPool
from idleless.model import cpu_kernels
from idleless.model.attention import CompositeAttention, FusedDecodeAttention, TorchNativeAttention
from idleless.model.attention.invariant import QuantizedKVChunkedAttention, TorchChunkedAttention
from idleless.quant import kv_scales
from idleless.quant.kv import QuantizedKV

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
FMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_DTYPE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
H, HKV, D = 4, 2, 16


def head_scales(layers: int, heads: int, seed: int = 0, amax: float = 6.0, fmt: str = "fp8_e4m3"):
    """Static (k, v) scales [layers, heads] for an fp8 pool: amax * U(0.5, 1.5) * 4 / fmax (the
    calibration's form with a made-up amax per head)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(amax * (0.5 + torch.rand(layers, heads, generator=g)) * 4 / FMAX.get(fmt, 448.0) for _ in "kv")


def make_pool(fmt, layers, heads, dim, slots, dtype, seed=0):
    """A pool of format ``fmt``, with made-up static scales (``head_scales``) when it is fp8."""
    scales = head_scales(layers, heads, seed, fmt=fmt) if fmt in FP8_DTYPE else None
    return KVPool(layers, heads, dim, slots, dtype, cache_dtype=fmt, kv_scales=scales)


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_rows_round_trip(fmt):
    pool = make_pool(fmt, 1, HKV, D, 32, torch.float32)
    k, _ = pool.layer_kv(0)
    assert isinstance(k, QuantizedKV) and pool.quantized and k.static == (fmt != "int8")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, HKV, D, generator=g) * torch.tensor([0.01, 30.0])[None, :, None]
    slots = torch.tensor([7, 3, 30, 0, 12])
    k.write(slots, x)
    scale = k.scale[slots]
    if fmt == "int8":
        assert torch.equal(scale, x.abs().amax(-1) / FMAX[fmt])  # per token and head, from the row itself
    else:  # the static per-head scale for every slot, untouched by the write; no memory per slot
        assert torch.equal(scale, pool.k_head_scale[0].expand(5, HKV)) and k.scale.stride(0) == 0
        assert pool.k_scale is None and pool.v_scale is None
        assert bool((pool.k_head_scale > 0).all())
    back = k.index_select(0, slots).double()
    # fp8: saturation at +-fmax * scale (the second head's values run far beyond it)
    top = (scale.double() * FMAX[fmt])[..., None]
    want = x.double().clamp(-top, top) if fmt != "int8" else x.double()
    err = (back - want).abs()
    if fmt == "int8":
        bound = scale.double()[..., None] / 2 * 1.0001
    else:
        rel = 2.0 ** -4 if fmt == "fp8_e4m3" else 2.0 ** -3
        sub = 2.0 ** -9 if fmt == "fp8_e4m3" else 2.0 ** -16
        bound = want.abs() * rel * 1.0001 + scale.double()[..., None] * sub
        assert bool((x.double().abs() > top).any())  # the clamp was exercised
        assert bool((back.abs() <= top).all())
    assert bool((err <= bound).all())
    assert torch.equal(k[slots.min().item():slots.min().item() + 1], k.index_select(0, slots.min().reshape(1)))


def test_bytes_per_token_and_capacity():
    # float32 K and V: 2 * layers * heads * D * 4; int8: D bytes + a float32 scale per head; fp8: D bytes
    assert KVPool.bytes_per_token(3, 2, 64, torch.float32) == 2 * 3 * 2 * 64 * 4
    assert KVPool.bytes_per_token(3, 2, 64, torch.bfloat16) == 2 * 3 * 2 * 64 * 2
    assert KVPool.bytes_per_token(3, 2, 64, torch.float32, "bf16") == 2 * 3 * 2 * 64 * 2
    assert KVPool.bytes_per_token(3, 2, 64, torch.bfloat16, "int8") == 2 * 3 * 2 * (64 + 4)
    for fmt in FP8_DTYPE:
        assert KVPool.bytes_per_token(3, 2, 64, torch.bfloat16, fmt) == 2 * 3 * 2 * 64
    # SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64 in a 2 GiB budget
    budget = 2 << 30
    bf16 = budget // KVPool.bytes_per_token(30, 3, 64, torch.bfloat16)
    int8 = budget // KVPool.bytes_per_token(30, 3, 64, torch.bfloat16, "int8")
    fp8 = budget // KVPool.bytes_per_token(30, 3, 64, torch.bfloat16, "fp8_e4m3")
    assert (bf16, int8, fp8) == (93206, 175448, 186413) and fp8 in (2 * bf16, 2 * bf16 + 1)
    assert int8 / bf16 > 1.85  # 128 / 68 bytes per head
    with pytest.raises(ValueError, match="kv cache dtype"):
        KVPool(1, 2, 16, 8, torch.float32, cache_dtype="int4")
    with pytest.raises(ValueError, match="no default"):
        KVPool(1, 2, 16, 8, torch.float32, cache_dtype="fp8_e4m3")  # never a scale of 1.0
    with pytest.raises(ValueError, match="positive and finite"):
        KVPool(1, 2, 16, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(torch.ones(1, 2), torch.zeros(1, 2)))
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        KVPool(1, 2, 16, 8, torch.float32, cache_dtype="fp8_e5m2", kv_scales=(torch.ones(2), torch.ones(2)))
    with pytest.raises(ValueError, match="no static scales"):
        KVPool(1, 2, 16, 8, torch.float32, cache_dtype="int8", kv_scales=(torch.ones(1, 2), torch.ones(1, 2)))


def _reference(q, pool, tables, starts, extend, prefix):
    """float64 causal attention of every new row over the dequantised stored K/V (GQA: q head h reads
    KV head h // (H / HKV))."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    if pool.quantized:
        kq, vq = pool.layer_kv(0)
        kd = pool.k_cache[0].float().double() * kq.scale.double()[..., None]
        vd = pool.v_cache[0].float().double() * vq.scale.double()[..., None]
    else:
        kd, vd = pool.k_cache[0].double(), pool.v_cache[0].double()
    rep = H // HKV
    for table, s, e, p in zip(tables, starts, extend, prefix):
        k = kd[table].repeat_interleave(rep, 1)  # [L, H, D]
        v = vd[table].repeat_interleave(rep, 1)
        for r in range(e):
            n = p + r + 1
            sc = torch.einsum("hd,lhd->hl", q[s + r].double(), k[:n]) * D ** -0.5
            out[s + r] = torch.einsum("hl,lhd->hd", sc.softmax(-1), v[:n])
    return out


def _backends(pool, kind):
    if kind == "native":
        return TorchNativeAttention(pool, H, HKV, D)
    kern = cpu_kernels.load(torch.float32)
    if kind == "kernels" and kern is None:
        pytest.skip("no C compiler: the kernels are not built")
    return CompositeAttention(pool, H, HKV, D, kernels=kern, deterministic=kind == "deterministic")


@pytest.mark.parametrize("fmt", FORMATS + ["bf16"])
@pytest.mark.parametrize("kind", ["native", "kernels", "deterministic"])
def test_attention_reads_the_stored_format(fmt, kind):
    """A prefill, then a mixed batch: a decode row, an extend sharing 70 prefix slots with it (a shared
    segment, aligned to 64 when deterministic), a fresh prompt. Outputs match float64 attention over
    the dequantised K/V (the new tokens' K/V included: they are read back from the pool)."""
    g = torch.Generator().manual_seed(1)
    pool = make_pool(fmt, 1, HKV, D, 400, torch.float32)
    attn = _backends(pool, kind)
    perm = torch.randperm(400, generator=g)
    # step 1: request A prefills 80 tokens
    a_slots = perm[:80]
    q = torch.randn(80, H, D, generator=g)
    k, v = torch.randn(80, HKV, D, generator=g) * 3, torch.randn(80, HKV, D, generator=g)
    meta = attn.prepare([80], [0], [a_slots])
    out = attn.forward(q, k, v, 0, meta, a_slots)
    ref = _reference(q, pool, [a_slots], [0], [80], [0])
    assert (out.double() - ref).abs().max() < 2e-5
    # step 2: A decodes one token; B extends 3 tokens after A's first 70; C prefills 5
    a_new, b_new, c_new = perm[80:81], perm[81:84], perm[84:89]
    tables = [torch.cat([a_slots, a_new]), torch.cat([a_slots[:70], b_new]), c_new]
    extend, prefix = [1, 3, 5], [80, 70, 0]
    q = torch.randn(9, H, D, generator=g)
    k, v = torch.randn(9, HKV, D, generator=g) * 3, torch.randn(9, HKV, D, generator=g)
    meta = attn.prepare(extend, prefix, tables)
    assert meta.segments, "the shared 70-token prefix should be attended as a segment"
    out = attn.forward(q, k, v, 0, meta, torch.cat([a_new, b_new, c_new]))
    ref = _reference(q, pool, tables, [0, 1, 4], extend, prefix)
    assert (out.double() - ref).abs().max() < 2e-5


def test_quantized_pool_routing():
    """The fused decode kernel reads a quantised pool in place (decode_attn_q8); the other C attention
    kernels read K/V of their own dtype only, so extends and segments go to padded flash, which
    dequantises the rows it gathers; writes go through the quantiser."""
    kern = cpu_kernels.load(torch.float32)
    if kern is None:
        pytest.skip("no C compiler")
    pool = KVPool(2, HKV, D, 64, torch.float32, cache_dtype="int8")
    attn = CompositeAttention(pool, H, HKV, D, kernels=kern)
    assert isinstance(attn.decode_backend, FusedDecodeAttention) and attn.decode_backend.kernels is kern
    assert attn.extend_backend is attn.flash and attn.segment_backend is attn.flash and attn.kernels is None
    assert attn._write_kv == attn._write_kv_q8_kernel
    assert TorchNativeAttention(pool, H, HKV, D)._write_kv == attn._write_kv_quantized
    det = CompositeAttention(pool, H, HKV, D, kernels=kern, deterministic=True)
    assert isinstance(det.decode_backend, QuantizedKVChunkedAttention) and det.decode_backend.kernels is kern
    assert det.extend_backend is det.decode_backend and det.segment_backend is det.decode_backend
    bare = CompositeAttention(pool, H, HKV, D, kernels=None, deterministic=True)  # no kernels: PyTorch's twin
    assert isinstance(bare.decode_backend, TorchChunkedAttention)
    # chunk_attn refuses a quantised pair it cannot read, or a quantised K beside a plain V, before reading
    k, v = pool.layer_kv(0)
    one = torch.tensor([0, 1])
    args = (one, torch.tensor([3]), one, torch.tensor([0]), None, D ** -0.5, torch.empty(1, H, D))
    with pytest.raises(ValueError, match="bfloat16 kernels"):
        kern.chunk_attn(torch.zeros(1, H, D), k, v, *args)
    with pytest.raises(ValueError, match="both"):
        kern.chunk_attn(torch.zeros(1, H, D), k, torch.zeros(64, HKV, D), *args)


def _dequantised_reference(q, kq, vq, tables, extend, prefix):
    """float64 causal attention of the rows q [T, H, d] over the K/V codes times their scales (GQA)."""
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for table, e, p in zip(tables, extend, prefix):
        k = (kq.data[table].float().double() * kq.scale[table].double()[..., None]).repeat_interleave(H // HKV, 1)
        v = (vq.data[table].float().double() * vq.scale[table].double()[..., None]).repeat_interleave(H // HKV, 1)
        for r in range(e):
            sc = torch.einsum("hd,lhd->hl", q[start + r].double(), k[:p + r + 1]) * q.shape[-1] ** -0.5
            out[start + r] = torch.einsum("hl,lhd->hd", sc.softmax(-1), v[:p + r + 1])
        start += e
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,int8_attention,in_place", [(torch.float32, False, False),
                                                           (torch.bfloat16, False, False),
                                                           (torch.bfloat16, False, True),
                                                           (torch.bfloat16, True, True)])
def test_deterministic_attention_over_a_quantised_pool(fmt, dtype, int8_attention, in_place):
    """Deterministic attention over an int8 / fp8 pool, through a prefill, then a batch with a decode row,
    an extend sharing 130 prefix slots with it (a 128-key shared segment) and a fresh prompt. With the
    step's rows dequantised per layer it gives, bit for bit, the chunked kernel's output over a pool of the
    model dtype holding the dequantised values (the plain backend fed the rows the quantised pool reads
    back); with the codes read in place (bfloat16 kernels on AVX-512 BF16: the scales applied to scores
    and probabilities) it is as close to float64 attention over codes x scales as that plain backend is
    (within 1.5x its error), and the decode row alone gives the bits it gets in the batch. Also under int8
    attention (W8A8), where the kernels have it."""
    kern = cpu_kernels.load(dtype)
    if kern is None:
        pytest.skip("no C compiler")
    if in_place and not kern.chunk_attn_q8(64):
        pytest.skip("these kernels do not read a quantised pool in place (no AVX-512 BF16)")
    d, slots_n = 64, 400
    g = torch.Generator().manual_seed(3)
    qpool = make_pool(fmt, 1, HKV, d, slots_n, dtype)
    ref_pool = KVPool(1, HKV, d, slots_n, dtype)
    attn = CompositeAttention(qpool, H, HKV, d, kernels=kern, deterministic=True, int8_attention=int8_attention)
    ref = CompositeAttention(ref_pool, H, HKV, d, kernels=kern, deterministic=True, int8_attention=int8_attention)
    assert isinstance(attn.decode_backend, QuantizedKVChunkedAttention)
    assert attn.decode_backend.int8_attention == ref.decode_backend.int8_attention
    assert attn.decode_backend.in_place == kern.chunk_attn_q8(d)
    attn.decode_backend.in_place = in_place
    kq, vq = qpool.layer_kv(0)
    perm = torch.randperm(slots_n, generator=g)
    a_slots = perm[:150]
    a_new, b_new, c_new = perm[150:151], perm[151:154], perm[154:159]
    steps = [([150], [0], [a_slots], a_slots),
             ([1, 3, 5], [150, 130, 0], [torch.cat([a_slots, a_new]), torch.cat([a_slots[:130], b_new]), c_new],
              torch.cat([a_new, b_new, c_new]))]
    for extend, prefix, tables, loc in steps:
        n = sum(extend)
        q = (torch.randn(n, H, d, generator=g) * 2).to(dtype)
        k, v = (torch.randn(n, HKV, d, generator=g) * 3).to(dtype), torch.randn(n, HKV, d, generator=g).to(dtype)
        out = attn.forward(q, k, v, 0, attn.prepare(extend, prefix, tables), loc)
        # the reference pool gets what the quantised pool holds at those slots
        want = ref.forward(q, kq.index_select(0, loc), vq.index_select(0, loc), 0, ref.prepare(extend, prefix, tables),
                           loc)
        if not in_place:
            assert torch.equal(out, want)
        else:
            exact = _dequantised_reference(q, kq, vq, tables, extend, prefix)
            err, ref_err = (out.double() - exact).abs().max(), (want.double() - exact).abs().max()
            assert err <= 1.5 * ref_err + 1e-3, (err, ref_err)
    alone = attn.forward(q[:1], k[:1], v[:1], 0, attn.prepare([1], [150], tables[:1]), loc[:1])
    assert torch.equal(alone, out[:1])
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_reads_bytes_and_scales(fmt):
    """decode_attn_q8 alone on scattered slots with GQA, against float64 over the dequantised K/V, and
    its log-sum-exp against the float64 one."""
    kern = cpu_kernels.load(torch.float32)
    if kern is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(2)
    pool = make_pool(fmt, 1, HKV, D, 100, torch.float32)
    k, v = pool.layer_kv(0)
    k.write(torch.arange(100), torch.randn(100, HKV, D, generator=g) * 4)
    v.write(torch.arange(100), torch.randn(100, HKV, D, generator=g))
    lens = [1, 37, 60]
    slots = torch.randperm(100, generator=g)[:sum(lens)]
    offsets = torch.tensor([0] + lens).cumsum(0)
    q = torch.randn(3, H, D, generator=g)
    out, lse = torch.empty(3, H, D), torch.empty(3, H)
    rows = torch.arange(3)
    kern.decode_attn_q8(q, rows, k, v, slots, offsets, D ** -0.5, out, rows, lse)
    kd, vd = k.index_select(0, torch.arange(100)).double(), v.index_select(0, torch.arange(100)).double()
    for b in range(3):
        sl = slots[offsets[b]:offsets[b + 1]]
        kk, vv = kd[sl].repeat_interleave(H // HKV, 1), vd[sl].repeat_interleave(H // HKV, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), kk) * D ** -0.5
        assert (out[b].double() - torch.einsum("hl,lhd->hd", s.softmax(-1), vv)).abs().max() < 1e-5
        assert (lse[b].double() - s.logsumexp(-1)).abs().max() < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_bytes_of_the_torch_quantiser(fmt, dtype):
    """kv_write_q8 stores the same bytes and scales as QuantizedKV.write (PyTorch's round-to-nearest-
    even conversions), on values that hit ties, zeros, subnormal fp8 codes, the format's top and (static
    scales) values beyond it, which saturate."""
    kern = cpu_kernels.load(dtype)
    if kern is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, HKV, D, generator=g) * torch.logspace(-3, 3, 40)[:, None, None]
    x[0] = 0  # an all-zero row: scale 0
    x[1, :, :] = torch.linspace(-1, 1, D)  # exact ties after scaling for int8 (k/15 * 127)
    x[2, 0, :] = -0.0
    x = x.to(dtype)
    slots = torch.randperm(64, generator=g)[:40]
    a = make_pool(fmt, 1, HKV, D, 64, dtype, seed=4)
    b = make_pool(fmt, 1, HKV, D, 64, dtype, seed=4)
    a.layer_kv(0)[0].write(slots, x)
    kern.kv_write_q8(b.layer_kv(0)[0], x, slots)
    assert torch.equal(a.layer_kv(0)[0].scale, b.layer_kv(0)[0].scale)
    assert torch.equal(a.k_cache.view(torch.uint8), b.k_cache.view(torch.uint8))


@pytest.mark.parametrize("fmt", list(FP8_DTYPE))
def test_static_fp8_codes_every_value_tie_and_overflow(fmt):
    """With a static scale, kv_write_q8 (native and portable builds) and QuantizedKV.write store
    PyTorch's float8 conversion of clamp(x / s, +-fmax): every code's value, every midpoint between
    neighbouring codes (ties to even), values past fmax (saturated, never NaN) and signed zeros."""
    from kernel_builds import native_and_portable

    fp8 = FP8_DTYPE[fmt]
    vals = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    pos = vals[:128][torch.isfinite(vals[:128])].unique().sort().values  # 0 .. fmax
    mids = (pos[1:] + pos[:-1]) / 2
    ys = torch.cat([pos, mids, pos[1:] * 1.001, pos[1:] * 0.999, torch.tensor([FMAX[fmt] * 1.5, 1e30, 0.0])])
    ys = torch.cat([ys, -ys])
    n = -(-ys.numel() // (HKV * D))
    ys = torch.cat([ys, torch.zeros(n * HKV * D - ys.numel())])
    s = torch.tensor([[1.0, 0.37]])
    x = (ys.reshape(n, HKV, D) * s[0, :, None]).float()
    slots = torch.arange(n)
    want = (x / s[0, :, None]).clamp(-FMAX[fmt], FMAX[fmt]).to(fp8).view(torch.uint8)
    ref = KVPool(1, HKV, D, n, torch.float32, cache_dtype=fmt, kv_scales=(s, s))
    ref.layer_kv(0)[0].write(slots, x)
    assert torch.equal(ref.k_cache[0].view(torch.uint8), want)
    builds = native_and_portable()
    if not builds:
        pytest.skip("no C compiler")
    for kern in builds[torch.float32]:
        pool = KVPool(1, HKV, D, n, torch.float32, cache_dtype=fmt, kv_scales=(s, s))
        kern.kv_write_q8(pool.layer_kv(0)[0], x, slots)
        assert torch.equal(pool.k_cache[0].view(torch.uint8), want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_read_kernel_equals_torch_dequant(fmt, dtype):
    """kv_read_q8 (native and portable builds: the AVX-512 VBMI register decode and the scalar table),
    gathered and sliced, gives QuantizedKV's PyTorch dequantisation bit for bit (lut * scale in float32,
    rounded once)."""
    from kernel_builds import native_and_portable

    builds = native_and_portable()
    if not builds:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(8)
    pool = make_pool(fmt, 1, 3, 64, 300, dtype, seed=2)
    k, _ = pool.layer_kv(0)
    k.write(torch.arange(300), torch.randn(300, 3, 64, generator=g) * 5)
    k.data.view(torch.uint8)[7] = torch.arange(192, dtype=torch.uint8).reshape(3, 64)  # every code in a row
    k.data.view(torch.uint8)[8] = torch.arange(64, 256, dtype=torch.uint8).reshape(3, 64)
    if fmt == "int8":  # -128 is never stored (writes clamp to +-127)
        k.data.view(torch.uint8)[7:9][k.data.view(torch.uint8)[7:9] == 128] = 129
    else:
        k.data.view(torch.uint8)[7:9] &= 0xF7  # NaN codes aside (never stored: writes saturate)
    idx = torch.randperm(300, generator=g)[:77]
    idx[:2] = torch.tensor([7, 8])
    want = k._dequant(k._bits.index_select(0, idx), k.scale.index_select(0, idx))
    want_slice = k._dequant(k._bits[5:205], k.scale[5:205])
    for kern in builds[dtype]:
        assert torch.equal(kern.kv_read_q8(k, idx), want)
        assert torch.equal(kern.kv_read_q8(k, None, 5, 200), want_slice)
    assert torch.equal(k.index_select(0, idx), want) and torch.equal(k[5:205], want_slice)
    with pytest.raises(ValueError, match="out of range"):
        builds[dtype][0].kv_read_q8(k, torch.tensor([300]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attn_q8_builds(fmt, dtype):
    """decode_attn_q8 with per-head (fp8) and per-slot (int8) scales: the AVX2 build (-mno-avx512bf16)
    gives the portable scalar build's bits (output and log-sum-exp) for requests of 0, 1, 7, 8, 9 and 300
    keys on scattered slots; the native build (on an AVX-512 VBMI + BF16 CPU the VDPBF16PS kernel, another
    q.k order by design) and both others meet float64 attention over the dequantised K/V."""
    from kernel_builds import native_and_portable, native_without_avx512_bf16

    builds = native_and_portable()
    if not builds:
        pytest.skip("no C compiler")
    native, portable = builds[dtype]
    avx2 = native_without_avx512_bf16()[dtype]
    Hq, Hkv, Dd = 9, 3, 64
    g = torch.Generator().manual_seed(5)
    pool = make_pool(fmt, 1, Hkv, Dd, 1000, dtype, seed=6)
    k, v = pool.layer_kv(0)
    k.write(torch.arange(1000), torch.randn(1000, Hkv, Dd, generator=g) * 4)
    v.write(torch.arange(1000), torch.randn(1000, Hkv, Dd, generator=g))
    lens = [0, 1, 7, 8, 9, 300]
    q = (torch.randn(len(lens), Hq, Dd, generator=g) * 2).to(dtype)
    slots = torch.cat([torch.randperm(1000, generator=g)[:n] for n in lens])
    offsets = torch.tensor([0] + lens).cumsum(0)
    rows = torch.arange(len(lens))
    outs = []
    for kern in (avx2, portable, native):
        out, lse = torch.full((len(lens), Hq, Dd), 7.0), torch.full((len(lens), Hq), 7.0)
        kern.decode_attn_q8(q, rows, k, v, slots, offsets, Dd ** -0.5, out, rows, lse)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    kd = k.data.float().double() * k.scale.double()[..., None]
    vd = v.data.float().double() * v.scale.double()[..., None]
    for b, n in enumerate(lens):
        for out, lse in outs:
            if n == 0:
                assert torch.all(out[b] == 0) and torch.all(lse[b] == -float("inf"))
                continue
            sl = slots[offsets[b]:offsets[b + 1]]
            kk, vv = kd[sl].repeat_interleave(Hq // Hkv, 1), vd[sl].repeat_interleave(Hq // Hkv, 1)
            sc = torch.einsum("hd,lhd->hl", q[b].double(), kk) * Dd ** -0.5
            ref = torch.einsum("hl,lhd->hd", sc.softmax(-1), vv)
            assert (out[b].double() - ref).abs().max() < 2e-5
            assert (lse[b].double() - sc.logsumexp(-1)).abs().max() < 2e-5


# ---- calibration, the scale file, the runner and the engine over an fp8 cache ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kvq"), seed=3)


def _runner(path, kv="auto", **kw):
    from conftest import TEST_THREADS
    from idleless.config import EngineConfig
    from idleless.model.runner import ModelRunner

    cfg = dict(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS, kv_cache_dtype=kv)
    cfg.update(kw)
    return ModelRunner(EngineConfig(**cfg))


def test_calibrated_scales_are_the_brute_force_amax(tiny):
    """The runner's fp8 scales = amax * 4 / fmax per (layer, K or V, KV head), amax taken here by hand
    over every token and dimension of the K/V a plain runner writes for the gate's text (read back from
    its float32 pool, one token at a time); the pool holds exactly twice bf16's tokens for the same
    memory; the accuracy gate runs and reports its KL."""
    from idleless.quant.accuracy import CHUNK, forward_range, text_token_ids

    plain = _runner(tiny)
    ids = text_token_ids(tiny, plain.model_config.vocab_size)
    slots = plain.pool.alloc(0, 0, len(ids))
    for a in range(0, len(ids), CHUNK):
        forward_range(plain, ids[a:a + CHUNK], slots, a, torch.tensor([0]))
    L, Hkv = plain.pool.k_cache.shape[0], plain.pool.k_cache.shape[2]
    amax = {"k": torch.zeros(L, Hkv, dtype=torch.float64), "v": torch.zeros(L, Hkv, dtype=torch.float64)}
    for name, cache in (("k", plain.pool.k_cache), ("v", plain.pool.v_cache)):
        for layer in range(L):
            for h in range(Hkv):
                for s in slots.tolist():
                    amax[name][layer, h] = max(float(amax[name][layer, h]), float(cache[layer, s, h].abs().max()))
    for fmt in FP8_DTYPE:
        r = _runner(tiny, fmt)
        for name, got in (("k", r.pool.k_head_scale), ("v", r.pool.v_head_scale)):
            want = (amax[name] * 4 / FMAX[fmt]).float()
            assert torch.allclose(got, want, rtol=1e-6, atol=0), (fmt, name)
        assert r.precision["gate"] == "passed" and r.precision["kl"] is not None and r.precision["kl"] < 0.01
        assert r.pool.k_scale is None and r.pool.layer_kv(0)[0].scale.stride(0) == 0  # nothing per slot
        bf16 = _runner(tiny, "bf16", skip_quantization_gate=True)
        assert r.pool.num_slots in (2 * bf16.pool.num_slots, 2 * bf16.pool.num_slots + 1)
        assert r.precision["kv_bytes_per_token"] * 2 == bf16.precision["kv_bytes_per_token"]


def test_scale_file_round_trip_and_refusals(tiny, tmp_path):
    """--quantization-param-path: the per-head file the runner writes loads back exactly and gives the
    same pool; vLLM's per-layer form applies one scale to K, V and every head; a file missing a layer or
    a head, with a bad value, for another format, or given to int8 is refused with a message naming it."""
    ref = _runner(tiny, "fp8_e4m3", skip_quantization_gate=True)
    path = str(tmp_path / "kv.json")
    kv_scales.save_scale_file(path, ref.pool.k_head_scale, ref.pool.v_head_scale, "fp8_e4m3")
    # with the accuracy gate on (its float reference must not be handed the fp8 file: a fresh-clone
    # server with a valid file failed to start)
    r = _runner(tiny, "fp8_e4m3", quantization_param_path=path)
    assert r.precision["gate"] == "passed" and r.precision["kl"] is not None
    assert torch.equal(r.pool.k_head_scale, ref.pool.k_head_scale)
    assert torch.equal(r.pool.v_head_scale, ref.pool.v_head_scale)
    L, Hkv = ref.pool.k_head_scale.shape
    doc = json.load(open(path))
    layers = doc["kv_cache"]["scaling_factor"]["0"]

    def refused(mutate, match, fmt="fp8_e4m3"):
        d = json.loads(json.dumps(doc))
        mutate(d["kv_cache"], d["kv_cache"]["scaling_factor"]["0"])
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(d))
        with pytest.raises(kv_scales.KVScaleError, match=match):
            kv_scales.load_scale_file(str(bad), L, Hkv, fmt)
        with pytest.raises(ValueError, match=match):
            _runner(tiny, fmt, skip_quantization_gate=True, quantization_param_path=str(bad))

    refused(lambda kv, ls: ls.pop(str(L - 1)), f"layer {L - 1} is missing")
    refused(lambda kv, ls: ls["0"]["v"].pop(), "one scale per KV head")
    refused(lambda kv, ls: ls["0"].pop("k"), "one scale per KV head")
    refused(lambda kv, ls: ls["0"]["k"].__setitem__(0, 0.0), "positive finite")
    refused(lambda kv, ls: ls.__setitem__(str(L), 0.1), "not layers")
    refused(lambda kv, ls: kv.__setitem__("dtype", "float8_e5m2"), "the KV cache is fp8_e4m3")
    with pytest.raises(kv_scales.KVScaleError, match="cannot read"):
        kv_scales.load_scale_file(str(tmp_path / "none.json"), L, Hkv, "fp8_e4m3")
    # vLLM's and SGLang's per-layer form
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn",
                                             "scaling_factor": {"0": {str(i): 0.01 * (i + 1) for i in range(L)}}}}))
    k, v = kv_scales.load_scale_file(str(flat), L, Hkv, "fp8_e4m3")
    assert torch.equal(k, v) and torch.equal(k[:, 0], torch.tensor([0.01 * (i + 1) for i in range(L)]))
    assert torch.equal(k, k[:, :1].expand(L, Hkv))
    with pytest.raises(ValueError, match="int8 scales are per token"):
        _runner(tiny, "int8", skip_quantization_gate=True, quantization_param_path=str(flat))


def _engine_outputs(path, **kw):
    from conftest import TEST_THREADS
    from idleless.config import EngineConfig
    from idleless.engine.core import EngineCore
    from idleless.engine.request import Request, SamplingParams

    g = torch.Generator().manual_seed(21)
    shared = torch.randint(3, 256, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 256, (5 + 3 * i,), generator=g).tolist() for i in range(6)]
    cfg = dict(model=path, dtype="float32", kv_cache_memory="4MiB", num_threads=TEST_THREADS,
               kv_cache_dtype="fp8_e4m3", skip_quantization_gate=True)
    cfg.update(kw)
    core = EngineCore(EngineConfig(**cfg))
    out = {f"r{i}": [] for i in range(len(prompts))}
    cached = {}
    # two waves: the second repeats the first's prompts (radix hits on fp8 pages written by the first)
    for wave in range(2):
        for i, p in enumerate(prompts):
            core.add_request(Request(f"w{wave}r{i}", p, SamplingParams(temperature=0, max_new_tokens=24,
                                                                         ignore_eos=True)))
        while core.has_work():
            for o in core.step():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
                cached[o.rid] = o.cached_tokens
    return {k: v for k, v in out.items() if v}, cached, core


def test_engine_fp8_radix_chunked_retraction_match_a_cold_run(tiny):
    """Greedy outputs over an fp8 KV cache (calibrated scales) are the same with the radix cache off (every
    token computed cold), on (the second wave reads the first wave's fp8 pages), with chunked prefill of 16
    tokens, and in a pool small enough to retract requests; deterministic inference gives them too."""
    from idleless.cache.kv_pool import KVPool as _Pool

    cold, _, _ = _engine_outputs(tiny, disable_radix_cache=True)
    warm, cached, _ = _engine_outputs(tiny)
    assert sum(cached[f"w1r{i}"] for i in range(6)) > 6 * 70  # the second wave hit the tree
    chunked, _, _ = _engine_outputs(tiny, chunked_prefill_size=16)
    per_token = _Pool.bytes_per_token(2, 2, 16, torch.float32, "fp8_e4m3")
    small, _, core = _engine_outputs(tiny, kv_cache_memory=str(260 * per_token), disable_radix_cache=True)
    assert core.scheduler.stats.num_retractions > 0
    det, _, _ = _engine_outputs(tiny, enable_deterministic_inference=True, disable_radix_cache=True)
    det_warm, _, _ = _engine_outputs(tiny, enable_deterministic_inference=True)
    for name, got in (("radix", warm), ("chunked", chunked), ("retraction", small)):
        assert got == cold, name
    assert det == det_warm


def test_disabled_kernels_read_with_torch_ops(tiny):
    """--disable-cpu-kernels reaches the quantised layers' row reads (PyTorch ops alone); a pool given no
    kernels loads them on first use; both read the same values."""
    r = _runner(tiny, "fp8_e4m3", skip_quantization_gate=True, disable_cpu_kernels=True)
    k, _ = r.pool.layer_kv(0)
    assert k.kernels is None
    pool = make_pool("fp8_e4m3", 1, HKV, D, 8, torch.float32)
    pool.layer_kv(0)[0].write(torch.arange(8), torch.randn(8, HKV, D))
    if cpu_kernels.load(torch.float32) is not None:
        assert pool.layer_kv(0)[0].kernels is not None
    off = KVPool(1, HKV, D, 8, torch.float32, cache_dtype="fp8_e4m3", kv_scales=(pool.k_head_scale, pool.v_head_scale),
                 kernels=None)
    off.k_cache.copy_(pool.k_cache)
    assert torch.equal(off.layer_kv(0)[0][0:8], pool.layer_kv(0)[0][0:8])


@pytest.mark.parametrize("fmt", FORMATS + ["bf16", "auto"])
def test_quantised_pool_merges_shared_prefixes_in_c(fmt):
    """Padded flash's cascade merge runs in the C kernels (``merge``, in the model dtype) for a quantised
    pool too, not only for a pool of the model's own dtype; a bf16 pool under a float32 model keeps the
    PyTorch merge (no kernels of its storage dtype). A shared-prefix batch's output agrees with the
    PyTorch merge's to float32 rounding and with float64 attention over the dequantised K/V."""
    kern = cpu_kernels.load(torch.float32)
    if kern is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(5)
    pool = make_pool(fmt, 1, HKV, D, 300, torch.float32)
    attn, native = CompositeAttention(pool, H, HKV, D, kernels=kern), TorchNativeAttention(pool, H, HKV, D)
    c_merge = fmt != "bf16"
    assert (attn.flash.kernels is kern) == c_merge and native.flash.kernels is None
    assert attn.flash._merge == (attn.flash._merge_kernel if c_merge else attn.flash._merge_torch)
    slots = torch.randperm(300, generator=g)
    prompt = slots[:90]
    attn.forward(torch.randn(90, H, D, generator=g), torch.randn(90, HKV, D, generator=g) * 3,
                 torch.randn(90, HKV, D, generator=g), 0, attn.prepare([90], [0], [prompt]), prompt)
    # three requests share the 90-token prompt: two decode rows and a 20-token extend (a shared segment
    # merged into each row's tail; the decode rows go to the fused kernel, the extend to padded flash)
    new = [slots[90:91], slots[91:92], slots[92:112]]
    tables = [torch.cat([prompt, n]) for n in new]
    extend, prefix = [1, 1, 20], [90, 90, 90]
    q = torch.randn(22, H, D, generator=g)
    k, v = torch.randn(22, HKV, D, generator=g) * 3, torch.randn(22, HKV, D, generator=g)
    loc = torch.cat(new)
    meta = attn.prepare(extend, prefix, tables)
    assert any(b is attn.flash and p.segments for b, p in meta.parts)
    out = attn.forward(q, k, v, 0, meta, loc)
    ref_torch = native.forward(q, k, v, 0, native.prepare(extend, prefix, tables), loc)  # rewrites the same rows
    ref = _reference(q, pool, tables, [0, 1, 2], extend, prefix)
    assert (out.double() - ref).abs().max() < 2e-5
    assert (out - ref_torch).abs().max() < 1e-5


def test_engine_int8_in_place_radix_chunked_retraction_match_a_cold_run(tmp_path):
    """The same over an int8 cache read in place by the deterministic chunked kernel (a bfloat16 model with
    head_dim 32: ``chunk_attn_q8``): radix hits, chunked prefill of 16 tokens and retractions give the cold
    run's greedy tokens."""
    from conftest import make_tiny_model
    from idleless.cache.kv_pool import KVPool as _Pool

    kern = cpu_kernels.load(torch.bfloat16)
    if kern is None or not kern.chunk_attn_q8(32):
        pytest.skip("these kernels do not read a quantised pool in place (no AVX-512 BF16)")
    path = make_tiny_model(tmp_path, seed=4, hidden_size=128, head_dim=32, dtype=torch.bfloat16)
    kw = dict(dtype="bfloat16", kv_cache_dtype="int8", enable_deterministic_inference=True)
    cold, _, core = _engine_outputs(path, disable_radix_cache=True, **kw)
    assert core.runner.backend.decode_backend.in_place
    warm, cached, _ = _engine_outputs(path, **kw)
    assert sum(cached[f"w1r{i}"] for i in range(6)) > 6 * 70
    chunked, _, _ = _engine_outputs(path, chunked_prefill_size=16, **kw)
    per_token = _Pool.bytes_per_token(2, 2, 32, torch.bfloat16, "int8")
    small, _, core = _engine_outputs(path, kv_cache_memory=str(260 * per_token), disable_radix_cache=True, **kw)
    assert core.scheduler.stats.num_retractions > 0
    for name, got in (("radix", warm), ("chunked", chunked), ("retraction", small)):
        assert got == cold, name
