"""The link model and the SSD tier inside whole simulator runs."""

from __future__ import annotations

import pytest

from mooncake_rs import PrefillCostModel, TransferCostModel
from mooncake_rs.sim import Request, SimConfig, Simulator, generate_trace
from mooncake_rs.sim import links as links_mod

PM, TM = PrefillCostModel(), TransferCostModel()
BPT = TM.bytes_per_token
LAT = TM.latency_s


def req(t_s, blocks, out=1, extra=0):
    return Request(t_s * 1000.0, len(blocks) * 512 + extra, out, tuple(blocks))


def test_ssd_hit_pays_the_storage_link():
    # A's 8 blocks are demoted to SSD by B (DRAM holds 8 blocks), C reuses them from SSD
    a, b = req(0.0, range(8)), req(10.0, range(100, 108))
    c = req(100.0, list(range(8)) + [200], extra=100)
    cfg = SimConfig(prefill=1, decode=1, capacity_tokens_per_instance=8 * 512, ssd_capacity_tokens_per_instance=64 * 512, storage_bandwidth=1e10)
    sim = Simulator(cfg)
    rep = sim.run([a, b, c])
    x = rep.requests[2]
    assert x.reused_blocks == 8
    load = 8 * 512 * BPT / 1e10
    assert x.ttft_s == pytest.approx(load + LAT + PM.predict(c.input_length, 8 * 512), rel=1e-9)
    assert rep.bytes_loaded_per_path["ssd_direct"] == pytest.approx(8 * 512 * BPT, rel=1e-9)
    # demoted: A's 8 (by B), B's 8 (by C) and one of C's own 9 (DRAM holds 8)
    assert rep.counters["ssd_write_bytes"] == pytest.approx(17 * 512 * BPT, rel=1e-9)
    assert rep.io_wait_fraction == pytest.approx((load + LAT) / (rep.prefill_busy_s), rel=1e-9)
    # with multipath the decode instance relays half (its storage link is as free)
    rep2 = Simulator(SimConfig(**{**cfg.__dict__, "multipath": True, "nic_bandwidth": 1e11})).run([a, b, c])
    assert rep2.requests[2].ttft_s == pytest.approx(load / 2 + LAT + PM.predict(c.input_length, 8 * 512), rel=1e-9)
    assert rep2.bytes_loaded_per_path["ssd_relay"] == pytest.approx(8 * 512 * BPT / 2, rel=1e-6)


def test_a_fetch_shares_the_holders_nic_with_its_kv_stream():
    # A leaves 40 blocks on instance 0; X starts a long prefill there at t=50 and streams
    # its KV out of 0's NIC; B (A's prefix) goes to idle instance 1 and fetches from 0:
    # the two flows share 0's NIC out, 25 GB/s each
    a = req(0.0, range(40))
    x = req(50.0, range(500, 600))
    b = req(50.001, list(range(40)) + [700, 701], extra=10)
    cfg = SimConfig(prefill=2, decode=2, nic_bandwidth=50e9)
    rep = Simulator(cfg).run([a, x, b])
    rb = rep.requests[2]
    assert rep.requests[1].prefill_instance == 0 and rb.prefill_instance == 1 and rb.fetched_blocks == 40
    # X and B decode on different instances, so no decode-side link is shared: the only
    # shared link is 0's NIC out, which the TTFT below prices at half the bandwidth
    assert rep.requests[1].decode_instance != rb.decode_instance
    fetch = 40 * 512 * BPT / 25e9
    assert rb.ttft_s == pytest.approx(fetch + LAT + PM.predict(b.input_length, 40 * 512), rel=1e-6)
    assert rep.bytes_loaded_per_path["dram_peer"] == 40 * 512 * BPT


