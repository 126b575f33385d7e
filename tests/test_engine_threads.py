"""ThreadGovernor: the engine core's threads follow the cores other processes leave free.

Scripted clocks and CPU counters (no real load, no timing): the expected counts are worked out by
hand from the rule in idleless.engine.threads (a core is taken at TAKEN = 0.6 of it busy with other
processes, free again below FREED = 0.4)."""

from __future__ import annotations

import pytest

from idleless.engine.threads import ThreadGovernor, cpu_busy_seconds, cpu_steal_seconds, threads_for


@pytest.mark.parametrize("others,max_threads,current,want", [
    (0.0, 2, 2, 2),
    (0.7, 2, 2, 1),    # 0.7 >= 0.6: one core taken
    (0.5, 2, 2, 2),    # between FREED and TAKEN: keep what runs
    (0.5, 2, 1, 1),
    (0.3, 2, 1, 2),    # below FREED: the core is free again
    (1.0, 2, 1, 1),    # a whole core busy: one thread
    (1.9, 2, 1, 1),    # never below one
    (1.7, 4, 4, 2),    # 1.7 = one core + 0.7 of another: two taken
    (1.5, 4, 2, 2),    # 1.5: the second core is in the band, keep two
    (1.3, 4, 2, 3),    # 1.3: the second core is free again
])
def test_threads_for_hand_computed(others, max_threads, current, want):
    assert threads_for(others, max_threads, current) == want


class Script:
    """A scripted machine: wall clock, busy seconds of the engine's CPUs, the engine's own CPU seconds."""

    def __init__(self):
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.set_calls: list[int] = []

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def governor(self, max_threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, cpus={0, 1}, window_s=0.5, clock=lambda: self.t, busy=lambda: self.busy,
                              own=lambda: self.own, set_threads=self.set_calls.append)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back():
    m = Script()
    g = m.governor()
    m.run(1.0, own_cores=2.0, other_cores=0.1)  # quiet: the frontend's tenth of a core
    assert g.update() == 2 and m.set_calls == []
    m.run(1.0, own_cores=1.33, other_cores=0.67)  # a load generator takes its share of the two cores
    assert g.update() == 1 and m.set_calls == [1]
    assert g.others == pytest.approx(0.67)
    m.run(1.0, own_cores=1.0, other_cores=1.0)  # it keeps its core while we run one thread
    assert g.update() == 1 and m.set_calls == [1]
    m.run(1.0, own_cores=1.0, other_cores=0.2)  # it is gone
    assert g.update() == 2 and m.set_calls == [1, 2]


def test_measures_at_most_once_per_window():
    m = Script()
    g = m.governor()
    m.run(0.3, own_cores=1.0, other_cores=1.0)
    assert g.update() == 2  # 0.3 s < window: no measurement yet
    m.run(0.3, own_cores=1.0, other_cores=1.0)
    assert g.update() == 1  # 0.6 s measured as one window: others 1.0
    assert g.others == pytest.approx(1.0)


def test_unreadable_busy_time_keeps_max_threads():
    calls: list[int] = []
    g = ThreadGovernor(2, cpus={0, 1}, clock=lambda: 10.0, busy=lambda: None, own=lambda: 0.0,
                       set_threads=calls.append)
    assert g.update() == 2 and calls == []


def test_one_thread_is_left_alone():
    m = Script()
    g = m.governor(max_threads=1)
    m.run(1.0, own_cores=1.0, other_cores=1.0)
    assert g.update() == 1 and m.set_calls == []


def test_cpu_busy_seconds_reads_only_the_given_cpus(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 0 300 5000 50 0 10 0 0 0\n"
                    "cpu0 100 20 30 1000 40 5 6 7 0 0\n"
                    "cpu1 200 0 50 2000 10 0 4 0 0 0\n"
                    "cpu2 600 0 220 2000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    import os
    tick = os.sysconf("SC_CLK_TCK")
    # cpu0: 100 + 20 + 30 + 5 + 6 + 7 = 168; cpu1: 200 + 50 + 4 = 254 (idle and iowait left out)
    assert cpu_busy_seconds({0, 1}, str(stat)) == pytest.approx((168 + 254) / tick)
    assert cpu_busy_seconds({2}, str(stat)) == pytest.approx(820 / tick)
    assert cpu_busy_seconds({0}, str(tmp_path / "missing")) is None


def test_serve_adapts_only_when_it_chose_the_threads(monkeypatch):
    import torch

    from idleless.config import EngineConfig
    from idleless.server import launch
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its threads
    auto = EngineConfig(num_threads=0)
    launch.engine_threads(auto)
    assert auto.adaptive_threads and auto.num_threads >= 1
    given = EngineConfig(num_threads=3)
    launch.engine_threads(given)
    assert not given.adaptive_threads and given.num_threads == 3
    assert not EngineConfig().adaptive_threads  # offline: as configured


def test_runner_asks_the_governor_before_each_step(tiny_model_dir, monkeypatch):
    """The runner re-measures before every forward, with --num-threads as the most; a governor that
    takes a thread away (2 -> 1) changes nothing in the greedy tokens of a tiny float32 model."""
    import torch

    from idleless.config import EngineConfig
    from idleless.engine import threads
    from idleless.engine.core import EngineCore
    from idleless.engine.request import Request
    from idleless.sampling_params import SamplingParams
    calls = []

    class OneThread(threads.ThreadGovernor):
        def update(self):
            calls.append(self.max_threads)
            torch.set_num_threads(1)
            return 1

    def run(**kw):
        core = EngineCore(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_memory="4MiB", num_threads=2,
                                       **kw))
        for i, ids in enumerate([[5, 6, 7, 8], [9, 10, 11, 12, 13]]):
            core.add_request(Request(f"r{i}", ids, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        steps = 0
        while core.has_work():
            steps += 1
            for out in core.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        return tokens, steps

    before = torch.get_num_threads()
    try:
        plain, _ = run()
        monkeypatch.setattr("idleless.model.runner.ThreadGovernor", OneThread)
        governed, steps = run(adaptive_threads=True)
    finally:
        torch.set_num_threads(before)
    assert calls == [2] * len(calls) and 1 <= len(calls) <= steps
    assert governed == plain and all(len(t) == 6 for t in plain.values())


def test_cpu_steal_seconds_reads_the_machine_line(tmp_path):
    """The aggregate "cpu" line's eighth column (steal), in seconds; None without the column or file."""
    import os
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 100 0 0 0 37 0 0\ncpu0 5 0 2 50 0 0 0 30 0 0\ncpu1 5 0 3 50 0 0 0 7 0 0\n")
    assert cpu_steal_seconds(str(stat)) == pytest.approx(37 / tick)
    stat.write_text("cpu  10 0 5 100 0 0 0\n")
    assert cpu_steal_seconds(str(stat)) is None
    assert cpu_steal_seconds(str(tmp_path / "missing")) is None
