"""Issue 25 in a real Cluster: the conductor's hot-prefix replica hints acted on, with a
byte cap (serving/replication.py).

Request 1 computes a prefix on A; six more requests reuse it there (admitted and
cancelled: a hit counts at admission), so it is hot; A's NIC out is reported backed up
by seconds of KV streams, so every holder of the prefix is link-bound and the
conductor proposes a copy to B. Within the cap, the Cluster copies it (A exports and
pins the blocks, B reads them into its store, A unpins) and B's store events show it in
the conductor's index; a request for the prefix then runs on B with the prefix reused
and nothing fetched, and its output is the single-Engine reference. Over the cap,
nothing is copied.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=8)
PREFIX_BLOCKS = 6
KV_BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x (K, V) x 2 KV heads x 16 x 4 bytes
PREFIX_BYTES = PREFIX_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN
LINK = 1e9


@pytest.mark.parametrize("fits", [True, False], ids=["within_the_cap", "over_the_cap"])
def test_a_hot_prefix_on_a_link_bound_holder_is_copied_within_the_byte_cap(fits):
    from mooncake_rs import Cluster

    rng = random.Random(27)
    prefix = [rng.randrange(256) for _ in range(PREFIX_BLOCKS * BLOCK)]
    prompts = [prefix + [1, 2, 3], prefix + [4, 5]]
    ref = reference_outputs(prompts, GREEDY, seed=3)
    cap = 4 * PREFIX_BYTES if fits else PREFIX_BYTES - 1
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, link_bandwidth=LINK, replica_max_bytes=cap) as c:
        cond = c.conductor
        assert cond.config.transfer_model.bytes_per_token == KV_BYTES_PER_TOKEN
        keys = c._core.hasher.hash_blocks(prefix)
        o1 = c.generate([prompts[0]], GREEDY)[0]
        a = o1.metrics.prefill_instance
        b = next(p.id for p in cond.snapshot().prefill if p.id != a)
        held = lambda inst: cond.index.match_prefix(keys).get(inst, 0)  # noqa: E731
        wait_for(lambda: held(a) >= PREFIX_BLOCKS, "the index never showed A's prefix")
        # six hits on A, more than the 4 the conductor asks (they decay) (B drained meanwhile, so none is a fetch that would put it on B)
        cond.drain_instance(b)
        for k in range(6):
            d = cond.schedule(10**9 + k, keys, len(prompts[0]), c._core.now(), 8)
            assert (d.prefill, d.reused_blocks) == (a, PREFIX_BLOCKS), d
            cond.cancel(10**9 + k)
        cond.undrain_instance(b)
        assert held(b) == 0
        # A's NIC out: 10 s of KV streams. A heartbeat of A's (an idle link) may land
        # between the report and the round: then report again
        started = 0
        for _ in range(5):
            assert cond.report_link_load(a, c._core.now(), 10 * LINK)
            hints = cond.replication_hints(c._core.now())
            started = c.replicate_hot_prefixes()
            if started or not fits:
                break
        rep = c._core.router.replicator
        if not fits:
            assert hints == [] and started == 0 and rep.started == 0
            return
        assert [(h.from_instance, h.to_instance, len(h.blocks)) for h in hints] == [(a, b, PREFIX_BLOCKS)]
        assert started == 1
        wait_for(lambda: held(b) >= PREFIX_BLOCKS, "B's store events never showed the replica")
        wait_for(lambda: rep.done == 1 and not rep.copies, "the copy never ended (A still pins the prefix)")
        assert rep.copied_bytes == PREFIX_BYTES
        # B serves the prefix from its own store now
        cond.drain_instance(a)
        o2 = c.generate([prompts[1]], GREEDY)[0]
        assert o2.metrics.prefill_instance == b
        assert o2.metrics.reused_tokens == PREFIX_BLOCKS * BLOCK and o2.metrics.fetched_tokens == 0
        assert [o1.token_ids, o2.token_ids] == ref
        cond.undrain_instance(a)


def test_replicator_keeps_copies_in_flight_within_the_cap_and_unpins_every_holder():
    """The cluster's side against a scripted conductor: hints that do not fit in the cap
    with the copies in flight wait; ``Exported`` goes on to the target as
    ``Replicate``; ``Fetched`` (or a ``Failed``, or an empty export) unpins the holder
    and frees the bytes; an instance going down drops its copies."""
    from types import SimpleNamespace as NS

    from mooncake_rs.serving.protocol import Endpoint, Export, Exported, Failed, Fetched, Replicate, Unpin
    from mooncake_rs.serving.replication import Replicator

    sent: list[tuple[int, object]] = []
    hints: list[NS] = []
    cond = NS(replication_hints=lambda now: list(hints))
    rep = Replicator(lambda inst, msg: sent.append((inst, msg)), lambda: 100.0, max_bytes=500.0)
    hot = lambda frm, to, n, first: NS(from_instance=frm, to_instance=to, blocks=list(range(first, first + n)))  # noqa: E731
    hints[:] = [hot(1, 2, 3, 10), hot(1, 3, 3, 20)]  # 300 + 300 bytes: only the first fits
    assert rep.round(cond, 0.0) == 1 and rep.in_flight_bytes() == 300.0
    (holder, exp), = sent
    assert holder == 1 and isinstance(exp, Export) and exp.rid < 0
    sent.clear()
    # the same hint again is on its way: not started twice; the second still does not fit
    assert rep.round(cond, 1.0) == 0 and not sent
    ep = Endpoint("h", "", 1)
    rep.on_message(1, Exported(exp.rid, ep, [0, 4096]))  # the holder kept 2 of the 3 blocks
    (target, msg), = sent
    assert target == 2 and isinstance(msg, Replicate) and msg.fetch.offsets == [0, 4096]
    assert len(msg.fetch.keys) == 2 * 16
    sent.clear()
    rep.on_message(2, Fetched(exp.rid))
    assert sent == [(1, Unpin(exp.rid))] and rep.in_flight_bytes() == 0.0 and rep.done == 1
    sent.clear()
    # the second fits now, with a third (300 + 100 <= 500)
    hints[:] = [hot(1, 3, 3, 20), hot(6, 7, 1, 40)]
    assert rep.round(cond, 2.0) == 2
    rids = [m.rid for _, m in sent]
    sent.clear()
    rep.on_message(6, Exported(rids[1], ep, []))  # its holder exported nothing: unpinned, no copy
    assert sent == [(6, Unpin(rids[1]))] and rep.done == 1
    sent.clear()
    rep.on_message(3, Failed(rids[0], "boom"))  # the target failed the copy
    assert sent == [(1, Unpin(rids[0]))] and not rep.copies and rep.done == 1
    # a target that goes down: its copy is dropped and the holder unpinned
    hints[:] = [hot(4, 5, 1, 30)]
    assert rep.round(cond, 3.0) == 1
    rid = sent[-1][1].rid
    sent.clear()
    rep.instance_down(5)
    assert sent == [(4, Unpin(rid))] and not rep.copies and rep.in_flight_bytes() == 0.0
