"""Fused CPU kernels for the glue between a layer's matmuls: RMSNorm (with the residual add), rotary
embedding, SwiGLU, KV-pool writes, decode attention and the cascade merge; and, on CPUs with AMX tiles
(Intel Sapphire Rapids and later; bfloat16 only, ``has_amx``), ragged attention for shared segments and
multi-token tails (``ragged_attn``) and the linear layers of decode-sized batches (``amx_linear``).

Why: at decode each of these is 3-15 eager PyTorch ops on a few kilobytes, and inside a model step
each op pays PyTorch's dispatch cost, so for SmolLM2 at batch 1 the glue took as long as the weight
reads (figures in benchmarks/README.md). The kernels are plain C (``cpu_kernels.c``), compiled on first use with the system C
compiler (``cc -O3 -march=native -fopenmp``, no FMA contraction so products round as in PyTorch) into
``$IDLELESS_CACHE_DIR/kernels/`` keyed by the source, the flags and the CPU, and called through ctypes. Large calls split their rows over OpenMP threads: the library links libgomp.so.1,
which resolves to the copy PyTorch already loaded, so both share one thread pool and
``torch.set_num_threads``. They round to the model dtype where PyTorch / Hugging Face do, so they
agree with the eager path up to float32 summation order (tests check each against it and the model
against transformers). Without a compiler, with an unwritable cache, or with
``EngineConfig.disable_cpu_kernels``, the model runs its eager PyTorch path.

AMX needs the kernel's permission for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked once);
where it is refused, ``has_amx`` is False and those paths stay on PyTorch's flash kernel and oneDNN.

All methods take CPU tensors of the dtype the object was made for (float32 or bfloat16) and raise
ValueError on a layout the kernel cannot read; index tensors are int64.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-ffp-contract=off", "-fPIC",
          "-shared"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_LIB: dict[str, Optional[ctypes.CDLL]] = {}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "decode_attn_q8": [_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _F, _P, _P, _P, _P],
    "kv_write_q8": [_P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    "kv_read_q8": [_P, _P, _I, _P, _P, _I, _I, _I, _I, _P],
    "rms_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _F],
    "rope": [_P, _I, _P, _P, _P, _I, _I, _I],
    "silu_mul": [_P, _P, _I, _I],
    "kv_write": [_P, _P, _I, _P, _I, _I],
    "decode_attn": [_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _P, _P, _P, _P],
    "merge": [_P, _P, _P, _P, _P, _P, _I, _I, _I],
    "a8_quantize": [_P, _I, _I, _I, _P, _P, _P],
}
# kernels in both dtypes that return int (1 = done, 0 = out of memory): the batch-invariant ones
_SIGNATURES_INT = {
    "bi_linear_pack": [_P, _I, _I, _P],
    "bi_linear": [_P, _I, _I, _I, _P, _I, _P, _P, _I],
    "chunk_attn": [_P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _F, _P, _P, _P, ctypes.c_int, _P, ctypes.c_int,
                   _P, _P, _I, _P],
    "chunk_attn_layer": [_P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _F, _P, ctypes.c_int, _P, _P, _I, _P],
    # quantised weights (idleless.quant): x in the kernels' dtype, weights int8 or GGUF Q4_1
    "q8_linear": [_P, _I, _I, _I, _P, _P, _I, _P, _P, _I],
    "q41_linear": [_P, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I],
    "w8a8_linear": [_P, _I, _I, _I, _P, _P, _I, _P, _P, _I],
    "w8a8_gemm": [_P, _I, _I, _I, _P, _P, _I, _P, _P, _I],
    "q80_linear": [_P, _I, _I, _I, _P, _P, _I, _P, _P, _I],
    "lut8_linear": [_P, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I],
    # GGUF Q4_1 / Q8_0 weights times activations quantised to int8 per block of 32 (W4A8, llama.cpp's scheme)
    "q41_a8_linear": [_P, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I],
    "q80_a8_linear": [_P, _I, _I, _I, _P, _P, _I, _P, _P, _I],
}
# kernels of one version whatever the dtype (float32 outputs)
_DTYPE_FREE = {"q41_dequant": [_P, _P, _P, _I, _I, _P], "q80_dequant": [_P, _P, _I, _I, _P],
               "w8a8_pack": [_P, _I, _I, _P]}
# kernels without a float32 twin: name -> (argtypes, restype)
_BF16_ONLY = {"amx_linear_pack": ([_P, _I, _I, _P], None),
              "amx_linear": ([_P, _I, _I, _I, _P, _I, _P, _P, _I], ctypes.c_int),
              "ragged_attn": ([_P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _F, _P, _P, _I, _P, _I, _I], ctypes.c_int)}


def _cpu_id() -> str:
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build_library() -> Optional[Path]:
    """Compile ``cpu_kernels.c`` into the cache (once per source / flags / CPU) and return the .so path,
    or None (with a warning) when no C compiler is found, the cache folder cannot be written or
    compiling fails. ``$CC`` may hold a command with arguments (``ccache gcc``)."""
    from idleless.model.loader import _cache_root

    cc = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not cc:
        log.warning("no C compiler (cc/gcc) found: the fused CPU kernels are off, the eager path runs")
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(cc + CFLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    out_dir = Path(_cache_root()) / "kernels"
    so = out_dir / f"cpu_kernels-{key}.so"
    if so.exists():
        return so
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as e:
        log.warning("cannot write the kernel cache %s (eager path used): %s", out_dir, e)
        return None
    try:
        res = None
        for extra in (["-fopenmp"], []):  # OpenMP if the compiler has it (then PyTorch's libgomp is used)
            try:
                res = subprocess.run([*cc, *CFLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                                     text=True)
            except OSError as e:
                log.warning("running the C compiler %s failed (eager path used): %s", " ".join(cc), e)
                return None
            if res.returncode == 0:
                break
        if res.returncode != 0:
            log.warning("compiling the fused CPU kernels with %s failed (eager path used), exit %d:\n%s",
                        " ".join(cc), res.returncode, (res.stderr or res.stdout)[-2000:])
            return None
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: let other users sharing the cache load it
        os.replace(tmp, so)  # atomic: concurrent builders each install a complete file
        return so
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _library() -> Optional[ctypes.CDLL]:
    if "lib" not in _LIB:
        so = build_library()
        lib = None
        if so is not None:
            try:
                lib = ctypes.CDLL(str(so))
            except OSError as e:
                log.warning("loading the fused CPU kernels failed (eager path used): %s", e)
        _LIB["lib"] = lib
    return _LIB["lib"]


def load(dtype: torch.dtype, device: str = "cpu") -> Optional["CpuKernels"]:
    """The kernels for ``dtype`` on ``device``, or None where they do not apply (not CPU, a dtype
    other than float32 / bfloat16, no compiler)."""
    if device != "cpu" or dtype not in _SUFFIX:
        return None
    lib = _library()
    return CpuKernels(lib, dtype) if lib is not None else None


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def check_chunk_attn(res: int, name: str) -> None:
    """chunk_attn's / chunk_attn_layer's return code: 1 done, else MemoryError (0: buffers) or ValueError (-1: a
    row's limit negative or past its item's key count; -2: a quantised pool these kernels do not read; nothing
    was read or written)."""
    if res == 0:
        raise MemoryError(f"{name}: cannot allocate its buffers")
    if res == -2:
        raise ValueError(f"{name}: these kernels do not read a quantised KV pool (chunk_attn_q8)")
    if res < 0:
        raise ValueError(f"{name}: a row's limit is negative or past its item's keys")


def _check_index(*tensors: torch.Tensor) -> None:
    """The C code reads index tensors as raw int64 arrays: anything else would be read as garbage."""
    for t in tensors:
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"index tensors must be contiguous int64, got {t.dtype}")


class CpuKernels:
    """The kernels of ``cpu_kernels.c`` for one dtype (``self.dtype``)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype):
        self.dtype = dtype
        suf = _SUFFIX[dtype]
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"{name}_{suf}")
            fn.argtypes, fn.restype = argtypes, None
            setattr(self, f"_{name}", fn)
        for name, argtypes in _SIGNATURES_INT.items():
            fn = getattr(lib, f"{name}_{suf}")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, f"_{name}", fn)
        lib.amx_available.argtypes, lib.amx_available.restype = [], ctypes.c_int
        for name, argtypes in _DTYPE_FREE.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
            setattr(self, f"_{name}", fn)
        # deterministic inference with Q4_1 weights in bfloat16 on VDPBF16PS (AVX-512 BF16 in this build; H3)
        lib.bi_q41_available.argtypes, lib.bi_q41_available.restype = [], ctypes.c_int
        self.has_bi_q41 = dtype == torch.bfloat16 and bool(lib.bi_q41_available())
        lib.bi_q41_pack.argtypes, lib.bi_q41_pack.restype = [_P, _P, _P, _I, _I, _P], None
        lib.bi_q41_linear.argtypes, lib.bi_q41_linear.restype = [_P, _I, _I, _I, _P, _I, _P, _P, _I], ctypes.c_int
        self._bi_q41_pack, self._bi_q41_linear = lib.bi_q41_pack, lib.bi_q41_linear
        # the Q8_0 twin (the GGUF lm_head): bi_q80_pack / bi_q80_linear, same condition
        lib.bi_q80_available.argtypes, lib.bi_q80_available.restype = [], ctypes.c_int
        self.has_bi_q80 = dtype == torch.bfloat16 and bool(lib.bi_q80_available())
        lib.bi_q80_pack.argtypes, lib.bi_q80_pack.restype = [_P, _P, _I, _I, _P], None
        lib.bi_q80_linear.argtypes, lib.bi_q80_linear.restype = [_P, _I, _I, _I, _P, _I, _P, _P, _I], ctypes.c_int
        self._bi_q80_pack, self._bi_q80_linear = lib.bi_q80_pack, lib.bi_q80_linear
        # int8 weights x bfloat16 on VDPBF16PS over a packed weight (AVX-512 BF16 + VBMI in this build)
        lib.q8p_available.argtypes, lib.q8p_available.restype = [], ctypes.c_int
        self.has_q8p = dtype == torch.bfloat16 and bool(lib.q8p_available())
        lib.q8_pack.argtypes, lib.q8_pack.restype = [_P, _I, _I, _P], ctypes.c_int
        lib.q8p_linear_bf16.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _P, _I]
        lib.q8p_linear_bf16.restype = ctypes.c_int
        self._q8_pack, self._q8p_linear = lib.q8_pack, lib.q8p_linear_bf16
        # w8a8_gemm on vpdpbusd (AVX512-VNNI in this build) rather than its scalar loops
        lib.w8a8_gemm_vnni.argtypes, lib.w8a8_gemm_vnni.restype = [], ctypes.c_int
        self.has_vnni = bool(lib.w8a8_gemm_vnni())
        lib.chunk_attn_int8.argtypes, lib.chunk_attn_int8.restype = [_I], ctypes.c_int
        self._chunk_attn_int8 = lib.chunk_attn_int8
        lib.chunk_attn_q8.argtypes, lib.chunk_attn_q8.restype = [_I], ctypes.c_int
        self._chunk_attn_q8 = lib.chunk_attn_q8
        # AMX tiles (Intel Sapphire Rapids and later) for ragged_attn and amx_linear: bfloat16 only
        self.has_amx = dtype == torch.bfloat16 and bool(lib.amx_available())
        if self.has_amx:
            for name, (argtypes, restype) in _BF16_ONLY.items():
                fn = getattr(lib, f"{name}_bf16")
                fn.argtypes, fn.restype = argtypes, restype
                setattr(self, f"_{name}", fn)

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != self.dtype or t.device.type != "cpu":
                raise ValueError(f"expected a CPU {self.dtype} tensor, got {t.dtype} on {t.device}")

    def _check_bias(self, bias: Optional[torch.Tensor], n: int, kernel: str) -> None:
        """A linear kernel's bias: None or a contiguous [n] of the kernels' dtype, else ValueError."""
        if bias is not None:
            self._check(bias)
            if bias.numel() != n or not bias.is_contiguous():
                raise ValueError(f"{kernel}: bias must be contiguous [N]")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """RMSNorm of x [n, h] (rows may be strided, elements contiguous) with weight [h] ->
        new [n, h]. With residual [n, h] (contiguous), first residual += x in place (rounded to the
        dtype) and the norm is of the sum, as ``hidden = residual + hidden`` before a Llama norm."""
        self._check(x, weight)
        n, h = x.shape
        if x.stride(1) != 1 or weight.numel() != h or not weight.is_contiguous():
            raise ValueError("rms_norm: x rows must be contiguous and weight [h]")
        if residual is not None:
            self._check(residual)
            if residual.shape != x.shape or not residual.is_contiguous():
                raise ValueError("rms_norm: residual must be a contiguous tensor of x's shape")
        out = torch.empty(n, h, dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), _ptr(residual), h, weight.data_ptr(), out.data_ptr(), h,
                       n, h, eps)
        return out

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [n, heads, d] in place (rotate-half layout); rows may be strided, heads must
        be d elements apart. positions int64 [n]; cos, sin float32 [max_positions, d]."""
        self._check(x)
        n, nh, d = x.shape
        _check_index(positions)
        if x.stride(2) != 1 or x.stride(1) != d or positions.numel() != n:
            raise ValueError("rope: x must be [n, heads, d] with contiguous heads and int64 positions [n]")
        if cos.dtype != torch.float32 or cos.shape[1] != d or not cos.is_contiguous() or not sin.is_contiguous():
            raise ValueError("rope: cos/sin must be contiguous float32 [max_positions, d]")
        self._rope(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, nh, d)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: gate_up [n, 2m] contiguous (gate | up) -> silu(gate) * up, new [n, m]."""
        self._check(gate_up)
        n, m2 = gate_up.shape
        if not gate_up.is_contiguous() or m2 % 2:
            raise ValueError("silu_mul: gate_up must be contiguous [n, 2m]")
        out = torch.empty(n, m2 // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), n, m2 // 2)
        return out

    def kv_write(self, cache: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
        """cache[slots] = src: cache [num_slots, heads, d] contiguous, src [n, heads, d] with
        contiguous rows (row stride free), slots int64 [n], each < num_slots."""
        self._check(cache, src)
        n = src.shape[0]
        width = cache.shape[1] * cache.shape[2]
        if (not cache.is_contiguous() or src.shape[1] * src.shape[2] != width or src.stride(2) != 1
                or src.stride(1) != src.shape[2] or slots.numel() != n):
            raise ValueError("kv_write: layout mismatch")
        _check_index(slots)
        self._kv_write(cache.data_ptr(), src.data_ptr(), src.stride(0), slots.data_ptr(), n, width)

    def decode_attn(self, q: torch.Tensor, q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, offsets: torch.Tensor, scale: float, out: torch.Tensor,
                    out_rows: torch.Tensor, lse: Optional[torch.Tensor] = None) -> None:
        """One query row per request against its keys in the pool (all visible), float32 softmax.
        q [T, H, D] (heads contiguous, rows may be strided); request b reads query row q_rows[b] and the KV slots
        slots[offsets[b]:offsets[b+1]] of k_cache / v_cache [num_slots, Hkv, D]; writes row
        out_rows[b] of out [*, H, D] (float32, or the kernels' dtype) and, if given, of lse [*, H]
        float32 (natural log-sum-exp of the scaled scores). Index tensors int64, contiguous."""
        self._check(q, k_cache, v_cache)
        nb = q_rows.numel()
        _, H, D = q.shape
        Hkv = k_cache.shape[1]
        if (q.stride(2) != 1 or q.stride(1) != D or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or offsets.numel() != nb + 1 or out_rows.numel() != nb or out.shape[1:] != (H, D)
                or not out.is_contiguous() or out.dtype not in (torch.float32, self.dtype)):
            raise ValueError("decode_attn: layout mismatch")
        if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous()):
            raise ValueError("decode_attn: lse must be contiguous float32")
        _check_index(q_rows, slots, offsets, out_rows)
        as_float = out.dtype == torch.float32
        self._decode_attn(q.data_ptr(), q.stride(0), q_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), offsets.data_ptr(), nb, H, Hkv, D, scale,
                          out.data_ptr() if as_float else None, None if as_float else out.data_ptr(),
                          _ptr(lse), out_rows.data_ptr())

    @staticmethod
    def _scale_stride(layer, what: str) -> int:
        """The slot stride of a ``QuantizedKV`` layer's scale [num_slots, Hkv] (Hkv: one per slot and head;
        0: one per head, a stride-0 view); ValueError for another layout."""
        sc = layer.scale
        if sc.dtype != torch.float32 or sc.dim() != 2 or sc.stride(1) != 1 or sc.stride(0) not in (0, sc.shape[1]):
            raise ValueError(f"{what}: scales must be float32 [num_slots, Hkv], per slot or per head (stride 0)")
        return sc.stride(0)

    def decode_attn_q8(self, q: torch.Tensor, q_rows: torch.Tensor, k, v, slots: torch.Tensor,
                       offsets: torch.Tensor, scale: float, out: torch.Tensor, out_rows: torch.Tensor,
                       lse: Optional[torch.Tensor] = None) -> None:
        """``decode_attn`` over a quantised KV cache: k, v are ``idleless.quant.kv.QuantizedKV`` layers
        (one byte per element, int8 or fp8, decoded through their ``lut``; float32 scales [num_slots, Hkv],
        one per slot and KV head (int8's dynamic scales) or one per KV head (fp8's static scales, a stride-0
        view over the slots: folded into the softmax factor and the output, no cost per key)), read in place
        (no dequantised copy). Other arguments as ``decode_attn``. Raises ValueError on a layout mismatch
        (k and v with scales of different kinds included)."""
        self._check(q)
        nb = q_rows.numel()
        _, H, D = q.shape
        Hkv = k.shape[1]
        kd, vd = k.data, v.data
        ss = self._scale_stride(k, "decode_attn_q8")
        if (q.stride(2) != 1 or q.stride(1) != D or not kd.is_contiguous() or not vd.is_contiguous()
                or kd.shape[2] != D or self._scale_stride(v, "decode_attn_q8") != ss or kd.shape != vd.shape
                or offsets.numel() != nb + 1 or out_rows.numel() != nb or out.shape[1:] != (H, D)
                or not out.is_contiguous() or out.dtype not in (torch.float32, self.dtype)):
            raise ValueError("decode_attn_q8: layout mismatch")
        if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous()):
            raise ValueError("decode_attn_q8: lse must be contiguous float32")
        _check_index(q_rows, slots, offsets, out_rows)
        as_float = out.dtype == torch.float32
        self._decode_attn_q8(q.data_ptr(), q.stride(0), q_rows.data_ptr(), kd.data_ptr(), vd.data_ptr(),
                             k.scale.data_ptr(), v.scale.data_ptr(), ss, k.lut.data_ptr(), slots.data_ptr(),
                             offsets.data_ptr(), nb, H, Hkv, D, scale, out.data_ptr() if as_float else None,
                             None if as_float else out.data_ptr(), _ptr(lse), out_rows.data_ptr())

    def kv_write_q8(self, layer, src: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantise src [n, Hkv, D] (the kernels' dtype, contiguous rows, row stride free) into the
        quantised KV layer ``layer`` (``idleless.quant.kv.QuantizedKV``) at slots (int64 [n]): with
        per-slot scales a scale per (row, head) computed and stored, with per-head scales the layer's
        (``layer.static``) applied; values beyond the format's range saturate. The same bytes (and scales)
        as ``QuantizedKV.write``'s PyTorch ops. Raises ValueError on a layout mismatch."""
        self._check(src)
        n = src.shape[0]
        data = layer.data
        ss = self._scale_stride(layer, "kv_write_q8")
        if (not data.is_contiguous() or src.shape[1:] != data.shape[1:] or src.stride(2) != 1
                or src.stride(1) != src.shape[2] or slots.numel() != n or (ss == 0) != layer.static):
            raise ValueError("kv_write_q8: layout mismatch")
        _check_index(slots)
        self._kv_write_q8(data.data_ptr(), layer.scale.data_ptr(), src.data_ptr(), src.stride(0), slots.data_ptr(),
                          n, data.shape[1], data.shape[2], layer.mbits, layer.bias, layer.fmax, int(not layer.static))

    def kv_read_q8(self, layer, slots: Optional[torch.Tensor] = None, first: int = 0, n: int = 0) -> torch.Tensor:
        """Rows of the quantised KV layer ``layer`` (``QuantizedKV``) dequantised into the kernels' dtype: the
        slots ``slots`` (int64 [n]) or, with slots None, the n consecutive slots from ``first``: a new
        [n, Hkv, D] tensor, lut[code] * scale rounded once (``QuantizedKV``'s PyTorch path, bit for bit).
        Raises ValueError on a layout mismatch or slots out of range."""
        data = layer.data
        ss = self._scale_stride(layer, "kv_read_q8")
        if not data.is_contiguous():
            raise ValueError("kv_read_q8: layout mismatch")
        if slots is not None:
            _check_index(slots)
            n = slots.numel()
            if n:
                lo, hi = torch.aminmax(slots)  # one pass (a read per attention part and layer)
                if int(lo) < 0 or int(hi) >= data.shape[0]:
                    raise ValueError("kv_read_q8: slot out of range")
        elif first < 0 or n < 0 or first + n > data.shape[0]:
            raise ValueError("kv_read_q8: slot out of range")
        out = torch.empty(n, data.shape[1], data.shape[2], dtype=self.dtype)
        if n:
            self._kv_read_q8(data.data_ptr(), layer.scale.data_ptr(), ss, layer.lut.data_ptr(), _ptr(slots), first,
                             n, data.shape[1], data.shape[2], out.data_ptr())
        return out

    def merge(self, out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor,
              src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Merge partial attention: row dst_rows[i] of (out [*, H, D] float32, lse [*, H] float32)
        absorbs row src_rows[i] of (o [*, H, D] in the kernels' dtype, o_lse [*, H] float32) by
        log-sum-exp weighting (Hydragen, arXiv 2402.05099; FlashInfer merge_state). All contiguous."""
        self._check(o)
        for t in (out, lse, o_lse):
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("merge: out, lse and o_lse must be contiguous float32")
        if not o.is_contiguous() or src_rows.numel() != dst_rows.numel() or o.shape[1:] != out.shape[1:]:
            raise ValueError("merge: layout mismatch")
        _check_index(src_rows, dst_rows)
        H, D = out.shape[1:]
        self._merge(out.data_ptr(), lse.data_ptr(), o.data_ptr(), o_lse.data_ptr(), src_rows.data_ptr(),
                    dst_rows.data_ptr(), src_rows.numel(), H, D)

    @staticmethod
    def ragged_work_bytes(key_lens: list[int], num_kv_heads: int, head_dim: int) -> int:
        """Bytes of the ``work`` buffer ragged_attn needs for items of key_lens keys: K and V of
        every kv head packed, each item's keys rounded up to 32."""
        return sum(4 * num_kv_heads * ((n + 31) // 32 * 32) * head_dim for n in key_lens)

    def ragged_attn(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_offsets: torch.Tensor,
                    slots: torch.Tensor, row_offsets: torch.Tensor, rows: torch.Tensor,
                    limits: Optional[torch.Tensor], scale: float, out: torch.Tensor, lse: torch.Tensor,
                    merge: bool, work: torch.Tensor, packed: bool = False) -> None:
        """Attention of many query rows against shared key lists in the pool, on AMX tiles (bfloat16
        only; ``has_amx``). Item i: keys slots[key_offsets[i]:key_offsets[i+1]] of k_cache / v_cache
        [num_slots, Hkv, D], query rows rows[row_offsets[i]:row_offsets[i+1]] of q [T, H, D] (heads
        contiguous, rows may be strided); row entry j sees the first limits[j] keys of its item
        (causal tails) or all of them (limits None: a shared segment). Writes (merge False) or
        log-sum-exp-merges into (merge True) out [*, H, D] float32 and lse [*, H] float32; rows must
        be distinct across items. work: uint8, at least ``ragged_work_bytes`` long, where K and V
        are packed into the tile layout; packed True: it already holds this call's packing (the same
        keys, unchanged since: a shared prefix at the next decode step) and is read as is. Float32 softmax,
        FlashAttention's chunked rescaling (arXiv 2205.14135), probabilities rounded to bfloat16 for
        the P V product. Raises ValueError on a layout it cannot read, RuntimeError without AMX."""
        if not self.has_amx:
            raise RuntimeError("ragged_attn needs AMX tiles and bfloat16 kernels")
        self._check(q, k_cache, v_cache)
        _, H, D = q.shape
        Hkv = k_cache.shape[1]
        n = key_offsets.numel() - 1
        if (q.stride(2) != 1 or q.stride(1) != D or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or v_cache.shape != k_cache.shape or k_cache.shape[2] != D or H % Hkv or n < 0
                or row_offsets.numel() != n + 1 or out.dtype != torch.float32 or out.shape[1:] != (H, D)
                or not out.is_contiguous() or lse.dtype != torch.float32 or not lse.is_contiguous()
                or lse.shape[1:] != (H,) or (limits is not None and limits.numel() != rows.numel())
                or work.dtype != torch.uint8 or not work.is_contiguous()):
            raise ValueError("ragged_attn: layout mismatch")
        _check_index(key_offsets, slots, row_offsets, rows, *(() if limits is None else (limits,)))
        ok = self._ragged_attn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), n,
                               key_offsets.data_ptr(), slots.data_ptr(), row_offsets.data_ptr(), rows.data_ptr(),
                               _ptr(limits), H, Hkv, D, scale, out.data_ptr(), lse.data_ptr(), int(merge),
                               work.data_ptr(), work.numel(), int(packed))
        if ok == -1:
            raise ValueError("ragged_attn: work buffer smaller than ragged_work_bytes")
        if ok != 1:
            raise ValueError(f"ragged_attn: head_dim {D} is not a multiple of 32 up to 256")

    # rows up to which a linear layer runs in amx_linear (decode batches); larger ones stay on oneDNN
    AMX_LINEAR_MAX_ROWS = 64

    def amx_pack_weight(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """weight [N, K] (bfloat16) in amx_linear's tile layout (int16 [N * K]: the same bytes again), or
        None where amx_linear does not apply (no AMX, N or K not a multiple of 32)."""
        self._check(weight)
        n, k = weight.shape
        if not self.has_amx or n % 32 or k % 32:
            return None
        w = weight.contiguous()
        wp = torch.empty(n * k, dtype=torch.int16)
        self._amx_linear_pack(w.data_ptr(), n, k, wp.data_ptr())
        return wp

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [M, K] (1 <= M <= AMX_LINEAR_MAX_ROWS; rows may be strided) times the weight [N, K] packed by
        amx_pack_weight, plus bias [N] -> new [M, N] bfloat16 (float32 sums, rounded once). Raises
        ValueError on another M or a layout mismatch."""
        self._check(x)
        m, k = x.shape
        if (not 1 <= m <= self.AMX_LINEAR_MAX_ROWS or x.stride(1) != 1 or packed.numel() != n * k
                or packed.dtype != torch.int16 or not packed.is_contiguous()):
            raise ValueError("amx_linear: layout mismatch")
        self._check_bias(bias, n, "amx_linear")
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if not self._amx_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise ValueError("amx_linear: not supported for this shape")
        return out

    # ---- batch-invariant kernels (deterministic inference; see the section comment in cpu_kernels.c) ----
    #: output columns per packed panel of bi_linear, and keys per softmax chunk of chunk_attn (the
    #: alignment a shared segment's end must have, so that a split key range folds as one)
    BI_PANEL = 16
    BI_CHUNK = 64

    def bi_pack_weight(self, weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """weight [N, K] in the kernels' dtype -> bi_linear's panel layout [ceil(N / BI_PANEL), K, BI_PANEL],
        zero past column N (the weight's bytes again; for bfloat16 with K even on AVX-512 BF16 CPUs each
        panel holds [K / 2, BI_PANEL, 2]: the column's pairs (2k, 2k+1) side by side, as VDPBF16PS reads them): written into ``out`` when it is a contiguous tensor
        of that shape and dtype (a weight update re-packs in place, without touching new memory), else
        into a new tensor. Returns the packed tensor."""
        self._check(weight)
        n, k = weight.shape
        w = weight.contiguous()
        shape = ((n + self.BI_PANEL - 1) // self.BI_PANEL, k, self.BI_PANEL)
        if out is None or tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous():
            out = torch.empty(shape, dtype=self.dtype)
        self._bi_linear_pack(w.data_ptr(), n, k, out.data_ptr())
        return out

    def bi_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Batch-invariant y = x W^T (+ bias): x [M, K] (rows may be strided), W [N, K] packed by
        ``bi_pack_weight``, bias [N] -> new [M, N] in the kernels' dtype. Each output element is one
        float32 chain over k in order, rounded once (after the bias), so a row's result is bit-identical
        for any M and any other rows: fused multiply-adds one k at a time (float32, and bfloat16 on CPUs
        without AVX-512 BF16: the same bits on AVX2, AVX-512 and scalar builds), or, for bfloat16 with K
        even on AVX-512 BF16 CPUs, VDPBF16PS over the pairs (2k, 2k+1) in order (exact products, another
        order than the scalar build's, by design; the section comments in cpu_kernels.c).
        Raises ValueError on a layout mismatch, MemoryError if the row buffer cannot be allocated."""
        self._check(x)
        m, k = x.shape
        if x.stride(1) != 1 or packed.shape != ((n + self.BI_PANEL - 1) // self.BI_PANEL, k, self.BI_PANEL) \
                or packed.dtype != self.dtype or not packed.is_contiguous():
            raise ValueError("bi_linear: layout mismatch")
        self._check_bias(bias, n, "bi_linear")
        out = torch.empty(m, n, dtype=self.dtype)
        if m and not self._bi_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, _ptr(bias),
                                     out.data_ptr(), n):
            raise MemoryError("bi_linear: cannot allocate the row buffer")
        return out

    def chunk_attn_int8(self, head_dim: int) -> bool:
        """Whether ``chunk_attn`` / ``chunk_attn_layer`` with ``int8_attention`` take q.k and P.V on int8
        codes for this head dimension: bfloat16 kernels on a CPU with AVX-512 BF16 and AVX512-VNNI (this
        build), head_dim a multiple of 32. Elsewhere the flag is ignored (bf16 activations' attention)."""
        return self.dtype == torch.bfloat16 and bool(self._chunk_attn_int8(head_dim))

    def chunk_attn_q8(self, head_dim: int) -> bool:
        """Whether ``chunk_attn`` / ``chunk_attn_layer`` read a quantised KV pool (``QuantizedKV`` caches:
        int8 / fp8 codes decoded as they are gathered into their exact bfloat16 values, a key's scale
        applied to its scores and a value's to the probabilities before P.V, as ``decode_attn_q8``; under
        int8 attention the decoded rows quantised as bfloat16 rows are, their scales times the stored
        ones): bfloat16 kernels with the AVX-512 BF16 pair paths (this build), head_dim a multiple of 32."""
        return self.dtype == torch.bfloat16 and bool(self._chunk_attn_q8(head_dim))

    def _attn_caches(self, q: torch.Tensor, k_cache, v_cache, name: str):
        """chunk_attn's caches: (K, V tensors for the layout checks, then the C arguments k, v, ks, vs, ss,
        lut): a ``QuantizedKV`` pair (where ``chunk_attn_q8``) or tensors of the kernels' dtype."""
        if isinstance(k_cache, torch.Tensor) != isinstance(v_cache, torch.Tensor):
            raise ValueError(f"{name}: K and V must both be tensors or both quantised KV layers")
        if not isinstance(k_cache, torch.Tensor):
            kd, vd, d = getattr(k_cache, "data", None), getattr(v_cache, "data", None), q.shape[-1]
            if kd is None or vd is None or not self.chunk_attn_q8(d) or k_cache.out_dtype != self.dtype:
                raise ValueError(f"{name}: a quantised KV pool needs bfloat16 kernels with chunk_attn_q8({d})")
            ss = self._scale_stride(k_cache, name)
            if self._scale_stride(v_cache, name) != ss or kd.dtype != vd.dtype:
                raise ValueError(f"{name}: layout mismatch")
            self._check(q)
            return kd, vd, (kd.data_ptr(), vd.data_ptr(), k_cache.scale.data_ptr(), v_cache.scale.data_ptr(), ss,
                            k_cache.lut.data_ptr())
        self._check(q, k_cache, v_cache)
        return k_cache, v_cache, (k_cache.data_ptr(), v_cache.data_ptr(), None, None, 0, None)

    def chunk_attn(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_offsets: torch.Tensor,
                   slots: torch.Tensor, row_offsets: torch.Tensor, rows: torch.Tensor,
                   limits: Optional[torch.Tensor], scale: float, out: Optional[torch.Tensor],
                   state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                   store: bool = False, int8_attention: bool = False) -> None:
        """Attention with one reduction order per query row (see the section comments in cpu_kernels.c; in
        bfloat16 on AVX-512 BF16 CPUs, with D a multiple of 32, q.k is a VDPBF16PS chain over the pairs).
        Item i: keys slots[key_offsets[i]:key_offsets[i+1]] of k_cache / v_cache [num_slots, Hkv, D],
        the first at an absolute position that is a multiple of BI_CHUNK; query rows
        rows[row_offsets[i]:row_offsets[i+1]] of q [T, H, D] (heads contiguous, rows may be strided);
        row entry j sees the first limits[j] keys (limits None: all); D <= 256. state: (m [*, H], l [*, H],
        acc [*, H, D]) float32, contiguous: each row's running softmax state is read from it (else it
        starts empty); store True writes it back there instead of writing out [*, H, D] (the kernels'
        dtype) = acc / l. Rows must be distinct across items. Index tensors int64, contiguous.
        int8_attention (W8A8's attention, where ``chunk_attn_int8(D)``; SageAttention's int8 QK^T, Zhang et
        al., arXiv 2410.02367): q per row and head, k and v per key and kv head quantised symmetrically
        (codes rint(x * 127 / max|x|)), score = (float(exact int dot) * s_k) * (s_q * scale); per chunk of
        64 keys w = p * s_v quantised to 0..255 against the chunk's largest w and multiplied with the v codes
        as integers (the section comment in cpu_kernels.c); the softmax state as above.
        k_cache / v_cache may be ``idleless.quant.kv.QuantizedKV`` layers where ``chunk_attn_q8(D)``: their codes
        read in place (``chunk_attn_q8``).
        Raises ValueError on a layout mismatch or a row's limit negative or past its item's keys, MemoryError
        when buffers cannot be allocated."""
        k_cache, v_cache, kv = self._attn_caches(q, k_cache, v_cache, "chunk_attn")
        _, H, D = q.shape
        Hkv = k_cache.shape[1]
        n = key_offsets.numel() - 1
        if (q.stride(2) != 1 or q.stride(1) != D or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or v_cache.shape != k_cache.shape or k_cache.shape[2] != D or H % Hkv or n < 0 or D > 256
                or row_offsets.numel() != n + 1 or (limits is not None and limits.numel() != rows.numel())
                or (store and state is None) or (not store and (out is None or out.dtype != self.dtype
                                                                 or out.shape[1:] != (H, D) or not out.is_contiguous()))):
            raise ValueError("chunk_attn: layout mismatch")
        if state is not None:
            m, l, acc = state
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in state) or m.shape[1:] != (H,) \
                    or l.shape != m.shape or acc.shape[1:] != (H, D):
                raise ValueError("chunk_attn: state must be contiguous float32 (m [*, H], l [*, H], acc [*, H, D])")
        _check_index(key_offsets, slots, row_offsets, rows, *(() if limits is None else (limits,)))
        st = state if state is not None else (None, None, None)
        check_chunk_attn(self._chunk_attn(q.data_ptr(), q.stride(0), kv[0], kv[1], n,
                                           key_offsets.data_ptr(), slots.data_ptr(), row_offsets.data_ptr(),
                                           rows.data_ptr(), _ptr(limits), H, Hkv, D, scale, *(_ptr(t) for t in st),
                                           int(store), _ptr(out), int(int8_attention), *kv[2:]), "chunk_attn")

    def chunk_attn_desc(self, calls) -> torch.Tensor:
        """The descriptor ``chunk_attn_layer`` takes for ``calls``, a sequence of (key_offsets, slots, row_offsets,
        rows, limits or None) int64 contiguous index tensors (``chunk_attn``'s): int64 [len(calls), 6], per call
        the item count and the tensors' addresses (limits None: 0). It holds addresses only: keep the tensors
        alive while it is used. Raises ValueError on a bad index tensor or an empty ``calls``."""
        if not calls:
            raise ValueError("chunk_attn_layer: no calls")
        rows = []
        for ko, sl, ro, r, lim in calls:
            _check_index(ko, sl, ro, r, *(() if lim is None else (lim,)))
            n = ko.numel() - 1
            if n < 0 or ro.numel() != n + 1 or (lim is not None and lim.numel() != r.numel()):
                raise ValueError("chunk_attn_layer: layout mismatch")
            rows.append([n, ko.data_ptr(), sl.data_ptr(), ro.data_ptr(), r.data_ptr(), _ptr(lim) or 0])
        return torch.tensor(rows, dtype=torch.int64)

    def chunk_attn_layer(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, calls, scale: float,
                         out: torch.Tensor, desc: Optional[torch.Tensor] = None, int8_attention: bool = False) -> None:
        """A layer's ``chunk_attn`` calls in one kernel call: calls (see ``chunk_attn_desc``) in fold order, the
        shared segments, then the tails; every call but the last continues its rows' softmax state (kept by the
        kernel: a row starts empty where no earlier call had it), the last writes out [T, H, D] (the kernels'
        dtype, contiguous) for its rows. q [T, H, D] (heads contiguous, rows may be strided), caches
        [num_slots, Hkv, D] contiguous, rows < T, D <= 256. The bits of ``chunk_attn`` called per call with a state
        filled with (-inf, 0, 0) (``ChunkedAttention.forward``'s sequence). desc: ``chunk_attn_desc(calls)``,
        made once and reused (else made here); int8_attention and quantised caches as ``chunk_attn``'s. Raises
        ValueError on a layout mismatch, MemoryError when buffers cannot be allocated."""
        k_cache, v_cache, kv = self._attn_caches(q, k_cache, v_cache, "chunk_attn_layer")
        T, H, D = q.shape
        Hkv = k_cache.shape[1]
        if (q.stride(2) != 1 or q.stride(1) != D or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or v_cache.shape != k_cache.shape or k_cache.shape[2] != D or H % Hkv or D > 256
                or out.dtype != self.dtype or out.shape[1:] != (H, D) or not out.is_contiguous()):
            raise ValueError("chunk_attn_layer: layout mismatch")
        if desc is None:
            desc = self.chunk_attn_desc(calls)
        check_chunk_attn(self._chunk_attn_layer(q.data_ptr(), q.stride(0), kv[0], kv[1], desc.shape[0],
                                                 desc.data_ptr(), T, H, Hkv, D, scale, out.data_ptr(),
                                                 int(int8_attention), *kv[2:]), "chunk_attn_layer")

    # ---- batch-invariant Q4_1 x bfloat16 on AVX-512 BF16 (H3; see the section comment in cpu_kernels.c) ----
    #: bytes per (panel of 16 output columns, block of 32 input features) of ``bi_q41_pack``'s layout
    BQ_PB = 320

    def bi_q41_pack(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """GGUF Q4_1 blocks (``q41_linear``'s layout: qs uint8 [N, K/32, 16], d and m float16 [N, K/32],
        contiguous) -> ``bi_q41_linear``'s layout, uint8 [ceil(N / 16), K/32, BQ_PB] (per panel of 16 columns
        and block: d[16], m[16] float16, then 16 steps of 16 bytes holding the codes (2s, 2s+1) of each
        column as two nibbles; zero past column N): the same values, no rounding. Written into ``out`` when
        it is a contiguous uint8 tensor of that shape (a weight update re-packs in place), else a new
        tensor. Raises ValueError on a layout mismatch."""
        n, nb, _ = qs.shape
        if (qs.dtype != torch.uint8 or qs.shape[2] != 16 or not qs.is_contiguous()
                or any(t.dtype != torch.float16 or t.shape != (n, nb) or not t.is_contiguous() for t in (d, m))):
            raise ValueError("bi_q41_pack: layout mismatch")
        shape = ((n + 15) // 16, nb, self.BQ_PB)
        if out is None or tuple(out.shape) != shape or out.dtype != torch.uint8 or not out.is_contiguous():
            out = torch.empty(shape, dtype=torch.uint8)
        self._bi_q41_pack(qs.data_ptr(), d.data_ptr(), m.data_ptr(), n, nb * 32, out.data_ptr())
        return out

    def bi_q41_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Batch-invariant y = x W^T (+ bias) for W in Q4_1 blocks packed by ``bi_q41_pack``: x [M, K]
        bfloat16 (rows may be strided, K a multiple of 32), bias [N] -> new [M, N] bfloat16. Per output
        element one chain for any M: per block of 32 features in order, a VDPBF16PS chain of x with the
        codes, then fma(d, that, acc) and fma(m, sum of the block's x, acc); rounded once after the bias.
        Only where ``has_bi_q41`` (bfloat16 kernels built with AVX-512 BF16). Raises ValueError on a layout
        mismatch or without ``has_bi_q41``, MemoryError when buffers cannot be allocated."""
        if not self.has_bi_q41:
            raise ValueError("bi_q41_linear: needs bfloat16 kernels built with AVX-512 BF16")
        self._check(x)
        m, k = x.shape
        if (x.stride(1) != 1 or k % 32 or packed.dtype != torch.uint8 or not packed.is_contiguous()
                or tuple(packed.shape) != ((n + 15) // 16, k // 32, self.BQ_PB)):
            raise ValueError("bi_q41_linear: layout mismatch")
        self._check_bias(bias, n, "bi_q41_linear")
        out = torch.empty(m, n, dtype=self.dtype)
        if m and not self._bi_q41_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, _ptr(bias),
                                         out.data_ptr(), n):
            raise MemoryError("bi_q41_linear: cannot allocate its buffers")
        return out

    # ---- batch-invariant Q8_0 x bfloat16 on AVX-512 BF16 (issue 15/14; the section comment in cpu_kernels.c) ----
    #: bytes per (panel of 16 output columns, block of 32 input features) of ``bi_q80_pack``'s layout
    BZ_PB = 544

    def bi_q80_pack(self, q: torch.Tensor, d: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """GGUF Q8_0 blocks (``q80_linear``'s layout: q int8 [N, K/32, 32], d float16 [N, K/32], contiguous)
        -> ``bi_q80_linear``'s layout, uint8 [ceil(N / 16), K/32, BZ_PB] (per panel of 16 columns and block:
        d[16] float16, then 16 steps of 32 bytes holding the codes (2s, 2s+1) of columns 0..7, then of
        columns 8..15; zero past column N): the same values, no rounding. Written into ``out`` when it is a
        contiguous uint8 tensor of that shape (a weight update re-packs in place), else a new tensor. Raises
        ValueError on a layout mismatch."""
        n, nb, _ = q.shape
        if (q.dtype != torch.int8 or q.shape[2] != 32 or not q.is_contiguous() or d.dtype != torch.float16
                or d.shape != (n, nb) or not d.is_contiguous()):
            raise ValueError("bi_q80_pack: layout mismatch")
        shape = ((n + 15) // 16, nb, self.BZ_PB)
        if out is None or tuple(out.shape) != shape or out.dtype != torch.uint8 or not out.is_contiguous():
            out = torch.empty(shape, dtype=torch.uint8)
        self._bi_q80_pack(q.data_ptr(), d.data_ptr(), n, nb * 32, out.data_ptr())
        return out

    def bi_q80_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Batch-invariant y = x W^T (+ bias) for W in Q8_0 blocks packed by ``bi_q80_pack``: x [M, K]
        bfloat16 (rows may be strided, K a multiple of 32), bias [N] -> new [M, N] bfloat16. Per output
        element one chain for any M: per block of 32 features in order, a VDPBF16PS chain of x with the
        codes from 0, then fma(d, that, acc); rounded once after the bias. Only where ``has_bi_q80``
        (bfloat16 kernels built with AVX-512 BF16). Raises ValueError on a layout mismatch or without
        ``has_bi_q80``, MemoryError when buffers cannot be allocated."""
        if not self.has_bi_q80:
            raise ValueError("bi_q80_linear: needs bfloat16 kernels built with AVX-512 BF16")
        self._check(x)
        m, k = x.shape
        if (x.stride(1) != 1 or k % 32 or packed.dtype != torch.uint8 or not packed.is_contiguous()
                or tuple(packed.shape) != ((n + 15) // 16, k // 32, self.BZ_PB)):
            raise ValueError("bi_q80_linear: layout mismatch")
        self._check_bias(bias, n, "bi_q80_linear")
        out = torch.empty(m, n, dtype=self.dtype)
        if m and not self._bi_q80_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, _ptr(bias),
                                         out.data_ptr(), n):
            raise MemoryError("bi_q80_linear: cannot allocate its buffers")
        return out

    # ---- quantised weights, weight-only (idleless.quant; see the section comment in cpu_kernels.c) ----
    def _quant_rows(self, x: torch.Tensor, bias: Optional[torch.Tensor], n: int, kernel: str) -> torch.Tensor:
        self._check(x)
        if x.stride(1) != 1:
            raise ValueError(f"{kernel}: x rows must be contiguous")
        self._check_bias(bias, n, kernel)
        return torch.empty(x.shape[0], n, dtype=self.dtype)

    def q8_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = (x q^T) * scale (+ bias): x [M, K] in the kernels' dtype (rows may be strided), q int8
        [N, K] contiguous, scale float32 [N] (one per output channel), bias [N] -> new [M, N] in the
        kernels' dtype. Each output element is one float32 sum in a fixed order for any M (batch-
        invariant), rounded once. Raises ValueError on a layout mismatch, MemoryError when the row
        buffer cannot be allocated."""
        n, k = q.shape
        if (q.dtype != torch.int8 or not q.is_contiguous() or x.shape[1] != k or scale.dtype != torch.float32
                or scale.numel() != n or not scale.is_contiguous()):
            raise ValueError("q8_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "q8_linear")
        if x.shape[0] and not self._q8_linear(x.data_ptr(), x.shape[0], k, x.stride(0), q.data_ptr(),
                                              scale.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("q8_linear: cannot allocate the row buffer")
        return out

    def q8_pack(self, q: torch.Tensor) -> torch.Tensor:
        """int8 weights q [N, K] (contiguous, K a multiple of 4, codes in [-127, 127]) -> ``q8p_linear``'s
        layout, int8 [ceil(N / 16), K / 4, 64] (the shape counts bytes; the order is cpu_kernels.c's): panels of
        16 output columns in tiles of ``formats.Q8P_TILE`` panels (the last tile what is left), each tile
        [K / 4] steps of its panels' 64-byte blocks side by side; in the block of panel p and step b, byte
        16 L + 8 h + 2 c + i holds feature 4 b + 2 h + i of column 16 p + 4 L + c (zero past column N): the
        same codes, reordered (``formats.unpack_q8``). Raises ValueError on another layout or a code of -128."""
        if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous() or q.shape[1] % 4:
            raise ValueError("q8_pack: q must be contiguous int8 [N, K], K a multiple of 4")
        n, k = q.shape
        wp = torch.empty(-(-n // 16), k // 4, 64, dtype=torch.int8)
        if not self._q8_pack(q.data_ptr(), n, k, wp.data_ptr()):
            raise ValueError("q8_pack: codes must be in [-127, 127]")
        return wp

    def q8p_linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q8_linear``'s product, y = (x q^T) * scale (+ bias), on q packed by ``q8_pack``: x [M, K]
        bfloat16 (rows may be strided), scale float32 [N] (N = scale.numel()), bias [N] -> [M, N] bfloat16,
        written into ``out`` when given ([M, N], unit column stride) else a new tensor. Per output element
        one VDPBF16PS chain over the input-feature pairs in order, whatever M (batch-invariant; another
        summation order than ``q8_linear``'s). Only where ``has_q8p``. Raises ValueError on a layout
        mismatch or without ``has_q8p``, MemoryError when buffers cannot be allocated."""
        if not self.has_q8p:
            raise ValueError("q8p_linear: needs bfloat16 kernels built with AVX-512 BF16 and VBMI")
        self._check(x)
        m, k = x.shape
        n = scale.numel()
        if (packed.dtype != torch.int8 or not packed.is_contiguous() or tuple(packed.shape) != (-(-n // 16), k // 4, 64)
                or k % 4 or scale.dtype != torch.float32 or not scale.is_contiguous() or x.stride(1) != 1):
            raise ValueError("q8p_linear: layout mismatch")
        if out is None:
            out = self._quant_rows(x, bias, n, "q8p_linear")
        else:
            self._check(out)
            self._check_bias(bias, n, "q8p_linear")
            if out.shape != (m, n) or out.stride(1) != 1:
                raise ValueError("q8p_linear: out must be [M, N] with contiguous rows")
        if m and not self._q8p_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), scale.data_ptr(), n,
                                      _ptr(bias), out.data_ptr(), out.stride(0)):
            raise MemoryError("q8p_linear: cannot allocate its buffers")
        return out

    def q41_linear(self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = x W^T (+ bias) for W in GGUF Q4_1 blocks (``idleless.quant.formats.quantize_q4_1``' layout:
        qs uint8 [N, K/32, 16], d and m float16 [N, K/32], contiguous): x [M, K] in the kernels' dtype
        (rows may be strided) -> new [M, N]. Each output element is one float32 sum in a fixed order
        for any M. Raises ValueError on a layout mismatch, MemoryError when buffers cannot be allocated."""
        n, nb, _ = qs.shape
        k = x.shape[1]
        if (qs.dtype != torch.uint8 or qs.shape[2] != 16 or nb * 32 != k or not qs.is_contiguous()
                or any(t.dtype != torch.float16 or t.shape != (n, nb) or not t.is_contiguous() for t in (d, m))):
            raise ValueError("q41_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "q41_linear")
        if x.shape[0] and not self._q41_linear(x.data_ptr(), x.shape[0], k, x.stride(0), qs.data_ptr(),
                                               d.data_ptr(), m.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("q41_linear: cannot allocate its buffers")
        return out

    def w8a8_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """W8A8: each row of x [M, K] (the kernels' dtype, rows may be strided) quantised per token to
        int8 (``quantize_rows``' codes and scale sx), times q int8 [N, K] as exact int32 sums, then
        ``float(sum) * sx * scale[c] (+ bias)`` -> new [M, N] in the kernels' dtype. scale: float32 [N].
        Raises ValueError on a layout mismatch, MemoryError when buffers cannot be allocated."""
        n, k = q.shape
        if (q.dtype != torch.int8 or not q.is_contiguous() or x.shape[1] != k or scale.dtype != torch.float32
                or scale.numel() != n or not scale.is_contiguous()):
            raise ValueError("w8a8_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "w8a8_linear")
        if x.shape[0] and not self._w8a8_linear(x.data_ptr(), x.shape[0], k, x.stride(0), q.data_ptr(),
                                                scale.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("w8a8_linear: cannot allocate its buffers")
        return out

    #: most input features of w8a8_gemm (its int32 sums of (q + 128) * x stay below 2^31)
    W8A8_GEMM_MAX_K = 65536

    def w8a8_pack(self, q: torch.Tensor) -> torch.Tensor:
        """int8 weights q [N, K] (contiguous, codes in [-127, 127]) -> ``w8a8_gemm``'s layout: uint8
        [ceil(N/16) * ceil(K/4) * 64]: panels of 16 output columns holding q + 128 (128 past N and K), in
        runs of 3 panels (the last run what is left), each run [ceil(K/4)][run width][16][4] bytes. Raises
        ValueError on another layout or K above W8A8_GEMM_MAX_K."""
        if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous() or q.shape[1] > self.W8A8_GEMM_MAX_K:
            raise ValueError(f"w8a8_pack: q must be contiguous int8 [N, K <= {self.W8A8_GEMM_MAX_K}]")
        n, k = q.shape
        wp = torch.empty(-(-n // 16) * -(-k // 4) * 64, dtype=torch.uint8)
        self._w8a8_pack(q.data_ptr(), n, k, wp.data_ptr())
        return wp

    def w8a8_gemm(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``w8a8_linear``'s product (the same bits, for any M) on a weight in ``w8a8_pack``'s layout, for
        batches of any size: x [M, K] in the kernels' dtype (rows may be strided), packed uint8 (N
        columns: N = scale.numel()), scale float32 [N], bias [N] -> [M, N] in the kernels' dtype, written
        into ``out`` when given ([M, N], unit column stride) else a new tensor. vpdpbusd register tiles
        where ``has_vnni``, scalar loops elsewhere. Raises ValueError on a layout mismatch, MemoryError
        when the activation buffers cannot be allocated."""
        m, k = x.shape
        n = scale.numel()
        if (packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.numel() != -(-n // 16) * -(-k // 4) * 64
                or scale.dtype != torch.float32 or not scale.is_contiguous() or k > self.W8A8_GEMM_MAX_K):
            raise ValueError("w8a8_gemm: layout mismatch")
        if out is None:
            out = self._quant_rows(x, bias, n, "w8a8_gemm")
        else:
            self._check(x, out)
            self._check_bias(bias, n, "w8a8_gemm")
            if x.stride(1) != 1 or out.shape != (m, n) or out.stride(1) != 1:
                raise ValueError("w8a8_gemm: x and out need contiguous rows, out [M, N]")
        if m and not self._w8a8_gemm(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), scale.data_ptr(), n,
                                     _ptr(bias), out.data_ptr(), out.stride(0)):
            raise MemoryError("w8a8_gemm: cannot allocate its buffers")
        return out

    def q80_linear(self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = x W^T (+ bias) for W in GGUF Q8_0 blocks (``idleless.quant.formats.quantize_q8_0``' layout:
        q int8 [N, K/32, 32], d float16 [N, K/32], contiguous): x [M, K] in the kernels' dtype (rows may
        be strided) -> new [M, N]; one fixed-order float32 sum per output for any M. Raises ValueError
        on a layout mismatch, MemoryError when the row buffer cannot be allocated."""
        n, nb, _ = q.shape
        k = x.shape[1]
        if (q.dtype != torch.int8 or q.shape[2] != 32 or nb * 32 != k or not q.is_contiguous()
                or d.dtype != torch.float16 or d.shape != (n, nb) or not d.is_contiguous()):
            raise ValueError("q80_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "q80_linear")
        if x.shape[0] and not self._q80_linear(x.data_ptr(), x.shape[0], k, x.stride(0), q.data_ptr(), d.data_ptr(),
                                               n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("q80_linear: cannot allocate the row buffer")
        return out

    def q41_dequant(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """GGUF Q4_1 blocks (qs uint8 [n, K/32, 16], d and m float16 [n, K/32], contiguous) -> new float32
        [n, K]: m + d * code, as ``formats.dequantize_q4_1``. Raises ValueError on a layout mismatch."""
        n, nb, _ = qs.shape
        if (qs.dtype != torch.uint8 or qs.shape[2] != 16 or not qs.is_contiguous()
                or any(t.dtype != torch.float16 or t.shape != (n, nb) or not t.is_contiguous() for t in (d, m))):
            raise ValueError("q41_dequant: layout mismatch")
        w = torch.empty(n, nb * 32, dtype=torch.float32)
        self._q41_dequant(qs.data_ptr(), d.data_ptr(), m.data_ptr(), n, nb * 32, w.data_ptr())
        return w

    def q80_dequant(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """GGUF Q8_0 blocks (q int8 [n, K/32, 32], d float16 [n, K/32], contiguous) -> new float32 [n, K]:
        d * code, as ``formats.dequantize_q8_0``. Raises ValueError on a layout mismatch."""
        n, nb, _ = q.shape
        if (q.dtype != torch.int8 or q.shape[2] != 32 or not q.is_contiguous() or d.dtype != torch.float16
                or d.shape != (n, nb) or not d.is_contiguous()):
            raise ValueError("q80_dequant: layout mismatch")
        w = torch.empty(n, nb * 32, dtype=torch.float32)
        self._q80_dequant(q.data_ptr(), d.data_ptr(), n, nb * 32, w.data_ptr())
        return w

    def lut8_linear(self, x: torch.Tensor, q: torch.Tensor, lut: torch.Tensor, scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = (x lut[q]^T) * scale (+ bias) for one-byte weights of any 8-bit float format: x [M, K] in the
        kernels' dtype (rows may be strided), q [N, K] one byte per weight (e.g. float8_e4m3fn, read as
        bytes), lut float32 [256] (each byte pattern's value), scale float32 [N] -> new [M, N]; one
        fixed-order float32 sum per output for any M. Raises ValueError on a layout mismatch,
        MemoryError when the row buffer cannot be allocated."""
        n, k = q.shape
        if (q.element_size() != 1 or not q.is_contiguous() or x.shape[1] != k or lut.dtype != torch.float32
                or lut.numel() != 256 or not lut.is_contiguous() or scale.dtype != torch.float32
                or scale.numel() != n or not scale.is_contiguous()):
            raise ValueError("lut8_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "lut8_linear")
        if x.shape[0] and not self._lut8_linear(x.data_ptr(), x.shape[0], k, x.stride(0), q.data_ptr(), lut.data_ptr(),
                                                scale.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("lut8_linear: cannot allocate the row buffer")
        return out

    # ---- GGUF block weights times int8 activations per block of 32 (W4A8; cpu_kernels.c, same name) ----
    def a8_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activation quantiser of ``q41_a8_linear`` / ``q80_a8_linear``: x [M, K] in the kernels'
        dtype (K a multiple of 32, rows may be strided) -> (codes int8 [M, K], steps d float32 [M, K/32],
        s float32 [M, K/32]) per block of 32 features: d = max|x| / 127, codes rint(x / d) (nearest even;
        zero where the block is zero), s = d * float(sum of the block's codes) (llama.cpp's Q8_1).
        Raises ValueError on a layout mismatch."""
        self._check(x)
        m, k = x.shape
        if k % 32 or x.stride(1) != 1:
            raise ValueError("a8_quantize: x must have contiguous rows of a multiple of 32 features")
        q = torch.empty(m, k, dtype=torch.int8)
        d, s = torch.empty(m, k // 32), torch.empty(m, k // 32)
        if m:
            self._a8_quantize(x.data_ptr(), m, k, x.stride(0), q.data_ptr(), d.data_ptr(), s.data_ptr())
        return q, d, s

    def q41_a8_linear(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """W4A8: y = x W^T (+ bias) for W in GGUF Q4_1 blocks — codes uint8 [N * ceil(K/64) * 32] in the
        W4A8 layout (``formats.interleave_q4_1`` of GGUF's [N, K/32, 16]), d and m float16 [N, K/32],
        contiguous — with x [M, K] (the kernels' dtype, rows may be strided) quantised per block of 32
        features as ``a8_quantize``; integer products per block, exact, scaled by d_w * d_x, plus
        m_w * s_x (llama.cpp's ggml_vec_dot_q4_1_q8_1 arithmetic) -> new [M, N] in the kernels' dtype.
        Each output is one fixed-order float32 computation for any M (batch-invariant) and the same bits
        on the AVX2 and the portable build. Raises ValueError on a layout mismatch, MemoryError when
        the activation buffer cannot be allocated."""
        n, nb = d.shape
        k = x.shape[1]
        if (codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != n * ((nb + 1) // 2) * 32 or nb * 32 != k
                or not codes.is_contiguous()
                or any(t.dtype != torch.float16 or t.shape != (n, nb) or not t.is_contiguous() for t in (d, m))):
            raise ValueError("q41_a8_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "q41_a8_linear")
        if x.shape[0] and not self._q41_a8_linear(x.data_ptr(), x.shape[0], k, x.stride(0), codes.data_ptr(),
                                                  d.data_ptr(), m.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("q41_a8_linear: cannot allocate the activation buffer")
        return out

    def q80_a8_linear(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = x W^T (+ bias) for W in GGUF Q8_0 blocks — codes int8 [N * K/32 * 32] in the W4A8 layout
        (``formats.interleave_q8_0`` of GGUF's [N, K/32, 32]), d float16 [N, K/32], contiguous — with x
        [M, K] (the kernels' dtype, rows may be strided) quantised as ``a8_quantize``: exact integer
        products per block scaled by d_w * d_x (ggml_vec_dot_q8_0_q8_0's arithmetic) -> new [M, N];
        batch-invariant, the same bits on every build. Raises ValueError on a layout mismatch, MemoryError
        when the activation buffer cannot be allocated."""
        n, nb = d.shape
        k = x.shape[1]
        if (codes.dtype != torch.int8 or codes.dim() != 1 or codes.numel() != n * nb * 32 or nb * 32 != k
                or not codes.is_contiguous() or d.dtype != torch.float16 or not d.is_contiguous()):
            raise ValueError("q80_a8_linear: layout mismatch")
        out = self._quant_rows(x, bias, n, "q80_a8_linear")
        if x.shape[0] and not self._q80_a8_linear(x.data_ptr(), x.shape[0], k, x.stride(0), codes.data_ptr(),
                                                  d.data_ptr(), n, _ptr(bias), out.data_ptr(), n):
            raise MemoryError("q80_a8_linear: cannot allocate the activation buffer")
        return out
