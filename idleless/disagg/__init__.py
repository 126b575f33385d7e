"""Prefill/decode disaggregation (``--disaggregation-mode prefill|decode``).

A prefill engine (P) runs prompts as usual; its radix tree keeps their KV. A decode engine (D) that
gets a request with ``kv_transfer_params`` (vLLM's field: ``{"do_remote_prefill": True,
"remote_host", "remote_port"}``) pulls the KV of the prompt's tokens it does not already hold from P,
writes it into its own pool, inserts it into its own radix tree and only then queues the request,
which the scheduler admits with that prefix as a cache hit (the last prompt token is recomputed for
its logits, as for any cache hit). So the scheduler never learns about disaggregation: the connector
works between steps, at the engine core (DESIGN.md section 7), and a transfer that fails ends in
recomputation (``--pd-fallback recompute``) or an error, never a wait. With the router's
``--pd-layerwise`` both engines start at once and the prefill engine sends each layer's KV as its
forward writes it (``layerwise``: a step observer and forward hooks on the runner's decoder layers,
the runner side of DESIGN.md's connector).

Papers: DistServe (Zhong et al., OSDI 2024), Splitwise (Patel et al., ISCA 2024), Mooncake (Qin et al.,
FAST 2025); the pull with a skip (D names the prefix it holds, P sends only the rest) is ours.
"""

from __future__ import annotations

from idleless.disagg.connector import KVConnector, make_kv_connector

__all__ = ["KVConnector", "make_kv_connector"]
