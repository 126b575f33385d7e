"""The decode side of the KV transfer: pull a prompt's KV, put it in the radix tree, then queue.

A request with ``kv_transfer_params.do_remote_prefill`` is held here, not in the scheduler's queue:
the longest prefix of its prompt this engine already caches is locked, a ``PULL`` for the rest goes to
the prefill engine named by ``remote_host``/``remote_port`` (``wire`` describes the messages), and
when the KV arrives it is written into freshly allocated slots and inserted into the radix tree; the
request is then queued and admitted with that prefix as a cache hit. The inserted prefix stays locked
until the request leaves the waiting queue, so it cannot be evicted in between.

Every held request ends: a reply that does not come within ``timeout_s``, an ``ERR`` reply, a reply
that does not fit, or a pool too full for the KV makes the request fall back (``--pd-fallback
recompute``: queued as is, its prompt prefilled here) or end with an error (``error``); a KV layout
mismatch (different ``--kv-cache-dtype``) always ends it with an error. Each pull has its own socket,
closed when the pull ends, so a broken or dead prefill engine leaves nothing behind and the next
request to it starts afresh.

With ``--disaggregation-transfer-backend mooncake`` the reply names a staging buffer of the prefill
engine instead of carrying the KV, and a worker thread reads it through Mooncake's transfer engine
(``mooncake`` describes the exchange and why a buffer a read may still touch is never freed early);
the step thread only starts the read and, between steps, imports what has arrived. A read that
fails, or does not return before the pull's deadline, ends the pull like any other failure.

A request whose ``kv_transfer_params`` say ``"layerwise": true`` (with the router's ``transfer_id``)
comes while the prefill engine still computes its prompt: its slots are allocated at once and the
pull asks for the KV layer by layer (``wire``, ``layerwise``); each ``KVL`` message is written into
those slots as it arrives, between steps, and when every layer has reached the end the prefix is
inserted into the radix tree and the request queued as above. Until then the slots belong to the
pull; every way a pull ends frees them. A prefill engine that had already finished answers with
one ``KV`` message, taken as above. Such a pull waits for seconds (the prefill), so its socket is
watched: a connection to the prefill engine that closes (its process died) ends the pull at once
instead of at the timeout.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Optional

import torch
import zmq

from idleless.cache.base import CacheHandle
from idleless.disagg import mooncake, timing, wire
from zmq.utils.monitor import recv_monitor_message

from idleless.disagg.connector import KVConnector
from idleless.engine.admission import check_request
from idleless.engine.messages import ErrorOutput
from idleless.engine.request import FinishReason, Request, RequestError, RequestOutput

log = logging.getLogger("idleless.disagg")

#: an idle decode engine whose only work is layer-wise pulls waits this long (ms) per loop for their
#: messages (which end the wait at once): a prefill takes seconds, and a shorter wait makes the engine
#: loop spin beside the prefill engine's compute (a frontend message waits at most this long)
LAYERWISE_IDLE_WAIT_MS = 25


@dataclass(eq=False)
class _Read:
    """A Mooncake read under way on the reader thread, into ``buf`` (registered)."""
    future: Any  # -> (0 on success, negative on failure; seconds the read took)
    buf: torch.Tensor  # uint8, the receive buffer: nobody else touches it until the read has returned
    read_id: str
    session: str
    num_tokens: int
    head: dict  # the prefill engine's reply header
    free_at: Optional[float] = None  # quarantined: monotonic time after which the buffer may go


@dataclass(eq=False)
class _Pull:
    req: Request
    handle: CacheHandle  # locked: the prefix this engine held when the pull was sent
    skip: int
    want: int
    sock: Any
    peer: str
    deadline: float
    sent: float  # time.monotonic() when the pull went out
    read: Optional[_Read] = None  # mooncake: the read of the KV, once the reply came
    slots: Optional[torch.Tensor] = None  # layer-wise: int64 [want - skip], the pull's own until it ends
    received: Optional[list[int]] = None  # layer-wise: per layer, the position its KV has reached
    layerwise: bool = False  # asked layer by layer (whatever the backend, the KV comes on the ZMQ wire)
    monitor: Any = None  # layer-wise: the socket's monitor, reporting a closed connection


@dataclass(eq=False)
class _Split:
    """A request queued after its transfer, until its first token (``timing``)."""
    rec: Any  # the scheduler's RequestRecord
    record: dict  # queue_s / prefill_s (from the prefill engine, or None), transfer_s
    imported: float  # time.monotonic() when its KV was in the pool


def remote_endpoint(params: dict) -> str:
    """``tcp://host:port`` from ``kv_transfer_params``. Raises RequestError (param
    ``kv_transfer_params``) when ``remote_host`` is not a non-empty string or ``remote_port`` not an
    int in 1..65535."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host or any(c in host for c in "/ "):
        raise RequestError("kv_transfer_params.remote_host must be a host name or address",
                           param="kv_transfer_params")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise RequestError("kv_transfer_params.remote_port must be an int in 1..65535", param="kv_transfer_params")
    return f"tcp://{host}:{port}"


