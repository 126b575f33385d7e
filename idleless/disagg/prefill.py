"""The prefill side of the KV transfer: serve pulls of cached prompts' KV from the radix tree.

The prefill engine keeps no per-request transfer state: a prompt it has prefilled is in its radix
tree, and a pull names token ids, so serving one is a prefix match and a copy of the matched slots
(``wire`` describes the messages). A prefix evicted before the pull arrives is simply not sent (the
decode engine recomputes it).

Two threads share the work, so a pull does not wait for the step loop to copy and send:
- the transfer thread owns the ZMQ ROUTER socket: it receives pulls, refuses malformed ones itself,
  and copies and sends the KV of the slots it is handed;
- the step thread (between steps: ``poll``; the transfer thread wakes the idle loop through
  ``wake_sockets``) matches a pull's tokens in the radix tree and locks the matched prefix, hands the
  slots to the transfer thread, and unlocks the prefix once the transfer thread reports it sent.
So the tree is only ever touched by the step thread, and the transfer thread only reads slots that
are committed and locked (no step writes or frees them until the unlock): ``KVPool``'s one-owner rule
holds, the tree owning those slots throughout.

A request a router sent with a ``transfer_id`` does not even wait for a step boundary: when its
prefill finishes, the step thread locks its prompt's cached prefix at once and hands it to the
transfer thread as a reservation, which a pull naming that id (and the same tokens) is served from
directly. A reservation is handed back and unlocked when the decode engine says it will not pull
(``DONE``: it holds the prompt already) or after ``RESERVE_S`` (a later pull takes the path above).

With ``--disaggregation-transfer-backend mooncake`` a pull may ask for its KV through Mooncake's
transfer engine (``mooncake``): the transfer thread then copies the slots into a registered staging
buffer, answers where to read it, and frees it when the decode engine says it has read it or after
the pull's ``hold_s``. A mooncake pull to an engine without the backend is refused
(``backend_mismatch``).

For the TTFT split (``timing``) the connector times the requests a router sent with a
``transfer_id``: their queue and prefill seconds go into the header of the pull that names that id.

A layer-wise pull (``wire``; the router started this engine and the decode engine at once) that
names the ``transfer_id`` of a request still running here is not matched in the tree: the request's
KV is streamed layer by layer as its steps compute it (``layerwise.LayerStreamer``, attached to the
model runner). One that arrives before its request is parked until the request comes (or ``ERR``
after ``timeout_s``); one that arrives after the request finished takes the paths above (one ``KV``
message). A streamed request that ends without its KV complete (an abort) is answered ``ERR``.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from idleless.cache.base import CacheHandle
from idleless.disagg import mooncake, timing, wire
from idleless.disagg.connector import KVConnector
from idleless.disagg.layerwise import LayerStreamer, Stream
from idleless.engine.request import Request

log = logging.getLogger("idleless.disagg")

_KEEP_TIMINGS = 4096  # prefill timings kept for pulls still to come (oldest dropped first)
RESERVE_S = 10.0  # how long a finished prefill's prefix stays locked for the pull naming its transfer_id
_instances = itertools.count()


def mooncake_hold(head: dict) -> Optional[float]:
    """A pull's ``hold_s`` when it asks for ``"transfer": "mooncake"``, None for a ``tcp`` pull. Raises
    ValueError for another transfer or a ``hold_s`` that is not a number in (0, 86400]."""
    transfer = head.get("transfer", "tcp")
    if transfer == "tcp":
        return None
    if transfer != "mooncake":
        raise ValueError(f"unknown transfer {transfer!r}")
    hold = head.get("hold_s")
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 < hold <= 86400 or math.isnan(hold):
        raise ValueError("a mooncake pull needs hold_s in (0, 86400] seconds")
    return float(hold)


def _signal(sock) -> None:
    """Wake the other thread; a full queue of wake-ups means one is already pending."""
    try:
        sock.send(b"", zmq.NOBLOCK)
    except zmq.Again:
        pass


@dataclass(eq=False)
class _Job:
    """A pull matched and locked on the step thread, for the transfer thread to send."""
    ident: bytes
    header: dict
    slots: Any  # int64 [n] pool slots, committed and locked in the tree
    handle: Optional[CacheHandle]  # the locked prefix (None when nothing is sent)
    t_recv: float  # perf_counter when the transfer thread received the pull
    transfer_id: Optional[str] = None  # set when served from a reservation
    hold_s: Optional[float] = None  # mooncake: keep the staging buffer readable this long at most


@dataclass(eq=False)
class _Reservation:
    """A finished prefill's prefix, locked on the step thread, held by the transfer thread for the
    pull that names ``transfer_id``."""
    transfer_id: str
    ids: list[int]  # the prompt
    handle: CacheHandle  # locked; covers ids[:handle.cached_len]
    prefill_timing: dict


@dataclass(eq=False)
class _Timed:
    """A request whose queue and prefill seconds are measured (it has a ``transfer_id``)."""
    rec: Any  # the scheduler's RequestRecord
    transfer_id: str
    added: float  # time.monotonic() when the engine core got it
    admitted: Optional[float] = None


class PrefillConnector(KVConnector):
    """Binds a ZMQ ROUTER on ``tcp://host:port`` (``--disaggregation-bootstrap-host/-port``) and
    answers ``PULL`` messages from decode engines with the KV of the longest cached prefix of the
    named tokens past ``skip``, from its own transfer thread (module docstring). Malformed messages
    are answered with ``ERR`` (or dropped when not even the envelope parses) and counted; they never
    reach the engine. ``address``: the bound endpoint, ``port`` its port. ``backend`` ``mooncake``
    also serves pulls through a Mooncake transfer engine on ``host`` (one transfer at most
    ``timeout_s``, ``mooncake.transfer_timeout_s``). Raises zmq.ZMQError when the port is taken,
    RuntimeError when the Mooncake engine does not start."""

    mode = "prefill"

    def __init__(self, core, host: str, port: int, backend: str = "tcp", timeout_s: float = 30.0):
        self.backend = backend
        self.mc = mooncake.MooncakeEngine(host, timeout_s) if backend == "mooncake" else None
        self._exposed: dict[str, tuple] = {}  # read_id -> (staging buffer, monotonic expiry); transfer thread's
        self.pool = core.scheduler.pool
        self.sched = core.scheduler
        self.layout = wire.pool_layout(self.pool)
        self.scales = wire.pool_scales(self.pool)  # static (fp8) scales, to name a pull's differing one
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)  # the transfer thread's from start()
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a layer-wise stream is many messages: never drop one
        self.sock.bind(f"tcp://{host}:{port or '*'}")  # port 0: any free port (see ``address``)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.address.rsplit(":", 1)[1])
        name = f"inproc://idleless-pd-prefill-{next(_instances)}"
        self._wake_rx = self._pair(ctx, name + "-step", bind=True)   # step thread: woken by the transfer thread
        self._jobs_rx = self._pair(ctx, name + "-jobs", bind=True)   # transfer thread: woken by the step thread
        self._wake_tx = self._pair(ctx, name + "-step", bind=False)  # transfer thread's end
        self._jobs_tx = self._pair(ctx, name + "-jobs", bind=False)  # step thread's end
        self.wake_sockets = (self._wake_rx,)
        self._to_step: queue.SimpleQueue = queue.SimpleQueue()  # ("pull", ident, head, t) | ("sent", job)
        self._to_thread: queue.SimpleQueue = queue.SimpleQueue()  # _Job | _Reservation | ("expire", id) | None
        self._in_flight = 0  # pulls and reservations holding a lock, not yet handed back (step thread)
        self._timed: dict[str, _Timed] = {}
        self._timings: OrderedDict[str, dict] = OrderedDict()  # transfer_id -> queue/prefill seconds
        self._reserved: dict[str, float] = {}  # transfer_id -> when its reservation expires (step thread)
        self._held: dict[str, _Reservation] = {}  # reservations the transfer thread holds (its own)
        self._last_poll = time.monotonic()
        self._lock = threading.Lock()  # guards counters (both threads write them)
        self.counters = {"num_pulls": 0, "num_tokens_sent": 0, "bytes_sent": 0, "seconds": 0.0,
                         "wait_seconds": 0.0, "num_bad_messages": 0, "num_read_released": 0,
                         "num_read_expired": 0, "num_streams": 0, "num_layer_messages": 0}
        self.timeout_s = float(timeout_s)
        self._by_tid: dict[str, str] = {}  # transfer_id -> rid of a timed request not finished (step thread)
        self._parked: dict[str, tuple] = {}  # transfer_id -> (ident, head, monotonic expiry): layer-wise pulls
        self._layerwise_in: queue.SimpleQueue = queue.SimpleQueue()  # (ident, head, t_recv): layer-wise pulls
        self.streamer = LayerStreamer(self.pool, self._send_layers, self._take_layerwise)
        self.streamer.attach(core.runner)
        self._thread = threading.Thread(target=self._run, name="idleless-kv-transfer", daemon=True)
        self._thread.start()

    @staticmethod
    def _pair(ctx, addr: str, bind: bool):
        s = ctx.socket(zmq.PULL if bind else zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(addr) if bind else s.connect(addr)
        return s

    # -- step thread -------------------------------------------------------------------------------
    def admit(self, core, req: Request) -> bool:
        """Queue a request a router sent with a ``transfer_id`` here, keeping its record to time it."""
        params = req.kv_transfer_params
        tid = params.get("transfer_id") if isinstance(params, dict) and params.get("do_remote_decode") else None
        if not isinstance(tid, str) or not tid:
            return False
        self.sched.add_request(req)  # RequestError: nothing queued, nothing kept
        self._timed[req.rid] = _Timed(self.sched.waiting[-1], tid, time.monotonic())
        self._by_tid[tid] = req.rid
        parked = self._parked.pop(tid, None)
        if parked is not None:
            self._stream(req.rid, parked[0], parked[1])
        return True

    def has_work(self) -> bool:
        """Pulls on their way through the two threads, and reservations, hold locked prefixes: a
        flush or a memory release must wait for them."""
        return self._in_flight > 0 or bool(self._parked)

    def poll(self, core) -> None:
        self.streamer.flush()  # before the step's slots can be freed or written again
        now = time.monotonic()
        if self._parked:
            self._expire_parked(now)
        if self._timed:
            self._time_requests(now)
        for tid, expires in list(self._reserved.items()):
            if now >= expires:  # the transfer thread hands it back (unless a pull took it meanwhile)
                del self._reserved[tid]
                self._to_thread.put(("expire", tid))
                _signal(self._jobs_tx)
        if (self._in_flight or self._parked) and not self.sched.has_work():
            self._wake_rx.poll(5)  # only pulls or reservations: wait a little for their ends, do not spin
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        self._take_layerwise()
        items = []  # what is there now; what comes while these are handled waits for the next call
        while True:
            try:
                items.append(self._to_step.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item[0] == "sent":
                self._unlock(item[1])
            else:
                self._lock_and_hand_over(*item[1:])
        self._last_poll = time.monotonic()
        if items:
            core.scheduler.clock.mark("kv_transfer")

    def _unlock(self, job) -> None:
        """A _Job sent or a _Reservation handed back: unlock its prefix."""
        if job.handle is not None:
            self.sched.cache.unlock(job.handle)
        self._in_flight -= 1
        if job.transfer_id is not None:
            self._reserved.pop(job.transfer_id, None)

    def _time_requests(self, now: float) -> None:
        """Note admissions (at the start of the step that admitted them: the last poll); at a
        request's end, its queue and prefill seconds, and a reservation of its prefix."""
        for rid, t in list(self._timed.items()):
            rec = t.rec
            if t.admitted is None and rec.cached_tokens >= 0:
                t.admitted = max(t.added, self._last_poll)
            if rec.finish_reason is None:
                continue
            del self._timed[rid]
            self._by_tid.pop(t.transfer_id, None)
            stream = self.streamer.drop(rid)
            if stream is not None and not stream.done:
                self._error(stream.ident, stream.peer_rid, "the prefill engine ended the request before its KV "
                            f"was complete ({rec.finish_reason.value})", "kv_transfer_failed")
            if rec.first_token_time is None or t.admitted is None:  # ended without a token (aborted)
                continue
            parts = timing.prefill_parts(rec.arrival_time, t.admitted, rec.first_token_time)
            if stream is not None:  # streamed: no pull will name it any more
                continue
            self._timings[t.transfer_id] = parts
            while len(self._timings) > _KEEP_TIMINGS:
                self._timings.popitem(last=False)
            self._reserve(t.transfer_id, rec.prompt_ids, parts, now)

    def _reserve(self, tid: str, ids: list[int], parts: dict, now: float) -> None:
        cache = self.sched.cache
        handle = cache.match_prefix(ids, hit=False)
        if handle.cached_len == 0 or tid in self._reserved:
            return
        cache.lock(handle)
        self._in_flight += 1
        self._reserved[tid] = now + RESERVE_S
        self._to_thread.put(_Reservation(tid, list(ids), handle, parts))
        _signal(self._jobs_tx)

    def _take_layerwise(self) -> None:
        """Start streaming the layer-wise pulls that arrived whose request runs here; hand the rest
        to ``poll`` (park or whole-prompt path). Step thread: between steps, before the forward and
        after every layer (``LayerStreamer``), so a pull that arrives mid-step is not kept waiting."""
        while True:
            try:
                ident, head, t_recv = self._layerwise_in.get_nowait()
            except queue.Empty:
                return
            rid = self._by_tid.get(head["transfer_id"])
            if rid is not None:
                self._stream(rid, ident, head)
            else:
                self._to_step.put(("pull", ident, head, t_recv))

    def _stream_or_park(self, ident: bytes, head: dict, tid: str) -> bool:
        """A layer-wise pull: stream it (its request runs here), park it (its request has not come
        yet), or False (its request finished: the whole-prompt paths serve it)."""
        rid = self._by_tid.get(tid)
        if rid is not None:
            self._stream(rid, ident, head)
            return True
        if tid in self._timings or tid in self._reserved or tid in self._parked:
            return False
        self._parked[tid] = (ident, head, time.monotonic() + self.timeout_s)
        return True

    def _stream(self, rid: str, ident: bytes, head: dict) -> None:
        rec = self._timed[rid].rec
        if head["token_ids"] != rec.prompt_ids:
            self._error(ident, head.get("rid"), "the layer-wise pull names other tokens than the request under "
                        "its transfer_id", "bad_request")
            return
        skip = int(head["skip"])
        self.streamer.start(Stream(rid, ident, head.get("rid"), skip, int(head["want"]), skip))
        self.counters["num_streams"] += 1

    def _expire_parked(self, now: float) -> None:
        for tid, (ident, head, expires) in list(self._parked.items()):
            if now >= expires:
                del self._parked[tid]
                self._error(ident, head.get("rid"), f"no request with this transfer_id reached the prefill engine "
                            f"within {self.timeout_s:g} s", "kv_transfer_missed")

    def _error(self, ident: bytes, rid, message: str, code: str) -> None:
        """Have the transfer thread answer ``ERR`` (it owns the socket)."""
        self._to_thread.put(("err", ident, rid, message, code))
        _signal(self._jobs_tx)

    def _send_layers(self, s: Stream, start: int, n: int, first: int, parts: list) -> None:
        """``LayerStreamer``'s sender: the transfer thread sends the copies as one ``KVL`` message."""
        header = {"rid": s.peer_rid, "start": start, "num_tokens": n, "layer": first,
                  "num_layers": int(parts[0].shape[0]), "layout": self.layout}
        self._to_thread.put(("layers", s.ident, header, parts))
        _signal(self._jobs_tx)

    def _lock_and_hand_over(self, ident: bytes, head: dict, t_recv: float) -> None:
        tid = head.get("transfer_id")
        if head.get("layerwise") is True and isinstance(tid, str) and self._stream_or_park(ident, head, tid):
            return
        ids, skip, want = head["token_ids"], int(head["skip"]), int(head["want"])
        cache = self.sched.cache
        handle = cache.match_prefix(ids[:want], hit=True)
        if handle.cached_len > skip:
            slots = handle.slots[skip:handle.cached_len]
            cache.lock(handle)
        else:
            slots, handle = handle.slots[:0], None
        header = {"rid": head.get("rid"), "start": skip, "num_tokens": int(slots.numel()), "layout": self.layout}
        if isinstance(tid, str) and tid in self._timings:
            header["prefill_timing"] = self._timings.pop(tid)
        self._in_flight += 1
        self._to_thread.put(_Job(ident, header, slots, handle, t_recv, hold_s=mooncake_hold(head)))
        _signal(self._jobs_tx)

    # -- transfer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._jobs_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(self._expire_exposed()))
                if self._jobs_rx in ready:
                    while True:
                        try:
                            self._jobs_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while True:
                    try:
                        job = self._to_thread.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        return
                    if isinstance(job, _Reservation):
                        self._held[job.transfer_id] = job
                    elif isinstance(job, _Job):
                        self._send(job)
                    elif job[0] == "layers":
                        self._send_layer_message(*job[1:])
                    elif job[0] == "err":
                        self._reply_error(*job[1:])
                    else:  # ("expire", transfer_id)
                        res = self._held.pop(job[1], None)
                        if res is not None:
                            self._hand_back(res)
                if self.sock in ready:
                    while True:
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._accept(frames)
        except Exception:  # noqa: BLE001 - a dead transfer thread must say why in the log
            log.exception("kv transfer thread failed")
        finally:
            self.sock.close(0)
            self._wake_tx.close(0)
            self._jobs_rx.close(0)

    def _accept(self, frames) -> None:
        """Check a message; a valid pull goes to the step thread, anything else is answered here."""
        t_recv = time.perf_counter()
        if len(frames) == 3 and frames[1].bytes == wire.DONE:
            self._release(frames[2].bytes)
            return
        if len(frames) < 3 or frames[1].bytes != wire.PULL:
            self._count("num_bad_messages", 1)
            if len(frames) >= 2:
                self._reply_error(frames[0].bytes, None, "expected [PULL, header]", "bad_request")
            return
        ident = frames[0].bytes
        try:
            head = wire.decode_header(frames[2].bytes)
            ids = head["token_ids"]
            skip, want = int(head["skip"]), int(head["want"])
            if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise ValueError("token_ids must be a list of ints")
            if not 0 <= skip <= want <= len(ids):
                raise ValueError(f"need 0 <= skip <= want <= len(token_ids), got {skip}, {want}, {len(ids)}")
            hold_s = mooncake_hold(head)
        except (ValueError, KeyError, TypeError) as e:
            self._count("num_bad_messages", 1)
            self._reply_error(ident, None, f"bad pull: {e}", "bad_request")
            return
        why = wire.layout_mismatch(self.layout, head.get("layout"), self.scales, head.get("kv_scales"),
                                   "the decode engine", "the prefill engine")
        if why is not None:
            self._reply_error(ident, head.get("rid"), why, "layout_mismatch")
            return
        if hold_s is not None and self.mc is None:
            self._reply_error(ident, head.get("rid"), "the prefill engine does not run the mooncake transfer "
                              "backend (both engines need the same --disaggregation-transfer-backend)",
                              "backend_mismatch")
            return
        tid = head.get("transfer_id")
        res = self._held.pop(tid, None) if isinstance(tid, str) else None
        if res is not None:
            end = min(res.handle.cached_len, want)
            end -= end % self.pool.page_size
            if ids[:end] == res.ids[:end]:
                slots = res.handle.slots[skip:end] if end > skip else res.handle.slots[:0]
                header = {"rid": head.get("rid"), "start": skip, "num_tokens": int(slots.numel()),
                          "layout": self.layout, "prefill_timing": res.prefill_timing}
                self._send(_Job(ident, header, slots, res.handle, t_recv, tid, hold_s))
                return
            self._hand_back(res)  # other tokens under this id: the step thread matches them
        if head.get("layerwise") is True and isinstance(tid, str):
            self._layerwise_in.put((ident, head, t_recv))
        else:
            self._to_step.put(("pull", ident, head, t_recv))
        _signal(self._wake_tx)

    def _release(self, raw: bytes) -> None:
        """A decode engine will not pull this transfer_id: hand its reservation back; or it has read
        the staging buffer of this read_id: free it."""
        try:
            head = wire.decode_header(raw)
        except ValueError:
            head = {}
        read_id = head.get("read_id")
        if isinstance(read_id, str):
            exposed = self._exposed.pop(read_id, None)
            if exposed is not None:
                self.mc.unregister(exposed[0])
                self._count("num_read_released", 1)
            return
        tid = head.get("transfer_id")
        if not isinstance(tid, str):
            self._count("num_bad_messages", 1)
            return
        res = self._held.pop(tid, None)
        if res is not None:  # else: pulled, expired, or not held yet (it then expires)
            self._hand_back(res)

    def _hand_back(self, res: _Reservation) -> None:
        self._to_step.put(("sent", res))
        _signal(self._wake_tx)

    def _send(self, job: _Job) -> None:
        """Copy the locked slots' KV and send it; then hand the job back for the unlock."""
        t0 = time.perf_counter()
        pool, slots = self.pool, job.slots
        parts = [pool.k_cache[:, slots], pool.v_cache[:, slots]]  # copies of committed, locked slots
        if pool.k_scale is not None:  # per-token scales (int8); static (fp8) ones are the pool's, not sent
            parts += [pool.k_scale[:, slots], pool.v_scale[:, slots]]
        try:
            if job.hold_s is not None and slots.numel():
                self._expose(job, parts)
            else:
                self.sock.send_multipart([job.ident, wire.KV, wire.encode_header(job.header)]
                                         + [wire.tensor_frame(t) for t in parts], copy=False)
        finally:
            self._to_step.put(("sent", job))
            _signal(self._wake_tx)
        with self._lock:
            c = self.counters
            c["num_pulls"] += 1
            c["num_tokens_sent"] += int(slots.numel())
            c["bytes_sent"] += sum(t.numel() * t.element_size() for t in parts)
            c["seconds"] += time.perf_counter() - t0
            c["wait_seconds"] += t0 - job.t_recv

    def _send_layer_message(self, ident: bytes, header: dict, parts: list) -> None:
        t0 = time.perf_counter()
        self.sock.send_multipart([ident, wire.LAYERS, wire.encode_header(header)]
                                 + [wire.tensor_frame(t) for t in parts], copy=False)
        with self._lock:
            c = self.counters
            c["num_layer_messages"] += 1
            c["bytes_sent"] += sum(t.numel() * t.element_size() for t in parts)
            c["seconds"] += time.perf_counter() - t0
            if header["layer"] == 0:
                c["num_tokens_sent"] += header["num_tokens"]

    def _expose(self, job: _Job, parts: list) -> None:
        """Copy the KV into a registered staging buffer and answer where to read it (``mooncake``)."""
        buf = mooncake.pack(parts)
        try:
            addr = self.mc.register(buf)
        except RuntimeError as e:
            self._reply_error(job.ident, job.header.get("rid"), str(e), "kv_transfer_failed")
            return
        read_id = secrets.token_hex(12)
        self._exposed[read_id] = (buf, time.monotonic() + job.hold_s)
        info = {"session": self.mc.session_id, "addr": addr, "nbytes": int(buf.numel()), "read_id": read_id}
        self.sock.send_multipart([job.ident, wire.KV, wire.encode_header({**job.header, "mooncake": info})])

    def _expire_exposed(self) -> Optional[int]:
        """Free the staging buffers past their hold; the milliseconds until the next expiry (None:
        none held, the poll waits for a message)."""
        if not self._exposed:
            return None
        now = time.monotonic()
        for read_id, (buf, expires) in list(self._exposed.items()):
            if now >= expires:
                del self._exposed[read_id]
                self.mc.unregister(buf)
                self._count("num_read_expired", 1)
        if not self._exposed:
            return None
        return max(1, int(1000 * (min(e for _, e in self._exposed.values()) - now)) + 1)

    def _count(self, key: str, n) -> None:
        with self._lock:
            self.counters[key] += n

    def _reply_error(self, ident: bytes, rid, message: str, code: str) -> None:
        log.warning("kv transfer: refusing a pull: %s", message)
        try:
            self.sock.send_multipart([ident, wire.ERR, wire.encode_header({"rid": rid, "error": message,
                                                                            "code": code})], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- either thread ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: ``seconds`` (the transfer thread's copy and send, whose rate is ``gb_per_s``) and
        ``wait_seconds`` (from a pull's arrival to the start of its copy), summed; ``num_in_flight``:
        pulls being served and reservations held (each holds a locked prefix)."""
        with self._lock:
            d = dict(self.counters)
        d["mode"], d["address"] = self.mode, self.address
        d["num_in_flight"] = self._in_flight
        d["num_read_buffers"] = len(self._exposed)
        d["num_parked"] = len(self._parked)
        d["transfer_backend"] = self.backend
        d["gb_per_s"] = d["bytes_sent"] / d["seconds"] / 1e9 if d["seconds"] > 0 else 0.0
        return d

    def close(self) -> None:
        """Stop the transfer thread (it closes the ROUTER socket) and unlock what it still held
        (idempotent; call on the step thread)."""
        if self._thread.is_alive():
            self._to_thread.put(None)
            _signal(self._jobs_tx)
            self._thread.join(timeout=10)
        self.streamer.streams.clear()  # nothing can be sent any more
        self._parked.clear()
        self._by_tid.clear()
        for res in self._held.values():  # the thread has stopped: its reservations are the step thread's
            self._unlock(res)
        self._held.clear()
        while True:  # pulls sent, and jobs the thread never took: unlock them all
            try:
                item = self._to_step.get_nowait()
            except queue.Empty:
                try:
                    item = ("sent", self._to_thread.get_nowait())
                except queue.Empty:
                    break
            if item[0] == "sent" and isinstance(item[1], (_Job, _Reservation)):
                self._unlock(item[1])
        for s in (self._wake_rx, self._jobs_tx):
            s.close(0)
        self.mc = None  # the engine stops serving reads (dropped first) before its staging buffers go
        self._exposed.clear()
