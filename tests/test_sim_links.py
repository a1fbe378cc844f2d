"""The shared-link model alone: max-min fair rates, bytes conserved, capacities respected."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rs import InvalidArgument
from mooncake_rs.sim.links import Links


def check_allocation(net: Links) -> None:
    """Capacities respected, and the max-min property: every flow crosses a saturated
    link on which no flow gets more than it does."""
    net.rates()
    for k, cap in enumerate(net.cap):
        assert net.used(k) <= cap * (1 + 1e-9) + 1e-6
    for f in net.flows.values():
        assert f.rate > 0
        ok = False
        for k in f.links:
            saturated = net.used(k) >= net.cap[k] * (1 - 1e-9)
            top = max(net.flows[g].rate for g in net.on[k])
            if saturated and f.rate >= top * (1 - 1e-9):
                ok = True
        assert ok, f"flow {f.id} at {f.rate} has no bottleneck"


def replay(caps, flows):
    """Runs ``flows`` [(start, links, bytes)] to the end; returns each one's completion
    time, checking the allocation at every change and bytes at the end."""
    net = Links(caps)
    order = sorted(range(len(flows)), key=lambda j: flows[j][0])
    done: dict[int, float] = {}
    objs = {}
    pos = 0
    while pos < len(order) or net.flows:
        nxt = net.next_completion()
        ta = flows[order[pos]][0] if pos < len(order) else math.inf
        if nxt is not None and nxt <= ta:
            for f in net.pop_done(nxt):
                done[f.tag] = nxt
            check_allocation(net)
            continue
        j = order[pos]
        pos += 1
        objs[j] = net.add(ta, flows[j][1], flows[j][2], tag=j)
        check_allocation(net)
    # conservation: every flow delivered its bytes, every link carried what crossed it
    for j, f in objs.items():
        assert f.sent == pytest.approx(flows[j][2], rel=1e-9)
    for k in range(len(caps)):
        want = sum(size for _, links, size in flows if k in links)
        assert net.carried[k] == pytest.approx(want, rel=1e-9, abs=1e-6)
    return [done[j] for j in range(len(flows))]


def test_one_flow_takes_size_over_capacity():
    assert replay([10.0], [(0.0, [0], 50.0)]) == [pytest.approx(5.0)]


def test_two_flows_share_a_link_equally_then_the_survivor_speeds_up():
    # both at 5 B/s until the small one ends at t=4 (20 B); the big one has 40 B left at 10
    t = replay([10.0], [(0.0, [0], 20.0), (0.0, [0], 60.0)])
    assert t == [pytest.approx(4.0), pytest.approx(8.0)]
    # a late joiner halves the first one's rate from then on
    t = replay([10.0], [(0.0, [0], 100.0), (5.0, [0], 10.0)])
    assert t == [pytest.approx(11.0), pytest.approx(7.0)]


def test_max_min_fair_with_two_bottlenecks():
    # A (10 B/s) carries f0 and f1, B (4 B/s) carries f1 and f2: B's fair share 2 limits
    # f1 and f2; f0 takes what A has left (8), not A's equal share (5)
    net = Links([10.0, 4.0])
    f0 = net.add(0.0, [0], 1e9)
    f1 = net.add(0.0, [0, 1], 1e9)
    f2 = net.add(0.0, [1], 1e9)
    net.rates()
    assert (f0.rate, f1.rate, f2.rate) == (pytest.approx(8.0), pytest.approx(2.0), pytest.approx(2.0))
    check_allocation(net)
    assert net.free(0) == pytest.approx(0.0) and net.free(1) == pytest.approx(0.0)


def test_unused_capacity_is_free():
    net = Links([10.0, 100.0])
    net.add(0.0, [0, 1], 1e6)
    assert net.free(1) == pytest.approx(90.0)
    assert net.free(0) == pytest.approx(0.0)


@settings(max_examples=60, deadline=None)
@given(
    caps=st.lists(st.floats(1.0, 100.0), min_size=1, max_size=5),
    raw=st.lists(
        st.tuples(st.floats(0.0, 10.0), st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True), st.floats(1.0, 1000.0)),
        min_size=1,
        max_size=12,
    ),
)
def test_random_flows_conserve_bytes_and_respect_capacities(caps, raw):
    flows = [(t, [k % len(caps) for k in dict.fromkeys(k % len(caps) for k in links)], size) for t, links, size in raw]
    ends = replay(caps, flows)
    for (start, links, size), end in zip(flows, ends):
        # no flow beats its path's slowest link alone
        assert end - start >= size / min(caps[k] for k in links) * (1 - 1e-9)
    # work conservation on one link: with every flow on link 0 only, the last ends when
    # the link has moved all the bytes, counted from the first start, gaps excluded
    solo = [(t, [0], s) for t, _, s in flows]
    ends = replay([caps[0]], solo)
    busy_until = 0.0
    for (t, _, s) in sorted(solo):
        busy_until = max(busy_until, t) + s / caps[0]
    assert max(ends) == pytest.approx(busy_until, rel=1e-9)


@pytest.mark.parametrize(
    "caps, links, size",
    [([0.0], [0], 1.0), ([1.0], [], 1.0), ([1.0], [1], 1.0), ([1.0], [0, 0], 1.0), ([1.0], [0], 0.0), ([1.0], [0], math.inf)],
)
def test_bad_links_and_flows_are_invalid_argument(caps, links, size):
    with pytest.raises(InvalidArgument):
        Links(caps).add(0.0, links, size)


def test_time_cannot_go_backwards():
    net = Links([1.0])
    net.add(5.0, [0], 1.0)
    with pytest.raises(InvalidArgument):
        net.add(4.0, [0], 1.0)


def test_extend_moves_only_the_completion():
    net = Links([10.0])
    a = net.add(0.0, [0], 10.0)
    b = net.add(0.0, [0], 100.0)
    assert net.next_completion() == pytest.approx(2.0)
    net.extend(1.0, a, 10.0)  # 5 B left at t=1, now 15: done at t=4
    assert net.next_completion() == pytest.approx(4.0)
    assert [f.id for f in net.pop_done(4.0)] == [a.id]
    assert a.sent == pytest.approx(20.0)
    # b: 20 B by t=4, then alone at 10 B/s
    assert net.next_completion() == pytest.approx(12.0)
    net.pop_done(12.0)
    assert b.sent == pytest.approx(100.0) and net.carried[0] == pytest.approx(120.0)
    with pytest.raises(InvalidArgument):
        net.extend(13.0, a, 1.0)
