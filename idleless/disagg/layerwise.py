"""Layer-by-layer KV sending on the prefill engine, overlapped with the prefill's compute.

With a layer-wise pull (``wire``: ``"layerwise": true``) the decode engine does not wait for the
prefill to end: the prefill engine streams the request's KV while it computes it. After decoder
layer ``i`` of a step has written the K/V of the step's new tokens into the pool, the K/V of the
streamed request's new tokens in layer ``i`` is copied out (on the step thread, so the pool's
one-owner rule holds: nobody reads a slot after the step that owns it) and handed to the transfer
thread, which sends it while layers ``i + 1 ..`` compute. With chunked prefill each chunk goes out
layer by layer in its own step. vLLM's KV connector v1 has the same shape on its worker side
(``save_kv_layer`` after each attention layer, ``wait_for_save`` at the end of the forward); the
layer-wise transfer of SGLang's disaggregation and of Mooncake (Qin et al., FAST 2025) likewise.

``LayerStreamer`` attaches to the model runner at two points, neither of which knows about
disaggregation: ``runner.step_observer`` (the runner calls ``begin(plan)`` before its forward) and
a PyTorch forward hook on every decoder layer. What a step's hooks could not send (a batch the
runner ran without the module tree, ``model.decode_graph``; a runner without layers) goes out as a
whole-layers message from ``flush``, which the prefill connector calls after every step, before the
step's slots can be freed or written again.

The stream of a request covers token positions ``[skip, want)`` (the decode engine holds
``[0, skip)``). Tokens whose KV already existed when the stream started (the prefill engine's own
cache hit, chunks computed before the pull arrived) go out first, all layers in one message; a
preempted request that recomputes tokens already sent does not send them again (``sent`` only
grows), so every (layer, token) is sent exactly once, in token order per layer.

A pull may arrive while the step that computes its prompt runs (a prompt in one chunk is one long
step): ``take_new``, the connector's intake of layer-wise pulls, is called before the forward and
after every layer, and a stream that starts mid-step sends the layers this step has already written
at once and the rest as they come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(eq=False)
class Stream:
    """One request's layer-wise transfer. ``ident``: the decode engine's ZMQ identity; ``peer_rid``:
    the decode engine's request id (its replies are keyed by it); positions ``[skip, want)`` are to
    be sent, ``[skip, sent)`` have been (all layers)."""
    rid: str
    ident: bytes
    peer_rid: object
    skip: int
    want: int
    sent: int

    @property
    def done(self) -> bool:
        return self.sent >= self.want


@dataclass(eq=False)
class _Active:
    """A streamed request's tokens written by the current step: positions ``[lo, hi)`` in ``slots``;
    layers ``< next_layer`` are sent."""
    stream: Stream
    lo: int
    hi: int
    slots: torch.Tensor  # int64 [hi - lo]
    next_layer: int = 0


#: send(stream, start, num_tokens, first_layer, parts): parts are K, V [num_layers, n, H, D] (+ per-token
#: scales [num_layers, n, H] float32, int8), fresh copies the transfer thread may keep
SendFn = Callable[[Stream, int, int, int, list], None]


class LayerStreamer:
    """The prefill engine's layer-wise sender over ``pool`` (a ``KVPool``): ``send`` hands each
    message's tensors to the transfer thread; ``take_new`` (step thread) starts the streams of the
    pulls that have arrived. ``streams``: rid -> Stream."""

    def __init__(self, pool, send: SendFn, take_new: Callable[[], None] = lambda: None):
        self.pool = pool
        self.send = send
        self.take_new = take_new  # starts the streams of pulls that arrived (may call ``start``)
        self.num_layers = int(pool.k_cache.shape[0])
        self.streams: dict[str, Stream] = {}
        self._active: list[_Active] = []
        self._plan: dict = {}  # rid -> ScheduledRequest of the step under way ({} between steps)
        self._layers_done = 0  # layers of the step under way that have written their K/V

    def attach(self, runner) -> None:
        """Observe ``runner``'s steps and, when it has a module tree, each decoder layer's end."""
        runner.step_observer = self
        layers = getattr(getattr(runner, "model", None), "layers", None)
        for i, layer in enumerate(layers or ()):
            layer.register_forward_hook(self._layer_hook(i))

    def _layer_hook(self, i: int):
        def hook(module, args, output):
            if self._plan:
                self._layers_done = i + 1
                self.take_new()
                if self._active:
                    self._layer_done(i)
        return hook

    def start(self, stream: Stream) -> None:
        """Stream ``stream.rid`` from now on (mid-step: what this step has written goes out at once)."""
        self.streams[stream.rid] = stream
        r = self._plan.get(stream.rid)
        if r is not None:
            self._join(stream, r)

    def drop(self, rid: str) -> Optional[Stream]:
        self._active = [a for a in self._active if a.stream.rid != rid]
        return self.streams.pop(rid, None)

    def begin(self, plan) -> None:
        """Before the forward of ``plan`` (a StepPlan): send what streamed requests had before this
        step (all layers), and note the positions this step writes for the layer hooks."""
        self._flush_active()
        self._plan = {r.rid: r for r in plan.requests}
        self._layers_done = 0
        self.take_new()
        for rid, s in self.streams.items():
            r = self._plan.get(rid)
            if r is not None and not any(a.stream is s for a in self._active):
                self._join(s, r)

    def _join(self, s: Stream, r) -> None:
        """Take ``s`` into the step under way, whose entry for it is ``r`` (a ScheduledRequest)."""
        if s.done:
            return
        before = min(r.start, s.want)
        if before > s.sent:
            self._send_slots(s, s.sent, r.slot_table[s.sent:before], 0, self.num_layers)
            s.sent = before
        lo, hi = max(r.start, s.sent), min(r.start + r.num_tokens, s.want)
        if hi <= lo:
            return
        a = _Active(s, lo, hi, r.slot_table[lo:hi], self._layers_done)
        if a.next_layer:  # joined mid-step: the layers written so far, at once
            self._send_slots(s, lo, a.slots, 0, a.next_layer)
        if a.next_layer == self.num_layers:
            s.sent = hi
        else:
            self._active.append(a)

    def _layer_done(self, i: int) -> None:
        for a in self._active:
            if a.next_layer == i:
                self._send_slots(a.stream, a.lo, a.slots, i, 1)
                a.next_layer = i + 1
                if a.next_layer == self.num_layers:
                    a.stream.sent = a.hi
        self._active = [a for a in self._active if a.next_layer < self.num_layers]

    def flush(self) -> None:
        """After a step: send the layers of this step's tokens its hooks did not (the runner ran no
        module tree). Call before anything can free or rewrite the step's slots."""
        self._flush_active()

    def _flush_active(self) -> None:
        for a in self._active:
            self._send_slots(a.stream, a.lo, a.slots, a.next_layer, self.num_layers - a.next_layer)
            a.stream.sent = a.hi
        self._active = []
        self._plan = {}

    def _send_slots(self, s: Stream, start: int, slots: torch.Tensor, first: int, count: int) -> None:
        pool, end = self.pool, first + count
        parts = [pool.k_cache[first:end, slots], pool.v_cache[first:end, slots]]  # copies
        if pool.k_scale is not None:  # per-token scales (int8); static (fp8) ones are the pool's, not sent
            parts += [pool.k_scale[first:end, slots], pool.v_scale[first:end, slots]]
        self.send(s, start, int(slots.numel()), first, parts)
