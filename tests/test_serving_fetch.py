"""The prefix fetch of a prefill instance runs alongside its engine loop: the fetch is
started (the transport's asynchronous ``read``, completion seen through
``pending``/``error``), the loop goes on, and the request starts computing once the read
has ended. The tests wrap ``read`` so they can hold its completion back."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.serving import transport as T  # noqa: E402
from serving_helpers import BLOCK, gate_transport, reference_outputs  # noqa: E402

pytestmark = pytest.mark.timeout(240)
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture()
def gated_read(monkeypatch):
    return gate_transport(monkeypatch, "read")


def drained(c) -> bool:
    return all(not st["requests"] and not st["pinned_requests"] and st["free_pages"] == st["pages"]
               for st in c.instance_stats().values())


def test_fetch_through_the_asynchronous_read(gated_read):
    from mooncake_rs import Cluster

    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        holder = c.generate([prefix + [1, 2, 3]], GREEDY)[0].metrics.prefill_instance
        filler = c.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
        out = c.submit(prefix + [9, 9], GREEDY).result(60)
        filler.result(60)
        assert out.metrics.prefill_instance != holder
        assert out.metrics.fetched_tokens > 0 and gated_read.calls >= 1
        assert out.token_ids == reference_outputs([prefix + [9, 9]], GREEDY, seed=3)[0]
        end = time.monotonic() + 30
        while not drained(c):
            assert time.monotonic() < end, c.instance_stats()
            time.sleep(0.05)


def test_an_instance_computes_while_its_fetch_is_in_flight(gated_read):
    from mooncake_rs import Cluster

    rng = random.Random(8)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    other = [rng.randrange(256) for _ in range(2 * BLOCK + 3)]
    ref = reference_outputs([prefix + [9, 9], other], GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        holder = c.generate([prefix + [1, 2, 3]], GREEDY)[0].metrics.prefill_instance
        filler = c.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
        gated_read.open.clear()
        fetching = c.submit(prefix + [9, 9], GREEDY)
        end = time.monotonic() + 60
        while not gated_read.held:  # the fetch has started and is held
            assert time.monotonic() < end and not fetching.done
            time.sleep(0.01)
        fetcher = fetching.prefill_instance
        assert fetcher != holder
        # a request for the same instance while its fetch is held: served meanwhile
        quick = c.submit(other, GREEDY)
        if quick.prefill_instance == fetcher:
            assert quick.result(60).token_ids == ref[1]
            assert not fetching.done  # it really waited for the read, and the other one did not
        gated_read.open.set()
        assert fetching.result(60).token_ids == ref[0]
        assert quick.result(60).token_ids == ref[1]
        filler.result(60)
        end = time.monotonic() + 30
        while not drained(c):
            assert time.monotonic() < end, c.instance_stats()
            time.sleep(0.05)


def test_cancel_while_the_fetch_is_in_flight(gated_read):
    from mooncake_rs import Cluster

    rng = random.Random(9)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        c.generate([prefix + [1, 2, 3]], GREEDY)
        filler = c.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
        gated_read.open.clear()
        h = c.submit(prefix + [9, 9], GREEDY)
        end = time.monotonic() + 60
        while not gated_read.held and not h.done:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert h.cancel()
        time.sleep(0.2)
        gated_read.open.set()  # the read ends; the prefill drops what it reserved
        filler.result(60)
        end = time.monotonic() + 30
        while not drained(c):
            assert time.monotonic() < end, c.instance_stats()
            time.sleep(0.05)
        check = prefix + [4, 4]
        assert c.generate([check], GREEDY)[0].token_ids == reference_outputs([check], GREEDY, seed=3)[0]
