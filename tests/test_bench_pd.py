"""``idleless bench pd``'s summaries (issue 18): the TTFT split percentiles over a run and the KV rates,
against numpy's percentiles and hand-computed values."""

from __future__ import annotations

import numpy as np

from idleless.bench.pd import _percentile, split_summary, transfer_summary
from idleless.disagg.timing import SplitStats


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        v = rng.exponential(size=n).tolist()
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert abs(_percentile(v, q) - float(np.percentile(v, 100 * q))) < 1e-12
    assert _percentile([], 0.5) is None


def test_split_summary_covers_only_the_requests_of_the_run():
    s = SplitStats()
    s.add({"queue_s": 9.0, "prefill_s": 9.0, "transfer_s": 9.0, "first_decode_s": 9.0})  # before the run
    before = s.snapshot()
    run = [(0.001, 0.2, 0.01, 0.05), (0.003, 0.4, 0.03, 0.07), (0.002, None, 0.02, 0.06)]
    for q, p, t, d in run:
        s.add({"queue_s": q, "prefill_s": p, "transfer_s": t, "first_decode_s": d})
    out = split_summary(before, s.snapshot())
    assert out["split_n"] == 3
    assert abs(out["queue_p50_ms"] - 2.0) < 1e-9 and abs(out["transfer_p50_ms"] - 20.0) < 1e-9
    assert abs(out["prefill_p50_ms"] - 300.0) < 1e-9  # the part P did not report is left out
    assert abs(out["first_decode_p99_ms"] - float(np.percentile([50, 60, 70], 99))) < 1e-9
    assert split_summary({}, {})["split_n"] == 0


def test_transfer_summary_rates_are_byte_deltas_over_second_deltas():
    d0 = {"bytes_received": 1000, "seconds": 1.0, "num_fallbacks": 1}
    d1 = {"bytes_received": 1000 + 4_000_000_000, "seconds": 3.0, "num_fallbacks": 2}
    p0 = {"bytes_sent": 0, "seconds": 0.0, "wait_seconds": 0.5}
    p1 = {"bytes_sent": 4_000_000_000, "seconds": 0.5, "wait_seconds": 1.25}
    out = transfer_summary(d0, d1, p0, p1)
    assert out["kv_bytes"] == 4_000_000_000 and out["kv_gb_per_s"] == 2.0 and out["kv_send_gb_per_s"] == 8.0
    assert out["kv_send_wait_s"] == 0.75 and out["kv_fallbacks"] == 1
    assert transfer_summary({}, {}, {}, {})["kv_gb_per_s"] is None
