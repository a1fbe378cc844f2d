"""Every placement of a small trace, simulated: the brute force behind
tests/test_sim_online_bound.py and benches/sim_online_bound.py.

``forced_placements(p)`` makes the simulator put request ``i`` on prefill instance
``p[i]``: around each of the conductor's ``schedule`` calls every other prefill instance
is drained, so the real conductor still prices and records the request (its reuse on
that instance, its decode instance), it just has one candidate. Fetches are off in the
runs below (``local_cache_aware`` never fetches), so a vector of instances is the whole
decision; with 2 prefill instances a trace of n requests has 2**n of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mooncake_rs.sim import SimConfig, Simulator
from mooncake_rs.sim import loop as sim_loop

NO_SLO = dict(ttft_slo_s=1e9, tbt_slo_s=1e9)
BASELINES = ("load_balance", "local_cache_aware")


@contextmanager
def forced_placements(placements: Sequence[int]) -> Iterator[None]:
    schedule = sim_loop.EventLoop.schedule_or_reject

    def pinned(self: Any, i: int, t: float) -> Any:
        others = [p for p in range(self.cfg.prefill) if p != placements[i]]
        for p in others:
            self.conductor.drain_instance(p)
        try:
            return schedule(self, i, t)
        finally:
            for p in others:
                self.conductor.undrain_instance(p)

    sim_loop.EventLoop.schedule_or_reject = pinned  # type: ignore[method-assign]
    try:
        yield
    finally:
        sim_loop.EventLoop.schedule_or_reject = schedule  # type: ignore[method-assign]


def run(trace: Sequence[Any], policy: str, *, prefill: int, decode: int, nic: float,
        placements: Sequence[int] | None = None) -> tuple[float, list[int]]:
    """Mean TTFT of one run and each request's prefill instance."""
    cfg = SimConfig(prefill=prefill, decode=decode, policy=policy, nic_bandwidth=nic, **NO_SLO)
    if placements is None:
        rep = Simulator(cfg).run(trace)
    else:
        with forced_placements(placements):
            rep = Simulator(cfg).run(trace)
    ttft = [r.ttft_s for r in rep.requests]
    return sum(ttft) / len(ttft), [r.prefill_instance for r in rep.requests]


def every_placement(trace: Sequence[Any], *, prefill: int, decode: int, nic: float,
                    policy: str = "local_cache_aware") -> dict[tuple[int, ...], float]:
    """Mean TTFT of every vector of prefill instances (``policy`` decides the rest on the
    given instance: ``local_cache_aware`` reuses what it holds and fetches nothing)."""
    return {v: run(trace, policy, prefill=prefill, decode=decode, nic=nic, placements=v)[0]
            for v in itertools.product(range(prefill), repeat=len(trace))}


def best_baseline(trace: Sequence[Any], *, prefill: int, decode: int, nic: float) -> float:
    return min(run(trace, p, prefill=prefill, decode=decode, nic=nic)[0] for p in BASELINES)


def excess_over(full: dict[tuple[int, ...], float], best_full: float,
                head: dict[tuple[int, ...], float], best_head: float) -> float:
    """The *unavoidable excess* of a trace and its first m requests: the least seconds by
    which any placement is above the best baseline on the trace or on its prefix, whichever
    is worse. An online policy places those m the same way in both (it cannot tell them
    apart when it decides), so it is above on one of them by at least this much; 0 when one
    placement is within both. ``full`` and ``head``: ``every_placement`` of the trace and of
    its prefix; ``best_full``, ``best_head``: their ``best_baseline``."""
    m = len(next(iter(head)))
    return max(0.0, min(max(full[v] - best_full, head[v[:m]] - best_head) for v in full))
