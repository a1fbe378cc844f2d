"""Whole-object holds for remote writers and readers: ``Store.reserve_objects`` /
``ReservedObject.commit`` / ``Store.lease_objects`` (one Rust call per batch, what a store
node's Reserve, Commit and Lookup use) against the per-chunk calls as reference, and the
segment's batch calls built on them (``reserve_many`` / ``lease_many``)."""

from __future__ import annotations

import pytest

from mooncake_rs._core import Store
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool.chunks import chunk_key, new_oid
from mooncake_rs.pool.objects import Lease, Reservation
from mooncake_rs.pool.segment import ObjectSegment
from mooncake_rs.pool.status import KeyStatus

BB = 4096


def test_reserved_objects_commit_to_the_blocks_per_chunk_calls_make():
    s, ref = Store(BB, 64 * BB), Store(BB, 64 * BB)
    oids = [new_oid() for _ in range(5)]
    counts = [1, 3, 2, 4, 1]
    got = s.reserve_objects(oids, counts)
    assert [len(o) for o in got] == counts
    for oid, n, obj in zip(oids, counts, got):
        assert obj.commit()
        for j in range(n):
            w = ref.reserve(chunk_key(oid, j))
            w.commit().release()
            assert chunk_key(oid, j) in s and chunk_key(oid, j) in ref
            assert s.slot_offset(chunk_key(oid, j)) == obj.offsets[j]
    # a lease of each whole object holds the slots a per-chunk lookup finds
    runs = s.lease_objects(oids, counts)
    for oid, n, run in zip(oids, counts, runs):
        ref_run = s.lookup_prefix_run([chunk_key(oid, j) for j in range(n)])
        assert list(run.offsets) == list(ref_run.offsets) and len(run) == n
        ref_run.release()
        run.release()


def test_an_object_that_does_not_fit_is_none_and_keeps_no_slot():
    s = Store(BB, 4 * 4096)  # 4 slots (a slot is at least a page)
    for k in (1, 2):
        assert s.put(k, bytes(BB))
        s.pin(k)
    a, b = new_oid(), new_oid()
    assert s.reserve_objects([a], [3]) == [None]
    (obj,) = s.reserve_objects([b], [2])  # the first object's two slots came back
    assert obj is not None and len(obj) == 2
    obj.abort()
    obj.abort()  # (nothing the second time)
    with pytest.raises(InvalidArgument, match="already committed or aborted"):
        obj.commit()
    assert chunk_key(a, 0) not in s and chunk_key(b, 0) not in s


def test_a_pinned_commit_pins_every_chunk_and_a_missing_chunk_fails_the_lease():
    s = Store(BB, 16 * 4096)
    oid = new_oid()
    (obj,) = s.reserve_objects([oid], [3])
    assert obj.commit(pin=True)
    with pytest.raises(InvalidArgument, match="pinned"):
        s.remove(chunk_key(oid, 1))
    for j in range(3):
        s.unpin(chunk_key(oid, j))
    s.remove(chunk_key(oid, 2))
    assert s.lease_objects([oid], [3]) == [None]
    assert len(s.lease_objects([oid], [2])[0]) == 2


def test_bad_object_calls_say_what_to_fix():
    s = Store(BB, 16 * 4096)
    with pytest.raises(InvalidArgument, match="one count per object"):
        s.reserve_objects([new_oid()], [1, 2])
    with pytest.raises(InvalidArgument, match="one count per object"):
        s.lease_objects([new_oid(), new_oid()], [1])
    with pytest.raises(InvalidArgument, match="chunk numbers"):
        s.reserve_objects([new_oid() | 1], [2])
    with pytest.raises(InvalidArgument, match="at least one chunk"):
        s.reserve_objects([new_oid()], [0])


def test_segment_batches_answer_per_key_as_one_key_calls_do():
    seg = ObjectSegment(64 * 65536, chunk_bytes=65536, small_bytes=BB)
    assert seg.put_value("held", b"x" * 100_000) is KeyStatus.OK
    sizes = {"big": 200_000, "small": 100, "held": 100_000, "huge": 1 << 40, "bad": -1}
    got = dict(zip(sizes, seg.reserve_many(list(sizes), list(sizes.values()))))
    assert got["held"] is KeyStatus.OK and got["huge"] is KeyStatus.NO_SPACE and got["bad"] is KeyStatus.INVALID
    assert isinstance(got["big"], Reservation) and len(got["big"].offsets) == 4
    assert isinstance(got["small"], Reservation) and len(got["small"].offsets) == 1
    assert seg.commit(got["big"]) is KeyStatus.OK
    seg.abort(got["small"])
    assert seg.exists("big") and not seg.exists("small")
    leases = dict(zip(["big", "held", "nope"], seg.lease_many(["big", "held", "nope"])))
    assert isinstance(leases["big"], Lease) and leases["big"].meta.size == 200_000
    assert isinstance(leases["held"], Lease) and leases["nope"] is KeyStatus.MISSING
    for lease in (leases["big"], leases["held"]):
        lease.release()
    # an object that lost a chunk behind the table's back: missing, and dropped whole
    meta = seg._objects["big"]
    seg.classes[meta.cls].store.remove(chunk_key(meta.oid, 3))
    before = seg.counters.failed_reads
    assert seg.lease_many(["big"]) == [KeyStatus.MISSING]
    assert seg.counters.failed_reads == before + 1 and not seg.exists("big")
    assert chunk_key(meta.oid, 0) not in seg.classes[meta.cls].store


