"""The simulator's event-loop base class: its contract, its clock, and the two loops
behind ``Simulator``."""

from __future__ import annotations

import json

import pytest

from mooncake_rs.sim import SimConfig, Simulator, generate_trace
from mooncake_rs.sim import loop
from mooncake_rs.sim.coupled import run_coupled
from mooncake_rs.sim.disaggregated import run_disaggregated
from mooncake_rs.sim.loop import EventLoop
from mooncake_rs.sim.report import Report
from mooncake_rs.sim.trace import Request


class _Clock(EventLoop):
    """A toy loop: each arrival pushes one event ``delay_s`` later; records the order."""

    delay_s = 1.0

    def __init__(self, cfg, trace):
        super().__init__(cfg, trace, None)
        self.kv_used = []
        self.caches = None
        self.counters = {}
        self.log: list[tuple[str, float, int]] = []

    def arrive(self, i, t):
        self.log.append(("arrive", t, i))
        self.push(t + self.delay_s, 7, i)

    def handle(self, t, kind, a, b, c):
        assert kind == 7 and b == c == 0
        self.log.append(("event", t, a))

    def go(self):
        self.drive()
        return loop.build_report(self.cfg, self.trace, self.keys, self.s, 0.0, [], 0.0, self.counters)


def _trace(*arrivals_s):
    return [Request(t * 1000.0, 1024, 2, (1, 2)) for t in arrivals_s]


def test_the_contract_is_enforced():
    class NoGo(EventLoop):
        def arrive(self, i, t): ...

        def handle(self, t, kind, a, b, c): ...

    with pytest.raises(TypeError, match="go"):
        NoGo(SimConfig(), [], None)  # type: ignore[abstract]
    assert EventLoop.__abstractmethods__ == {"arrive", "handle", "go"}


def test_events_before_an_arrival_run_first_and_ties_go_to_the_arrival():
    c = _Clock(SimConfig(), _trace(0.0, 1.0, 1.5, 5.0))
    rep = c.go()
    assert isinstance(rep, Report) and len(rep.requests) == 4
    # request 0's event is due at 1.0, with request 1's arrival: the arrival runs first
    assert c.log == [("arrive", 0.0, 0), ("arrive", 1.0, 1), ("event", 1.0, 0), ("arrive", 1.5, 2),
                     ("event", 2.0, 1), ("event", 2.5, 2), ("arrive", 5.0, 3), ("event", 6.0, 3)]


def test_speedup_divides_arrival_times():
    c = _Clock(SimConfig(speedup=4.0), _trace(0.0, 8.0))
    c.go()
    assert [e for e in c.log if e[0] == "arrive"] == [("arrive", 0.0, 0), ("arrive", 2.0, 1)]


def _same(a: Report, b: Report) -> bool:
    def doc(r: Report) -> dict:
        d = json.loads(r.to_json())
        for k in ("wall_s", "peak_rss_mb"):
            d["summary"].pop(k, None)
        return d

    return doc(a) == doc(b)


@pytest.mark.parametrize("arch,run", [("disaggregated", run_disaggregated), ("coupled", run_coupled)])
def test_simulator_runs_the_loop_of_its_architecture(arch, run):
    trace = generate_trace(300, rate=6.0, seed=4)
    cfg = SimConfig(prefill=3, decode=2, architecture=arch, speedup=2.0,
                    policy="mooncake" if arch == "disaggregated" else "local_cache_aware")
    sim = Simulator(cfg)
    rep = sim.run(trace)
    assert _same(rep, run(cfg, trace))
    assert sim.conductor is not None and sim.caches is not None
    assert len(sim.caches) == (3 if arch == "disaggregated" else 5)
    sim.conductor.check_integrity()
