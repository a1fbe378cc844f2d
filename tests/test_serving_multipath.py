"""Multi-source prefix fetch in a real Cluster (``Cluster(multipath=True)``, issue 16):
a prefix held by two prefill instances is fetched by a third from both at once, through
the transfer engine, with greedy outputs equal to a single Engine's and the fetched
blocks byte for byte the holders' (which are what a single-source fetch brought).

The conductor is steered with ``drain_instance`` (a drained instance takes no new
request but its blocks stay fetchable): request 1 computes the prefix on A; with A
drained, request 2 lands on B and fetches it from A (a single-source fetch); with A and
B drained, request 3 lands on C, and the index says both A and B hold the prefix."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

pytest.importorskip("torch")

from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, gate_transport, reference_outputs  # noqa: E402

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=8)
PREFIX_BLOCKS = 6


@pytest.fixture()
def gated_read(monkeypatch):
    """Holds every fetch read back while ``open`` is clear (serving_helpers.gate_transport)."""
    return gate_transport(monkeypatch, "read")


def _drained(c) -> bool:
    return all(not st["requests"] and not st["pinned_requests"] and st["free_pages"] == st["pages"]
               for st in c.instance_stats().values())


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def _three_requests(c, prefix: list[int]):
    """Runs the three steps; returns (outputs, holders A and B, the fetching instance C)."""
    keys = c._core.hasher.hash_blocks(prefix)
    outs = []
    o1 = c.generate([prefix + [1, 2, 3]], GREEDY)[0]
    a = o1.metrics.prefill_instance
    outs.append(o1)
    c.conductor.drain_instance(a)
    o2 = c.generate([prefix + [4, 5]], GREEDY)[0]
    b = o2.metrics.prefill_instance
    outs.append(o2)
    assert b != a and o2.metrics.fetched_tokens == PREFIX_BLOCKS * BLOCK
    assert o2.metrics.fetch_sources == 1
    # the index hears of B's copy through its store events (they race the tokens)
    _wait(lambda: sum(n >= PREFIX_BLOCKS for n in c.conductor.index.match_prefix(keys).values()) >= 2,
          "the index never showed both holders")
    c.conductor.drain_instance(b)
    o3 = c.generate([prefix + [7, 8]], GREEDY)[0]
    outs.append(o3)
    third = o3.metrics.prefill_instance
    assert third not in (a, b)
    assert o3.metrics.fetched_tokens == PREFIX_BLOCKS * BLOCK
    c.conductor.undrain_instance(a)
    c.conductor.undrain_instance(b)
    return outs, a, b, third


@pytest.mark.parametrize("multipath", [True, False])
def test_a_prefix_is_fetched_from_two_holders_at_once(monkeypatch, multipath):
    from mooncake_rs import Cluster
    from mooncake_rs.serving import instance as inst_mod

    made: dict[int, object] = {}  # in-process instances, to read their stores afterwards
    real_init = inst_mod.Instance.__init__

    def init(self, spec, *a, **kw):
        real_init(self, spec, *a, **kw)
        made[spec.id] = self

    monkeypatch.setattr(inst_mod.Instance, "__init__", init)
    rng = random.Random(16)
    prefix = [rng.randrange(256) for _ in range(PREFIX_BLOCKS * BLOCK)]
    prompts = [prefix + [1, 2, 3], prefix + [4, 5], prefix + [7, 8]]
    ref = reference_outputs(prompts, GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=3, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, multipath=multipath) as c:
        outs, a, b, third = _three_requests(c, prefix)
        assert [o.token_ids for o in outs] == ref
        assert outs[2].metrics.fetch_sources == (2 if multipath else 1) and outs[2].metrics.fetch_s > 0
        assert c.metrics.multi_source_fetches == (1 if multipath else 0)
        _wait(lambda: _drained(c), "a pin, a request or a page was left behind")
        # the bytes: C's copy of every prefix block is A's (which computed it) and B's
        # (which fetched it from A alone: a single-source fetch's result)
        keys = c._core.hasher.hash_blocks(prefix)
        for k in keys:
            got = []
            for i in (a, b, third):
                blk = made[i].store.lookup(k)
                assert blk is not None, f"instance {i} does not hold block {k:#x}"
                try:
                    got.append(bytes(np.asarray(blk)))
                finally:
                    blk.release()
            assert got[0] == got[1] == got[2]
        # a later request sharing the prefix (anywhere) still gets the reference output
        more = c.generate([prefix + [9]], GREEDY)[0]
        assert more.token_ids == reference_outputs([prefix + [9]], GREEDY, seed=3)[0]


def test_multipath_across_worker_processes():
    from mooncake_rs import Cluster

    rng = random.Random(17)
    prefix = [rng.randrange(256) for _ in range(PREFIX_BLOCKS * BLOCK)]
    ref = reference_outputs([prefix + [1, 2, 3], prefix + [4, 5], prefix + [7, 8]], GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=3, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, multipath=True, processes=True) as c:
        outs, _, _, _ = _three_requests(c, prefix)
        assert [o.token_ids for o in outs] == ref
        assert outs[2].metrics.fetch_sources == 2
        _wait(lambda: _drained(c), "a pin, a request or a page was left behind")


def test_cancel_while_a_two_source_fetch_is_in_flight(gated_read):
    """The reads from both holders are held (``gated_read``); the request is cancelled
    meanwhile: the prefill drops the fetch once its reads end (no slot left reserved),
    both holders are unpinned, and the cluster serves the prefix again afterwards."""
    from mooncake_rs import Cluster

    rng = random.Random(18)
    prefix = [rng.randrange(256) for _ in range(PREFIX_BLOCKS * BLOCK)]
    with Cluster(ModelConfig.tiny(), prefill=3, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, multipath=True) as c:
        keys = c._core.hasher.hash_blocks(prefix)
        a = c.generate([prefix + [1]], GREEDY)[0].metrics.prefill_instance
        c.conductor.drain_instance(a)
        b = c.generate([prefix + [2]], GREEDY)[0].metrics.prefill_instance
        _wait(lambda: sum(n >= PREFIX_BLOCKS for n in c.conductor.index.match_prefix(keys).values()) >= 2,
              "the index never showed both holders")
        c.conductor.drain_instance(b)
        reads = gated_read.calls
        gated_read.open.clear()
        h = c.submit(prefix + [3, 3], GREEDY)
        _wait(lambda: len(gated_read.held) >= 2 or h.done, "the two reads never started", 60)
        assert gated_read.calls - reads == 2 and not h.done  # one read per holder, both held
        assert h.cancel()
        time.sleep(0.2)
        gated_read.open.set()
        c.conductor.undrain_instance(a)
        c.conductor.undrain_instance(b)
        _wait(lambda: _drained(c), "a pin, a request or a page was left behind")
        check = prefix + [4, 4]
        assert c.generate([check], GREEDY)[0].token_ids == reference_outputs([check], GREEDY, seed=3)[0]
