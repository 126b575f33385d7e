"""ServerMetrics observes through labelled children looked up once: the samples after a set of
observations equal those of the same observations made through prometheus_client's ``labels()`` on a
fresh registry (the reference), including a label value not created up front."""

from prometheus_client import CollectorRegistry

from idleless.telemetry.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict:
    """(name, labels) -> value of every sample, the ``_created`` timestamps left out."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in metrics.registry.collect()
            for s in fam.samples if not s.name.endswith("_created")}


def _observe_by_labels(m: ServerMetrics) -> None:
    """The same observations as _observe, through prometheus_client's labels() (the reference)."""
    name = "replay"
    m.ttft.labels(name).observe(0.3)
    for _ in range(3):
        m.itl.labels(name).observe(0.012)
    m.itl.labels(name).observe(0.7)
    m.requests.labels(name, "stop").inc()
    m.requests.labels(name, "error").inc()
    m.prompt_tokens.labels(name).inc(17)
    m.cache_hit_tokens.labels(name).inc(5)
    m.generation_tokens.labels(name).inc(9)
    m.e2e.labels(name).observe(1.4)
    m.requests.labels(name, "length").inc()
    m.prompt_tokens.labels(name).inc(3)
    m.cache_hit_tokens.labels(name).inc(0)
    m.generation_tokens.labels(name).inc(4)
    m.e2e.labels(name).observe(0.2)
    m.rejected.labels(name, "overloaded").inc()
    m.rejected.labels(name, "teapot").inc()
    m.inflight.labels(name).set(7)


def _observe(m: ServerMetrics) -> None:
    m.observe_ttft(0.3)
    m.observe_itl(0.012, 3)
    m.observe_itl(0.7)
    m.observe_finished("stop", 17, 5, 9, 1.4)
    m.observe_finished("error", 0, 0, 0, 0.0)  # an unforeseen reason: its own series, as labels() makes it
    m.observe_finished("length", 3, 0, 4, 0.2)
    m.observe_rejected("overloaded")
    m.observe_rejected("teapot")
    m.set_inflight(7)


def test_metrics_children_match_labels():
    fresh = ServerMetrics("replay", CollectorRegistry())
    ref = ServerMetrics("replay", CollectorRegistry())
    assert _samples(fresh) == _samples(ref)  # before any observation: every series at 0
    _observe(fresh)
    _observe_by_labels(ref)
    # the reference's "error" finish adds 0 tokens and a 0.0 s e2e observation, as observe_finished does
    ref.e2e.labels("replay").observe(0.0)
    got, want = _samples(fresh), _samples(ref)
    assert got == want
    assert got[("idleless:inter_token_latency_seconds_count", (("model_name", "replay"),))] == 4
    assert got[("idleless:num_requests_total", (("finish_reason", "error"), ("model_name", "replay")))] == 1
    assert got[("vllm:inter_token_latency_seconds_count", (("model_name", "replay"),))] == 4
