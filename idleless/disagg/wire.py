"""The KV transfer wire format over ZMQ (all of it for the ``tcp`` backend; the control messages for ``mooncake``).

Decode -> prefill (DEALER -> ROUTER), one message per request: ``[b"PULL", header]`` with the header a
JSON object ``{"rid", "token_ids": [...], "skip": s, "want": w, "layout": {...}}`` (+ the router's
``"transfer_id"`` when it gave one): send the KV of ``token_ids[s:w]`` (D already holds
``token_ids[:s]``; ``w`` is the most it can use).

Or ``[b"DONE", header]`` ``{"transfer_id"}``: no pull will name that id (D holds the prompt already, or
prefills it itself); P unlocks the prefix it reserved for it. Not answered.

Prefill -> decode: ``[b"KV", header, k, v]`` (+ ``k_scale, v_scale`` for a quantised cache) with
``{"rid", "start": s, "num_tokens": n, "layout"}``: raw tensors ``[num_layers, n, num_kv_heads,
head_dim]`` in the pool's stored dtype (scales float32 ``[num_layers, n, num_kv_heads]``), C order;
``n`` may be 0 (P holds nothing past ``s``) and ``s + n`` ends at a page of P; with a ``transfer_id``
P timed, the header also has ``"prefill_timing": {"queue_s", "prefill_s"}`` (``timing``). Or ``[b"ERR", header]``
``{"rid", "error", "code"}``; ``code`` ``layout_mismatch`` when the two pools store different shapes or
dtypes (``--kv-cache-dtype`` differs): refused, never converted.

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

import json
import warnings
from typing import Optional

import torch

PULL, KV, ERR, DONE, LAYERS = b"PULL", b"KV", b"ERR", b"DONE", b"KVL"
MAX_HEADER_BYTES = 64 << 20


def pool_layout(pool) -> dict:
    """What both sides must agree on: layers, KV heads, head size, stored dtype, whether scales come."""
    _, _, heads, dim = pool.k_cache.shape
    return {"num_layers": int(pool.k_cache.shape[0]), "num_kv_heads": int(heads), "head_dim": int(dim),
            "dtype": str(pool.dtype).replace("torch.", ""), "quantized": bool(pool.quantized)}


def layout_mismatch(mine: dict, theirs) -> Optional[str]:
    """None when ``theirs`` equals ``mine``, else a message naming the first difference."""
    if not isinstance(theirs, dict):
        return "the peer sent no KV layout"
    for key, value in mine.items():
        if theirs.get(key) != value:
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
