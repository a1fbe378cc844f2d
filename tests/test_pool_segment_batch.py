"""The one-call batch path of a segment (segment_batch.py: Store.put_objects_from /
get_objects_into) against the per-object reference path (ObjectSegment.put_from /
get_into) on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import KeyStatus, ObjectSegment
from mooncake_rs.pool.segment_batch import get_batch, put_batch

MiB = 1 << 20
CHUNK = 64 << 10
SIZES = [0, 1, 128, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 333, MiB]


def values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]


def seg(dram: int = 32 * MiB) -> ObjectSegment:
    return ObjectSegment(dram, chunk_bytes=CHUNK)


def one_piece(vals: list[np.ndarray]) -> tuple[list[list[int]], list[list[int]]]:
    # a 0-byte value still needs a valid address
    return [[v.ctypes.data if v.nbytes else np.empty(1, np.uint8).ctypes.data] for v in vals], [[v.nbytes] for v in vals]


def test_batch_put_then_reference_get_and_reference_put_then_batch_get():
    vals = values(1)
    keys = [f"k{i}" for i in range(len(vals))]
    ptrs, sizes = one_piece(vals)
    fast, ref = seg(), seg()
    assert put_batch(fast, keys, ptrs, sizes, False) == [ref.put_from(k, p, s) for k, p, s in zip(keys, ptrs, sizes)]
    for s_ in (fast, ref):
        for k, v in zip(keys, vals):
            out = np.full(v.nbytes + 8, 7, np.uint8)
            assert s_.get_into(k, [out.ctypes.data], [out.nbytes]) == v.nbytes
            assert (out[:v.nbytes] == v).all() and (out[v.nbytes:] == 7).all()
    # batch get on both, into fresh buffers; a missing key and a too-small buffer
    for s_ in (fast, ref):
        outs = [np.zeros(v.nbytes + 1, np.uint8) for v in vals]
        got = get_batch(s_, keys + ["absent", "k9"], [[o.ctypes.data] for o in outs] + [[outs[0].ctypes.data]] * 2,
                        [[o.nbytes] for o in outs] + [[1], [10]])
        assert got == [v.nbytes for v in vals] + [KeyStatus.MISSING, KeyStatus.INVALID]
        for o, v in zip(outs, vals):
            assert (o[:v.nbytes] == v).all()
    fast.check_integrity()


def test_duplicates_pieces_and_existing_keys_follow_put_if_absent():
    vals = values(2)
    s = seg()
    first = np.arange(200, dtype=np.uint8)
    assert s.put_from("k3", [first.ctypes.data], [first.nbytes]) == KeyStatus.OK
    big = vals[-2]
    half = big.nbytes // 2
    keys = ["k3", "dup", "dup", "pieces"]
    ptrs = [[vals[3].ctypes.data], [vals[5].ctypes.data], [vals[6].ctypes.data],
            [big.ctypes.data, big.ctypes.data + half]]
    sizes = [[vals[3].nbytes], [vals[5].nbytes], [vals[6].nbytes], [half, big.nbytes - half]]
    assert put_batch(s, keys, ptrs, sizes, False) == [KeyStatus.OK] * 4
    out = np.zeros(big.nbytes, np.uint8)
    assert get_batch(s, ["k3"], [[out.ctypes.data]], [[out.nbytes]]) == [200]
    assert (out[:200] == first).all(), "the first put of a key wins"
    assert get_batch(s, ["dup"], [[out.ctypes.data]], [[out.nbytes]]) == [vals[5].nbytes]
    assert (out[:vals[5].nbytes] == vals[5]).all(), "the first of two puts in one batch wins"
    pieces_out = [np.zeros(half, np.uint8), np.zeros(big.nbytes - half, np.uint8)]
    assert get_batch(s, ["pieces"], [[o.ctypes.data for o in pieces_out]], [[o.nbytes for o in pieces_out]]) == [
        big.nbytes]
    assert (np.concatenate(pieces_out) == big).all()
    s.check_integrity()


def test_a_batch_larger_than_the_segment_falls_back_and_never_serves_wrong_bytes():
    s = seg(4 * MiB)
    rng = np.random.default_rng(3)
    vals = [rng.integers(0, 256, 512 << 10, dtype=np.uint8) for _ in range(16)]  # 8 MiB into ~3.75 MiB
    keys = [f"b{i}" for i in range(16)]
    st = put_batch(s, keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals], False)
    assert all(x in (KeyStatus.OK, KeyStatus.NO_SPACE) for x in st)
    outs = [np.zeros_like(v) for v in vals]
    got = get_batch(s, keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs])
    served = [i for i, g in enumerate(got) if g >= 0]
    assert served, "the newest objects stay"
    for i, g in enumerate(got):
        if g >= 0:
            assert g == vals[i].nbytes and (outs[i] == vals[i]).all()
        else:
            assert g == KeyStatus.MISSING
    s.check_integrity()


def test_pinned_batches_stay_and_a_full_pinned_segment_answers_no_space():
    s = seg(4 * MiB)
    rng = np.random.default_rng(4)
    vals = [rng.integers(0, 256, 256 << 10, dtype=np.uint8) for _ in range(20)]
    keys = [f"p{i}" for i in range(20)]
    st = put_batch(s, keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals], True)
    assert KeyStatus.NO_SPACE in st and st[0] == KeyStatus.OK
    outs = [np.zeros_like(v) for v in vals]
    got = get_batch(s, keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs])
    for i, x in enumerate(st):
        if x == KeyStatus.OK:
            assert got[i] == vals[i].nbytes and (outs[i] == vals[i]).all(), "a pinned object is never evicted"
    s.check_integrity()


@pytest.mark.parametrize("durable", [False, True])
def test_batches_through_the_embedded_client(tmp_path, durable):
    from mooncake_rs.pool import DistributedStore

    kw = {"ssd_path": str(tmp_path), "ssd_bytes": 64 * MiB} if durable else {}
    vals = values(5)
    with DistributedStore.embedded(16 * MiB, chunk_bytes=CHUNK, **kw) as s:
        keys = [f"e{i}" for i in range(1, len(vals))]
        ptrs, sizes = one_piece(vals[1:])
        assert s.batch_put_from(keys, ptrs, sizes) == [KeyStatus.OK] * len(keys)
        outs = [np.zeros(v.nbytes, np.uint8) for v in vals[1:]]
        assert s.batch_get_into(keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs]) == [
            v.nbytes for v in vals[1:]]
        for o, v in zip(outs, vals[1:]):
            assert (o == v).all()


def test_objects_are_stored_under_each_objects_own_chunk_keys_and_ranges():
    """``Store.put_objects_from`` (the batch path's Rust chunking) against ``chunk_keys``'
    arrays (the per-object path's keys): every chunk of every object is found under its
    key, holding that chunk's bytes, zero-filled past the object's end; and
    ``get_objects_into`` gives the objects back, a missing one reported as such."""
    import random

    from mooncake_rs import Store
    from mooncake_rs.pool.chunks import chunk_keys, new_oid

    rng = random.Random(3)
    cb = 4096
    for _ in range(40):
        store = Store(block_bytes=cb, dram_bytes=512 * cb)
        sizes = [rng.choice([0, 1, cb - 1, cb, cb + 1, 7 * cb, 64 * cb - 5]) for _ in range(rng.randrange(1, 8))]
        vals = [np.frombuffer(rng.randbytes(n), np.uint8) if n else np.zeros(1, np.uint8) for n in sizes]
        oids = [new_oid() for _ in sizes]
        assert store.put_objects_from(oids, [v.ctypes.data for v in vals], sizes) == [True] * len(sizes)
        for oid, v, n in zip(oids, vals, sizes):
            nchunks = max(1, -(-n // cb))
            for j, (lo, hi) in enumerate(chunk_keys(oid, nchunks).tolist()):
                block = store.get(int(hi) << 64 | int(lo))
                assert block is not None
                want = np.zeros(cb, np.uint8)
                piece = v[j * cb:min(n, (j + 1) * cb)] if n else v[:0]
                want[:piece.size] = piece
                assert (np.asarray(block) == want).all()
        outs = [np.full(max(n, 1), 9, np.uint8) for n in sizes] + [np.full(5, 9, np.uint8)]
        found = store.get_objects_into(oids + [new_oid()], [o.ctypes.data for o in outs], sizes + [5])
        assert found == [True] * len(sizes) + [False]
        for o, v, n in zip(outs, vals, sizes):
            assert (o[:n] == v[:n]).all()
        assert (outs[-1] == 9).all()
        with pytest.raises(InvalidArgument):
            store.put_objects_from([oids[0] | 1], [vals[0].ctypes.data], [2 * cb])
