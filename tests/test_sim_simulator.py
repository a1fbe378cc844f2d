"""The simulator on hand-built traces with answers from the cost models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mooncake_rs import DecodeCostModel, InvalidArgument, PrefillCostModel, TransferCostModel
from mooncake_rs.sim import Request, SimConfig, Simulator, generate_trace, load_trace

PM, TM, DM = PrefillCostModel(), TransferCostModel(), DecodeCostModel()
# The public trace lives in shared/ beside the checkout (never copied into the repo).
SYNTHETIC = os.environ.get(
    "MOONCAKE_TRACE",
    str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"),
)


def req(t_s, blocks, out=1, extra=0):
    return Request(t_s * 1000.0, len(blocks) * 512 + extra, out, tuple(blocks))


def test_single_request_ttft_is_the_prefill_cost_and_tbt_the_decode_cost():
    L, out = 4096 + 100, 50
    r = Request(0.0, L, out, tuple(range(9)))
    rep = Simulator(SimConfig(prefill=2, decode=2)).run([r])
    x = rep.requests[0]
    assert x.ttft_s == pytest.approx(PM.predict(L, 0), rel=1e-12)
    assert x.reused_blocks == 0 and x.rejected is None
    # 49 decode steps, batch 1, the context growing by one token a step from L
    steps = [DM.predict(1, L + j) for j in range(out - 1)]
    assert x.tbt_s == pytest.approx(sum(steps) / len(steps), rel=1e-9)
    # the KV reaches decode when the prefill ends (streamed layer by layer, shorter)
    assert x.finish_s == pytest.approx(x.ttft_s + sum(steps), rel=1e-9)
    assert rep.mean_ttft_s == x.ttft_s and rep.effective_request_capacity == 1.0


def test_second_request_reuses_the_prefix_it_left_behind():
    a = req(0.0, range(8))
    b = req(10.0, list(range(8)) + [100, 101])
    rep = Simulator(SimConfig(prefill=1, decode=1)).run([a, b])
    assert rep.requests[1].reused_blocks == 8
    assert rep.requests[1].ttft_s == pytest.approx(PM.predict(10 * 512, 8 * 512), rel=1e-12)
    assert rep.cache_hit_rate == pytest.approx(8 / 18)
    assert rep.prefill_compute_s == pytest.approx(PM.predict(8 * 512, 0) + PM.predict(10 * 512, 8 * 512))


def test_fifo_queue_on_one_prefill_instance():
    a, b = req(0.0, range(20)), req(0.0, range(100, 120))
    rep = Simulator(SimConfig(prefill=1, decode=1)).run([a, b])
    p = PM.predict(20 * 512, 0)
    assert rep.requests[0].ttft_s == pytest.approx(p)
    assert rep.requests[1].ttft_s == pytest.approx(2 * p)


def _global_local_trace():
    shared = list(range(40))
    return [
        req(0.0, shared),  # -> instance 0, which then holds the 40 blocks
        req(5.0, range(1000, 1100)),  # keeps instance 0 busy for ~3 s
        req(5.01, shared + [2000]),  # instance 0 has the prefix but a queue; 1 is idle
    ]


def test_global_cache_fetches_the_prefix_local_recomputes():
    tr = _global_local_trace()
    g = Simulator(SimConfig(prefill=2, decode=1, cache="global")).run(tr).requests[2]
    loc = Simulator(SimConfig(prefill=2, decode=1, cache="local")).run(tr).requests[2]
    assert g.prefill_instance == loc.prefill_instance == 1
    assert (g.reused_blocks, g.fetched_blocks) == (40, 40)
    assert (loc.reused_blocks, loc.fetched_blocks) == (0, 0)
    assert g.ttft_s == pytest.approx(TM.fetch(40 * 512, 0.0) + PM.predict(41 * 512, 40 * 512), rel=1e-9)
    assert loc.ttft_s == pytest.approx(PM.predict(41 * 512, 0), rel=1e-9)


def test_local_cache_aware_waits_for_its_own_prefix_when_cheaper():
    # local policy on a local cache: instance 0 is busy only briefly, so waiting there
    # for the prefix beats recomputing on the idle instance.
    shared = list(range(40))
    tr = [req(0.0, shared), req(5.0, range(1000, 1004)), req(5.0, shared + [2000])]
    rep = Simulator(SimConfig(prefill=2, decode=1, cache="local", policy="local_cache_aware")).run(tr)
    x = rep.requests[2]
    assert x.prefill_instance == 0 and x.reused_blocks == 40
    assert x.ttft_s == pytest.approx(PM.predict(4 * 512, 0) + PM.predict(41 * 512, 40 * 512), rel=1e-9)


def _overload(n=10):
    return [req(0.0, range(i * 100, i * 100 + 20)) for i in range(n)]


def test_rejection_under_obvious_overload():
    p = PM.predict(20 * 512, 0)
    fits = sum(1 for k in range(1, 11) if k * p <= 1.0)  # TTFT of the k-th in the FIFO
    assert 1 <= fits < 10
    none = Simulator(SimConfig(prefill=1, decode=1, ttft_slo_s=1.0)).run(_overload())
    early = Simulator(SimConfig(prefill=1, decode=1, ttft_slo_s=1.0, rejection="early")).run(_overload())
    assert none.rejected == 0
    assert none.effective_request_capacity == pytest.approx(fits / 10)
    assert early.rejected == 10 - fits
    assert [r.rejected is None for r in early.requests] == [True] * fits + [False] * (10 - fits)
    assert all(r.rejected == "ttft_slo" for r in early.requests[fits:])
    assert early.effective_request_capacity == pytest.approx(fits / 10)


def test_bounded_cache_evicts_and_costs_hits():
    tr = generate_trace(300, seed=5, rate=20.0)
    unb = Simulator(SimConfig(prefill=2, decode=2)).run(tr)
    small = Simulator(SimConfig(prefill=2, decode=2, capacity_tokens_per_instance=64 * 512)).run(tr)
    assert small.cache_hit_rate < unb.cache_hit_rate
    assert small.prefill_compute_s > unb.prefill_compute_s


def test_deterministic_for_a_seed():
    tr = generate_trace(200, seed=9, rate=30.0)
    runs = [Simulator(SimConfig(prefill=4, decode=2, policy="random", seed=s)).run(tr) for s in (1, 1, 2)]
    rows = [json.loads(r.to_json())["requests"]["rows"] for r in runs]
    assert rows[0] == rows[1]
    assert rows[0] != rows[2]


def test_coupled_prefill_stalls_decode():
    # A decodes 200 tokens; B's long prompt lands on the same instance mid-way.
    a = Request(0.0, 1024, 200, (1, 2))
    b = Request(500.0, 60_000, 1, tuple(range(10, 10 + 118)))
    base = dict(prefill=1, decode=1, policy="load_balance")
    dis = Simulator(SimConfig(**base)).run([a, b]).requests[0]
    cpl = Simulator(SimConfig(architecture="coupled", **base)).run([a, b]).requests
    assert cpl[1].prefill_instance == cpl[0].prefill_instance == 0
    # coupled: A's 199 gaps include B's whole prefill
    stall = PM.predict(60_000, 0)
    assert cpl[0].tbt_s * 199 == pytest.approx(dis.tbt_s * 199 + stall, rel=0.01)
    assert cpl[0].ttft_s == pytest.approx(PM.predict(1024, 0))
    chunked = Simulator(SimConfig(architecture="coupled", chunked_prefill=True, **base)).run([a, b]).requests
    assert dis.tbt_s < chunked[0].tbt_s
    assert chunked[1].ttft_s > cpl[1].ttft_s  # chunks share iterations with decode


def test_coupled_single_request_chunked_ttft_is_the_sum_of_chunks():
    L = 5000
    r = Request(0.0, L, 1, tuple(range(10)))
    rep = Simulator(SimConfig(prefill=1, decode=1, architecture="coupled", chunked_prefill=True, chunk_tokens=2048)).run([r])
    want = PM.predict(2048, 0) + PM.predict(4096, 2048) + PM.predict(5000, 4096)
    assert rep.requests[0].ttft_s == pytest.approx(want, rel=1e-12)


def test_config_validation():
    for bad in (
        dict(prefill=0),
        dict(cache="shared"),
        dict(policy="best"),
        dict(rejection="sometimes"),
        dict(ttft_slo_s=0),
        dict(speedup=-1),
        dict(capacity_tokens_per_instance=10),
        dict(eviction="fifo-ish"),
        dict(architecture="mixed"),
        dict(bandwidth=float("nan")),
    ):
        with pytest.raises(InvalidArgument):
            SimConfig(**bad)
    assert SimConfig(bandwidth=1e9).models()[1].network_bandwidth == 1e9
    assert SimConfig(capacity_tokens_per_instance=3 * 512 + 5).capacity_blocks == 3


def test_report_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    tr = generate_trace(100, seed=2, rate=10.0)
    rep = Simulator(SimConfig(prefill=2, decode=2)).run(tr)
    doc = json.loads(rep.to_json())
    assert doc["summary"]["requests"] == 100
    assert len(doc["requests"]["rows"]) == 100
    assert doc["hot_blocks"] and all(len(s["blocks"]) == len(s["replicas"]) for s in doc["hot_blocks"])
    rep.plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_sim_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, mooncake_rs.sim; assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not os.path.exists(SYNTHETIC), reason="shared synthetic trace absent")
def test_synthetic_policies_order():
    tr = load_trace(SYNTHETIC)
    ttft = {p: Simulator(SimConfig(policy=p, speedup=8.0)).run(tr).mean_ttft_s for p in ("random", "load_balance", "local_cache_aware", "mooncake")}
    assert ttft["random"] > ttft["load_balance"] > ttft["local_cache_aware"] > ttft["mooncake"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(capacity_tokens_per_instance=40 * 512),
        dict(capacity_tokens_per_instance=40 * 512, eviction="s3fifo", eager_index=True),
        dict(capacity_tokens_per_instance=40 * 512, cache="local", replicate_every_s=1.0),
        dict(capacity_tokens_per_instance=40 * 512, architecture="coupled", policy="local_cache_aware"),
    ],
)
def test_index_matches_the_caches_after_a_run(kw):
    tr = generate_trace(250, seed=7, rate=25.0)
    sim = Simulator(SimConfig(prefill=3, decode=2, **kw))
    rep = sim.run(tr)
    c, caches = sim.conductor, sim.caches
    assert c is not None and caches is not None
    c.check_integrity()
    assert c.snapshot().requests == 0  # every request finished and left the conductor
    assert all(r.finish_s is not None for r in rep.requests)
    index = c.index
    for key in {k for r in tr for k in r.full_blocks()}:
        holders = {inst for inst, _ in index.holders(key)}
        assert holders == {p for p, cache in enumerate(caches) if key in cache}, key
    assert all(len(cache) <= 40 for cache in caches)


def test_worst_gap_sees_a_whole_stall_and_chunking_shortens_it():
    a = Request(0.0, 1024, 200, (1, 2))
    b = Request(500.0, 60_000, 1, tuple(range(10, 10 + 118)))
    base = dict(prefill=1, decode=1, policy="load_balance")
    dis = Simulator(SimConfig(**base)).run([a, b]).requests[0]
    cpl = Simulator(SimConfig(architecture="coupled", **base)).run([a, b]).requests[0]
    chk = Simulator(SimConfig(architecture="coupled", chunked_prefill=True, **base)).run([a, b]).requests[0]
    # alone on its decode instance, A's longest gap is its last step (context grown)
    assert dis.max_gap_s == pytest.approx(DM.predict(1, 1024 + 198), rel=1e-9)
    # coupled: one gap holds B's whole prefill (plus the step after it)
    stall = PM.predict(60_000, 0)
    assert stall < cpl.max_gap_s < stall + 0.05
    # chunked: no gap is longer than one 2048-token chunk plus a step
    assert chk.max_gap_s < PM.predict(60_000, 60_000 - 2047) + 0.05 < stall
    assert dis.max_gap_s < chk.max_gap_s


def test_capacity_at_other_slos():
    tr = generate_trace(150, seed=3, rate=20.0)
    rep = Simulator(SimConfig(prefill=2, decode=2, architecture="coupled", policy="local_cache_aware")).run(tr)
    assert rep.capacity_at(rep.tbt_slo_s) == rep.effective_request_capacity
    assert rep.capacity_at(0.1, worst_gap=True) <= rep.capacity_at(0.1)
    assert rep.capacity_at(1e9, ttft_slo_s=1e9) == 1.0
    assert all(r.max_gap_s is not None and r.max_gap_s + 1e-12 >= (r.tbt_s or 0.0) for r in rep.requests)
