"""Issue 25 in a real Cluster with emulated slow links (``link_bandwidth``): the same
Rust conductor as the simulator prices a prefix fetch on the holder's link as loaded.

Request 1 computes a prefix on A; A is then drained in the conductor (it takes no new
request, its blocks stay fetchable), so request 2 lands on B, which either fetches the
prefix from A or computes it. The holder's NIC out is reported (what its transfer
engine counts as queued on the link; ``Conductor.report_link_load``) either backed up
by seconds of KV streams or idle: saturated, the fetch is declined and B computes the
whole prompt; idle, B fetches from A. Outputs are the single-Engine reference either way.
"""

from __future__ import annotations

import random
import threading

import pytest

pytest.importorskip("torch")

from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=8)
PREFIX_BLOCKS = 6
#: the tiny model's KV: 2 layers x (K, V) x 2 KV heads x 16 x 4 bytes (float32)
KV_BYTES_PER_TOKEN = 512
LINK = 1e9  # bytes/s per emulated link: fetching the 6-block prefix (tens of us) beats recomputing it (~2 ms) when idle


@pytest.mark.parametrize("saturated", [True, False], ids=["saturated_holder", "idle_holder"])
def test_fetch_over_a_saturated_holder_is_declined(saturated):
    from mooncake_rs import Cluster

    rng = random.Random(25)
    prefix = [rng.randrange(256) for _ in range(PREFIX_BLOCKS * BLOCK)]
    prompts = [prefix + [1, 2, 3], prefix + [4, 5]]
    ref = reference_outputs(prompts, GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, link_bandwidth=LINK) as c:
        cond = c.conductor
        assert all(l.nic_bps == LINK for l in cond.link_loads())
        keys = c._core.hasher.hash_blocks(prefix)
        o1 = c.generate([prompts[0]], GREEDY)[0]
        a = o1.metrics.prefill_instance
        wait_for(lambda: cond.index.match_prefix(keys).get(a, 0) >= PREFIX_BLOCKS, "the index never showed A's prefix")
        cond.drain_instance(a)
        now = c._core.now()
        # A's NIC out: 10 s of KV streams queued, or nothing
        assert cond.report_link_load(a, now, 10 * LINK if saturated else 0.0)
        d = cond.preview(10**9, keys, len(prompts[1]), now, 8)
        if saturated:
            assert d.fetch_from is None and d.reused_blocks == 0, d
        else:
            assert d.fetch_from == a and d.fetch_blocks == PREFIX_BLOCKS, d
        o2 = c.generate([prompts[1]], GREEDY)[0]
        assert o2.metrics.prefill_instance != a
        if saturated:
            assert o2.metrics.fetched_tokens == 0 and o2.metrics.reused_tokens == 0
        else:
            assert o2.metrics.fetched_tokens == PREFIX_BLOCKS * BLOCK and o2.metrics.fetch_s > 0
        assert [o1.token_ids, o2.token_ids] == ref
        cond.undrain_instance(a)


@pytest.mark.parametrize("processes", [False, True], ids=["in_process", "workers"])
def test_heartbeats_carry_link_counters_that_correct_the_conductor(processes):
    """Each instance's heartbeat carries its transfer engine's bytes queued or in flight
    on its NIC out and in (``Beat.link_out_bytes`` / ``link_in_bytes``, dated on the
    cluster's clock by their age), and the router hands them to the conductor's link
    loads (``report_link_load``): during a KV stream over a slow emulated link the
    prefill instance reports bytes queued out; and a backlog the conductor believes in
    (10,000 s of it, reported here by hand) is replaced by the instance's next reading,
    which says the link is idle."""
    from mooncake_rs import Cluster

    rng = random.Random(26)
    prompt = [rng.randrange(256) for _ in range(8 * BLOCK)]
    link = len(prompt) * KV_BYTES_PER_TOKEN / 3.0  # the prompt's KV stream takes ~3 s on this link
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, heartbeat_timeout_s=4.0, processes=processes, link_bandwidth=link) as c:
        cond = c.conductor
        assert cond.config.transfer_model.bytes_per_token == KV_BYTES_PER_TOKEN
        p = cond.snapshot().prefill[0].id
        member = c._core.members[p]
        seen: list[float] = []
        done = threading.Event()

        def run() -> None:
            try:
                c.generate([prompt], GREEDY)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        while not done.wait(0.02):
            b = member.ch.last_beat
            if b is not None and b.link_t >= 0:
                seen.append(b.link_out_bytes)
        assert max(seen, default=0.0) > 0, f"no heartbeat reported the KV stream queued on the link out: {seen[-5:]}"

        def out_bytes() -> float:
            return next(l for l in cond.link_loads(c._core.now()) if l.instance == p).nic_out_bytes

        assert cond.report_link_load(p, c._core.now(), 1e4 * link)
        assert out_bytes() > 1e3 * link
        wait_for(lambda: out_bytes() == 0.0, "the instance's heartbeat never replaced the conductor's backlog", 20.0)
