"""Quantised KV cache (issue 14): the pool's formats, capacity, and attention over the stored format
against float64 attention over the same dequantised K/V."""

import pytest
import torch

from idleless.cache.kv_pool import KVPool
from idleless.model import cpu_kernels
from idleless.model.attention import CompositeAttention, FusedDecodeAttention, TorchNativeAttention
from idleless.model.attention.invariant import TorchChunkedAttention
from idleless.quant.kv import QuantizedKV

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
FMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
H, HKV, D = 4, 2, 16


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_rows_round_trip(fmt):
    pool = KVPool(1, HKV, D, 32, torch.float32, cache_dtype=fmt)
    k, _ = pool.layer_kv(0)
    assert isinstance(k, QuantizedKV) and pool.quantized
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, HKV, D, generator=g) * torch.tensor([0.01, 30.0])[None, :, None]
    slots = torch.tensor([7, 3, 30, 0, 12])
    k.write(slots, x)
    scale = pool.k_scale[0, slots]
    assert torch.equal(scale, x.abs().amax(-1) / FMAX[fmt])  # per token and head, from the row itself
    back = k.index_select(0, slots).double()
    err = (back - x.double()).abs()
    if fmt == "int8":
        bound = scale.double()[..., None] / 2 * 1.0001
    else:
        rel = 2.0 ** -4 if fmt == "fp8_e4m3" else 2.0 ** -3
        bound = x.double().abs() * rel * 1.0001 + scale.double()[..., None] * 2.0 ** -9
    assert bool((err <= bound).all())
    assert torch.equal(k[slots.min().item():slots.min().item() + 1], k.index_select(0, slots.min().reshape(1)))


def test_bytes_per_token_and_capacity():
    # float32 K and V: 2 * layers * heads * D * 4; a quantised format: D bytes + a float32 scale per head
    assert KVPool.bytes_per_token(3, 2, 64, torch.float32) == 2 * 3 * 2 * 64 * 4
    assert KVPool.bytes_per_token(3, 2, 64, torch.bfloat16) == 2 * 3 * 2 * 64 * 2
    assert KVPool.bytes_per_token(3, 2, 64, torch.float32, "bf16") == 2 * 3 * 2 * 64 * 2
    for fmt in FORMATS:
        assert KVPool.bytes_per_token(3, 2, 64, torch.bfloat16, fmt) == 2 * 3 * 2 * (64 + 4)
    budget = 1 << 20
    bf16 = budget // KVPool.bytes_per_token(3, 2, 64, torch.bfloat16)
    int8 = budget // KVPool.bytes_per_token(3, 2, 64, torch.bfloat16, "int8")
    assert int8 / bf16 > 1.85  # 128 / 68 bytes per head
    with pytest.raises(ValueError, match="kv cache dtype"):
        KVPool(1, 2, 16, 8, torch.float32, cache_dtype="int4")


def _reference(q, pool, tables, starts, extend, prefix):
    """float64 causal attention of every new row over the dequantised stored K/V (GQA: q head h reads
    KV head h // (H / HKV))."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    if pool.quantized:
        kd = pool.k_cache[0].float().double() * pool.k_scale[0].double()[..., None]
        vd = pool.v_cache[0].float().double() * pool.v_scale[0].double()[..., None]
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
    pool = KVPool(1, HKV, D, 400, torch.float32, cache_dtype=fmt)
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
    assert isinstance(det.decode_backend, TorchChunkedAttention)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_reads_bytes_and_scales(fmt):
    """decode_attn_q8 alone on scattered slots with GQA, against float64 over the dequantised K/V, and
    its log-sum-exp against the float64 one."""
    kern = cpu_kernels.load(torch.float32)
    if kern is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(2)
    pool = KVPool(1, HKV, D, 100, torch.float32, cache_dtype=fmt)
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
    even conversions), on values that hit ties, zeros, subnormal fp8 codes and the format's top."""
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
    a = KVPool(1, HKV, D, 64, dtype, cache_dtype=fmt)
    b = KVPool(1, HKV, D, 64, dtype, cache_dtype=fmt)
    a.layer_kv(0)[0].write(slots, x)
    kern.kv_write_q8(b.layer_kv(0)[0], x, slots)
    assert torch.equal(a.k_scale, b.k_scale)
    assert torch.equal(a.k_cache.view(torch.uint8), b.k_cache.view(torch.uint8))
