"""Small batches (decode steps, speculative verifies, short extends) without the module tree: the CPU
counterpart of replaying a captured CUDA graph (SGLang's ``CudaGraphRunner``, vLLM's CUDA graphs).

A decode step of a small model on a CPU is short: for SmolLM2-135M in its native Q4_1 blocks the linear
layers read ~100 MB, a few milliseconds at memory speed. Run through ``LlamaForCausalLM.hidden_states``,
every layer also pays Python for its module calls, the views between them and the allocation of each
intermediate, which at batch 1 cost about as much as the weight reads (benchmarks/README.md, issue 14).
``DecodeGraph`` runs the same sequence of calls — the same kernels, linear methods and attention backend,
in the same order, so the hidden states are bitwise those of the module path — over buffers allocated
once, with the views of a batch size made once and kept, and the modules' attributes read once at
construction. What the module path computes per layer:

    residual += h; x = rms_norm(residual)          (the first layer: residual = embedding, x = its norm)
    qkv = qkv_proj(x); rope(q, k); o = attention(q, k, v)   (the backend writes k, v into the pool)
    residual += o_proj(o); x = rms_norm(residual)
    h = down_proj(silu(gate) * up)  with [gate | up] = gate_up_proj(x)

Used by ``ModelRunner`` for batches of at most ``max_rows`` tokens when the model's glue runs on the
fused CPU kernels (``ops.CpuKernelOps``); anything else goes through the modules.
"""

from __future__ import annotations

from typing import Optional

import torch

from idleless.model.attention.decode import FusedDecodeAttention
from idleless.model.attention.invariant import ChunkedAttention
from idleless.model.cpu_kernels import check_chunk_attn
from idleless.model.llama import LlamaForCausalLM
from idleless.model.ops import CpuKernelOps

#: most tokens in a batch the graph runs (its buffers hold this many rows)
MAX_ROWS = 64


class _Views:
    """One batch size's views of the graph's buffers and their addresses (made on first use, kept)."""

    def __init__(self, g: "DecodeGraph", t: int):
        self.x = g.x_buf[:t]
        self.qkv = g.qkv_buf[:t]
        nqk = g.num_heads + g.num_kv_heads
        self.qk = self.qkv[:, : g.q_size + g.kv_size].view(t, nqk, g.head_dim)
        self.q = self.qk[:, : g.num_heads]
        self.k = self.qk[:, g.num_heads:]
        self.v = self.qkv[:, g.q_size + g.kv_size:].view(t, g.num_kv_heads, g.head_dim)
        self.attn = g.attn_buf[:t]
        self.o = g.o_buf[:t]
        self.gate_up = g.gate_up_buf[:t]
        self.act = g.act_buf[:t]
        self.h = g.h_buf[:t]
        self.x_ptr, self.qkv_ptr, self.o_ptr = self.x.data_ptr(), self.qkv.data_ptr(), self.o.data_ptr()
        self.gate_up_ptr, self.act_ptr, self.h_ptr = self.gate_up.data_ptr(), self.act.data_ptr(), self.h.data_ptr()
        self.attn_ptr = self.attn.data_ptr()


