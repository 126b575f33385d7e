"""The messages between the server's frontend and the engine-core process (pickled over ZMQ).

Frontend -> core:
  ``AddRequest``, ``AbortRequest``: requests in and out of the engine;
  ``ControlCall(call_id, verb)``: one control verb, answered by exactly one ``ControlReply`` with the
  same ``call_id``. Each verb is its own frozen dataclass (a ``ControlVerb``); the engine-core loop
  dispatches on its type through one handler table (``core_process.EngineCoreLoop.handlers``).
Core -> frontend (one pickled list per loop turn, ``dumps_messages``; ``pickle.loads`` reads it):
  ``RequestOutput`` / ``ErrorOutput`` per request, ``ControlReply``, and once at start-up
  ``CoreReady`` or ``CoreFailed``.

Weight updates (``UpdateWeightsFrom*``, the update group verbs, ``GetWeightVersion``) are handled
through the same table, between steps (``idleless.rl``). A new verb (pause, continue, load report,
...) is a new ``ControlVerb`` subclass here
plus one entry in the loop's handler table; the frontend sends it with ``EngineClient.call(verb)``.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Optional

from idleless.engine.request import Request, RequestOutput


# --------------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """Queue ``request`` in the engine. A refusal comes back as an ``ErrorOutput`` for its rid."""

    request: Request


@dataclass(frozen=True)
class AbortRequest:
    """Abort the request ``rid`` (unknown rids are ignored); its last output has finish_reason ``abort``,
    or ``stop`` when ``stopped``: the frontend ended it at a stop string (counted as finished, not aborted)."""

    rid: str
    stopped: bool = False


@dataclass
class ErrorOutput(RequestOutput):
    """The last (and only) output of a request the engine core refused or failed:
    ``finish_reason`` is ``abort``, ``error`` the message; ``code`` / ``param`` as in RequestError
    (``internal_error`` when the engine itself failed)."""

    code: Optional[str] = None
    param: Optional[str] = None


# --------------------------------------------------------------------------------------------------
# control verbs: one frozen dataclass each; the reply's ``result`` is named in each docstring
# --------------------------------------------------------------------------------------------------
class ControlVerb:
    """Base class of the control verbs (a marker: the loop's handler table is keyed by the subclass)."""

    __slots__ = ()


@dataclass(frozen=True)
class Ping(ControlVerb):
    """Liveness check, answered after the current step. Result: ``"pong"``."""


@dataclass(frozen=True)
class Shutdown(ControlVerb):
    """Leave the loop after this turn; what is still queued or running is aborted and reported.
    Result: ``True``."""


@dataclass(frozen=True)
class FlushCache(ControlVerb):
    """Empty the prefix cache, pins included. Result: ``True``, or ``False`` while requests run or wait."""


@dataclass(frozen=True)
class GetStats(ControlVerb):
    """Engine counters. Result: ``EngineCore.stats()``'s dict (tokens, seconds, ``kv``, ``time``)."""


@dataclass(frozen=True)
class AddEosIds(ControlVerb):
    """More token ids that end generation (e.g. the tokenizer's). Result: every eos id now, sorted."""

    ids: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "ids", tuple(self.ids))


@dataclass(frozen=True)
class PinPrefix(ControlVerb):
    """Keep the KV of ``input_ids`` in the prefix cache for ``ttl_s`` seconds under ``pin_id``
    (prefilling it first when it is not cached; re-pinning an id replaces its pin). Answered once
    the pin is made, possibly several steps later. Result: the pinned token count (``input_ids``
    cut to whole KV pages). Refused (``ControlReply.code == "refused"``) when the prefix cache is
    disabled, the pinned budget would be exceeded, or the ids are not a valid prompt."""

    input_ids: tuple[int, ...]
    ttl_s: float
    pin_id: str

    def __post_init__(self):
        object.__setattr__(self, "input_ids", tuple(self.input_ids))


@dataclass(frozen=True)
class UnpinPrefix(ControlVerb):
    """Release the pin ``pin_id`` early. Result: ``True``, or ``False`` if the id is unknown (never
    pinned, expired, or flushed)."""

    pin_id: str


@dataclass(frozen=True)
class GetWeightVersion(ControlVerb):
    """The served weights' version label (SGLang's ``weight_version``). Result: the string."""


@dataclass(frozen=True)
class UpdateWeightsFromDisk(ControlVerb):
    """Replace every weight with the checkpoint at ``model_path`` (an HF directory or a GGUF file of
    the served model's shape). Read and checked at once; written between two steps once no request
    runs (``abort_all_requests`` aborts them first; ``flush_cache=False``: written at once, running
    requests go on with the new weights and the prefix cache is kept). Result:
    ``UpdateResult.as_dict()``. Refused (nothing written) for an unreadable path, another shape, a
    missing, unknown or misshapen tensor."""

    model_path: str
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False


@dataclass(frozen=True)
class UpdateWeightsFromTensor(ControlVerb):
    """Update the weights named in a shared tensor file (``idleless.rl.shm``: ``shm_path`` and one
    ``TensorSpec`` per tensor; a subset of the weights is fine), as ``UpdateWeightsFromDisk`` otherwise.
    The file must stay until the reply. Result: ``UpdateResult.as_dict()``."""

    shm_path: str
    tensors: tuple  # of idleless.rl.shm.TensorSpec
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False

    def __post_init__(self):
        object.__setattr__(self, "tensors", tuple(self.tensors))


