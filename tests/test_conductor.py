"""The conductor from Python: hand-computed decisions, rejection, events, bad input,
cost-model fits, and hypothesis properties over random workloads and event sequences."""

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake_rs import (
    BlockIndex,
    Conductor,
    ConductorConfig,
    Decision,
    DecodeCostModel,
    InvalidArgument,
    Overloaded,
    PrefillCostModel,
    TransferCostModel,
)

# Unit costs: prefill 1 ms per new token; network 0.1 ms per token + 10 ms; SSD 0.5 ms
# per token; decode step 10 ms + 1 ms per sequence. Blocks of 10 tokens.
UNIT = dict(
    prefill_model=PrefillCostModel(c0=0.0, c_new=0.001, c_new2=0.0, c_cross=0.0),
    transfer_model=TransferCostModel(bytes_per_token=1.0, network_bandwidth=1e4, ssd_bandwidth=2e3, latency_s=0.01),
    decode_model=DecodeCostModel(base_s=0.01, per_seq_s=0.001, per_token_s=0.0),
)
H = list(range(1, 11))  # 10 blocks


def make(policy="mooncake", rejection="none", **kw):
    cfg = ConductorConfig(block_size=10, ttft_slo_s=1.0, tbt_slo_s=0.05, policy=policy, rejection=rejection, **UNIT, **kw)
    return Conductor(cfg)


def test_mooncake_fetches_to_the_idle_instance():
    c = make()
    c.add_prefill(2)
    c.add_decode(10)
    c.on_blocks_stored(2, H)
    assert c.schedule(99, [], 1000, now=0.0, expected_output_len=10).prefill == 2  # 1 s of work on 2
    # its KV stream to decode is planned on 2's NIC out; 2 reports that NIC idle (the
    # contention-aware cases are in test_conductor_links.py)
    assert c.report_link_load(2, 0.0, 0.0)
    c.add_prefill(1)
    d = c.schedule(1, H, 120, now=0.0, expected_output_len=10)
    assert isinstance(d, Decision)
    # 1: fetch 100 tokens (10 + 10 ms), prefill 20 tokens (20 ms) = 40 ms; 2: 1 s + 20 ms.
    assert (d.prefill, d.decode, d.reused_blocks, d.fetch_blocks, d.fetch_from) == (1, 10, 10, 10, 2)
    assert d.est_ttft_s == pytest.approx(0.04) and d.est_transfer_s == pytest.approx(0.02)
    assert d.est_queue_s == 0 and d.est_prefill_s == pytest.approx(0.02)
    assert d.est_tbt_s == pytest.approx(0.012)  # 2 sequences in the batch
    # the fetched blocks are not on 1 yet: the index learns them when 1 reports them
    assert c.index.match_prefix(H) == {2: 10}
    c.on_blocks_stored(1, H)
    assert c.index.match_prefix(H) == {1: 10, 2: 10}
    c.check_integrity()


def test_fetch_not_worth_it_and_local_policies():
    slow = dict(UNIT, transfer_model=TransferCostModel(bytes_per_token=1.0, network_bandwidth=500.0, ssd_bandwidth=500.0, latency_s=0.01))
    for policy, extra, want in [
        ("mooncake", slow, (1, 0, 0)),  # fetch = 230 ms > 120 ms recompute
        ("local_cache_aware", UNIT, (1, 0, 0)),  # no transfers: 120 ms on 1 vs 1.02 s on 2
        ("load_balance", UNIT, (1, 0, 0)),
        ("ttft_optimal", UNIT, (1, 10, 10)),
    ]:
        cfg = ConductorConfig(block_size=10, ttft_slo_s=1.0, tbt_slo_s=0.05, policy=policy, **extra)
        c = Conductor(cfg)
        c.add_prefill(2)
        c.add_decode(10)
        c.on_blocks_stored(2, H)
        c.schedule(99, [], 1000, 0.0, 10)
        c.report_link_load(2, 0.0, 0.0)  # its KV stream has left: an idle NIC
        c.add_prefill(1)
        d = c.schedule(1, H, 120, 0.0, 10)
        assert (d.prefill, d.reused_blocks, d.fetch_blocks) == want, policy


def test_random_policy_is_seeded():
    picks = []
    for _ in range(2):
        c = make("random", seed=42)
        for i in range(4):
            c.add_prefill(i)
        c.add_decode(10)
        picks.append([c.schedule(r, [], 10, 0.0, 1).prefill for r in range(40)])
    assert picks[0] == picks[1] and len(set(picks[0])) == 4


