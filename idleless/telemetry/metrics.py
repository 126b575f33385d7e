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
  idleless:engine_time_seconds_total{bucket=forward|verify|draft|schedule|kv_transfer|io|idle_no_work|other},
  idleless:busy_fraction
  with speculative decoding: idleless:spec_num_drafts_total, idleless:spec_num_draft_tokens_total,
  idleless:spec_num_accepted_tokens_total, idleless:spec_steps_off_total, idleless:spec_steps_on_total,
  idleless:spec_acceptance_rate, idleless:spec_mean_accepted_length
  with --disaggregation-mode: idleless:kv_transfer_{pulls,transfers,tokens_received,bytes_received,
  skipped_tokens,fallbacks,errors,tokens_sent,bytes_sent,seconds}_total (those of the engine's side)
  idleless:evicted_tokens_total, idleless:pinned_tokens, idleless:cache_hit_rate_window,
  idleless:queue_time_seconds_total
  idleless:engine_healthy (1 when the core answered the scrape's stats call)
Precision (set once from the engine core's start-up report, ``idleless.quant.gate``):
  idleless:weight_bytes_per_weight, idleless:kv_cache_bytes_per_token
  idleless:quantization_kl, idleless:quantization_top1_agreement   the accuracy gate's mean KL (nats) and
                                top-1 agreement against the unquantised model (only when the gate ran)

The same figures also under vLLM's names (what Grafana dashboards and the Kubernetes Gateway API
Inference Extension scrape), each with the ``model_name`` label; they are renamed views of the series
above, not a second count (``_VllmNames``):
  vllm:num_requests_running, vllm:num_requests_waiting     gauges (the core's running batch / queue)
  vllm:kv_cache_usage_perc      0..1, ``kv_cache_usage``: KV slots not free, less the radix cache's
                                evictable tokens when the core's report has them (vLLM's free-block
                                queue holds its cached blocks, so they count as free there)
  vllm:num_preemptions_total    = idleless:num_retractions_total
  vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   prompt tokens looked up in / served
                                by the radix cache (= idleless:prompt_tokens_total / cache_hit_tokens_total)
  vllm:prompt_tokens_total, vllm:generation_tokens_total          (counted when a request finishes)
  vllm:request_success_total{finished_reason=stop|length|abort}  = idleless:num_requests_total
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
  vllm:e2e_request_latency_seconds                                the histograms above, same buckets
  vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
  vllm:spec_decode_num_accepted_tokens_total                      with speculative decoding
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from idleless.telemetry.timing import BUCKETS

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST", "kv_cache_usage", "kv_used_tokens"]

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
            for b in BUCKETS:
                eb.add_metric(values + [b], float(t.get(b, 0.0)))
            yield eb
            yield gauge("idleless:busy_fraction", "(forward + verify) / (wall - idle_no_work) since start",
                        t.get("busy_fraction", 0.0))
        spec = s.get("speculative") or {}
        if spec:
            for name, doc, key in SPEC_COUNTERS:
                yield counter(name, doc, spec.get(key, 0))
            yield gauge("idleless:spec_acceptance_rate", "accepted / proposed draft tokens since start",
                        spec.get("acceptance_rate", 0.0))
            yield gauge("idleless:spec_mean_accepted_length",
                        "tokens per verify (accepted draft tokens + the target's own) since start",
                        spec.get("mean_accepted_length", 0.0))
        kvt = s.get("kv_transfer") or {}
        for name, doc, key in KV_TRANSFER_COUNTERS:
            if key in kvt:
                yield counter(name, doc, kvt[key])


# (metric name, help, key of EngineCore.stats()["speculative"]); vLLM's names in _VllmNames.SPEC
SPEC_COUNTERS = (
    ("idleless:spec_num_drafts", "verifies of draft tokens (one per request per step with drafts)", "num_drafts"),
    ("idleless:spec_num_draft_tokens", "draft tokens proposed and verified", "num_draft_tokens"),
    ("idleless:spec_num_accepted_tokens", "draft tokens accepted", "num_accepted_tokens"),
    ("idleless:spec_steps_off", "steps whose decoding requests got no drafts (the cost model said no)",
     "num_steps_off"),
    ("idleless:spec_steps_on", "steps whose decoding requests got drafts", "num_steps_on"),
)


# (metric name, help, key of EngineCore.stats()["kv_transfer"]): prefill/decode disaggregation; a
# prefill engine reports pulls served and what it sent, a decode engine what it pulled
KV_TRANSFER_COUNTERS = (
    ("idleless:kv_transfer_pulls", "KV pulls (decode: sent; prefill: served)", "num_pulls"),
    ("idleless:kv_transfer_transfers", "KV pulls that arrived and were imported (decode)", "num_transfers"),
    ("idleless:kv_transfer_tokens_received", "prompt tokens whose KV was pulled (decode)", "num_tokens_received"),
    ("idleless:kv_transfer_bytes_received", "KV bytes pulled (decode)", "bytes_received"),
    ("idleless:kv_transfer_skipped_tokens", "prompt tokens already cached here, not pulled (decode)",
     "num_skipped_tokens"),
    ("idleless:kv_transfer_fallbacks", "requests prefilled here after a failed pull (decode)", "num_fallbacks"),
    ("idleless:kv_transfer_errors", "requests ended by a failed pull (decode)", "num_errors"),
    ("idleless:kv_transfer_tokens_sent", "prompt tokens whose KV was sent (prefill)", "num_tokens_sent"),
    ("idleless:kv_transfer_bytes_sent", "KV bytes sent (prefill)", "bytes_sent"),
    ("idleless:kv_transfer_seconds", "seconds spent pulling (decode: send to import) or serving (prefill)",
     "seconds"),
)


def kv_used_tokens(kv: dict) -> int:
    """KV slots that cannot be reused without preempting, as vLLM and SGLang count them, from the
    core's ``kv`` report (tokens: ``total``, ``free`` and, when the report has it, ``evictable``: the
    radix cache's unlocked tokens, which count as free): total - free - evictable."""
    total = kv.get("total", 0)
    return total - kv.get("free", total) - kv.get("evictable", 0)


def kv_cache_usage(kv: dict) -> float:
    """``kv_used_tokens(kv) / total``, in [0, 1]; 0 for an empty pool (vllm:kv_cache_usage_perc,
    SGLang's token_usage)."""
    total = kv.get("total", 0)
    return kv_used_tokens(kv) / total if total else 0.0


def _renamed(family: Metric, name: str, doc: str, label_names: Optional[dict[str, str]] = None) -> Metric:
    """``family`` (a collected Counter/Gauge/Histogram) under another name, its labels renamed by
    ``label_names``; the samples (values, buckets, ``_created``) are the same."""
    out = Metric(name, doc, family.type)
    names = label_names or {}
    for smp in family.samples:
        out.samples.append(smp._replace(name=name + smp.name[len(family.name):],
                                        labels={names.get(k, k): v for k, v in smp.labels.items()}))
    return out


class _VllmNames:
    """The vllm: series (module docstring): renamed views of ServerMetrics' frontend metrics and of
    the core collector's last snapshot, computed at scrape time."""

    # (ServerMetrics attribute, vLLM name, vLLM's help text, label renames)
    FRONTEND = (
        ("requests", "vllm:request_success", "Count of finished requests, by finish reason.",
         {"finish_reason": "finished_reason"}),
        ("prompt_tokens", "vllm:prompt_tokens", "Number of prompt tokens of finished requests.", None),
        ("generation_tokens", "vllm:generation_tokens", "Number of generated tokens of finished requests.", None),
        ("prompt_tokens", "vllm:prefix_cache_queries", "Prefix cache queries, in queried prompt tokens.", None),
        ("cache_hit_tokens", "vllm:prefix_cache_hits", "Prefix cache hits, in cached prompt tokens.", None),
        ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", None),
        ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", None),
        ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", None),
    )

    # vLLM's speculative-decoding counters (key of EngineCore.stats()["speculative"])
    SPEC = (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
    )

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        for attr, name, doc, labels in self.FRONTEND:
            for family in getattr(m, attr).collect():
                yield _renamed(family, name, doc, labels)
        s = m.core.stats
        if not s:
            return
        names, values = list(m.core.labels), list(m.core.labels.values())
        for cls, name, doc, value in (
                (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in the running batch.",
                 s.get("num_running", 0)),
                (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 s.get("num_waiting", 0)),
                (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 kv_cache_usage(s.get("kv", {}))),
                (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemptions (retractions).",
                 s.get("num_retractions", 0)),
                *[(CounterMetricFamily, name, doc, (s.get("speculative") or {}).get(key, 0))
                  for name, doc, key in (self.SPEC if s.get("speculative") else ())]):
            family = cls(name, doc, labels=names)
            family.add_metric(values, float(value))
            yield family


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
        r.register(_VllmNames(self))
        # the labelled children, looked up once (``labels()`` costs a lock and a dict lookup per call, and
        # the TTFT/ITL observers run once per streamed token); created here, so a scrape before any
        # request already has every series, at 0
        self._requests = {reason: self.requests.labels(model_name, reason) for reason in ("stop", "length", "abort")}
        self._rejected = {reason: self.rejected.labels(model_name, reason)
                          for reason in ("bad_request", "overloaded", "unauthorized")}
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)
        self._cache_hit_tokens = self.cache_hit_tokens.labels(model_name)
        self._ttft, self._itl, self._e2e = (m.labels(model_name) for m in (self.ttft, self.itl, self.e2e))
        self._inflight = self.inflight.labels(model_name)
        self._inflight.set(0)

    @staticmethod
    def _child(children: dict, metric, model: str, label: str):
        """``metric``'s child for (``model``, ``label``), kept in ``children`` after its first use."""
        child = children.get(label)
        if child is None:
            child = children[label] = metric.labels(model, label)
        return child

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds_per_token: float, count: int = 1) -> None:
        h = self._itl
        for _ in range(count):
            h.observe(seconds_per_token)

    def observe_finished(self, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                         generation_tokens: int, e2e_seconds: float) -> None:
        self._child(self._requests, self.requests, self._model, finish_reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._cache_hit_tokens.inc(cached_tokens)
        self._generation_tokens.inc(generation_tokens)
        self._e2e.observe(e2e_seconds)

    def observe_rejected(self, reason: str) -> None:
        self._child(self._rejected, self.rejected, self._model, reason).inc()

    def set_inflight(self, n: int) -> None:
        self._inflight.set(n)

    def set_precision(self, precision: Optional[dict]) -> None:
        """Gauges of the engine core's ``precision`` report (``idleless.quant.gate.precision_report``; None:
        none): bytes per weight and KV bytes per token, and the accuracy gate's KL and top-1 agreement
        where it ran. Labelled with the weight, activation and KV dtypes."""
        if not precision:
            return
        labels = ["model_name", "weight_dtype", "activation_dtype", "kv_cache_dtype"]
        values = [self._model, precision["weight_dtype"], precision["activation_dtype"], precision["kv_cache_dtype"]]
        for name, doc, key in (
                ("idleless:weight_bytes_per_weight", "bytes per weight of the linear layers, scales included",
                 "bytes_per_weight"),
                ("idleless:kv_cache_bytes_per_token", "KV cache bytes per token (all layers, K and V, scales "
                 "included)", "kv_bytes_per_token"),
                ("idleless:quantization_kl", "accuracy gate: mean KL divergence (nats) of next-token "
                 "distributions from the unquantised model's on the built-in text", "kl"),
                ("idleless:quantization_top1_agreement", "accuracy gate: share of positions whose top-1 "
                 "token agrees with the unquantised model's", "top1")):
            if precision.get(key) is not None:
                Gauge(name, doc, labels, registry=self.registry).labels(*values).set(precision[key])

    def update_core(self, stats: Optional[dict], healthy: bool) -> None:
        """Snapshot of EngineCore.stats() (None when the core did not answer)."""
        self.core.healthy = healthy
        if stats is not None:
            self.core.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
