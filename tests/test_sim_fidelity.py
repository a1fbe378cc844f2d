"""Ground truth separate from estimates: true cost models and per-request estimate error."""

from __future__ import annotations

import json
import math

import pytest

from mooncake_rs import DecodeCostModel, InvalidArgument, PrefillCostModel
from mooncake_rs.sim import Request, SimConfig, Simulator, generate_trace
from mooncake_rs.sim.loop import error_factors

PM = PrefillCostModel()


def _strip(rep):
    d = json.loads(rep.to_json())
    d["summary"].pop("wall_s")
    d["summary"].pop("peak_rss_mb")
    return d


def test_off_by_default_and_zero_error_is_exact():
    tr = generate_trace(300, rate=2.0, seed=5)
    a = Simulator(SimConfig(speedup=6)).run(tr)
    b = Simulator(SimConfig(speedup=6, estimate_error=0.0)).run(tr)
    assert _strip(a) == _strip(b)
    # the new fields stay out of the report's config while off
    assert "estimate_error" not in a.config and "nic_bandwidth" not in a.config
    assert error_factors(SimConfig(), 10) is None


def test_true_prefill_model_times_the_instance_while_the_conductor_estimates_with_its_own():
    slow = PrefillCostModel(c0=PM.c0 * 2, c_new=PM.c_new * 2, c_new2=PM.c_new2 * 2, c_cross=PM.c_cross * 2)
    r = Request(0.0, 8192, 1, tuple(range(16)))
    sim = Simulator(SimConfig(prefill=1, decode=1, true_prefill_model=slow))
    rep = sim.run([r])
    assert rep.requests[0].ttft_s == pytest.approx(slow.predict(8192, 0), rel=1e-12)
    # the conductor still predicts with the default model
    assert sim.conductor is not None
    d = sim.conductor.preview(99, list(range(100, 116)), 8192, 100.0)
    assert d.est_prefill_s == pytest.approx(PM.predict(8192, 0), rel=1e-9)
    assert rep.config["true_prefill_model"]["c_new"] == pytest.approx(slow.c_new)


def test_true_decode_model_drives_the_batch():
    fast = DecodeCostModel(base_s=0.001, per_seq_s=0.0, per_token_s=0.0)
    r = Request(0.0, 1024, 11, tuple(range(2)))
    rep = Simulator(SimConfig(prefill=1, decode=1, true_decode_model=fast)).run([r])
    assert rep.requests[0].tbt_s == pytest.approx(0.001, rel=1e-9)


def test_estimate_error_multiplies_each_request_by_its_seeded_factor():
    trace = [Request(i * 100_000.0, 4096, 1, tuple(range(i * 8, i * 8 + 8))) for i in range(50)]
    cfg = SimConfig(prefill=1, decode=1, estimate_error=0.3, seed=7)
    rep = Simulator(cfg).run(trace)
    f = error_factors(cfg, len(trace))
    assert f is not None and len(set(f)) == len(f)
    for x, fi in zip(rep.requests, f):
        assert x.ttft_s == pytest.approx(PM.predict(4096, 0) * fi, rel=1e-12)
    # seeded: the same run twice gives the same factors; another seed others
    assert error_factors(cfg, 50) == f
    assert error_factors(SimConfig(estimate_error=0.3, seed=8), 50) != f


def test_error_factors_have_mean_one_and_the_asked_spread():
    f = error_factors(SimConfig(estimate_error=0.5), 20_000)
    assert f is not None
    mean = sum(f) / len(f)
    logs = [math.log(x) for x in f]
    mu = sum(logs) / len(logs)
    sd = math.sqrt(sum((v - mu) ** 2 for v in logs) / len(logs))
    assert mean == pytest.approx(1.0, abs=0.02)
    assert sd == pytest.approx(0.5, abs=0.02)


def test_coupled_uses_the_factor_too():
    trace = [Request(i * 100_000.0, 4096, 1, tuple(range(i * 8, i * 8 + 8))) for i in range(5)]
    for chunked in (False, True):
        cfg = SimConfig(prefill=1, decode=0 + 1, architecture="coupled", chunked_prefill=chunked, estimate_error=0.4, chunk_tokens=8192)
        rep = Simulator(cfg).run(trace)
        f = error_factors(cfg, 5)
        assert f is not None
        for x, fi in zip(rep.requests, f):
            assert x.ttft_s == pytest.approx(PM.predict(4096, 0) * fi, rel=1e-9)


@pytest.mark.parametrize(
    "kw",
    [
        dict(estimate_error=-0.1),
        dict(estimate_error=float("nan")),
        dict(estimate_error=True),
        dict(true_prefill_model=DecodeCostModel()),
        dict(nic_bandwidth=0),
        dict(storage_bandwidth=-1.0),
        dict(ssd_capacity_tokens_per_instance=10),
        dict(ssd_capacity_tokens_per_instance=1 << 20),  # without a DRAM capacity
        dict(multipath=True),  # without nic_bandwidth
        dict(multipath=1, nic_bandwidth=1e9),
        dict(nic_bandwidth=1e9, architecture="coupled"),
    ],
)
def test_bad_fidelity_options_are_invalid_argument(kw):
    with pytest.raises(InvalidArgument):
        SimConfig(**kw)