def test_overloaded_carries_reason_and_estimates_and_changes_nothing():
    c = make(rejection="early")
    with pytest.raises(Overloaded) as e:
        c.schedule(1, [], 10, 0.0)
    assert e.value.reason == "no_prefill_instance" and e.value.estimates is None
    c.add_prefill(1)
    c.add_decode(10, max_batch=100, kv_capacity_tokens=100_000)
    before = c.snapshot()
    with pytest.raises(Overloaded) as e:
        c.schedule(1, [], 1001, 0.0)
    assert e.value.reason == "ttft_slo"
    assert e.value.estimates.est_ttft_s == pytest.approx(1.001)
    after = c.snapshot()
    assert (after.requests, after.prefill[0].queue_s, after.now) == (before.requests, before.prefill[0].queue_s, before.now)
    for r in range(40):  # 10 + 40 ms: the TBT SLO is met up to 40 sequences
        c.schedule(r, [], 1, 0.0, 10)
    with pytest.raises(Overloaded) as e:
        c.schedule(40, [], 1, 0.0, 10)
    assert e.value.reason == "tbt_slo" and e.value.estimates.est_tbt_s == pytest.approx(0.051)
    assert c.snapshot().requests == 40
    c.check_integrity()


def test_predictive_admits_what_early_rejects():
    results = {}
    for mode in ["early", "predictive"]:
        c = make(rejection=mode)
        c.add_prefill(1)
        c.add_decode(10)
        for r in range(40):
            c.schedule(r, [], 1, 0.0, 5)
            c.on_decode_started(r, now=0.0)
        try:
            results[mode] = c.schedule(100, [], 500, 0.0, 5).est_tbt_s
        except Overloaded as e:
            results[mode] = e.reason
    assert results["early"] == "tbt_slo"
    assert results["predictive"] == pytest.approx(0.011)  # the batch has drained by 0.5 s


def test_progress_events_and_snapshot():
    c = make("load_balance")
    c.add_prefill(1)
    c.add_decode(10)
    c.schedule(1, [], 500, 0.0, 4)
    c.schedule(2, [], 300, 0.0, 4)
    c.on_prefill_started(1, now=0.1)
    s = c.snapshot(0.3)
    p = s.prefill[0]
    assert (p.id, p.queued, p.running) == (1, 1, 1) and p.queue_s == pytest.approx(0.6)
    assert (s.decode[0].batch, s.decode[0].decoding, s.requests) == (2, 0, 2)
    c.on_prefill_finished(1, now=0.6)
    c.on_decode_started(1, now=0.6)
    assert c.snapshot().decode[0].decoding == 1
    c.on_decode_finished(1, 7, now=1.0)
    assert c.snapshot().now == 1.0
    with pytest.raises(InvalidArgument, match="unknown request"):
        c.on_decode_finished(1, 7)
    with pytest.raises(InvalidArgument):
        c.on_prefill_started(999)
    c.on_decode_started(2)
    with pytest.raises(InvalidArgument, match="already"):
        c.on_prefill_started(2)
    c.cancel(2)
    assert c.snapshot().requests == 0
    c.check_integrity()


def test_output_length_history():
    c = make("load_balance")
    c.add_prefill(1)
    c.add_decode(10)
    assert c.predicted_output_len(5) == 256
    for r in range(30):
        c.schedule(r, [5], 20, 0.0)
        c.on_decode_finished(r, 1000)
    assert c.predicted_output_len(5) == pytest.approx(1000, abs=1)
    assert 256 < c.predicted_output_len() <= 1000


def test_replication_hints():
    c = make("local_cache_aware", hot_busy_fraction=0.05)
    c.add_prefill(1)
    c.add_prefill(2)
    c.add_decode(10)
    c.on_blocks_stored(1, H)
    for r in range(5):
        assert c.schedule(r, H, 120, 0.0, 1).prefill == 1
    (h,) = c.replication_hints(now=0.0)
    assert (h.from_instance, h.to_instance, h.blocks) == (1, 2, H)
    assert h.hits == pytest.approx(5) and h.from_queue_s == pytest.approx(0.1)
    c.on_blocks_stored(2, H, "ssd")
    assert c.replication_hints(now=0.0) == []


_CONFIG_FIELDS = ["block_size", "ttft_slo_s", "tbt_slo_s", "policy", "balancing_threshold", "rejection", "seed",
                  "default_output_len", "output_len_ewma", "max_output_len", "hot_min_hits", "hot_half_life_s",
                  "hot_busy_fraction", "hot_capacity", "contention_aware", "hot_link_busy_s", "hot_replica_max_bytes"]