class DecodeGraph:
    """The model's forward for batches of 1..max_rows tokens over preallocated buffers (module docstring).

    model: a LlamaForCausalLM whose ``ops`` are ``CpuKernelOps``; backend: its attention backend (the
    runner's ``CompositeAttention``). Buffers: [max_rows, width] in the model's dtype for the normed
    input, q/k/v, the attention output, the o_proj output, gate|up, the SwiGLU output and the MLP
    output (~ max_rows * (hidden * 3 + qkv + 3 * intermediate) elements)."""

    def __init__(self, model: LlamaForCausalLM, backend, max_rows: int = MAX_ROWS):
        cfg = model.cfg
        self.model = model
        self.backend = backend
        self.max_rows = max_rows
        self.kernels = model.ops.kernels
        dtype = model.embed_tokens.weight.dtype
        attn0 = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.q_size, self.kv_size = attn0.q_size, attn0.kv_size
        hidden = cfg.hidden_size
        inter = model.layers[0].mlp.down_proj.weight.shape[1]

        def buf(width: int) -> torch.Tensor:
            return torch.empty(max_rows, width, dtype=dtype)

        self.x_buf, self.qkv_buf = buf(hidden), buf(attn0.qkv_proj.weight.shape[0])
        self.attn_buf, self.o_buf = buf(self.q_size), buf(hidden)
        self.gate_up_buf, self.act_buf, self.h_buf = buf(2 * inter), buf(inter), buf(hidden)
        # per layer: (layer id, input norm weight, qkv, o, post norm weight, gate_up, down)
        self.layers = [(i, lay.input_layernorm.weight, lay.self_attn.qkv_proj, lay.self_attn.o_proj,
                        lay.post_attention_layernorm.weight, lay.mlp.gate_up_proj, lay.mlp.down_proj)
                       for i, lay in enumerate(model.layers)]
        self.eps = cfg.rms_norm_eps
        self.hidden, self.inter, self.qkv_width = hidden, inter, self.qkv_buf.shape[1]
        # the glue kernels' C entry points (ctypes), called with the addresses of the buffers: the
        # layouts are fixed here, so the wrappers' checks and output allocations are not repeated per call
        kern = self.kernels
        self._rms_norm, self._rope, self._silu_mul = kern._rms_norm, kern._rope, kern._silu_mul
        self._kv_write, self._decode_attn = kern._kv_write, kern._decode_attn
        self._views: dict[int, _Views] = {}

    @classmethod
    def build(cls, model, backend, max_rows: int = MAX_ROWS) -> Optional["DecodeGraph"]:
        """A graph for ``model``, or None where it does not apply (another model class, or glue not on
        the fused CPU kernels)."""
        if type(model) is not LlamaForCausalLM or not isinstance(model.ops, CpuKernelOps):
            return None
        return cls(model, backend, max_rows)

    def can_run(self, num_tokens: int) -> bool:
        """Whether a batch of ``num_tokens`` new tokens fits the buffers (and no module hook — a
        forward hook on a decoder layer — expects the module path)."""
        return 0 < num_tokens <= self.max_rows and not self._hooked()

    def _hooked(self) -> bool:
        return any(lay._forward_hooks or lay._forward_pre_hooks for lay in self.model.layers)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, out_cache_loc: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
        """``LlamaForCausalLM.hidden_states`` for T <= max_rows tokens, bitwise: input_ids, positions,
        out_cache_loc int64 [T]; meta: the backend's plan of this batch; rows int64 [R]. Returns the
        final-normed hidden states [R, hidden] (a new tensor); writes the batch's K/V into the pool.
        Raises IndexError for a position past the rope table, as the module path."""
        t = input_ids.numel()
        v = self._views.get(t)
        if v is None:
            v = self._views[t] = _Views(self, t)
        model, eps = self.model, self.eps
        hidden, inter, nqk, d = self.hidden, self.inter, self.num_heads + self.num_kv_heads, self.head_dim
        qkv_w = self.qkv_width
        norm, rope, silu_mul = self._rms_norm, self._rope, self._silu_mul
        attention = self.backend.forward
        attend = self._direct_attention(meta, out_cache_loc, v) or (
            lambda i: attention(v.q, v.k, v.v, i, meta, out_cache_loc).view(t, self.q_size))
        pos, cos, sin = model.ops.rope_state(model.rope, positions, v.x.dtype)  # checks the positions
        pos_ptr, cos_ptr, sin_ptr = pos.data_ptr(), cos.data_ptr(), sin.data_ptr()
        residual = model.embed_tokens(input_ids).contiguous()
        res_ptr = residual.data_ptr()
        x, x_ptr = v.x, v.x_ptr
        for i, w_in, qkv_proj, o_proj, w_post, gate_up_proj, down_proj in self.layers:
            # residual += h (from the second layer on), x = norm(residual): the kernels' fused add + norm
            if i == 0:
                norm(res_ptr, hidden, None, hidden, w_in.data_ptr(), x_ptr, hidden, t, hidden, eps)
            else:
                norm(v.h_ptr, hidden, res_ptr, hidden, w_in.data_ptr(), x_ptr, hidden, t, hidden, eps)
            qkv_proj.method.apply_into(qkv_proj, x, v.qkv)
            rope(v.qkv_ptr, qkv_w, pos_ptr, cos_ptr, sin_ptr, t, nqk, d)
            o_proj.method.apply_into(o_proj, attend(i), v.o)
            norm(v.o_ptr, hidden, res_ptr, hidden, w_post.data_ptr(), x_ptr, hidden, t, hidden, eps)
            gate_up_proj.method.apply_into(gate_up_proj, x, v.gate_up)
            silu_mul(v.gate_up_ptr, v.act_ptr, t, inter)
            down_proj.method.apply_into(down_proj, v.act, v.h)
        out, _ = model.norm(v.h[rows], residual[rows])
        return out

    def _direct_attention(self, meta, out_cache_loc: torch.Tensor, v: _Views):
        """When the whole batch is one part of the fused decode kernel over a pool in the model's dtype
        (decode rows and short tails without shared segments: ``meta.alone``), the per-layer attention
        as the composite runs it — K and V written into the pool, then ``decode_attn`` — with the kernels
        called by address and the output in the graph's buffer: ``f(layer) -> [T, H * D]``; for
        deterministic inference's ``ChunkedAttention`` covering the batch, ``_chunked_attention``. Else
        None (the composite's ``forward``)."""
        backend = self.backend
        if not meta.alone or backend.pool.quantized or backend.kernels is not self.kernels:
            return None
        part, plan = meta.parts[0]
        if type(part) is ChunkedAttention and part.kernels is self.kernels:
            return self._chunked_attention(part, plan, out_cache_loc, v)
        if not isinstance(part, FusedDecodeAttention) or len(plan.tails) != 1:
            return None
        group = plan.tails[0]
        loc, rows, slots, offsets = (x.contiguous() for x in (out_cache_loc, group.rows, group.slots, group.offsets))
        if any(x.dtype != torch.int64 for x in (loc, rows, slots, offsets)):
            return None
        t, nb = loc.numel(), rows.numel()
        esize = v.qkv.element_size()
        q_ptr, w = v.qkv_ptr, self.qkv_width
        k_ptr, v_ptr = q_ptr + self.q_size * esize, q_ptr + (self.q_size + self.kv_size) * esize
        k_layers, v_layers = backend._k_layers, backend._v_layers
        kv_write, decode_attn, scale = self._kv_write, self._decode_attn, part.scale
        h, hkv, d, kv_size = self.num_heads, self.num_kv_heads, self.head_dim, self.kv_size
        as_float = v.attn.dtype == torch.float32
        out_f, out_t = (v.attn_ptr, None) if as_float else (None, v.attn_ptr)
        keep = (loc, rows, slots, offsets)  # alive while the closure is

        def attend(i: int) -> torch.Tensor:
            kc, vc = k_layers[i].data_ptr(), v_layers[i].data_ptr()
            kv_write(kc, k_ptr, w, keep[0].data_ptr(), t, kv_size)
            kv_write(vc, v_ptr, w, keep[0].data_ptr(), t, kv_size)
            decode_attn(q_ptr, w, keep[1].data_ptr(), kc, vc, keep[2].data_ptr(), keep[3].data_ptr(), nb, h, hkv, d,
                        scale, out_f, out_t, None, keep[1].data_ptr())
            return v.attn
        return attend

    def _chunked_attention(self, part: ChunkedAttention, plan, out_cache_loc: torch.Tensor, v: _Views):
        """Deterministic inference's attention (``ChunkedAttention`` covering the batch: its segment calls,
        then its tail call) as the backend runs it — K and V written into the pool, then the segments and the
        tail in one ``chunk_attn_layer`` call (the segments' float32 softmax states in the kernel's own
        buffers, the tail continuing them into the graph's buffer) — called by address with a descriptor
        made once: ``f(layer) -> [T, H * D]``. None where the plan has no tail call covering the batch."""
        if len(plan.tails) != 1:
            return None
        backend = self.backend
        t = out_cache_loc.numel()
        h, hkv, d, kv_size, w = self.num_heads, self.num_kv_heads, self.head_dim, self.kv_size, self.qkv_width
        loc = out_cache_loc.contiguous()
        idx = []
        for c in plan.segments + plan.tails:
            x = tuple(y.contiguous() for y in (c.key_offsets, c.slots, c.row_offsets, c.rows)) + (
                None if c.limits is None else c.limits.contiguous(),)
            if any(y is not None and y.dtype != torch.int64 for y in x):
                return None
            idx.append(x)
        desc = self.kernels.chunk_attn_desc(idx)
        esize = v.qkv.element_size()
        q_ptr = v.qkv_ptr
        k_ptr, v_ptr = q_ptr + self.q_size * esize, q_ptr + (self.q_size + self.kv_size) * esize
        k_layers, v_layers = backend._k_layers, backend._v_layers
        kv_write, layer_attn, scale = self._kv_write, self.kernels._chunk_attn_layer, part.scale
        int8 = int(part.int8_attention)
        loc_ptr, desc_ptr, n_calls = loc.data_ptr(), desc.data_ptr(), desc.shape[0]

        def attend(i: int) -> torch.Tensor:
            kc, vc = k_layers[i].data_ptr(), v_layers[i].data_ptr()
            kv_write(kc, k_ptr, w, loc_ptr, t, kv_size)
            kv_write(vc, v_ptr, w, loc_ptr, t, kv_size)
            check_chunk_attn(layer_attn(q_ptr, w, kc, vc, n_calls, desc_ptr, t, h, hkv, d, scale, v.attn_ptr, int8,
                                        None, None, 0, None), "chunk_attn_layer")  # a pool of the model dtype
            return v.attn
        attend.keep = (loc, idx, desc)  # alive while the closure is
        return attend
