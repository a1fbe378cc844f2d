"""Prefetch at decision time in the simulator (``SimConfig.prefetch_staging_bytes``).

- on by default (64 GB, the conductor's default); 0 turns it off;
- without links, each prefetched request's prefill ends at ``max(dequeue, admission +
  fetch) + compute`` when its prefetch had arrived by its dequeue, and no earlier than
  that otherwise (it stepped aside while the instance computed others, and joins when
  the instance is free again): a reference computed from its decision and the cost models;
- the staging memory the decisions take never exceeds the cap on any instance;
- with links, every prefetched byte is carried and accounted for, and nothing is left
  on the links at the end;
- a bad size is refused with a message naming the field.
"""

from __future__ import annotations

import pytest

from mooncake_rs.errors import InvalidArgument
from mooncake_rs.sim import SimConfig, Simulator, disaggregated, generate_trace

NO_SLO = dict(ttft_slo_s=1e9, tbt_slo_s=1e9)


def _record(monkeypatch) -> dict[int, tuple[float, object]]:
    """Every admitted request's (admission time, decision)."""
    seen: dict[int, tuple[float, object]] = {}
    orig = disaggregated._Run.schedule_or_reject

    def wrapped(self, i, t):
        d = orig(self, i, t)
        if d is not None:
            seen[i] = (t, d)
        return d

    monkeypatch.setattr(disaggregated._Run, "schedule_or_reject", wrapped)
    return seen


def test_on_by_default_and_zero_turns_it_off():
    """The default is 64 GB of staging per instance (the conductor's default, BENCHMARKS.md
    "k25q"); 0 is the fetch at dequeue, with no prefetch counters."""
    assert SimConfig().prefetch_staging_bytes == 64e9
    trace = generate_trace(200, kind="agentic", seed=2)
    for nic in (None, 25e9):
        a = Simulator(SimConfig(prefill=4, decode=4, nic_bandwidth=nic, **NO_SLO)).run(trace)
        b = Simulator(SimConfig(prefill=4, decode=4, nic_bandwidth=nic, prefetch_staging_bytes=64e9, **NO_SLO)).run(trace)
        assert [r.ttft_s for r in a.requests] == [r.ttft_s for r in b.requests]
        assert a.counters["prefetches"] > 0
        off = Simulator(SimConfig(prefill=4, decode=4, nic_bandwidth=nic, prefetch_staging_bytes=0, **NO_SLO)).run(trace)
        assert "prefetches" not in off.counters


def test_a_prefetched_prefill_ends_at_max_of_dequeue_and_fetch_plus_compute(monkeypatch):
    seen = _record(monkeypatch)
    trace = generate_trace(400, kind="agentic", seed=2)
    cfg = SimConfig(prefill=4, decode=4, prefetch_staging_bytes=1e12, **NO_SLO)
    rep = Simulator(cfg).run(trace)
    pm, tm, _ = cfg.true_models()
    bt = cfg.block_tokens
    checked = overlapped = aside = aside_at_once = 0
    for r in rep.requests:
        t_a, d = seen[r.id]
        if not d.prefetch or r.fetched_blocks == 0:
            continue
        lo = d.reused_blocks - d.fetch_blocks
        held = r.reused_blocks
        fetch_end = t_a + tm.fetch((held - lo) * bt, 0.0)
        compute = pm.predict(r.input_length, min(held * bt, r.input_length))
        want = max(r.prefill_start_s, fetch_end) + compute
        end = r.arrival_s + r.ttft_s
        if fetch_end <= r.prefill_start_s:  # arrived while it was queued: computes at its dequeue
            assert end == pytest.approx(want, rel=1e-9, abs=1e-9), (r, d)
        else:  # set aside at its dequeue: computes once the fetch is in and the instance free
            assert end >= want - 1e-9, (r, d)
            aside += 1
            aside_at_once += end == pytest.approx(want, rel=1e-9, abs=1e-9)
        overlapped += r.prefill_start_s > t_a  # it waited in a queue while its fetch ran
        checked += 1
    assert rep.counters["prefetches"] > 10 and checked > 10 and overlapped > 0
    assert rep.counters["set_aside"] >= aside > 0 and aside_at_once > 0


@pytest.mark.parametrize("nic", [None, 25e9])
def test_staging_never_exceeds_the_cap(monkeypatch, nic):
    seen = _record(monkeypatch)
    trace = generate_trace(300, kind="agentic", seed=3, rate=2.0)
    cap = 8e9  # about one agent's context (8k+ tokens at 320 KiB a token is >= 2.6 GB)
    cfg = SimConfig(prefill=3, decode=3, nic_bandwidth=nic, prefetch_staging_bytes=cap, **NO_SLO)
    sim = Simulator(cfg)
    rep = sim.run(trace)
    bpt = sim.conductor.config.transfer_model.bytes_per_token
    bt = cfg.block_tokens
    events = []  # (time, order, instance, bytes): an admission takes, a dequeue gives back
    for r in rep.requests:
        t_a, d = seen[r.id]
        if d.prefetch:
            lo = d.reused_blocks - d.fetch_blocks
            nbytes = (min(d.reused_blocks * bt, r.input_length) - min(lo * bt, r.input_length)) * bpt
            events += [(t_a, 1, d.prefill, nbytes), (r.prefill_start_s, 0, d.prefill, -nbytes)]
    assert events, "no prefetch taken: the test proves nothing"
    held: dict[int, float] = {}
    for _, _, inst, nbytes in sorted(events):
        held[inst] = held.get(inst, 0.0) + nbytes
        assert held[inst] <= cap * (1 + 1e-9)


def test_with_links_every_prefetched_byte_is_carried():
    trace = generate_trace(300, kind="agentic", seed=2, rate=2.0)
    cfg = SimConfig(prefill=4, decode=4, nic_bandwidth=100e9, prefetch_staging_bytes=64e9, **NO_SLO)
    s = Simulator(cfg)
    rep = s.run(trace)
    assert rep.counters["prefetches"] > 0
    net = s.links
    assert net is not None and not net.flows
    into_prefill = sum(net.carried[3 * p + 1] for p in range(cfg.prefill))
    # what the prefill instances' NICs took in is what was fetched from peers (dropped
    # and abandoned prefetches' unsent bytes are not counted on either side)
    slack = 64 * (rep.counters["fetch_abandoned"] + rep.counters["prefetch_unused"] + 1)
    assert into_prefill == pytest.approx(rep.bytes_loaded_per_path["dram_peer"], rel=1e-9, abs=slack)
    assert all(r.ttft_s is not None and r.ttft_s > 0 for r in rep.requests)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "64e9"])
def test_a_bad_staging_size_is_refused(bad):
    with pytest.raises(InvalidArgument, match="prefetch_staging_bytes"):
        SimConfig(prefetch_staging_bytes=bad)
