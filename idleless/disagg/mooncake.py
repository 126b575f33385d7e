"""The ``mooncake`` KV transfer backend: the KV bytes move through Mooncake's transfer engine.

Mooncake (Qin et al., FAST 2025) moves bytes between registered host (or device) memory of two
processes over RDMA or TCP; the PyPI package ``mooncake-transfer-engine-non-cuda`` is the host-memory
build. Here each engine runs one ``TransferEngine`` with peer-to-peer metadata (``P2PHANDSHAKE``: no
metadata server; a peer is named by its session id ``host:rpc_port``) on the ``tcp`` protocol. The
control messages (the pull, the reply, the release) stay on the ZMQ wire (``wire``); only the KV
bytes go through the engine:

1. the decode engine pulls as for ``tcp``, asking for ``"transfer": "mooncake"`` and saying how long
   the prefill engine must keep the bytes readable (``hold_s``);
2. the prefill engine copies the matched slots' K/V (+ int8's per-token scales) into one staging
   buffer (``pack``), registers it, and answers ``[KV, header]`` with ``header["mooncake"] = {"session", "addr",
   "nbytes", "read_id"}`` and no tensor frames;
3. the decode engine reads the buffer into its own registered buffer (``transfer_sync_read``, on a
   worker thread), writes the KV into its pool as for ``tcp``, and sends ``[DONE, {"read_id"}]``: the
   prefill engine frees the buffer then, or after ``hold_s`` at the latest.

The decode side reads rather than the prefill side writing because a read's completion means the
bytes are in the reader's memory, while Mooncake's TCP transport reports a write complete once the
bytes are handed to the socket (before the peer has stored them). Mooncake's TCP transport checks no
address against the registered ranges, so neither side frees a buffer a transfer may still touch:
the prefill side keeps it for ``hold_s`` unless released, and the decode side keeps a buffer whose
read failed or outlived the request until the read has returned plus ``QUARANTINE_S``. The transfer
engine's port accepts reads and writes of any address from anyone who can reach it: run it on a
trusted network only.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import Optional

import torch

log = logging.getLogger("idleless.disagg")

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"
#: a failed or abandoned read's receive buffer is kept this long after the read returned
QUARANTINE_S = 5.0
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")


def missing_reason() -> Optional[str]:
    """None when ``mooncake.engine`` imports, else the message that names the pip command."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        why = (f"--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine "
               f"(pip install {PIP_PACKAGE}): {e}")
        if "libibverbs" in str(e):  # the wheel's engine.so links the verbs library even for TCP
            why += " (install the system's libibverbs1, e.g. apt-get install libibverbs1)"
        return why
    return None


def pack_nbytes(layout: dict, n: int) -> int:
    """Bytes of ``n`` tokens' K and V in the pool's stored dtype (+ float32 per-token scales when
    ``layout["token_scales"]``: int8; an fp8 pool's static scales do not travel), as ``pack`` lays them out."""
    L, H, D = layout["num_layers"], layout["num_kv_heads"], layout["head_dim"]
    elem = torch.empty((), dtype=getattr(torch, layout["dtype"])).element_size()
    total = 2 * L * n * H * D * elem
    if layout["token_scales"]:
        total += 2 * L * n * H * 4
    return total


def pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes one after another in a new contiguous CPU uint8 tensor (the staging buffer:
    K ``[L, n, H, D]``, V, then K and V scales ``[L, n, H]`` float32 for a pool with per-token scales)."""
    flat = [t.contiguous().cpu().view(torch.uint8).reshape(-1) for t in parts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def unpack(buf: torch.Tensor, layout: dict, n: int) -> list[torch.Tensor]:
    """Views of a staging buffer as ``pack`` wrote it: ``[k, v]`` ``[L, n, H, D]`` in the stored dtype
    (+ ``[k_scale, v_scale]`` ``[L, n, H]`` float32 when ``layout["token_scales"]``). Raises ValueError when
    the size does not match."""
    L, H, D = layout["num_layers"], layout["num_kv_heads"], layout["head_dim"]
    dtype = getattr(torch, layout["dtype"])
    if buf.numel() != pack_nbytes(layout, n):
        raise ValueError(f"KV buffer of {buf.numel()} bytes, expected {pack_nbytes(layout, n)} for {n} tokens")
    kv_bytes = L * n * H * D * torch.empty((), dtype=dtype).element_size()
    out = [buf[i * kv_bytes:(i + 1) * kv_bytes].view(dtype).reshape(L, n, H, D) for i in range(2)]
    if layout["token_scales"]:
        s = L * n * H * 4
        for i in range(2):
            start = 2 * kv_bytes + i * s
            seg = buf[start:start + s]
            if start % 4:  # a float32 view needs a 4-byte aligned offset
                seg = seg.clone()
            out.append(seg.view(torch.float32).reshape(L, n, H))
    return out


def transfer_timeout_s(timeout_s: float) -> int:
    """Set Mooncake's per-transfer timeout (``MC_TRANSFER_TIMEOUT``, seconds, at least 5) to
    ``timeout_s`` rounded up unless the environment already sets it; returns the value in force."""
    if not os.environ.get("MC_TRANSFER_TIMEOUT"):
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, math.ceil(timeout_s)))
    try:
        return max(5, int(os.environ["MC_TRANSFER_TIMEOUT"]))
    except ValueError:
        return 30  # Mooncake's own default for a value it cannot parse


class MooncakeEngine:
    """One Mooncake ``TransferEngine`` (P2P handshake, TCP protocol) reachable at ``host``.

    ``session_id``: ``host:rpc_port``, what a peer names to read this engine's registered memory.
    ``timeout_s`` bounds one transfer (``transfer_timeout_s``). Raises RuntimeError when the package is
    missing (the message names the pip command) or the engine does not start."""

    def __init__(self, host: str, timeout_s: float):
        why = missing_reason()
        if why is not None:
            raise RuntimeError(why)
        from mooncake.engine import TransferEngine
        if host in WILDCARD_HOSTS:
            host = socket.gethostbyname(socket.gethostname())
        self.timeout_s = transfer_timeout_s(timeout_s)
        self.engine = TransferEngine()
        ret = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if ret != 0:
            raise RuntimeError(f"the Mooncake transfer engine did not start on {host} (code {ret})")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, buf: torch.Tensor) -> int:
        """Register a contiguous CPU tensor's memory; returns its address. Raises RuntimeError."""
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        if nbytes:
            ret = self.engine.register_memory(addr, nbytes)
            if ret != 0:
                raise RuntimeError(f"Mooncake could not register {nbytes} bytes (code {ret})")
        return addr

    def unregister(self, buf: torch.Tensor) -> None:
        """Undo ``register`` (a failure is logged: the memory stays with its tensor)."""
        if buf.numel() and self.engine.unregister_memory(buf.data_ptr()) != 0:
            log.warning("mooncake: unregistering a KV buffer failed")

    def read(self, session_id: str, buf: torch.Tensor, remote_addr: int) -> int:
        """Read ``buf``'s size in bytes at ``remote_addr`` of the peer ``session_id`` into ``buf``
        (registered, contiguous); blocks, without the GIL, for at most ``timeout_s``. Returns 0 on
        success, negative on failure (an exception from the binding is a failure too)."""
        nbytes = buf.numel() * buf.element_size()
        try:
            return int(self.engine.transfer_sync_read(session_id, buf.data_ptr(), remote_addr, nbytes))
        except Exception as e:  # noqa: BLE001 - the binding raises on a bad peer; a failed read ends the pull
            log.warning("mooncake read from %s failed: %s", session_id, e)
            return -1
