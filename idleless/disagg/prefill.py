"""The prefill side of the ``tcp`` KV transfer: serve pulls of cached prompts' KV from the radix tree.

The prefill engine keeps no per-request transfer state: a prompt it has prefilled is in its radix
tree, and a pull names token ids, so serving one is a prefix match and a copy of the matched slots
(``wire`` describes the messages). A prefix evicted before the pull arrives is simply not sent (the
decode engine recomputes it). Pulls are served after every step and whenever they wake the idle loop.
"""

from __future__ import annotations

import logging
import time

import zmq

from idleless.disagg import wire
from idleless.disagg.connector import KVConnector

log = logging.getLogger("idleless.disagg")


class PrefillConnector(KVConnector):
    """Binds a ZMQ ROUTER on ``tcp://host:port`` (``--disaggregation-bootstrap-host/-port``) and
    answers ``PULL`` messages from decode engines with the KV of the longest cached prefix of the
    named tokens past ``skip``. Malformed messages are answered with ``ERR`` (or dropped when not even
    the envelope parses) and counted; they never reach the engine. ``address``: the bound endpoint,
    ``port`` its port. Raises zmq.ZMQError when the port is taken."""

    mode = "prefill"

    def __init__(self, core, host: str, port: int):
        self.pool = core.scheduler.pool
        self.layout = wire.pool_layout(self.pool)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{host}:{port or '*'}")  # port 0: any free port (see ``address``)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.address.rsplit(":", 1)[1])
        self.wake_sockets = (self.sock,)
        self.counters = {"num_pulls": 0, "num_tokens_sent": 0, "bytes_sent": 0, "seconds": 0.0,
                         "num_bad_messages": 0}

    def poll(self, core) -> None:
        served = False
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            served = True
            self._serve(core, frames)
        if served:
            core.scheduler.clock.mark("kv_transfer")

    def _serve(self, core, frames) -> None:
        if len(frames) < 3 or frames[1].bytes != wire.PULL:
            self.counters["num_bad_messages"] += 1
            if len(frames) >= 2:
                self._reply_error(frames[0], None, "expected [PULL, header]", "bad_request")
            return
        ident = frames[0]
        try:
            head = wire.decode_header(frames[2].bytes)
            rid, ids = head.get("rid"), head["token_ids"]
            skip, want = int(head["skip"]), int(head["want"])
            if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise ValueError("token_ids must be a list of ints")
            if not 0 <= skip <= want <= len(ids):
                raise ValueError(f"need 0 <= skip <= want <= len(token_ids), got {skip}, {want}, {len(ids)}")
        except (ValueError, KeyError, TypeError) as e:
            self.counters["num_bad_messages"] += 1
            self._reply_error(ident, None, f"bad pull: {e}", "bad_request")
            return
        why = wire.layout_mismatch(self.layout, head.get("layout"))
        if why is not None:
            self._reply_error(ident, rid, why, "layout_mismatch")
            return
        t0 = time.perf_counter()
        handle = core.scheduler.cache.match_prefix(ids[:want], hit=True)
        slots = handle.slots[skip:handle.cached_len] if handle.cached_len > skip else handle.slots[:0]
        pool = self.pool
        parts = [pool.k_cache[:, slots], pool.v_cache[:, slots]]
        if pool.quantized:
            parts += [pool.k_scale[:, slots], pool.v_scale[:, slots]]
        header = {"rid": rid, "start": skip, "num_tokens": int(slots.numel()), "layout": self.layout}
        frames_out = [ident, wire.KV, wire.encode_header(header)] + [wire.tensor_frame(t) for t in parts]
        self.sock.send_multipart(frames_out, copy=False)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        c = self.counters
        c["num_pulls"] += 1
        c["num_tokens_sent"] += int(slots.numel())
        c["bytes_sent"] += nbytes
        c["seconds"] += time.perf_counter() - t0

    def _reply_error(self, ident, rid, message: str, code: str) -> None:
        log.warning("kv transfer: refusing a pull: %s", message)
        try:
            self.sock.send_multipart([ident, wire.ERR, wire.encode_header({"rid": rid, "error": message,
                                                                            "code": code})], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def stats(self) -> dict:
        d = dict(self.counters)
        d["mode"], d["address"] = self.mode, self.address
        d["gb_per_s"] = d["bytes_sent"] / d["seconds"] / 1e9 if d["seconds"] > 0 else 0.0
        return d

    def close(self) -> None:
        self.sock.close(0)

