"""The router side of one engine's KV events: a ZMQ SUB socket feeding a ``KVEventStream``, and a
REQ socket for snapshots when the stream has a gap (``idleless.router.events`` has the protocol)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Optional

from idleless.router.events import SNAPSHOT_REQUEST, KVEventStream

log = logging.getLogger("idleless.router")


class KVEventSubscriber:
    """Follows one engine: ``stream.index`` (its cached tokens) and ``stream.load`` (its last load
    report) stay current while ``run()`` is running on the event loop. A snapshot request that gets
    no answer within ``snapshot_timeout_s`` is sent again on a fresh socket (ZMQ's lazy-pirate
    pattern), so an engine that restarts or is slow to bind is picked up when it comes back."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", snapshot_timeout_s: float = 2.0):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.snapshot_timeout_s = snapshot_timeout_s
        self.stream = KVEventStream()
        self.last_message = 0.0  # time.monotonic() of the last message (heartbeats included): the engine lives
        self._task: Optional[asyncio.Task] = None

    @property
    def synced(self) -> bool:
        """True when the index is complete up to the last batch received."""
        return self.stream.seq is not None

    def start(self) -> None:
        """Run ``run()`` as a task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        """Cancel the task and wait for its sockets to close."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _snapshot(self, ctx) -> Optional[dict]:
        import zmq
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            await req.send(SNAPSHOT_REQUEST)
            if await req.poll(int(self.snapshot_timeout_s * 1000)):
                return json.loads(await req.recv())
            return None
        finally:
            req.close(linger=0)

    async def run(self) -> None:
        """Receive forever (cancel to stop): feed each message to the stream; when it wants a
        snapshot, fetch one (retrying) and apply it."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        need = True  # nothing is known until the first snapshot
        try:
            while True:
                if need:
                    snap = await self._snapshot(ctx)
                    if snap is None:
                        log.debug("no snapshot from %s yet", self.replay_endpoint)
                        await self._drain(sub)  # keep buffering what arrives meanwhile
                        continue
                    need = self.stream.apply_snapshot(int(snap["seq"]), snap["paths"], snap.get("epoch"))
                    continue
                _, body = await sub.recv_multipart()
                self.last_message = time.monotonic()
                need = self.stream.feed(json.loads(body))
        finally:
            sub.close(linger=0)

    async def _drain(self, sub) -> None:
        """Feed whatever arrived without waiting (messages buffer in the stream while unsynced)."""
        import zmq
        while await sub.poll(0):
            _, body = await sub.recv_multipart(zmq.NOBLOCK)
            self.last_message = time.monotonic()
            self.stream.feed(json.loads(body))
