"""``kv_transfer_params`` at the HTTP surface (vLLM's field and flow).

A router asks the prefill engine for the prompt with ``max_tokens: 1`` and ``kv_transfer_params:
{"do_remote_decode": true, "transfer_id"}``; the prefill engine's answer carries ``kv_transfer_params:
{"do_remote_prefill": true, "remote_host", "remote_port", "transfer_id"}``, which the router forwards with the
original request to a decode engine (``idleless.disagg.decode`` pulls the KV from there).
"""

from __future__ import annotations

from typing import Optional

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")


def prefill_reply(config, params: Optional[dict]) -> Optional[dict]:
    """What a prefill engine answers to ``do_remote_decode``: where its KV can be pulled. None when the
    request did not ask or this engine is not a prefill engine. ``remote_host`` is None when the
    transfer port binds every interface (the router then uses the prefill engine's own host)."""
    if not params or not params.get("do_remote_decode") or getattr(config, "disaggregation_mode", "null") != "prefill":
        return None
    host = config.disaggregation_bootstrap_host
    reply = {"do_remote_prefill": True, "remote_host": None if host in WILDCARD_HOSTS else host,
             "remote_port": config.disaggregation_bootstrap_port}
    tid = params.get("transfer_id")
    if isinstance(tid, str) and tid:
        reply["transfer_id"] = tid  # the decode engine names it in its pull: the prefill timings come back
    return reply
