"""Conductor.drain_instance / is_drained / switch_role: a role switch loses no request."""

from __future__ import annotations

import random

import pytest

from mooncake_rs._core import Conductor
from mooncake_rs.errors import InvalidArgument, Overloaded


def make() -> Conductor:
    c = Conductor()
    c.add_prefill(0)
    c.add_prefill(1)
    c.add_decode(2)
    c.add_decode(3)
    return c


def test_drained_instance_takes_nothing_new_and_keeps_its_requests() -> None:
    c = make()
    d = c.schedule(1, [], 100, 0.0, 10)
    p = d.prefill
    assert c.drain_instance(p) == 1
    assert c.drain_instance(p) == 1  # twice is fine
    assert c.is_draining(p) and not c.is_drained(p)
    assert [x.draining for x in c.snapshot().prefill if x.id == p] == [True]
    for rid in range(2, 30):
        assert c.schedule(rid, [], 100, 0.0, 10).prefill != p
    with pytest.raises(InvalidArgument, match="still holds 1"):
        c.switch_role(p, "decode")
    c.on_prefill_started(1, 0.1)
    c.on_prefill_finished(1, 0.2)
    assert c.is_drained(p) and c.held_requests(p) == 0
    c.switch_role(p, "decode", max_batch=8, kv_capacity_tokens=10_000)
    c.check_integrity()
    snap = c.snapshot()
    assert p in [x.id for x in snap.decode] and p not in [x.id for x in snap.prefill]
    assert [x.max_batch for x in snap.decode if x.id == p] == [8]
    c.on_decode_started(1, 0.3)
    c.on_decode_finished(1, 10, 0.4)
    c.check_integrity()


def test_errors_are_typed() -> None:
    c = make()
    for f in (c.drain_instance, c.undrain_instance, c.is_drained, c.is_draining, c.held_requests):
        with pytest.raises(InvalidArgument, match="unknown instance 9"):
            f(9)
    with pytest.raises(InvalidArgument, match="not draining"):
        c.switch_role(0, "decode")
    c.drain_instance(0)
    with pytest.raises(InvalidArgument, match="role must be"):
        c.switch_role(0, "both")
    with pytest.raises(InvalidArgument):
        c.switch_role(0, "decode", max_batch=0)
    assert c.is_draining(0)


def test_all_decode_draining_is_overloaded_then_undrain() -> None:
    c = make()
    c.drain_instance(2)
    c.drain_instance(3)
    with pytest.raises(Overloaded) as e:
        c.schedule(1, [], 100, 0.0, 10)
    assert e.value.reason == "no_decode_instance"
    c.undrain_instance(3)
    assert c.schedule(1, [], 100, 0.0, 10).decode == 3


def test_random_drains_and_switches_lose_nothing() -> None:
    rng = random.Random(7)
    c = make()
    live: dict[int, int] = {}
    admitted = finished = 0
    events = [c.on_prefill_started, c.on_prefill_finished, c.on_decode_started]
    t = 0.0
    for rid in range(1, 2000):
        t += 0.01
        x = rng.random()
        if x < 0.35:
            try:
                c.schedule(rid, [], rng.randint(1, 4000), t, rng.randint(1, 50))
                live[rid] = 0
                admitted += 1
            except Overloaded:
                pass
        elif x < 0.85 and live:
            r = rng.choice(list(live))
            if live[r] == 3:
                c.on_decode_finished(r, 5, t)
                del live[r]
                finished += 1
            else:
                events[live[r]](r, t)
                live[r] += 1
        else:
            k = rng.randrange(4)
            c.drain_instance(k)
            if c.is_drained(k):
                to = "decode" if k in [p.id for p in c.snapshot().prefill] else "prefill"
                c.switch_role(k, to)
        c.check_integrity()
    for r, stage in live.items():
        for ev in events[stage:]:
            ev(r, t)
        c.on_decode_finished(r, 5, t)
        finished += 1
    assert finished == admitted
    assert c.snapshot().requests == 0