def test_config_defaults_come_from_the_core_and_are_read_from_it():
    """The defaults are written once (the core's ``ConductorConfig::default``): a field
    left out or None takes it, one given changes only itself, and the simulator's and the
    CLIs' conductor options start from ``ConductorConfig()``."""
    from mooncake_rs.sim import SimConfig

    d = ConductorConfig()
    values = {f: getattr(d, f) for f in _CONFIG_FIELDS}
    assert {f: getattr(ConductorConfig(**{f: None for f in _CONFIG_FIELDS}), f) for f in _CONFIG_FIELDS} == values
    changed = ConductorConfig(policy="random", hot_capacity=7, block_size=16)
    assert (changed.policy, changed.hot_capacity, changed.block_size) == ("random", 7, 16)
    assert {f: getattr(changed, f) for f in _CONFIG_FIELDS if f not in ("policy", "hot_capacity", "block_size")} == {
        f: v for f, v in values.items() if f not in ("policy", "hot_capacity", "block_size")}
    sim = SimConfig()
    assert (sim.policy, sim.rejection, sim.balancing_threshold, sim.contention_aware, sim.hot_replica_max_bytes) == (
        d.policy, d.rejection, d.balancing_threshold, d.contention_aware, d.hot_replica_max_bytes)


def test_bad_input():
    for kw in [dict(ttft_slo_s=math.nan), dict(tbt_slo_s=-1.0), dict(balancing_threshold=0.5), dict(policy="best"),
               dict(rejection="sometimes"), dict(block_size=0), dict(output_len_ewma=0.0)]:
        with pytest.raises(InvalidArgument):
            ConductorConfig(**kw)
    with pytest.raises(InvalidArgument):
        PrefillCostModel(c_new=-1.0)
    with pytest.raises(InvalidArgument):
        TransferCostModel(network_bandwidth=0.0)
    c = make()
    c.add_prefill(1)
    c.add_decode(2)
    with pytest.raises(InvalidArgument, match="already registered"):
        c.add_prefill(2)
    with pytest.raises(InvalidArgument):
        c.add_prefill(3, speed=math.nan)
    with pytest.raises(InvalidArgument):
        c.add_decode(3, max_batch=0)
    with pytest.raises(InvalidArgument, match="unknown instance"):
        c.remove_instance(7)
    with pytest.raises(InvalidArgument, match="unknown instance"):
        c.on_blocks_stored(7, H)
    with pytest.raises(InvalidArgument, match="tier"):
        c.on_blocks_stored(1, H, "tape")
    with pytest.raises(InvalidArgument, match="prompt_len"):
        c.schedule(1, H, 99, 0.0)
    with pytest.raises(InvalidArgument, match="now"):
        c.schedule(1, [], 10, math.nan)
    with pytest.raises(InvalidArgument):
        c.schedule(1, [-1], 10, 0.0)
    assert c.snapshot().requests == 0 and len(c.index) == 0
    c.schedule(1, [], 10, 0.0)
    with pytest.raises(InvalidArgument, match="already scheduled"):
        c.schedule(1, [], 10, 0.0)
    assert c.remove_instance(1) == [1]
    c.check_integrity()


def test_cost_model_fits():
    truth = PrefillCostModel(c0=0.004, c_new=3e-5, c_new2=2e-10, c_cross=6e-10)
    pts = [(512, 0), (1024, 0), (4096, 0), (8192, 0), (8192, 4096), (16384, 8192), (2048, 1024)]
    fit = PrefillCostModel.fit([(n, p, truth.predict(n, p)) for n, p in pts])
    for n, p in pts:
        assert fit.predict(n, p) == pytest.approx(truth.predict(n, p), rel=1e-6)
    d = DecodeCostModel.fit([(b, ctx, 0.01 + 1e-4 * b + 2e-8 * ctx) for b, ctx in [(1, 1e3), (8, 8e3), (64, 1e5), (32, 1e6)]])
    assert (d.base_s, d.per_seq_s, d.per_token_s) == pytest.approx((0.01, 1e-4, 2e-8))
    t = TransferCostModel().fit([(b, 0.002 + b / 25e9) for b in (1e6, 1e7, 1e9)])
    assert t.latency_s == pytest.approx(0.002) and t.network_bandwidth == pytest.approx(25e9)
    with pytest.raises(InvalidArgument):
        PrefillCostModel.fit([(1, 0, 1.0)])
    cfg = ConductorConfig(prefill_model=fit)
    assert cfg.prefill_model == fit