def _run_checked(cfg, trace, monkeypatch):
    """Runs with every rate solution checked against the capacities."""
    orig = links_mod.Links.rates
    worst = [0.0]

    def rates(self):
        orig(self)
        for k, cap in enumerate(self.cap):
            if self.on[k]:
                worst[0] = max(worst[0], sum(self.flows[f].rate for f in self.on[k]) / cap)

    monkeypatch.setattr(links_mod.Links, "rates", rates)
    sim = Simulator(cfg)
    rep = sim.run(trace)
    return sim, rep, worst[0]


@pytest.mark.parametrize("multipath", [False, True])
def test_whole_run_conserves_bytes_respects_capacities_and_keeps_the_index_exact(monkeypatch, multipath):
    trace = generate_trace(400, kind="agentic", rate=1.0, seed=2)
    cfg = SimConfig(
        prefill=4,
        decode=4,
        speedup=4.0,
        nic_bandwidth=20e9,
        storage_bandwidth=5e9,
        capacity_tokens_per_instance=100_000,
        ssd_capacity_tokens_per_instance=2_000_000,
        multipath=multipath,
        # every path must carry bytes here: a contention-aware conductor declines the
        # fetches over these saturated NICs (test_sim_contention.py covers that side)
        contention_aware=False,
    )
    sim, rep, worst = _run_checked(cfg, trace, monkeypatch)
    assert 0.99 < worst <= 1 + 1e-9  # the links were saturated at times, never above capacity
    net = sim.links
    assert net is not None and not net.flows  # everything delivered
    P, D = cfg.prefill, cfg.decode
    into_prefill = sum(net.carried[3 * p + 1] for p in range(P))
    into_decode = sum(net.carried[3 * d + 1] for d in range(P, P + D))
    out_all = sum(net.carried[3 * k] for k in range(P + D))
    stor_prefill = sum(net.carried[3 * p + 2] for p in range(P))
    stor_decode = sum(net.carried[3 * d + 2] for d in range(P, P + D))
    b = rep.bytes_loaded_per_path
    c = rep.counters
    rel = dict(rel=1e-9, abs=64)
    assert into_prefill == pytest.approx(b["dram_peer"] + b["ssd_relay"], **rel)
    assert into_decode == pytest.approx(c["kv_stream_bytes"], **rel)
    assert out_all == pytest.approx(b["dram_peer"] + b["ssd_relay"] + c["kv_stream_bytes"], **rel)
    assert stor_prefill == pytest.approx(b["ssd_direct"] + c["ssd_write_bytes"], **rel)
    assert stor_decode == pytest.approx(b["ssd_relay"], **rel)
    assert b["ssd_direct"] > 0 and c["ssd_write_bytes"] > 0 and b["dram_peer"] > 0
    assert (b["ssd_relay"] > 0) == multipath
    assert rep.rejected == 0 and all(r.finish_s is not None for r in rep.requests)
    assert 0 < rep.io_wait_fraction < 1
    # the index equals both tiers of every cache, and the tiers are disjoint
    idx = sim.conductor.index
    idx.check_integrity()
    keys = {k for r in trace for k in r.full_blocks()}
    assert sim.caches is not None and sim.ssd_caches is not None
    for k in keys:
        held = set(idx.holders(k))
        for p in range(P):
            in_dram, in_ssd = k in sim.caches[p], k in sim.ssd_caches[p]
            assert not (in_dram and in_ssd)
            assert ((p, "dram") in held) == in_dram
            assert ((p, "ssd") in held) == in_ssd


def test_links_off_leaves_the_report_as_it_was():
    trace = generate_trace(200, rate=2.0, seed=1)
    rep = Simulator(SimConfig(speedup=4.0)).run(trace)
    assert rep.bytes_loaded_per_path == {}
    assert "io_wait_fraction" not in rep.summary()
    rep2 = Simulator(SimConfig(speedup=4.0, nic_bandwidth=50e9)).run(trace)
    assert "io_wait_fraction" in rep2.summary() and rep2.config["nic_bandwidth"] == 50e9


