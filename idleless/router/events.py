"""KV events: what an engine's radix tree stored and evicted, published over ZMQ for routers.

Wire format (one ZMQ PUB multipart message per engine step that changed the tree, plus heartbeats):
``[topic, payload]``, the payload JSON ``{"epoch": id, "seq": n, "events": [...], "load": {...},
"heartbeat": bool}`` (``epoch``: a random id per publisher, so a restarted engine is noticed).
Each event is ``["stored", start, tokens]`` (the tree now holds ``tokens``; it held ``tokens[:start]``
already), ``["removed", start, tokens]`` (it no longer holds ``tokens[start:]``) or ``["cleared"]``.
``seq`` counts event batches from 1 with no gaps; a heartbeat repeats the last ``seq`` with no events,
so a subscriber also notices a lost last batch. ``load`` is the engine's load report
(``EngineCore.load_report``). A subscriber that sees a gap asks the replay endpoint (ZMQ REP) for a
snapshot: request ``b"snapshot"``, reply JSON ``{"epoch", "seq": n, "paths": [[token ids], ...]}``, the held
sequences as of batch n. ``KVEventStream`` is the subscriber's bookkeeping (apply in order, detect a
gap, buffer while a snapshot is on its way); the idea follows vLLM's KV events (``--kv-events-config``)
and Dynamo's KV router, with token ids instead of block hashes so the index is exact to the token.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Optional, Sequence

from idleless.router.index import TokenIndex

SNAPSHOT_REQUEST = b"snapshot"


@dataclass
class KVEventsConfig:
    """``--kv-events-config`` (vLLM's flag; a JSON object). ``endpoint``: the PUB socket's address
    (bound by the engine; ``*`` for every interface), ``replay_endpoint``: the snapshot REP socket's,
    ``topic``: the first frame of every message, ``heartbeat_s``: seconds between heartbeats when
    nothing changes. ``publisher`` must be ``zmq``. Raises ValueError on unknown keys or bad values."""

    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str = "tcp://*:5558"
    topic: str = "kv-events"
    heartbeat_s: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """The config from the flag's JSON text. Raises ValueError (see the class)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown} (known: {sorted(known)})")
        cfg = cls(**raw)
        if cfg.publisher != "zmq":
            raise ValueError(f"--kv-events-config: publisher must be 'zmq', got {cfg.publisher!r}")
        if not cfg.heartbeat_s > 0:
            raise ValueError("--kv-events-config: heartbeat_s must be > 0")
        return cfg


def connect_address(endpoint: str, host: str) -> str:
    """The address a subscriber connects to for a bound ``endpoint``: ``*`` / ``0.0.0.0`` become the
    engine's ``host`` (e.g. ``tcp://*:5557`` on 10.0.0.2 -> ``tcp://10.0.0.2:5557``)."""
    for wildcard in ("*", "0.0.0.0"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:" + endpoint[len(prefix):]
    return endpoint


def apply_events(index: TokenIndex, events: Sequence) -> None:
    """Apply a batch's events (the wire lists above) to ``index``. Raises ValueError on an unknown kind."""
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            index.stored(ev[2], ev[1])
        elif kind == "removed":
            index.removed(ev[2], ev[1])
        elif kind == "cleared":
            index.clear()
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")


class KVEventPublisher:
    """The engine side: the radix tree's listener (``on_stored`` / ``on_removed`` / ``on_cleared``,
    called in the engine thread) collects a step's events; ``end_step(load)`` hands them, with the
    load report, to a daemon thread that owns the sockets: it numbers the batch, applies it to its
    own ``TokenIndex`` (the snapshot source, so a snapshot never reads the engine's tree from another
    thread), publishes it, answers snapshot requests and sends heartbeats. ``close()`` stops it."""

    def __init__(self, config: KVEventsConfig):
        import zmq

        self.config = config
        self._events: list = []
        self._ctx = zmq.Context.instance()
        inproc = f"inproc://kv-events-{id(self)}"
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(inproc)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._rep = self._ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(config.replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the bound address (port 0 resolved)
        self.replay_endpoint = self._rep.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox = self._ctx.socket(zmq.PUSH)  # used by the engine thread only
        self._outbox.connect(inproc)
        self.seq = 0
        self.epoch = uuid.uuid4().hex[:12]
        self.mirror = TokenIndex()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # -- the radix tree's listener (engine thread) ------------------------------------------
    def on_stored(self, tokens: list[int], start: int) -> None:
        """The tree now holds ``tokens`` (token ids; it held ``tokens[:start]`` before)."""
        self._events.append(("stored", start, tokens))

    def on_removed(self, tokens: list[int], start: int) -> None:
        """The tree no longer holds ``tokens[start:]``."""
        self._events.append(("removed", start, tokens))

    def on_cleared(self) -> None:
        """The tree was emptied."""
        self._events = [("cleared",)]  # what came before in this step no longer matters

    def end_step(self, load: dict) -> None:
        """Send this step's events (if any) and ``load`` to the publishing thread; never blocks on
        the network."""
        events, self._events = self._events, []
        self._outbox.send(pickle.dumps((events, load), protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        self._outbox.send(pickle.dumps(None))
        self._thread.join(timeout=5.0)
        self._outbox.close(linger=0)

    # -- the publishing thread ----------------------------------------------------------------
    def _send(self, events: list, load: Optional[dict], heartbeat: bool) -> None:
        body = {"epoch": self.epoch, "seq": self.seq, "events": events, "load": load, "heartbeat": heartbeat}
        self._pub.send_multipart([self.config.topic.encode(), json.dumps(body, separators=(",", ":")).encode()])

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._rep, zmq.POLLIN)
        load: Optional[dict] = None
        last_sent = time.monotonic()
        try:
            while True:
                ready = dict(poller.poll(timeout=int(self.config.heartbeat_s * 1000)))
                if self._rep in ready:
                    self._rep.recv()
                    snap = {"epoch": self.epoch, "seq": self.seq, "paths": list(self.mirror.paths())}
                    self._rep.send(json.dumps(snap, separators=(",", ":")).encode())
                if self._inbox in ready:
                    item = pickle.loads(self._inbox.recv())
                    if item is None:
                        return
                    events, load = item
                    if events:
                        self.seq += 1
                        events = [list(e) for e in events]
                        apply_events(self.mirror, events)
                        self._send(events, load, heartbeat=False)
                        last_sent = time.monotonic()
                if time.monotonic() - last_sent >= self.config.heartbeat_s:
                    self._send([], load, heartbeat=True)
                    last_sent = time.monotonic()
        finally:
            for s in (self._inbox, self._pub, self._rep):
                s.close(linger=0)


class KVEventStream:
    """A subscriber's bookkeeping for one engine: applies batches to ``index`` in ``seq`` order and
    keeps the latest ``load``. ``feed(message)`` returns True when a snapshot is needed (nothing
    applied yet, or a gap: a batch numbered beyond the next, or a heartbeat ahead of what was
    applied); until ``apply_snapshot`` arrives, batches are buffered. ``apply_snapshot(seq, paths)``
    rebuilds the index and replays the buffered batches after ``seq``; it returns True when the
    buffer itself has a gap (ask again). A new ``epoch`` (a restarted engine) starts over."""

    def __init__(self):
        self.index = TokenIndex()
        self.seq: Optional[int] = None  # last applied batch; None while waiting for a snapshot
        self.epoch: Optional[str] = None
        self.load: Optional[dict] = None
        self.buffer: dict[int, list] = {}
        self.snapshots = 0  # snapshots applied (a gap's recovery is visible in /metrics)

    def feed(self, message: dict) -> bool:
        """Take one published message (the wire dict); True when a snapshot is needed."""
        if message.get("load") is not None:
            self.load = message["load"]
        seq, events = int(message["seq"]), message.get("events") or []
        if message.get("epoch") != self.epoch:  # first message, or the engine restarted
            self.epoch, self.seq, self.buffer = message.get("epoch"), None, {}
        if self.seq is None:
            if events:
                self.buffer[seq] = events
            return True
        if message.get("heartbeat") or not events:
            if seq > self.seq:
                self.seq = None
                return True
            return False
        if seq <= self.seq:
            return False  # already applied (a duplicate)
        if seq == self.seq + 1:
            apply_events(self.index, events)
            self.seq = seq
            return False
        self.buffer[seq] = events
        self.seq = None
        return True

    def apply_snapshot(self, seq: int, paths: Sequence[Sequence[int]], epoch: Optional[str] = None) -> bool:
        """Rebuild from a snapshot as of batch ``seq``; True when another snapshot is needed."""
        if epoch is not None and epoch != self.epoch:  # the engine restarted since: buffered batches are stale
            self.epoch, self.buffer = epoch, {}
        self.index.clear()
        for p in paths:
            self.index.stored(p)
        self.seq = seq
        self.snapshots += 1
        for s in sorted(self.buffer):
            if s <= self.seq:
                continue
            if s != self.seq + 1:
                self.seq = None
                self.buffer = {k: v for k, v in self.buffer.items() if k >= s}
                return True
            apply_events(self.index, self.buffer[s])
            self.seq = s
        self.buffer.clear()
        return False
