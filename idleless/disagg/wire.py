"""The KV transfer wire format over ZMQ (all of it for the ``tcp`` backend; the control messages for ``mooncake``).

Decode -> prefill (DEALER -> ROUTER), one message per request: ``[b"PULL", header]`` with the header a
JSON object ``{"rid", "token_ids": [...], "skip": s, "want": w, "layout": {...}}`` (+ the router's
``"transfer_id"`` when it gave one; + ``"kv_scales": {"k", "v"}`` for an fp8 pool, ``pool_scales``):
send the KV of ``token_ids[s:w]`` (D already holds ``token_ids[:s]``; ``w`` is the most it can use).

Or ``[b"DONE", header]`` ``{"transfer_id"}``: no pull will name that id (D holds the prompt already, or
prefills it itself); P unlocks the prefix it reserved for it. Not answered.

Prefill -> decode: ``[b"KV", header, k, v]`` (+ ``k_scale, v_scale`` for int8's per-token scales) with
``{"rid", "start": s, "num_tokens": n, "layout"}``: raw tensors ``[num_layers, n, num_kv_heads,
head_dim]`` in the pool's stored dtype (scales float32 ``[num_layers, n, num_kv_heads]``), C order;
``n`` may be 0 (P holds nothing past ``s``) and ``s + n`` ends at a page of P; with a ``transfer_id``
P timed, the header also has ``"prefill_timing": {"queue_s", "prefill_s"}`` (``timing``). Or ``[b"ERR", header]``
``{"rid", "error", "code"}``; ``code`` ``layout_mismatch`` when the two pools store different shapes or
dtypes (``--kv-cache-dtype`` differs) or, for fp8, different static scales: refused, never converted.

An fp8 pool's scales are per (layer, K/V, KV head), a property of the pool rather than of slots, so only
its bytes travel; both pools must hold bitwise the same scales. The layout carries their digest (every
message, checked by both sides) and the pull the scales themselves, so the prefill engine's refusal
names the first (layer, K/V, head) that differs.

The ``mooncake`` backend (``idleless.disagg.mooncake``) adds to the pull ``"transfer": "mooncake",
"hold_s": h``; the ``KV`` reply then has no tensor frames but ``"mooncake": {"session", "addr",
"nbytes", "read_id"}`` (the same tensors, packed one after another, in a buffer the decode engine
reads through its transfer engine), and once read the decode engine sends ``[b"DONE", {"read_id"}]``.
A mooncake pull to an engine without that backend is answered ``ERR`` ``backend_mismatch``.

Layer-wise (``layerwise``): a pull with ``"layerwise": true`` and the router's ``transfer_id``, sent
while the prefill engine still computes the prompt (the router starts both engines at once), is
answered with ``[b"KVL", header, k, v]`` (+ scales) messages ``{"rid", "start": s, "num_tokens": n,
"layer": l, "num_layers": m, "layout"}``: tensors ``[m, n, num_kv_heads, head_dim]`` of layers
``l .. l + m - 1``, positions ``s .. s + n - 1``. Per layer the positions come in order, without gaps,
from ``skip`` to ``want``; the transfer is complete when every layer has reached ``want``. A prefill
engine that has already finished the prompt answers with one ``KV`` message instead, and one that
ends the request before its KV is complete (an abort), or never gets it, with ``ERR``. Layer-wise
messages always travel on this wire, whatever the transfer backend.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Optional

import torch

PULL, KV, ERR, DONE, LAYERS = b"PULL", b"KV", b"ERR", b"DONE", b"KVL"
MAX_HEADER_BYTES = 64 << 20


def pool_layout(pool) -> dict:
    """What both sides must agree on: layers, KV heads, head size, stored dtype, whether it is quantised,
    whether per-token scales travel with the K/V (``token_scales``: int8's ``k_scale`` / ``v_scale``), and
    for a pool with static per-head scales (fp8) their digest (``kv_scales``, ``scales_digest``; None
    otherwise): such scales belong to the pool, not to slots, so only the bytes travel and both pools
    must hold the same scales."""
    _, _, heads, dim = pool.k_cache.shape
    static = getattr(pool, "k_head_scale", None) is not None
    return {"num_layers": int(pool.k_cache.shape[0]), "num_kv_heads": int(heads), "head_dim": int(dim),
            "dtype": str(pool.dtype).replace("torch.", ""), "quantized": bool(pool.quantized),
            "token_scales": getattr(pool, "k_scale", None) is not None,
            "kv_scales": scales_digest(pool.k_head_scale, pool.v_head_scale) if static else None}


def scales_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """SHA-256 (hex) of the float32 bytes of static scales k then v (each [num_layers, num_kv_heads]):
    equal digests mean bitwise equal scales."""
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def pool_scales(pool) -> Optional[dict]:
    """A pool's static scales as JSON, ``{"k": [[...] per KV head] per layer, "v": ...}`` (float32 values
    as Python floats: exact), sent with a pull so a mismatch can be named; None for a pool without."""
    if getattr(pool, "k_head_scale", None) is None:
        return None
    return {"k": pool.k_head_scale.cpu().tolist(), "v": pool.v_head_scale.cpu().tolist()}


def _first_scale_difference(mine: Optional[dict], theirs, peer: str, me: str) -> str:
    """`` (first difference: layer l K|V head h is x on <peer>, y on <me>)`` or "" when not found."""
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return ""
    for name in ("k", "v"):
        a, b = mine.get(name), theirs.get(name)
        if not isinstance(b, list) or len(b) != len(a):
            return ""
        for layer, (ra, rb) in enumerate(zip(a, b)):
            if not isinstance(rb, list) or len(rb) != len(ra):
                return ""
            for head, (x, y) in enumerate(zip(ra, rb)):
                if x != y:
                    return (f" (first difference: layer {layer} {name.upper()} head {head} is {y!r} on {peer}, "
                            f"{x!r} on {me})")
    return ""


def layout_mismatch(mine: dict, theirs, my_scales: Optional[dict] = None, their_scales=None,
                    peer: str = "the peer", me: str = "this engine") -> Optional[str]:
    """None when ``theirs`` equals ``mine``, else a message naming the first difference. A difference in
    static KV scales (``kv_scales``) is named as such, with the first differing (layer, K/V, head) when
    both sides' scales (``pool_scales``) are given (``peer`` / ``me``: how the message names the two
    engines): the bytes are never rescaled."""
    if not isinstance(theirs, dict):
        return "the peer sent no KV layout"
    for key, value in mine.items():
        if theirs.get(key) != value:
            if key == "kv_scales" and theirs.get(key) is not None and value is not None:
                return ("KV scale mismatch: the fp8 KV scales differ between the engines"
                        f"{_first_scale_difference(my_scales, their_scales, peer, me)}; the transferred fp8 "
                        "bytes would be read as other values, so the KV is refused, never rescaled (give both "
                        "engines the same --quantization-param-path: calibrated scales depend on the model's "
                        "weights and dtype)")
            return (f"KV layout mismatch: {key} is {theirs.get(key)!r} on the peer and {value!r} here "
                    f"(both engines must run the same model and --kv-cache-dtype)")
    return None


def encode_header(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_header(frame) -> dict:
    """Parse a JSON header frame. Raises ValueError for anything but a JSON object."""
    raw = bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError("header too large")
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("header is not a JSON object")
    return obj


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy (sent with ``copy=False``)."""
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def frame_tensor(frame, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The tensor a frame holds (a view of the frame's buffer: copy it before the frame goes).
    Raises ValueError when the byte count does not match ``shape`` and ``dtype``."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    n = 1
    for d in shape:
        n *= int(d)
    size = torch.empty((), dtype=dtype).element_size()
    if len(buf) != n * size:
        raise ValueError(f"KV frame of {len(buf)} bytes, expected {n * size} for {tuple(shape)} {dtype}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only buffer: the caller copies out of it at once
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