def test_shared_index_and_threads():
    idx = BlockIndex()
    c = Conductor(ConductorConfig(block_size=10), index=idx)
    for i in range(4):
        c.add_prefill(i)
        c.add_decode(100 + i)
    idx.insert(2, H)
    assert c.index.match_prefix(H) == {2: 10}

    def work(t):
        for i in range(200):
            c.schedule(t * 1000 + i, H[: i % 10], 200, i * 0.01, 8)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert c.snapshot().requests == 800
    c.check_integrity()
    idx.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["early", "predictive"]),
    ttft=st.floats(0.05, 2.0),
    tbt=st.floats(0.013, 0.03),
    reqs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8), st.integers(1, 3000), st.integers(1, 400)), min_size=1, max_size=30),
)
def test_rejected_iff_an_estimate_exceeds_its_slo(mode, ttft, tbt, reqs):
    c = Conductor(ConductorConfig(block_size=16, ttft_slo_s=ttft, tbt_slo_s=tbt, rejection=mode))
    for i in range(2):
        c.add_prefill(i)
        c.add_decode(10 + i, max_batch=8, kv_capacity_tokens=20_000)
    for rid, (fam, nb, extra, out) in enumerate(reqs):
        hashes = [fam * 1000 + b for b in range(nb)]
        before = c.snapshot().requests
        try:
            d = c.schedule(rid, hashes, nb * 16 + extra, rid * 0.05, out)
        except Overloaded as e:
            est = e.estimates
            assert c.snapshot().requests == before
            if e.reason == "decode_capacity":
                # no SLO estimate is needed to refuse a request no decode instance can take
                need = nb * 16 + extra + out
                assert all(dl.batch >= dl.max_batch or dl.kv_reserved_tokens + need > dl.kv_capacity_tokens
                           for dl in c.snapshot().decode), e
                continue
            assert est.est_ttft_s > ttft or est.est_tbt_s > tbt
            assert e.reason == ("ttft_slo" if est.est_ttft_s > ttft else "tbt_slo")
        else:
            assert d.est_ttft_s <= ttft and d.est_tbt_s <= tbt
            c.on_blocks_stored(d.prefill, hashes)
    c.check_integrity()


class ConductorMachine(RuleBasedStateMachine):
    """Random registry, scheduling, progress and cache events; invariants after each."""

    def __init__(self):
        super().__init__()
        self.c = Conductor(ConductorConfig(block_size=4, ttft_slo_s=0.5, tbt_slo_s=0.02, policy="mooncake", rejection="predictive"))
        self.live = set()

    @rule(i=st.integers(0, 6), decode=st.booleans())
    def add(self, i, decode):
        try:
            self.c.add_decode(i, max_batch=3, kv_capacity_tokens=300) if decode else self.c.add_prefill(i)
        except InvalidArgument:
            pass

    @rule(i=st.integers(0, 7))
    def remove(self, i):
        try:
            self.live -= set(self.c.remove_instance(i))
        except InvalidArgument:
            pass

    @rule(r=st.integers(0, 15), fam=st.integers(0, 2), n=st.integers(0, 5), extra=st.integers(0, 30), now=st.floats(0, 50))
    def schedule(self, r, fam, n, extra, now):
        try:
            self.c.schedule(r, [fam * 100 + b for b in range(n)], n * 4 + extra, now)
            self.live.add(r)
        except (Overloaded, InvalidArgument):
            pass

    @rule(r=st.integers(0, 15), ev=st.sampled_from(["ps", "pf", "ds", "df", "cancel"]))
    def event(self, r, ev):
        try:
            if ev == "ps":
                self.c.on_prefill_started(r)
            elif ev == "pf":
                self.c.on_prefill_finished(r)
            elif ev == "ds":
                self.c.on_decode_started(r)
            elif ev == "df":
                self.c.on_decode_finished(r, 10)
                self.live.discard(r)
            else:
                self.c.cancel(r)
                self.live.discard(r)
        except InvalidArgument:
            assert ev in ("ps", "pf", "ds") or r not in self.live

    @rule(i=st.integers(0, 7), fam=st.integers(0, 2), n=st.integers(0, 5), evict=st.booleans())
    def cache(self, i, fam, n, evict):
        hs = [fam * 100 + b for b in range(n)]
        try:
            self.c.on_blocks_evicted(i, hs) if evict else self.c.on_blocks_stored(i, hs, "ssd" if n % 2 else "dram")
        except InvalidArgument:
            pass

    @invariant()
    def consistent(self):
        self.c.check_integrity()
        assert self.c.snapshot().requests == len(self.live)
        self.c.replication_hints()


TestConductorMachine = ConductorMachine.TestCase
TestConductorMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
