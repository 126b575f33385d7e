"""The router's /metrics: Prometheus text, one series per worker (label ``worker``: its URL)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# (name, help, kind, value of a worker)
_SERIES = [
    ("idleless_router_requests", "requests routed to the worker (retries elsewhere count again)", "counter",
     lambda w: w.routed),
    ("idleless_router_prompt_tokens", "prompt tokens routed (when the router tokenizes: the exact policy)",
     "counter", lambda w: w.prompt_tokens),
    ("idleless_router_predicted_hit_tokens", "prompt tokens the router expected the worker to have cached",
     "counter", lambda w: w.predicted_hit_tokens),
    ("idleless_router_cached_tokens", "cached prompt tokens the worker reported in usage "
     "(prompt_tokens_details.cached_tokens)", "counter", lambda w: w.cached_tokens),
    ("idleless_router_retries", "requests that did not start on the worker and were sent elsewhere", "counter",
     lambda w: w.retries),
    ("idleless_router_errors", "requests that failed on the worker after starting", "counter", lambda w: w.errors),
    ("idleless_router_inflight_requests", "the router's requests in flight on the worker", "gauge",
     lambda w: w.inflight),
    ("idleless_router_load", "requests in flight (engine report + routed since)", "gauge", lambda w: w.load()),
    ("idleless_router_queued_prefill_tokens", "prompt tokens waiting for prefill", "gauge",
     lambda w: w.queued_prefill_tokens()),
    ("idleless_router_kv_usage", "KV pool share neither free nor evictable (engine report; -1 unknown)", "gauge",
     lambda w: (w.report() or {}).get("kv_usage", -1)),
    ("idleless_router_healthy", "1 if the worker passes its health checks", "gauge", lambda w: int(w.healthy)),
    ("idleless_router_index_tokens", "tokens in the router's index of the worker's prefix cache", "gauge",
     lambda w: w.subscriber.stream.index.num_tokens if w.subscriber else 0),
    ("idleless_router_kv_event_snapshots", "snapshots taken to resync the worker's KV events", "counter",
     lambda w: w.subscriber.stream.snapshots if w.subscriber else 0),
]


class _Collector:
    def __init__(self, workers, policy: str, oracle_hit_tokens: int):
        self.workers, self.policy, self.oracle = list(workers), policy, oracle_hit_tokens

    def collect(self):
        for name, help_, kind, get in _SERIES:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_, labels=["worker"])
            for w in self.workers:
                fam.add_metric([w.url], get(w))
            yield fam
        info = GaugeMetricFamily("idleless_router_policy", "the routing policy", labels=["policy"])
        info.add_metric([self.policy], 1)
        yield info
        yield CounterMetricFamily("idleless_router_oracle_hit_tokens", "prompt tokens held by the healthy worker "
                                  "holding the most of each prompt, summed (when the router tokenizes)",
                                  value=self.oracle)


def render_metrics(workers: Iterable, policy: str, oracle_hit_tokens: int = 0) -> tuple[bytes, str]:
    """(Prometheus exposition text, its content type) for ``workers``."""
    reg = CollectorRegistry()
    reg.register(_Collector(workers, policy, oracle_hit_tokens))
    return generate_latest(reg), CONTENT_TYPE_LATEST
