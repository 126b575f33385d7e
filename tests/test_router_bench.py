"""``idleless bench router``'s pieces that need no engine: the router-cost curve runs and is
consistent (every policy decision measured, one row per worker count and index size), and the tables
show every run's figures."""

from __future__ import annotations

from idleless.bench.router import _serving_args, format_tables, router_cost_curve


def test_cost_curve_and_tables():
    curve = router_cost_curve([1, 3], prompt_len=64, per_worker_tokens=256)
    assert [r["workers"] for r in curve["select"]] == [1, 3]
    assert all(r["exact_us"] > 0 and r["cache_aware_approx_us"] > 0 for r in curve["select"])
    assert [r["cached_tokens"] for r in curve["index"]] == [10240, 100352, 1000448]
    run = {"policy": "exact", "workload": "multi-turn", "completed": 4, "failed": 0, "engine_hit_rate": 0.5,
           "router_hit_rate": 0.25, "oracle_hit_rate": 0.75, "output_throughput": 3.5, "total_throughput": 9.0,
           "ttft_p50_ms": 120.4, "ttft_p99_ms": 300.0, "duration_s": 2.0, "requests_per_worker": [3, 1]}
    text = format_tables({"cpu": "AMD EPYC", "dp": 2, "threads_per_replica": 1, "kv_cache_memory": "24MiB",
                          "model": "m", "runs": [run], "router_cost": curve})
    assert "| multi-turn | exact | 50.0% | 25.0% | 75.0% | 3.50 | 120 | 300 | [3, 1] | 0 |" in text
    assert "AMD EPYC" in text and "| 3 |" in text


def test_serving_args_shape_the_workloads():
    import argparse

    from idleless.bench.router import add_args
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--sessions", "5", "--turns", "2", "--system-len", "100"])
    mt = _serving_args(args, "multi-turn", "http://r")
    assert (mt.num_prompts, mt.mt_turns, mt.mt_system_len, mt.warmup_requests, mt.base_url) == (10, 2, 100, 0, "http://r")
    rnd = _serving_args(args, "random", "http://r")
    assert (rnd.num_prompts, rnd.random_input_len, rnd.random_range_ratio) == (16, 256, 1.0)
