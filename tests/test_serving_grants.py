"""``Cluster(kv_grants=True)`` (issue 17, item 1): a decode arena is restricted, and
only the prefill instance named for a request may write that request's reserved slots,
while the request lasts. Across processes each prefill worker proves its own token, so
the cluster token (or another prefill's) cannot pass for it.
"""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("torch")

import mooncake_rs as mc  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=6)


def make(processes: bool, **kw) -> mc.Cluster:
    return mc.Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                      seed=3, processes=processes, kv_grants=True, **kw)


def grants_left(c: mc.Cluster) -> int:
    return int(sum(st["grants"] for st in c.instance_stats().values()))


def wait_for_grants(c: mc.Cluster) -> None:
    end = time.monotonic() + 30
    while not grants_left(c):
        assert time.monotonic() < end, "no grant was made for the requests in flight"
        time.sleep(0.002)


def write(eng, peer, local, region, offset, length):
    req = mc.TransferRequest("write", local, 0, peer, region, offset, length)
    return eng.submit([req], timeout_s=10).wait()[0]


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "processes"])
def cluster(request):
    c = make(request.param)
    yield c
    c.close()


def test_greedy_outputs_equal_a_single_engine_and_no_grant_outlives_them(cluster):
    prompts = shared_prefix_prompts(4, seed=5) + [[5], list(range(BLOCK)), list(range(3 * BLOCK + 2))]
    ref = reference_outputs(prompts, GREEDY, seed=3)
    assert [o.token_ids for o in cluster.generate(prompts, GREEDY)] == ref
    assert [o.token_ids for o in cluster.generate(prompts, GREEDY)] == ref  # with reuse
    assert grants_left(cluster) == 0
    d = cluster.decode_ids[0]
    assert cluster.instance_stats()[d]["requests"] == 0


def test_a_prefix_fetched_from_another_prefill_still_works(cluster):
    # prefill arenas stay remote_readonly and unrestricted; across processes the reader
    # proves its own token to the holder, which lists it
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    holder = cluster.generate([prefix + [4]], GREEDY)[0].metrics.prefill_instance
    filler = cluster.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
    out = cluster.submit(prefix + [8, 8, 8], GREEDY).result(60)
    filler.result(60)
    assert out.metrics.prefill_instance != holder and out.metrics.fetched_tokens > 0
    assert out.token_ids == reference_outputs([prefix + [8, 8, 8]], GREEDY, seed=3)[0]
    assert grants_left(cluster) == 0


def test_a_peer_without_a_grant_cannot_write_a_decode_arena(cluster):
    d = cluster.decode_ids[0]
    arena = cluster._core.members[d].info.arena
    prompt = list(range(2 * BLOCK + 3))
    before = cluster.generate([prompt], GREEDY)[0].token_ids
    if cluster.processes:
        token = cluster._transfer_token
        # the cluster token authenticates a name of its own, which holds no grant
        with mc.TransferEngine("intruder", auth_token=token, transports=("tcp",),
                               registry=mc.TransferRegistry()) as te:
            peer = te.connect(arena.name, arena.address)
            st = write(te, peer, te.allocate(1 << 16), arena.region, 0, 1 << 16)
            assert st.code == "no_grant" and not st.ok, st
            with pytest.raises(mc.TransferFailed):
                st.raise_for_error()
        # ... and cannot pass for a prefill instance (each proves its own token)
        with mc.TransferEngine(cluster.instances()[cluster.prefill_ids[0]], auth_token=token, transports=("tcp",),
                               registry=mc.TransferRegistry()) as fake:
            with pytest.raises(mc.TransferFailed, match="authentication"):
                fake.connect(arena.name, arena.address)
        # a real prefill's token, under its own name, outside any request: no grant either
        p1 = cluster.prefill_ids[1]
        with mc.TransferEngine(cluster.instances()[p1], auth_token=cluster._instance_tokens[p1],
                               transports=("tcp",), registry=mc.TransferRegistry()) as other:
            peer = other.connect(arena.name, arena.address)
            assert write(other, peer, other.allocate(4096), arena.region, 0, 4096).code == "no_grant"
    else:
        with mc.TransferEngine("intruder", listen="", registry=cluster._registry) as te:
            peer = te.connect(arena.name)
            st = write(te, peer, te.allocate(1 << 16), arena.region, 0, 1 << 16)
            assert st.code == "no_grant" and not st.ok, st
    # the cluster keeps serving, with the same tokens (nothing landed in its arena)
    assert cluster.generate([prompt], GREEDY)[0].token_ids == before
    assert grants_left(cluster) == 0


def test_a_cancel_mid_request_leaves_no_grant(cluster):
    # one cancelled right away (its slots may be reserved and granted, the KV on its
    # way), one cancelled once decoding (its grants went with the KV)
    early = cluster.submit(list(range(6 * BLOCK + 1)), SamplingParams(max_tokens=64))
    early.cancel()
    late = cluster.submit(list(range(3 * BLOCK + 5)), SamplingParams(max_tokens=64))
    next(iter(late))
    late.cancel()
    for h in (early, late):
        with pytest.raises(mc.MooncakeError):
            h.result(60)
    end = time.monotonic() + 30
    while grants_left(cluster) or cluster.instance_stats()[cluster.decode_ids[0]]["requests"]:
        assert time.monotonic() < end, "a cancelled request left a grant or state behind"
        time.sleep(0.05)
    # and the cluster still serves
    assert len(cluster.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 6


def test_a_killed_prefill_leaves_no_grant_and_the_rest_go_on():
    import os
    import signal

    # a slow emulated link keeps the KV in flight (and the slots granted) for a while
    with make(True, link_bandwidth=2e6) as c:
        prompts = [list(range(i, i + 8 * BLOCK + 3)) for i in range(4)]
        handles = [c.submit(p, SamplingParams(max_tokens=32)) for p in prompts]
        victim = handles[0].prefill_instance
        wait_for_grants(c)
        os.kill(c.pid_of(victim), signal.SIGKILL)  # while its requests' slots are granted to it
        for h in handles:
            try:
                h.result(60)
            except mc.MooncakeError:
                assert h.prefill_instance == victim
        end = time.monotonic() + 30
        while grants_left(c) or c.instance_stats()[c.decode_ids[0]]["requests"]:
            assert time.monotonic() < end, "a dead prefill's grants were not revoked"
            time.sleep(0.05)
        assert victim not in c.instances()
        assert c.generate([[1, 2, 3]], GREEDY)[0].token_ids == reference_outputs([[1, 2, 3]], GREEDY, seed=3)[0]


@pytest.mark.parametrize("processes", [False, True], ids=["in_process", "processes"])
def test_a_cancel_while_the_slots_are_granted_revokes_them(processes):
    with make(processes, link_bandwidth=2e6) as c:
        h = c.submit(list(range(8 * BLOCK + 3)), SamplingParams(max_tokens=32))
        wait_for_grants(c)  # reserved, granted, KV on its way
        h.cancel()
        with pytest.raises(mc.MooncakeError):
            h.result(60)
        end = time.monotonic() + 30
        while grants_left(c) or c.instance_stats()[c.decode_ids[0]]["requests"]:
            assert time.monotonic() < end, "a cancelled request left a grant behind"
            time.sleep(0.05)