def test_commit_many_keeps_the_first_put_of_a_key_as_commit_does():
    seg, ref = (ObjectSegment(64 * 65536, chunk_bytes=65536, small_bytes=BB) for _ in range(2))
    keys, sizes = ["a", "a", "b", "c"], [200_000, 100_000, 70_000, 100]
    batch = seg.commit_many(seg.reserve_many(keys, sizes))
    one_by_one = [ref.commit(r) for r in ref.reserve_many(keys, sizes)]
    assert batch == one_by_one == [KeyStatus.OK] * 4
    for s in (seg, ref):
        assert sorted(s.keys()) == ["a", "b", "c"] and s.size_of("a") == 200_000
        assert (s.counters.puts, s.counters.puts_existing) == (3, 1)
    # the losing put's chunks were freed: only the winners' chunks are stored
    stored = [sc.store.stats().blocks_dram for sc in seg.classes]
    assert stored == [sc.store.stats().blocks_dram for sc in ref.classes] == [1, 4 + 2]


def test_a_nodes_commit_aborts_a_failed_transfer_and_publishes_the_rest():
    from mooncake_rs.pool.holds import ConnHolds
    from mooncake_rs.pool.node import StoreNode
    from mooncake_rs.pool.protocol import Commit, Lookup, Reserve

    with StoreNode(name="c", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=None, plaintext=True,
                   chunk_bytes=64 << 10, transports=("tcp",)) as node:
        conn = ConnHolds(node.te, 0, node._free)
        rep = node._handle(Reserve(1, ["ok1", "failed", "ok2"], [150_000] * 3, False, "cli"), conn)
        assert rep.statuses == [0, 0, 0] and all(rep.put_ids)
        ans = node._handle(Commit(2, [*rep.put_ids, 999_999], [True, False, True, True]), conn)
        assert ans.values == [0, int(KeyStatus.TRANSFER_FAILED), 0, int(KeyStatus.INVALID)]
        assert node.segment.exists("ok1") and node.segment.exists("ok2") and not node.segment.exists("failed")
        assert not conn.reservations, "every reservation of the Commit was taken"
        large = node.segment.classes[1].store
        assert large.stats().blocks_dram == 2 * 3, "the failed put's slots hold nothing"
        leased = node._handle(Lookup(3, ["ok1", "failed"], 4096, True, "cli"), conn)
        assert leased.statuses == [0, int(KeyStatus.MISSING)]
        # a second Commit of the same reservations finds nothing to commit
        again = node._handle(Commit(4, rep.put_ids, [True] * 3), conn)
        assert again.values == [int(KeyStatus.INVALID)] * 3
        conn.close()


def test_reserved_objects_commit_many_is_commit_of_each():
    from mooncake_rs._core import HeldKeys, ReservedObject

    s, ref = Store(BB, 64 * BB), Store(BB, 64 * BB)
    counts, pins = [1, 3, 2], [False, True, False]
    oids = [new_oid() for _ in counts]
    got, refs = s.reserve_objects(oids, counts), ref.reserve_objects(oids, counts)
    assert ReservedObject.commit_many(got, pins) == [o.commit(p) for o, p in zip(refs, pins)] == [True] * 3
    for oid, n in zip(oids, counts):
        for j in range(n):
            assert (chunk_key(oid, j) in s) and (chunk_key(oid, j) in ref)
    assert s.stats().pinned == ref.stats().pinned == 3
    # one closed object refuses the whole batch before anything is published
    fresh = s.reserve_objects([new_oid()], [2])[0]
    with pytest.raises(InvalidArgument, match="already committed or aborted"):
        ReservedObject.commit_many([fresh, got[0]], [False, False])
    assert fresh.commit()
    with pytest.raises(InvalidArgument, match="one pin per object"):
        ReservedObject.commit_many(got, [False])
    # HeldKeys.add_many: add of each, all or nothing on a key that is no str
    held = HeldKeys()
    assert held.add_many(["a", "b", "a"]) == 2 and len(held) == 2
    with pytest.raises(TypeError):
        held.add_many(["c", 7])  # type: ignore[list-item]
    assert "c" not in held and held.add_many([]) == 0
