"""The embedded pool (one ObjectSegment, no network): values of any size byte for byte,
put-if-absent, pins and NO_SPACE, eviction drops whole objects (never partial or wrong
bytes), a read's lease outlives a removal, the SSD tier, typed errors, metrics."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mooncake_rs.errors import BlockNotFound, InvalidArgument, StoreFull
from mooncake_rs.pool import DistributedStore, KeyStatus, ObjectSegment

MiB = 1 << 20


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", [1, 100, 4096, 4097, 65536, 256 << 10, (256 << 10) + 1, 3 * MiB + 17])
def test_values_of_any_size_round_trip(size):
    with DistributedStore.embedded(32 * MiB) as s:
        v = rand(size, size)
        s.put("k", v)
        assert s.size("k") == size and s.get("k") == v.tobytes()
        out = np.zeros(size + 10, np.uint8)
        assert s.get_into("k", out.ctypes.data, out.nbytes) == size
        assert (out[:size] == v).all() and not out[size:].any()


def test_multi_piece_put_and_get_match_a_reference():
    with DistributedStore.embedded(32 * MiB) as s:
        src = rand(1 << 20, 1)
        cuts = [0, 1000, 70000, 300000, 1 << 20]
        ptrs = [src.ctypes.data + a for a in cuts[:-1]]
        sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        assert s.batch_put_from(["m"], [ptrs], [sizes]) == [KeyStatus.OK]
        dst = np.zeros(2 << 20, np.uint8)
        dptrs = [dst.ctypes.data + 2 * a for a in cuts[:-1]]
        assert s.batch_get_into(["m"], [dptrs], [sizes]) == [1 << 20]
        got = np.concatenate([dst[2 * a: 2 * a + n] for a, n in zip(cuts, sizes)])
        assert (got == src).all()


def test_put_if_absent_even_when_racing():
    with DistributedStore.embedded(64 * MiB) as s:
        vals = [np.full(MiB, i, np.uint8) for i in range(8)]
        barrier = threading.Barrier(8)

        def put(i: int) -> None:
            barrier.wait()
            s.put("race", vals[i])

        ts = [threading.Thread(target=put, args=(i,)) for i in range(8)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        got = np.frombuffer(s.get("race"), np.uint8)
        assert (got == got[0]).all() and got[0] in range(8)
        m = s.metrics()
        assert m.puts == 1 and m.puts_existing == 7 and m.keys == 1
        s.backend.segment.check_integrity()


def test_eviction_drops_whole_objects_never_wrong_bytes():
    with DistributedStore.embedded(8 * MiB, chunk_bytes=64 << 10) as s:
        vals = {f"k{i}": rand(MiB + 1000, i) for i in range(30)}  # ~4x capacity
        for k, v in vals.items():
            s.put(k, v)
        present = [k for k in vals if s.exists(k)]
        assert 0 < len(present) < len(vals)
        for k, v in vals.items():
            out = np.zeros(v.size, np.uint8)
            got = s.batch_get_into([k], [[out.ctypes.data]], [[v.size]])[0]
            assert got in (v.size, KeyStatus.MISSING)
            if got == v.size:
                assert (out == v).all()
        m = s.metrics()
        assert m.objects_evicted > 0 and m.evictions_dram > 0
        assert m.keys == len([k for k in vals if s.exists(k)])


def test_pinned_objects_fill_the_pool_then_no_space_until_removed():
    with DistributedStore.embedded(16 * MiB, chunk_bytes=64 << 10) as s:
        v = rand(MiB, 3)
        n = 0
        while n < 64:
            st = s.batch_put_from([f"p{n}"], [[v.ctypes.data]], [[v.nbytes]], pin=True)[0]
            if st == KeyStatus.NO_SPACE:
                break
            n += 1
        assert 10 <= n < 16
        with pytest.raises(StoreFull):
            s.put("extra", v)
        assert all(s.exists(f"p{i}") for i in range(n))
        assert s.remove("p0") and s.remove("p1")
        s.put("extra", v)
        assert s.get("extra") == v.tobytes()
        s.backend.segment.check_integrity()


def test_a_value_larger_than_the_pool_is_refused_without_evicting():
    with DistributedStore.embedded(8 * MiB) as s:
        s.put("keep", b"x" * 1000)
        with pytest.raises(StoreFull):
            s.put("huge", np.zeros(9 * MiB, np.uint8))
        assert s.get("keep") == b"x" * 1000


def test_a_lease_keeps_bytes_of_a_removed_object():
    seg = ObjectSegment(8 * MiB, chunk_bytes=64 << 10)
    v = rand(300000, 5)
    assert seg.put_from("k", [v.ctypes.data], [v.nbytes]) == KeyStatus.OK
    lease = seg.lease("k")
    assert seg.remove("k")
    for i in range(200):  # churn: the removed slots would be reused if they were freed
        w = rand(64 << 10, 100 + i)
        seg.put_from(f"c{i}", [w.ctypes.data], [w.nbytes])
    blocks = [lease.run.block(i) for i in range(lease.meta.nchunks)]
    got = np.concatenate([np.asarray(b) for b in blocks])[: v.nbytes]
    assert (got == v).all()
    lease.release()


def test_ssd_tier_serves_objects_demoted_from_dram(tmp_path):
    with DistributedStore.embedded(4 * MiB, ssd_path=str(tmp_path), ssd_bytes=64 * MiB, chunk_bytes=64 << 10) as s:
        vals = {f"k{i}": rand(MiB, 50 + i) for i in range(12)}  # 3x DRAM
        for k, v in vals.items():
            s.put(k, v)
            s.backend.segment.classes[1].store.flush()
        readable = 0
        for k, v in vals.items():
            try:
                assert s.get(k) == v.tobytes()
                readable += 1
            except BlockNotFound:
                pass
        assert readable > 4  # more than DRAM alone holds
        assert s.metrics().hits_ssd > 0


def test_typed_errors():
    with DistributedStore.embedded(8 * MiB) as s:
        with pytest.raises(BlockNotFound):
            s.get("nope")
        with pytest.raises(InvalidArgument):
            s.put("", b"x")
        with pytest.raises(InvalidArgument):
            s.put("k", b"")
        with pytest.raises(InvalidArgument):
            s.batch_put_from(["a"], [[1], [2]], [[1]])
        with pytest.raises(InvalidArgument):
            ObjectSegment(1000)
        assert s.remove("nope") is False


def test_metrics_count_hits_misses_and_failed_reads():
    with DistributedStore.embedded(8 * MiB) as s:
        s.put("a", b"a" * 5000)
        s.get("a")
        with pytest.raises(BlockNotFound):
            s.get("b")
        m = s.metrics()
        assert (m.object_hits, m.keys, m.object_bytes) == (1, 1, 5000)
        assert "mooncake_pool_keys 1" in s.metrics_text()