@pytest.mark.parametrize("multipath", [False, True])
def test_multipath_splits_a_peer_fetch_across_both_dram_holders(multipath):
    # instances 0 and 1 both end up with A's 40 blocks in DRAM (1 fetched them from 0);
    # at t=100 both start long prefills (their NICs busy streaming KV out); C goes to idle
    # instance 2 and fetches the 40 blocks: single-path from one holder, sharing its NIC
    # with the stream (25 GB/s); multi-path half from each (25 + 25 = 50 GB/s)
    a = req(0.0, range(40))
    x1 = req(50.0, range(500, 600))
    b = req(50.001, list(range(40)) + [700, 701], extra=10)
    x2 = req(100.0, range(800, 900))
    x3 = req(100.0005, range(1000, 1100))
    c = req(100.001, list(range(40)) + [1200], extra=10)
    rep = Simulator(SimConfig(prefill=3, decode=2, nic_bandwidth=50e9, multipath=multipath)).run([a, x1, b, x2, x3, c])
    r = {i: x for i, x in enumerate(rep.requests)}
    assert r[2].prefill_instance == 1 and r[2].fetched_blocks == 40
    assert {r[3].prefill_instance, r[4].prefill_instance} == {0, 1}
    assert r[5].prefill_instance == 2 and r[5].fetched_blocks == 40
    rate = 50e9 if multipath else 25e9
    fetch = 40 * 512 * BPT / rate
    assert r[5].ttft_s == pytest.approx(fetch + LAT + PM.predict(c.input_length, 40 * 512), rel=1e-6)
    assert rep.counters["multipath_splits"] == (1 if multipath else 0)


def test_estimate_error_scales_the_compute_with_links_on():
    from mooncake_rs.sim.loop import error_factors

    a, b = req(0.0, range(8)), req(10.0, range(100, 108))
    c = req(100.0, list(range(8)) + [200], extra=100)
    cfg = SimConfig(
        prefill=1, decode=1, capacity_tokens_per_instance=8 * 512, ssd_capacity_tokens_per_instance=64 * 512,
        storage_bandwidth=1e10, estimate_error=0.5, seed=3,
    )  # fmt: skip
    rep = Simulator(cfg).run([a, b, c])
    f = error_factors(cfg, 3)
    assert f is not None
    load = 8 * 512 * BPT / 1e10
    assert rep.requests[2].ttft_s == pytest.approx(load + LAT + PM.predict(c.input_length, 8 * 512) * f[2], rel=1e-9)
    assert rep.requests[0].ttft_s == pytest.approx(PM.predict(a.input_length, 0) * f[0], rel=1e-9)


@pytest.mark.parametrize(
    "kw",
    [
        dict(policy="ttft_optimal", rejection="early", ttft_slo_s=5.0),
        dict(policy="local_cache_aware", cache="local"),
        dict(policy="random", rejection="predictive"),
        dict(eager_index=True, replicate_every_s=2.0, eviction="s3fifo"),
        dict(policy="load_balance", multipath=True, eviction="prefix"),
    ],
)
def test_every_policy_and_option_keeps_the_index_equal_to_both_tiers(kw):
    trace = generate_trace(250, kind="agentic", rate=2.0, seed=4)
    cfg = SimConfig(
        prefill=3, decode=2, speedup=2.0, nic_bandwidth=25e9, storage_bandwidth=8e9,
        capacity_tokens_per_instance=60_000, ssd_capacity_tokens_per_instance=300_000, **kw,
    )  # fmt: skip
    sim = Simulator(cfg)
    rep = sim.run(trace)
    for r in rep.requests:
        assert (r.rejected is None) == (r.finish_s is not None)
    assert sim.links is not None and not sim.links.flows
    idx = sim.conductor.index
    idx.check_integrity()
    assert sim.caches is not None and sim.ssd_caches is not None
    for k in {k for r in trace for k in r.full_blocks()}:
        held = set(idx.holders(k))
        for p in range(cfg.prefill):
            assert ((p, "dram") in held) == (k in sim.caches[p])
            assert ((p, "ssd") in held) == (k in sim.ssd_caches[p])