class DecodeConnector(KVConnector):
    """Holds requests until their KV has arrived (see the module docstring). ``timeout_s``: the most
    seconds a pull may take (``--disaggregation-timeout``); ``fallback``: ``recompute`` or ``error``;
    ``backend``: ``tcp`` or ``mooncake`` (a Mooncake transfer engine reachable at ``host``). Raises
    ValueError when the engine keeps no prefix cache (the KV would have nowhere to go), RuntimeError
    when the Mooncake engine does not start."""

    mode = "decode"

    def __init__(self, core, timeout_s: float, fallback: str, backend: str = "tcp", host: str = "127.0.0.1"):
        sched = core.scheduler
        if not sched.cache.keeps_prefixes:
            raise ValueError("--disaggregation-mode decode needs the prefix cache (drop --disable-radix-cache)")
        if fallback not in ("recompute", "error"):
            raise ValueError(f"pd_fallback must be recompute or error, got {fallback!r}")
        if not timeout_s > 0:
            raise ValueError(f"disaggregation_timeout must be > 0 seconds, got {timeout_s!r}")
        self.sched = sched
        self.pool = sched.pool
        self.layout = wire.pool_layout(self.pool)
        self.scales = wire.pool_scales(self.pool)
        self.timeout_s = float(timeout_s)
        self.fallback = fallback
        self.ctx = zmq.Context.instance()
        self.pending: dict[str, _Pull] = {}
        self.queued: dict[str, CacheHandle] = {}  # rid -> the imported prefix, locked until admission
        self.splits: dict[str, _Split] = {}  # rid -> TTFT split waiting for its first token
        self.split_stats = timing.SplitStats()
        self._outputs: list[RequestOutput] = []
        self.counters = {"num_pulls": 0, "num_transfers": 0, "num_tokens_received": 0, "bytes_received": 0,
                         "seconds": 0.0, "num_fallbacks": 0, "num_errors": 0, "num_skipped_tokens": 0,
                         "num_released": 0, "read_seconds": 0.0, "num_layerwise": 0, "num_layer_messages": 0}
        self.backend = backend
        self.mc = mooncake.MooncakeEngine(host, timeout_s) if backend == "mooncake" else None
        self._reader = ThreadPoolExecutor(2, "idleless-kv-read") if self.mc is not None else None
        self._quarantine: list[_Read] = []  # reads that failed or outlived their pull

    # -- intake ----------------------------------------------------------------------------------
    def admit(self, core, req: Request) -> bool:
        params = req.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return False
        peer = remote_endpoint(params)
        check_request(req.prompt_ids, req.params, self.sched.admission_limits())
        if req.params.prompt_logprobs is not None:
            self._release(peer, params)
            return False  # prompt logprobs need the prompt's logits: prefilled here
        want = len(req.prompt_ids) - 1  # the last prompt token is computed here for its logits
        cache = self.sched.cache
        handle = cache.match_prefix(req.prompt_ids[:want], hit=False)
        if want - handle.cached_len < self.pool.page_size:
            self._release(peer, params)
            return False  # nothing (or less than a page) worth pulling
        cache.lock(handle)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        header = {"rid": req.rid, "token_ids": list(req.prompt_ids), "skip": handle.cached_len, "want": want,
                  "layout": self.layout}
        if self.scales is not None:  # static (fp8) scales: the prefill engine names one that differs
            header["kv_scales"] = self.scales
        tid = params.get("transfer_id")
        if isinstance(tid, str) and tid:
            header["transfer_id"] = tid  # the prefill engine's queue and prefill seconds come back with it
        now = time.monotonic()
        p = _Pull(req, handle, handle.cached_len, want, sock, peer, now + self.timeout_s, now)
        self.pending[req.rid] = p
        self.counters["num_pulls"] += 1
        self.counters["num_skipped_tokens"] += handle.cached_len
        if params.get("layerwise") is True and "transfer_id" in header:
            p.slots = self._alloc(handle.cached_len, want - handle.cached_len)
            if p.slots is None:
                self._fail(p, "no room in the KV pool for the prompt's KV", "kv_transfer_no_room")
                return True
            p.received = [handle.cached_len] * self.layout["num_layers"]
            p.layerwise = True
            header["layerwise"] = True  # the KV comes layer by layer, many messages: queue them all
            sock.setsockopt(zmq.RCVHWM, 0)
            p.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.counters["num_layerwise"] += 1
        sock.connect(peer)
        if self.mc is not None and not p.layerwise:  # P keeps the KV readable until a read before our deadline is over
            header["transfer"] = "mooncake"
            header["hold_s"] = self.timeout_s + self.mc.timeout_s + mooncake.QUARANTINE_S
        sock.send_multipart([wire.PULL, wire.encode_header(header)])
        return True

    def _alloc(self, skip: int, n: int) -> Optional[torch.Tensor]:
        """Slots for ``n`` tokens after a page-aligned prefix of ``skip`` (evicting cached prefixes
        when short); None when the pool cannot hold them."""
        pool = self.pool
        short = pool.tokens_needed(skip, n) - pool.num_free_slots
        if short > 0:
            self.sched.cache.evict(short)
        return pool.alloc(skip, 0, n)  # skip is page-aligned: whole new pages

    def _release(self, peer: str, params: dict) -> None:
        """Tell the prefill engine that no pull will name this ``transfer_id`` (it unlocks the prefix
        it reserved for one); nothing is answered, and a message that does not arrive only leaves the
        reservation to expire."""
        tid = params.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)  # closed at once: up to 1 s for the message to leave
        sock.connect(peer)
        sock.send_multipart([wire.DONE, wire.encode_header({"transfer_id": tid})], zmq.NOBLOCK)
        sock.close()
        self.counters["num_released"] += 1

    def abort(self, rid: str) -> bool:
        p = self.pending.pop(rid, None)
        if p is None:
            return False
        self._close(p)
        self._outputs.append(RequestOutput(rid, [], FinishReason.ABORT, prompt_tokens=len(p.req.prompt_ids)))
        return True

    def has_work(self) -> bool:
        return bool(self.pending or self._outputs)

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # -- between steps ---------------------------------------------------------------------------
    def poll(self, core) -> None:
        self._release_admitted()
        if self.splits:
            self._first_tokens()
        if self._quarantine:
            self._drain_quarantine()
        if not self.pending:
            return
        poller = zmq.Poller()
        reads = []
        for p in self.pending.values():
            if p.read is None:
                poller.register(p.sock, zmq.POLLIN)
                if p.monitor is not None:
                    poller.register(p.monitor, zmq.POLLIN)
            else:
                reads.append(p)
        wait_ms = 0 if self.sched.has_work() else 5  # nothing else to do: wait a little, do not spin
        if wait_ms and all(p.layerwise for p in self.pending.values()):
            wait_ms = LAYERWISE_IDLE_WAIT_MS
        if len(reads) == len(self.pending):
            wait([p.read.future for p in reads], timeout=wait_ms / 1000, return_when=FIRST_COMPLETED)
            ready = {}
        else:
            ready = dict(poller.poll(0 if reads and any(p.read.future.done() for p in reads) else wait_ms))
        for p in reads:
            if p.read.future.done():
                self._finish_read(p)
        for rid, p in list(self.pending.items()):
            while p.read is None and p.sock in ready and self.pending.get(rid) is p:  # all that came
                try:
                    frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._receive(p, frames)
            if p.monitor is not None and p.monitor in ready and self.pending.get(rid) is p:
                self._watch(p)
        now = time.monotonic()
        for p in list(self.pending.values()):
            if now >= p.deadline:
                self._fail(p, f"no KV from the prefill engine at {p.peer} within {self.timeout_s:g} s",
                           "kv_transfer_timeout")
        core.scheduler.clock.mark("kv_transfer")

    def _receive(self, p: _Pull, frames) -> None:
        try:
            kind = frames[0].bytes
            head = wire.decode_header(frames[1].bytes)
            if head.get("rid") != p.req.rid:
                raise ValueError(f"reply for {head.get('rid')!r}, expected {p.req.rid!r}")
            if kind == wire.ERR:
                code = head.get("code") or "kv_transfer_failed"
                self._fail(p, f"the prefill engine at {p.peer} refused: {head.get('error')}", code)
                return
            if kind not in (wire.KV, wire.LAYERS) or (kind == wire.LAYERS and p.slots is None):
                raise ValueError(f"unexpected reply kind {kind[:16]!r}")
            why = wire.layout_mismatch(self.layout, head.get("layout"))
            if why is not None:
                self._fail(p, why, "layout_mismatch")
                return
            if kind == wire.LAYERS:
                self._write_layers(p, head, frames[2:])
                return
            if p.slots is not None:  # the prefill engine had finished: the whole prompt in one message
                self.pool.free(p.slots)
                p.slots = p.received = None
            start, n = int(head["start"]), int(head["num_tokens"])
            if start != p.skip or n < 0 or start + n > p.want:
                raise ValueError(f"reply covers [{start}, {start + n}), asked [{p.skip}, {p.want})")
            if self.mc is not None and not p.layerwise:
                if len(frames) != 2:
                    raise ValueError("a mooncake reply carries no tensor frames")
                info = self._read_info(head, n) if n >= self.pool.page_size else None
            else:
                tensors = self._tensors(frames[2:], n)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            self._fail(p, f"bad KV reply from {p.peer}: {e}", "kv_transfer_failed")
            return
        if n < self.pool.page_size:  # nothing usable arrived: the prefill engine no longer held it
            self._fail(p, f"the prefill engine at {p.peer} holds no KV of this prompt past {p.skip} tokens",
                       "kv_transfer_missed")
            return
        if self.mc is not None and not p.layerwise:
            self._start_read(p, info, n, head)
            return
        self._complete(p, n, tensors, head)

    def _watch(self, p: _Pull) -> None:
        """Read the pull socket's monitor: a closed connection to the prefill engine ends the pull."""
        while True:
            try:
                event = recv_monitor_message(p.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fail(p, f"the connection to the prefill engine at {p.peer} closed before its KV was "
                           "complete", "kv_transfer_failed")
                return

    def _write_layers(self, p: _Pull, head: dict, frames) -> None:
        """Write one ``KVL`` message into the pull's slots; the last one completes the pull. Raises
        ValueError (KeyError, TypeError) for a message that does not continue every layer it names."""
        start, n = int(head["start"]), int(head["num_tokens"])
        first, m = int(head["layer"]), int(head["num_layers"])
        if not (m >= 1 and 0 <= first and first + m <= len(p.received) and n >= 1 and start + n <= p.want
                and all(p.received[i] == start for i in range(first, first + m))):
            raise ValueError(f"layers [{first}, {first + m}) at [{start}, {start + n}) do not continue "
                             f"{p.received[first:first + m] if 0 <= first else '?'}")
        tensors = self._tensors(frames, n, m)
        slots, pool = p.slots[start - p.skip:start - p.skip + n], self.pool
        pool.k_cache[first:first + m, slots] = tensors[0]
        pool.v_cache[first:first + m, slots] = tensors[1]
        if pool.k_scale is not None:  # per-token scales (int8); static ones are the pool's (layout checked)
            pool.k_scale[first:first + m, slots] = tensors[2]
            pool.v_scale[first:first + m, slots] = tensors[3]
        for i in range(first, first + m):
            p.received[i] = start + n
        c = self.counters
        c["num_layer_messages"] += 1
        c["bytes_received"] += sum(t.numel() * t.element_size() for t in tensors)
        if first == 0:
            c["num_tokens_received"] += n
        if min(p.received) == p.want:
            self._enqueue(p, self._insert(p, p.slots, p.want - p.skip), {})

    def _read_info(self, head: dict, n: int) -> dict:
        """The ``mooncake`` block of a reply, checked. Raises ValueError."""
        info = head.get("mooncake")
        if not isinstance(info, dict):
            raise ValueError("the reply names no buffer to read (the prefill engine's backend is not mooncake?)")
        session, addr, nbytes, read_id = info.get("session"), info.get("addr"), info.get("nbytes"), info.get("read_id")
        if not isinstance(session, str) or not session or not isinstance(read_id, str):
            raise ValueError("mooncake session and read_id must be strings")
        if isinstance(addr, bool) or not isinstance(addr, int) or addr <= 0:
            raise ValueError("mooncake addr must be a positive int")
        if nbytes != mooncake.pack_nbytes(self.layout, n):
            raise ValueError(f"mooncake buffer of {nbytes!r} bytes, expected {mooncake.pack_nbytes(self.layout, n)}")
        return info

    def _start_read(self, p: _Pull, info: dict, n: int, head: dict) -> None:
        buf = torch.empty(int(info["nbytes"]), dtype=torch.uint8)
        try:
            self.mc.register(buf)
        except RuntimeError as e:
            self._fail(p, str(e), "kv_transfer_failed")
            return
        future = self._reader.submit(self._timed_read, info["session"], buf, int(info["addr"]))
        p.read = _Read(future, buf, info["read_id"], info["session"], n, head)

    def _timed_read(self, session: str, buf: torch.Tensor, addr: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        ret = self.mc.read(session, buf, addr)
        return ret, time.perf_counter() - t0

    def _finish_read(self, p: _Pull) -> None:
        """The read has returned: import the KV and tell the prefill engine it may free its buffer."""
        r = p.read
        ret, seconds = r.future.result()
        if ret != 0:
            self._fail(p, f"the mooncake read from {r.session} failed (code {ret})", "kv_transfer_failed")
            return
        p.read = None  # returned: the buffer is ours again
        p.sock.setsockopt(zmq.LINGER, 1000)  # the socket closes soon: up to 1 s for the release to leave
        try:
            p.sock.send_multipart([wire.DONE, wire.encode_header({"read_id": r.read_id})], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the prefill engine frees it after hold_s
        self.counters["read_seconds"] += seconds
        tensors = mooncake.unpack(r.buf, self.layout, r.num_tokens)
        self._complete(p, r.num_tokens, tensors, r.head)  # copies out of the buffer
        self.mc.unregister(r.buf)

    def _drain_quarantine(self) -> None:
        """Let go of the receive buffers whose reads returned ``QUARANTINE_S`` ago."""
        now = time.monotonic()
        for r in list(self._quarantine):
            if not r.future.done():
                continue
            if r.free_at is None:
                r.free_at = now + mooncake.QUARANTINE_S
            elif now >= r.free_at:
                self._quarantine.remove(r)
                self.mc.unregister(r.buf)

    def _complete(self, p: _Pull, n: int, tensors: list, head: dict) -> None:
        """Write the arrived KV into the pool and queue the request (or fail the pull)."""
        handle = self._import(p, n, tensors)
        if handle is None:
            self._fail(p, "no room in the KV pool for the transferred prefix", "kv_transfer_no_room")
            return
        c = self.counters
        c["num_tokens_received"] += n
        c["bytes_received"] += sum(t.numel() * t.element_size() for t in tensors)
        self._enqueue(p, handle, head)

    def _enqueue(self, p: _Pull, handle: CacheHandle, head: dict) -> None:
        """The pull is complete (its prefix inserted and locked under ``handle``): queue the request."""
        del self.pending[p.req.rid]
        p.slots = None  # the tree's now
        self._close_sockets(p)
        imported = time.monotonic()
        c = self.counters
        c["num_transfers"] += 1
        c["seconds"] += imported - p.sent
        rec = self._queue(p.req, handle)
        if rec is not None:
            parts = timing.valid_prefill_parts(head.get("prefill_timing")) or {"queue_s": None, "prefill_s": None}
            self.splits[p.req.rid] = _Split(rec, {**parts, "transfer_s": imported - p.sent}, imported)

    def _tensors(self, frames, n: int, num_layers: Optional[int] = None) -> list[torch.Tensor]:
        L = self.layout["num_layers"] if num_layers is None else num_layers
        H, D = self.layout["num_kv_heads"], self.layout["head_dim"]
        want = 4 if self.layout["token_scales"] else 2
        if len(frames) != want:
            raise ValueError(f"{len(frames)} tensor frames, expected {want}")
        kv = [wire.frame_tensor(f, self.pool.dtype, (L, n, H, D)) for f in frames[:2]]
        scales = [wire.frame_tensor(f, torch.float32, (L, n, H)) for f in frames[2:]]
        return kv + scales

    def _import(self, p: _Pull, n: int, tensors: list[torch.Tensor]) -> Optional[CacheHandle]:
        """Write the KV into new slots and insert ``prompt[:skip + n]``; returns the inserted prefix's
        handle, locked (the pull's own lock is released), or None when the pool has no room."""
        pool = self.pool
        slots = self._alloc(p.skip, n)
        if slots is None:
            return None
        pool.k_cache[:, slots] = tensors[0]
        pool.v_cache[:, slots] = tensors[1]
        if pool.k_scale is not None:  # per-token scales (int8); static ones are the pool's (layout checked)
            pool.k_scale[:, slots] = tensors[2]
            pool.v_scale[:, slots] = tensors[3]
        return self._insert(p, slots, n)

    def _insert(self, p: _Pull, slots: torch.Tensor, n: int) -> CacheHandle:
        """Insert ``prompt[:skip + n]`` with its new ``slots`` [n] into the tree (freeing what the tree
        does not take); returns its handle, locked (the pull's own lock is released)."""
        pool, cache = self.pool, self.sched.cache
        key = p.req.prompt_ids[:p.skip + n]
        prefix_len, handle = cache.insert(key, torch.cat([p.handle.slots, slots]))
        if prefix_len > p.skip:  # cached meanwhile by another request: our copies are duplicates
            pool.free(slots[:prefix_len - p.skip])
        kept = max(handle.cached_len, prefix_len)
        if kept < p.skip + n:  # a partial last page the tree does not take
            pool.free(slots[kept - p.skip:])
        cache.lock(handle)
        cache.unlock(p.handle)
        return handle

    def _queue(self, req: Request, handle: Optional[CacheHandle]):
        """Hand ``req`` to the scheduler; its RequestRecord, or None when refused (the request ends)."""
        try:
            self.sched.add_request(req)
        except RequestError as e:
            if handle is not None:
                self.sched.cache.unlock(handle)
            self._outputs.append(ErrorOutput(req.rid, [], FinishReason.ABORT, error=str(e), code=e.code,
                                             param=getattr(e, "param", None)))
            return None
        if handle is not None:
            self.queued[req.rid] = handle
        return self.sched.waiting[-1]

    def _first_tokens(self) -> None:
        """Complete the TTFT split of the requests whose first token came (aborted ones are dropped)."""
        for rid, sp in list(self.splits.items()):
            if sp.rec.first_token_time is not None:
                del self.splits[rid]
                self.split_stats.add({**sp.record, "first_decode_s": max(0.0, sp.rec.first_token_time - sp.imported)})
            elif sp.rec.finish_reason is not None:
                del self.splits[rid]

    def _release_admitted(self) -> None:
        if not self.queued:
            return
        waiting = {r.rid for r in self.sched.waiting}
        for rid in [r for r in self.queued if r not in waiting]:
            self.sched.cache.unlock(self.queued.pop(rid))

    @staticmethod
    def _close_sockets(p: _Pull) -> None:
        if p.monitor is not None:
            p.sock.disable_monitor()
            p.monitor.close(0)
            p.monitor = None
        p.sock.close()  # with its LINGER (0 unless a mooncake release is on its way)

    def _close(self, p: _Pull) -> None:
        self._close_sockets(p)
        self.sched.cache.unlock(p.handle)
        if p.slots is not None:  # layer-wise: the slots received into, never inserted
            self.pool.free(p.slots)
            p.slots = None
        if p.read is not None:  # the read may still write into its buffer
            self._quarantine.append(p.read)
            p.read = None

    def _fail(self, p: _Pull, why: str, code: str) -> None:
        """End the pull: recompute here (the fallback) or end the request with an error."""
        self.pending.pop(p.req.rid, None)
        self._close(p)
        log.warning("kv transfer for %s: %s", p.req.rid, why)
        if code in ("layout_mismatch", "backend_mismatch") or self.fallback == "error":
            self.counters["num_errors"] += 1
            self._outputs.append(ErrorOutput(p.req.rid, [], FinishReason.ABORT, error=why, code=code,
                                             prompt_tokens=len(p.req.prompt_ids)))
            return
        self.counters["num_fallbacks"] += 1
        self._queue(p.req, None)

    def stats(self) -> dict:
        """Counters: ``seconds`` (pull sent to KV in the pool, summed; ``gb_per_s`` is bytes over it) and,
        for mooncake, ``read_seconds`` (the transfer engine's reads alone, summed; ``read_gb_per_s``)."""
        d = dict(self.counters)
        d["mode"] = self.mode
        d["transfer_backend"] = self.backend
        d["num_pending"] = len(self.pending)
        d["num_quarantined"] = len(self._quarantine)
        d["ttft_split"] = self.split_stats.snapshot()
        d["gb_per_s"] = d["bytes_received"] / d["seconds"] / 1e9 if d["seconds"] > 0 else 0.0
        d["read_gb_per_s"] = d["bytes_received"] / d["read_seconds"] / 1e9 if d["read_seconds"] > 0 else 0.0
        return d

    def close(self) -> None:
        for p in list(self.pending.values()):
            self._close(p)
        self.pending.clear()
        if self._reader is not None:  # reads under way keep their buffers (and the engine) until they return
            self._reader.shutdown(wait=False)
