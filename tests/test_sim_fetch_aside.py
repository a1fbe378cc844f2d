"""A request waiting for its fetch does not hold its prefill instance (issue 25).

The serving ``Cluster`` starts a request's prefix fetch when its ``Prefill`` comes and
computes other requests while it runs (``serving/prefill.py``); so does the simulator
now: a request whose fetch is not done at its dequeue steps aside, the instance takes
the next ready request (first come, first served among the ready ones), and the one set
aside joins when its fetch has arrived. A request whose planned local prefix is the
prompt of one set aside before it waits for that one's prefill to end.

- hand-computed: two prefill instances, a fetch onto the idle one and a request behind
  it that computes during the fetch, without links and at 25 GB/s; a later step of the
  fetching request's session waits for it and reuses its whole prompt;
- property (hypothesis): on random small traces, with and without links and prefetch,
  every admitted request computes exactly once, one at a time on each instance, never
  before its dequeue, and the conductor ends with nothing queued.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rs import PrefillCostModel, TransferCostModel
from mooncake_rs.sim import Request, SimConfig, Simulator, disaggregated, generate_trace

PM, TM = PrefillCostModel(), TransferCostModel()
NO_SLO = dict(ttft_slo_s=1e9, tbt_slo_s=1e9)


def req(t_s: float, blocks, extra: int = 10) -> Request:
    return Request(t_s * 1000.0, len(blocks) * 512 + extra, 1, tuple(blocks))


# A leaves 40 blocks on instance 0; Z (60 fresh blocks, 1.58 s of compute) keeps 0
# busy from 10 s on; X (A's prefix and one block) goes to idle instance 1 and fetches
# the 40 blocks from 0; Y (one fresh block) comes 1 ms later: 1's queue is only X's
# compute (its fetch is X's own wait), so Y goes to 1 and computes during X's fetch
A = req(0.0, range(40), extra=0)
Z = req(10.0, range(1000, 1060), extra=0)
X = req(11.0, [*range(40), 2000])
Y = req(11.001, [3000])
# X's next step (its prompt and one block): counted as X's pending prefix on 1
X2 = req(11.0005, [*range(40), 2000, 2001])


def _expect_fetch_s(nic: float | None) -> float:
    nbytes = 40 * 512 * TM.bytes_per_token
    return TM.fetch(40 * 512, 0.0) if nic is None else nbytes / nic + TM.latency_s


@pytest.mark.parametrize("nic", [None, 25e9], ids=["no-links", "25GBps"])
def test_a_request_behind_a_fetch_computes_while_the_fetch_runs(nic):
    cfg = SimConfig(prefill=2, decode=1, nic_bandwidth=nic, **NO_SLO)
    rep = Simulator(cfg).run([A, Z, X, Y])
    a, z, x, y = rep.requests
    assert (a.prefill_instance, z.prefill_instance, x.prefill_instance, y.prefill_instance) == (0, 0, 1, 1)
    assert (x.reused_blocks, x.fetched_blocks) == (40, 40)
    c_x = PM.predict(X.input_length, 40 * 512)
    c_y = PM.predict(Y.input_length, 0)
    fetch = _expect_fetch_s(nic)
    assert c_y < fetch  # Y is done before X's fetch is in
    # Y starts at its arrival (X stepped aside at its dequeue, at 11 s); before, it
    # waited for X's fetch and compute: fetch - 1 ms + c_x + c_y
    assert y.prefill_start_s == pytest.approx(11.001, abs=1e-12)
    assert y.ttft_s == pytest.approx(c_y, rel=1e-9)
    # X computes when its fetch is in (the instance is free again by then)
    assert x.prefill_start_s == pytest.approx(11.0, abs=1e-12)
    assert x.ttft_s == pytest.approx(fetch + c_x, rel=1e-9)
    assert rep.counters["set_aside"] == 1 and rep.counters["blocked"] == 0
    # X's wait is its own I/O wait (no link model: the fetch; links: and the latency)
    assert rep.io_wait_s == pytest.approx(fetch, rel=1e-9)


@pytest.mark.parametrize("nic", [None, 25e9], ids=["no-links", "25GBps"])
def test_a_step_that_builds_on_a_set_aside_request_waits_for_it(nic):
    cfg = SimConfig(prefill=2, decode=1, nic_bandwidth=nic, **NO_SLO)
    rep = Simulator(cfg).run([A, Z, X, X2, Y])
    _, _, x, x2, y = rep.requests
    assert (x.prefill_instance, x2.prefill_instance, y.prefill_instance) == (1, 1, 1)
    # X2 was dequeued while X fetched, found nothing of its prompt on 1 and waited for
    # X's prefill; then it reused X's 41 blocks, as its decision planned
    assert (x2.reused_blocks, x2.fetched_blocks) == (41, 0)
    c_x = PM.predict(X.input_length, 40 * 512)
    c_x2 = PM.predict(X2.input_length, 41 * 512)
    x_end = x.arrival_s + x.ttft_s
    assert x.ttft_s == pytest.approx(_expect_fetch_s(nic) + c_x, rel=1e-9)
    assert x2.arrival_s + x2.ttft_s == pytest.approx(x_end + c_x2, rel=1e-9)
    # Y does not build on X: it went ahead during the fetch
    assert y.ttft_s == pytest.approx(PM.predict(Y.input_length, 0), rel=1e-9)
    assert rep.counters["set_aside"] == 1 and rep.counters["blocked"] == 1


def _record_computes(monkeypatch) -> tuple[dict[int, int], dict[int, tuple[int, float]]]:
    """Per request: how many times its prefill ended, and (instance, dequeue time) at the
    call that made it compute (join)."""
    ends: dict[int, int] = {}
    joins: dict[int, tuple[int, float]] = {}
    for cls in (disaggregated._Run, *disaggregated._Run.__subclasses__()):
        if "prefill_done" in cls.__dict__:
            orig_done = cls.__dict__["prefill_done"]

            def done(self, p, i, t, _o=orig_done):
                ends[i] = ends.get(i, 0) + 1
                return _o(self, p, i, t)

            monkeypatch.setattr(cls, "prefill_done", done)
        if "join" in cls.__dict__:
            orig_join = cls.__dict__["join"]

            def join(self, p, i, t, _o=orig_join):
                assert i not in joins, f"request {i} took an instance twice"
                assert not self.busy[p], f"instance {p} taken by {i} while busy"
                joins[i] = (p, t)
                return _o(self, p, i, t)

            monkeypatch.setattr(cls, "join", join)
    return ends, joins


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    n=st.integers(5, 60),
    kind=st.sampled_from(["agentic", "chat"]),
    seed=st.integers(0, 10**6),
    prefill=st.integers(1, 4),
    decode=st.integers(1, 2),
    nic=st.sampled_from([None, 5e9, 25e9, 100e9]),
    staging=st.sampled_from([0.0, 64e9]),
    rate=st.sampled_from([1.0, 5.0]),
)
def test_every_request_computes_once_and_one_at_a_time(n, kind, seed, prefill, decode, nic, staging, rate):
    mp = pytest.MonkeyPatch()
    try:
        ends, joins = _record_computes(mp)
        trace = generate_trace(n, kind=kind, seed=seed, rate=rate)
        cfg = SimConfig(prefill=prefill, decode=decode, nic_bandwidth=nic, prefetch_staging_bytes=staging, **NO_SLO)
        sim = Simulator(cfg)
        rep = sim.run(trace)
    finally:
        mp.undo()
    pm, _, _ = cfg.true_models()
    bt = cfg.block_tokens
    ran = [r for r in rep.requests if r.rejected is None]
    assert len(ran) == n  # SLOs off: nothing rejected, nothing lost
    assert all(ends.get(r.id) == 1 for r in ran) and len(ends) == n
    per_instance: dict[int, list[tuple[float, float]]] = {}
    for r in ran:
        p, t_join = joins[r.id]
        assert p == r.prefill_instance and r.ttft_s is not None and r.finish_s is not None
        assert t_join >= r.prefill_start_s - 1e-12  # never before its dequeue
        end = r.arrival_s + r.ttft_s
        c = pm.predict(r.input_length, min(r.reused_blocks * bt, r.input_length))
        assert end - c >= t_join - 1e-9
        per_instance.setdefault(p, []).append((end - c, end))
    for spans in per_instance.values():  # one compute at a time on each instance
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-9
    assert sim.conductor is not None
    snap = sim.conductor.snapshot()
    assert all(p.queued == 0 and p.running == 0 for p in snap.prefill)
    assert rep.counters["set_aside"] <= rep.counters["fetches"]