@dataclass(frozen=True)
class InitWeightsUpdateGroup(ControlVerb):
    """Join the trainer's weights-update group as rank ``rank_offset`` (``idleless.rl.distributed``);
    blocks the engine until every rank joined or ``timeout_s`` passed. Result: ``True``; refused when
    the rendezvous fails or a group is already joined."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weights_update_group"
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(ControlVerb):
    """Receive one broadcast from rank 0 per name (dtype and shape given) in the group ``group_name``,
    at once, then update as ``UpdateWeightsFromDisk`` (a subset is fine). Result:
    ``UpdateResult.as_dict()``; refused when the broadcast fails (the broken group is dropped) or the
    tensors do not fit the model."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = "weights_update_group"
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(ControlVerb):
    """Leave the weights-update group ``group_name``. Result: ``True``; refused for an unknown group."""

    group_name: str = "weights_update_group"


@dataclass(frozen=True)
class PauseGeneration(ControlVerb):
    """Stop stepping (SGLang's ``pause_generation``) until ``ContinueGeneration``; requests arriving
    meanwhile wait. ``mode``: ``abort`` ends every request in the engine (finish_reason ``abort``);
    ``retract`` sends the running ones back to the queue, their KV released (recomputed, or found in
    the prefix cache, after continue); ``in_place`` keeps them as they are. A weight update that
    flushes the cache goes ahead while paused once no request runs (abort, retract). Result: the
    number of requests aborted or retracted (0 for in_place); refused for another mode."""

    mode: str = "abort"


@dataclass(frozen=True)
class ContinueGeneration(ControlVerb):
    """Resume after ``PauseGeneration`` (the requests that waited are queued). Result: ``True``."""


@dataclass(frozen=True)
class ReleaseMemoryOccupation(ControlVerb):
    """Free the memory of ``tags`` (``kv_cache``, ``weights``; empty: both) for a trainer on this machine
    (``idleless.rl.memory``); no step runs and arriving requests wait until every tag is resumed.
    Refused while requests are in the engine. Result: {"released": [tags], "bytes": freed}."""

    tags: tuple = ()


@dataclass(frozen=True)
class ResumeMemoryOccupation(ControlVerb):
    """Take the memory of ``tags`` (empty: both) back, zero-filled (weights must be pushed again).
    Result: {"released": [tags still released], "bytes": taken}."""

    tags: tuple = ()


@dataclass(frozen=True)
class ControlCall:
    """Envelope of one control verb; ``call_id`` (unique per frontend) pairs it with its reply."""

    call_id: int
    verb: ControlVerb


@dataclass(frozen=True)
class ControlReply:
    """The answer to ``ControlCall(call_id, ...)``. ``ok``: the verb ran and ``result`` is its value.
    Otherwise ``error`` says why and ``code`` what kind of failure: ``refused`` (the engine declined:
    the caller's fault, e.g. over the pinned budget), ``unknown_verb``, ``internal_error``."""

    call_id: int
    ok: bool
    result: Any = None
    error: Optional[str] = None
    code: Optional[str] = None


# --------------------------------------------------------------------------------------------------
# start-up
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreReady:
    """First message of a started engine core: what the frontend needs to validate requests.

    vocab_size: ids in [0, vocab_size) are valid; context_length and kv_slots are in tokens (a
    request needs prompt + max_tokens <= min(context_length, kv_slots - pinned tokens));
    load_seconds: model load; precision: the runner's ``precision`` (``idleless.quant.gate.precision_report``:
    dtypes, bytes per weight, KV bytes per token, the accuracy gate's KL and top-1), None without one;
    deterministic: whether the batch-invariant kernels run (``runner.resolve_deterministic``)."""

    pid: int
    model_dir: str
    dtype: str
    vocab_size: int
    context_length: int
    kv_slots: int
    page_size: int
    max_running_requests: int
    eos_token_ids: list[int]
    load_seconds: float
    precision: Optional[dict] = None
    deterministic: bool = False


@dataclass(frozen=True)
class CoreFailed:
    """Sent instead of CoreReady when the engine core cannot start (the process then exits 1)."""

    message: str
    traceback: str = ""


# --------------------------------------------------------------------------------------------------
# the wire
# --------------------------------------------------------------------------------------------------
_OUTPUT_FIELDS = fields(RequestOutput)
if any(not f.init for f in _OUTPUT_FIELDS):  # the reduction below passes every field to __init__
    raise TypeError("RequestOutput fields must all be __init__ arguments to be sent as a tuple")
_output_args = attrgetter(*(f.name for f in _OUTPUT_FIELDS))


def _reduce_output(out: RequestOutput) -> tuple:
    return RequestOutput, _output_args(out)


class _MessagePickler(pickle.Pickler):
    """Pickles a ``RequestOutput`` (exactly that type) as a call of its constructor with its field
    values in order, instead of class + a dict of field names: a third of the bytes, and about a
    third of the time to write and to read (the per-token part of a step's message)."""

    dispatch_table = {**copyreg.dispatch_table, RequestOutput: _reduce_output}


def dumps_messages(msgs: list) -> bytes:
    """One core -> frontend message: the list ``msgs`` pickled (highest protocol) so that plain
    ``pickle.loads`` returns an equal list (each ``RequestOutput`` rebuilt by its constructor)."""
    buf = io.BytesIO()
    _MessagePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msgs)
    return buf.getvalue()
