"""A fetch's replica is visible when its bytes are there (issue 25, BENCHMARKS.md "k25q").

The conductor used to write a fetch's blocks into its index at admission, as a DRAM
replica of the prefill instance. A later request could then plan a fetch from that
instance before the blocks had arrived, find nothing at its dequeue and recompute
(``fetch_fallbacks``). Now the simulator stores a fetch's blocks (and reports them) when
they arrive, and only then does the index name the instance as a holder. With caches
that never evict, a holder the conductor names always has what it was named for, so no
fetch falls back; main's build fell back on the same runs (seed 2, 100 GB/s: 1-2 per run).
"""

from __future__ import annotations

import pytest

from mooncake_rs.sim import SimConfig, Simulator, generate_trace

NO_SLO = dict(ttft_slo_s=1e9, tbt_slo_s=1e9)


@pytest.mark.parametrize("staging", [0.0, 64e9], ids=["fetch-at-dequeue", "prefetch"])
@pytest.mark.parametrize("nic", [None, 100e9], ids=["no-links", "100GBps"])
@pytest.mark.parametrize("pd", [4, 8])
def test_no_fetch_plans_from_a_replica_still_on_its_way(pd, nic, staging):
    trace = generate_trace(400, kind="agentic", seed=2)
    cfg = SimConfig(prefill=pd, decode=pd, policy="mooncake", nic_bandwidth=nic, prefetch_staging_bytes=staging, **NO_SLO)
    assert cfg.capacity_tokens_per_instance is None  # nothing is ever evicted
    rep = Simulator(cfg).run(trace)
    assert rep.counters["fetches"] > 10
    assert rep.counters["fetch_fallbacks"] == 0


def test_a_fetched_prefix_is_stored_on_arrival():
    """Without links: request 1 fetches the prefix request 0 left on instance 0 onto an
    idle instance; the conductor's index names that instance a holder from the fetch's
    arrival on (before its prefill ends), not from the decision."""
    from mooncake_rs.sim import disaggregated

    trace = generate_trace(60, kind="agentic", seed=2)
    cfg = SimConfig(prefill=4, decode=4, policy="mooncake", prefetch_staging_bytes=0.0, **NO_SLO)  # fetched at dequeue
    run = disaggregated._Run(cfg, trace, None)
    seen: list[tuple[str, int, int]] = []
    arrive, arrived = run.arrive, run.fetch_arrived

    def on_arrive(i: int, t: float) -> None:
        arrive(i, t)
        d = run.s.prefill[i]
        if d is not None and run.s.fetch_from[i] is not None:
            lo = run.s.planned[i] - 1
            seen.append(("decided", i, sum(1 for h in run.index.holders(run.keys[i][lo]) if h[0] == d)))

    def on_fetched(p: int, i: int) -> None:
        lo, hi = run.fetch_arrivals[i]
        assert not any(h[0] == p for h in run.index.holders(run.keys[i][hi - 1]))
        arrived(p, i)
        seen.append(("arrived", i, sum(1 for h in run.index.holders(run.keys[i][hi - 1]) if h[0] == p)))

    run.arrive = on_arrive  # type: ignore[method-assign]
    run.fetch_arrived = on_fetched  # type: ignore[method-assign]
    run.go()
    decided = [s for s in seen if s[0] == "decided"]
    arrivals = [s for s in seen if s[0] == "arrived"]
    assert decided and arrivals
    assert all(n == 0 for _, _, n in decided)  # not a holder at the decision
    assert all(n == 1 for _, _, n in arrivals)  # a holder once the bytes are there
