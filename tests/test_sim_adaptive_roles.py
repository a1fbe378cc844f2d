"""SimConfig(adaptive_roles=True): instances switch roles through the conductor's drain,
no request is lost, and the option off changes nothing."""

from __future__ import annotations

import pytest

from mooncake_rs import sim
from mooncake_rs.errors import InvalidArgument

PHASES = (
    sim.Phase(60.0, 8.0, (6000, 12000), (16, 64)),
    sim.Phase(60.0, 32.0, (256, 1024), (600, 1200)),
    sim.Phase(60.0, 8.0, (6000, 12000), (16, 64)),
)


def cfg(**kw: object) -> sim.SimConfig:
    base: dict[str, object] = dict(prefill=4, decode=4, rejection="early", ttft_slo_s=10.0, tbt_slo_s=0.1)
    base.update(kw)
    return sim.SimConfig(**base)  # type: ignore[arg-type]


def test_role_switches_lose_no_request() -> None:
    trace = sim.phased_trace(PHASES, seed=3)
    policy = sim.RolePolicy(min_dwell_s=5.0, check_every_s=1.0, switch_s=0.5)
    s = sim.Simulator(cfg(adaptive_roles=True, role_policy=policy))
    rep = s.run(trace)
    assert rep.role_switches >= 2, rep.role_events
    assert rep.role_switches == len(rep.role_events)
    # both directions happened
    assert {role for _, _, role in rep.role_events} == {"prefill", "decode"}
    for r in rep.requests:
        # every request either finished or was rejected at admission: none dropped
        assert (r.finish_s is None) == (r.rejected is not None), r
    assert s.conductor is not None
    assert s.conductor.snapshot().requests == 0
    s.conductor.check_integrity()
    snap = s.conductor.snapshot()
    assert len(snap.prefill) + len(snap.decode) == 8
    assert rep.summary()["role_switches"] == rep.role_switches
    assert rep.config["role_policy"]["min_dwell_s"] == 5.0


def test_off_is_byte_identical_and_keeps_the_report_format(monkeypatch) -> None:
    # Two different code paths on one light trace (no reason to switch): the fixed loop
    # with the option off, and the adaptive loop. Their reports must be the same bytes but
    # for the adaptive-only keys, which the off report must not carry at all.
    import json

    from mooncake_rs.sim import simulator as simulator_mod

    trace = sim.phased_trace((sim.Phase(60.0, 0.5, (500, 1000), (50, 100)),), seed=2)
    adaptive = sim.Simulator(cfg(adaptive_roles=True)).run(trace)
    assert adaptive.role_switches == 0

    def no_adaptive_loop(*_a: object, **_k: object) -> None:
        raise AssertionError("adaptive_roles=False must not enter the adaptive loop")

    monkeypatch.setattr(simulator_mod, "_AdaptiveRun", no_adaptive_loop)
    off = sim.Simulator(cfg()).run(trace)
    for rep in (off, adaptive):
        rep.wall_s, rep.peak_rss_mb = 0.0, 0.0
    assert "role_switches" not in off.summary() and "adaptive_roles" not in off.config
    want = json.loads(adaptive.to_json())
    del want["summary"]["role_switches"], want["config"]["adaptive_roles"]
    assert off.to_json() == json.dumps(want)


def test_adaptive_without_a_reason_to_switch_matches_fixed() -> None:
    # a light load never crosses the thresholds: the adaptive loop replays like the fixed one
    trace = sim.phased_trace((sim.Phase(60.0, 0.5, (500, 1000), (50, 100)),), seed=2)
    a = sim.Simulator(cfg()).run(trace)
    b = sim.Simulator(cfg(adaptive_roles=True)).run(trace)
    assert b.role_switches == 0
    assert [(r.ttft_s, r.finish_s, r.prefill_instance, r.decode_instance) for r in a.requests] == [
        (r.ttft_s, r.finish_s, r.prefill_instance, r.decode_instance) for r in b.requests
    ]


