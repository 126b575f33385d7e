"""The KV connector interface of the engine core, and the choice of one from the config.

A connector sits between the frontend's requests and the scheduler, and runs between steps
(DESIGN.md section 7): ``admit`` may take a request the scheduler would otherwise queue (a decode
engine holds it until its KV has arrived), ``poll`` runs after every step, ``take_outputs`` hands the
engine outputs for requests it ended itself (an abort, an error), ``wake_sockets`` are what the
engine loop waits on besides the frontend while idle. The base class is the colocated engine's: it
takes nothing and does nothing.
"""

from __future__ import annotations

from typing import Any

from idleless.engine.request import Request, RequestOutput

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "mooncake")
PD_FALLBACKS = ("recompute", "error")


class KVConnector:
    """No disaggregation: every method is a no-op (the engine core calls them unconditionally)."""

    mode = "null"
    wake_sockets: tuple = ()

    def admit(self, core, req: Request) -> bool:
        """Take ``req`` instead of the scheduler (True), or leave it to the scheduler (False).
        May raise RequestError for a request it can never serve."""
        return False

    def abort(self, rid: str) -> bool:
        """End a request this connector holds (its abort comes out of ``take_outputs``)."""
        return False

    def has_work(self) -> bool:
        """Whether requests wait on the connector (the engine loop keeps stepping while so)."""
        return False

    def poll(self, core) -> None:
        """Between-step work: serve or receive transfers, fire timeouts."""

    def take_outputs(self) -> list[RequestOutput]:
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Close sockets (idempotent)."""


def make_kv_connector(config, core) -> KVConnector:
    """The connector ``config.disaggregation_mode`` names, attached to ``core``, moving KV with
    ``config.disaggregation_transfer_backend``. Raises ValueError for a mode or backend that does not
    exist, the ``mooncake`` backend without its package (the message names the pip command), or a
    decode engine without a prefix cache; zmq.ZMQError when the bootstrap port is taken; RuntimeError
    when the Mooncake transfer engine does not start."""
    mode = getattr(config, "disaggregation_mode", "null") or "null"
    if mode == "null":
        return KVConnector()
    if mode not in DISAGGREGATION_MODES:
        raise ValueError(f"disaggregation_mode must be one of {', '.join(DISAGGREGATION_MODES)}, got {mode!r}")
    if config.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        raise ValueError(f"disaggregation_transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}, "
                         f"got {config.disaggregation_transfer_backend!r}")
    backend = config.disaggregation_transfer_backend
    if backend == "mooncake":
        from idleless.disagg.mooncake import missing_reason
        why = missing_reason()
        if why is not None:
            raise ValueError(why)
    host = config.disaggregation_bootstrap_host
    if mode == "prefill":
        from idleless.disagg.prefill import PrefillConnector
        return PrefillConnector(core, host, config.disaggregation_bootstrap_port, backend, config.disaggregation_timeout)
    from idleless.disagg.decode import DecodeConnector
    return DecodeConnector(core, config.disaggregation_timeout, config.pd_fallback, backend, host)
