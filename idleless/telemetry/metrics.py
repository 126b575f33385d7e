"""Prometheus metrics of the server (prometheus-client, one private registry per server).

Frontend-measured (updated as requests run; counts are per engine request, i.e. per choice):
  idleless:num_requests_total{finish_reason}        finished requests (stop, length, abort)
  idleless:num_requests_rejected_total{reason}      refused before the engine (bad_request, overloaded, unauthorized)
  idleless:prompt_tokens_total                      prompt tokens of finished requests
  idleless:generation_tokens_total                  generated tokens of finished requests
  idleless:cache_hit_tokens_total                   prompt tokens served by the radix cache
  idleless:num_requests_inflight                    admitted, unfinished requests
  idleless:time_to_first_token_seconds              histogram (arrival at the frontend -> first token)
  idleless:inter_token_latency_seconds              histogram (per generated token after the first)
  idleless:e2e_request_latency_seconds              histogram (arrival -> finish)
Engine-core state (read from the core when /metrics is scraped):
  idleless:num_running_reqs, idleless:num_waiting_reqs
  idleless:kv_usage (fraction of KV slots held by running requests and the radix cache),
  idleless:kv_tokens{state=total|free|cached|in_use}
  idleless:cache_hit_rate (engine: cached / prompt tokens of finished requests)
  idleless:num_retractions_total, idleless:engine_steps_total
  idleless:engine_time_seconds_total{bucket=forward|schedule|io|idle_no_work|other}, idleless:busy_fraction
  idleless:evicted_tokens_total, idleless:pinned_tokens, idleless:cache_hit_rate_window,
  idleless:queue_time_seconds_total
  idleless:engine_healthy (1 when the core answered the scrape's stats call)
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _CoreCollector:
    """Exposes the last engine-core stats snapshot (set by ServerMetrics.update_core)."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.stats: Optional[dict] = None
        self.healthy = False

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        g = GaugeMetricFamily("idleless:engine_healthy", "1 when the engine core answered the last scrape",
                              labels=names)
        g.add_metric(values, 1.0 if self.healthy else 0.0)
        yield g
        s = self.stats
        if not s:
            return

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, float(value))
            return m

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, float(value))
            return m

        kv = s.get("kv", {})
        total = kv.get("total", 0) or 0
        yield gauge("idleless:num_running_reqs", "requests in the running batch", s.get("num_running", 0))
        yield gauge("idleless:num_waiting_reqs", "requests in the waiting queue", s.get("num_waiting", 0))
        used = total - kv.get("free", total) if total else 0
        yield gauge("idleless:kv_usage", "fraction of KV slots in use (running requests + radix cache)",
                    used / total if total else 0.0)
        kvt = GaugeMetricFamily("idleless:kv_tokens", "KV slots (tokens) by owner", labels=names + ["state"])
        for state in ("total", "free", "cached", "in_use"):
            kvt.add_metric(values + [state], float(kv.get(state, 0)))
        yield kvt
        yield gauge("idleless:cache_hit_rate", "radix cache hit tokens / prompt tokens (engine, finished requests)",
                    s.get("cache_hit_rate", 0.0))
        yield counter("idleless:num_retractions", "running requests sent back to the queue for lack of KV",
                      s.get("num_retractions", 0))
        yield counter("idleless:engine_steps", "scheduler steps that ran the model", s.get("num_steps", 0))
        yield counter("idleless:evicted_tokens", "tokens evicted from the radix cache", s.get("evicted_tokens", 0))
        yield gauge("idleless:pinned_tokens", "tokens pinned in the radix cache", s.get("pinned_tokens", 0))
        yield gauge("idleless:cache_hit_rate_window", "radix cache hit rate over the last 256 admitted requests",
                    s.get("window_hit_rate", 0.0))
        yield counter("idleless:queue_time_seconds", "seconds admitted requests waited before admission (sum)",
                      s.get("queue_time", 0.0))
        t = s.get("time") or {}
        if t:
            eb = CounterMetricFamily("idleless:engine_time_seconds",
                                     "engine-core wall time by exclusive bucket (sums to the wall time)",
                                     labels=names + ["bucket"])
            for b in ("forward", "schedule", "io", "idle_no_work", "other"):
                eb.add_metric(values + [b], float(t.get(b, 0.0)))
            yield eb
            yield gauge("idleless:busy_fraction", "forward / (wall - idle_no_work) since start",
                        t.get("busy_fraction", 0.0))


class ServerMetrics:
    """All server metrics in a private CollectorRegistry (several servers may share a process).

    Observers take seconds and token counts; ``render()`` returns the Prometheus text exposition
    (content type ``CONTENT_TYPE_LATEST``)."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._model = model_name
        self.requests = Counter("idleless:num_requests", "finished requests (per choice)",
                                labels + ["finish_reason"], registry=r)
        self.rejected = Counter("idleless:num_requests_rejected", "requests refused before reaching the engine",
                                labels + ["reason"], registry=r)
        self.prompt_tokens = Counter("idleless:prompt_tokens", "prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("idleless:generation_tokens", "generated tokens of finished requests",
                                         labels, registry=r)
        self.cache_hit_tokens = Counter("idleless:cache_hit_tokens", "prompt tokens served by the radix cache",
                                        labels, registry=r)
        self.inflight = Gauge("idleless:num_requests_inflight", "admitted, unfinished requests (per choice)",
                              labels, registry=r)
        self.ttft = Histogram("idleless:time_to_first_token_seconds", "time to first token", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("idleless:inter_token_latency_seconds", "inter-token latency", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("idleless:e2e_request_latency_seconds", "end-to-end request latency", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        self.core = _CoreCollector({"model_name": model_name})
        r.register(self.core)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(model_name, reason)
        for reason in ("bad_request", "overloaded", "unauthorized"):
            self.rejected.labels(model_name, reason)
        self.inflight.labels(model_name).set(0)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)

    def observe_itl(self, seconds_per_token: float, count: int = 1) -> None:
        h = self.itl.labels(self._model)
        for _ in range(count):
            h.observe(seconds_per_token)

    def observe_finished(self, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                         generation_tokens: int, e2e_seconds: float) -> None:
        self.requests.labels(self._model, finish_reason).inc()
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.cache_hit_tokens.labels(self._model).inc(cached_tokens)
        self.generation_tokens.labels(self._model).inc(generation_tokens)
        self.e2e.labels(self._model).observe(e2e_seconds)

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(self._model, reason).inc()

    def set_inflight(self, n: int) -> None:
        self.inflight.labels(self._model).set(n)

    def update_core(self, stats: Optional[dict], healthy: bool) -> None:
        """Snapshot of EngineCore.stats() (None when the core did not answer)."""
        self.core.healthy = healthy
        if stats is not None:
            self.core.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