def test_bad_options() -> None:
    with pytest.raises(InvalidArgument, match="adaptive_roles must be a bool"):
        cfg(adaptive_roles=1)
    with pytest.raises(InvalidArgument, match="disaggregated"):
        cfg(adaptive_roles=True, architecture="coupled")
    with pytest.raises(InvalidArgument, match="role_policy"):
        cfg(role_policy={"high": 1})
    with pytest.raises(InvalidArgument, match="low < high"):
        sim.RolePolicy(high=0.2, low=0.5)
    with pytest.raises(InvalidArgument, match="min_per_role"):
        sim.RolePolicy(min_per_role=0)
    with pytest.raises(InvalidArgument):
        sim.phased_trace(())
    with pytest.raises(InvalidArgument):
        sim.phased_trace((sim.Phase(10.0, 1.0, (5, 2), (1, 2)),))


def test_policy_is_data_in_data_out() -> None:
    from types import SimpleNamespace as NS

    pol = sim.RolePolicy(high=0.6, low=0.3, min_dwell_s=10.0)
    p = [NS(id=0, queue_s=9.0, queued=3, running=1), NS(id=1, queue_s=8.0, queued=2, running=1)]
    d = [
        NS(id=2, batch=5, max_batch=128, kv_reserved_tokens=1, kv_capacity_tokens=100, est_tbt_s=0.01),
        NS(id=3, batch=1, max_batch=128, kv_reserved_tokens=1, kv_capacity_tokens=100, est_tbt_s=0.01),
    ]
    snap = NS(prefill=p, decode=d)
    assert pol.decide(snap, 10.0, 0.1, False, 100.0, 0.0) == sim.RoleSwitch(3, "prefill")
    assert pol.decide(snap, 10.0, 0.1, True, 100.0, 0.0) is None  # one drain at a time
    assert pol.decide(snap, 10.0, 0.1, False, 5.0, 0.0) is None  # dwell
    # inside the hysteresis band: nothing moves
    assert pol.decide(snap, 20.0, 0.1, False, 100.0, 0.0) is None
    # never below min_per_role
    assert pol.decide(NS(prefill=p, decode=d[:1]), 10.0, 0.1, False, 100.0, 0.0) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("switch_s", [0.0, 2.0])
def test_switches_respect_the_dwell_and_lose_nothing(seed: int, switch_s: float) -> None:
    trace = sim.phased_trace(PHASES, seed=seed)
    policy = sim.RolePolicy(min_dwell_s=4.0, check_every_s=0.5, switch_s=switch_s, min_per_role=2)
    s = sim.Simulator(cfg(adaptive_roles=True, role_policy=policy, rejection="predictive"))
    rep = s.run(trace)
    assert rep.role_switches > 0
    times = [t for t, _, _ in rep.role_events]
    # each switch starts draining >= min_dwell_s after the previous one ended, then takes >= switch_s
    assert all(b - a >= policy.min_dwell_s + switch_s - 1e-9 for a, b in zip(times, times[1:]))
    roles = {k: ("prefill" if k < 4 else "decode") for k in range(8)}
    for _, k, role in rep.role_events:
        assert roles[k] != role
        roles[k] = role
        assert list(roles.values()).count("prefill") >= 2 and list(roles.values()).count("decode") >= 2
    assert all((r.finish_s is None) == (r.rejected is not None) for r in rep.requests)
    assert s.conductor is not None and s.conductor.snapshot().requests == 0
    snap = s.conductor.snapshot()
    assert sorted(p.id for p in snap.prefill) == sorted(k for k, r in roles.items() if r == "prefill")


def test_replay_cli_adaptive_roles(tmp_path) -> None:
    import json

    from mooncake_rs.cli import main
    from mooncake_rs.sim import save_trace

    p, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    save_trace(sim.phased_trace(PHASES[:2], seed=4), p)
    assert main(["replay", str(p), "--prefill", "4", "--decode", "4", "--rejection", "early",
                 "--ttft-slo", "10", "--adaptive-roles", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["adaptive_roles"] is True
    # the CLI runs the same replay as the API with the same options
    api = sim.Simulator(cfg(adaptive_roles=True)).run(sim.phased_trace(PHASES[:2], seed=4))
    assert api.role_switches >= 1
    assert doc["summary"]["role_switches"] == api.role_switches
