"""A remote put or get hands each node's objects to Rust in one call
(``TransferEngine.submit_objects``): bytes equal over TCP for values cut into pieces
in any way (an empty piece included), the caller's registered buffers moved in place,
and memory nobody registered registered for the batch only."""

from __future__ import annotations

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import value_of

from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.node import StoreNode

pytestmark = [pytest.mark.timeout(120)]
PREFIX = "/mooncake/objbatch"
CHUNK = 64 << 10


@pytest.fixture
def pool(etcd_url):
    with StoreNode(name="o", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token=None, plaintext=True,
                   etcd=etcd_url, prefix=PREFIX, chunk_bytes=CHUNK, transports=("tcp",)):
        with DistributedStore.connect(etcd_url, plaintext=True, prefix=PREFIX, transports=("tcp",)) as s:
            yield s


def cut(buf: np.ndarray, sizes: list[int]) -> tuple[list[int], list[int]]:
    """Pieces of ``buf`` of these sizes, back to back."""
    at, ptrs = 0, []
    for n in sizes:
        ptrs.append(buf.ctypes.data + at)
        at += n
    return ptrs, sizes


def watch_batches(s: DistributedStore) -> list[tuple[str, int, int]]:
    """Each node batch's (op, requests, temporary regions) as submitted."""
    seen: list[tuple[str, int, int]] = []
    backend = s._backend
    submit = backend._submit

    def watched(op, *a):
        b = submit(op, *a)
        seen.append((op, b.requests, b.temporary_regions))
        return b

    backend._submit = watched
    return seen


def test_values_cut_into_any_pieces_move_whole_an_empty_piece_included(pool):
    n = 3 * CHUNK + 1234
    val = value_of("cut", n)
    # an empty piece before the last: every byte after it still moves
    put_cuts = [[n], [100, 0, CHUNK, n - CHUNK - 100], [CHUNK + 5, 0, 0, n - CHUNK - 5]]
    get_cuts = [[n], [7, n - 7], [2 * CHUNK, 0, n - 2 * CHUNK], [n + 100]]  # the last one larger than the value
    for p, pc in enumerate(put_cuts):
        key = f"cut-{p}"
        ptrs, sizes = cut(val, pc)
        assert pool.batch_put_from([key], [ptrs], [sizes]) == [KeyStatus.OK]
        for gc in get_cuts:
            out = np.zeros(sum(gc), np.uint8)
            optrs, osizes = cut(out, gc)
            assert pool.batch_get_into([key], [optrs], [osizes]) == [n]
            assert (out[:n] == val).all(), (pc, gc)
            assert not out[n:].any()
    # a buffer smaller than the value: INVALID, nothing read
    small = np.zeros(n - 1, np.uint8)
    assert pool.batch_get_into(["cut-0"], [[small.ctypes.data]], [[small.nbytes]]) == [KeyStatus.INVALID]
    # a negative size: the node refuses the key, nothing moves
    assert pool.batch_put_from(["neg"], [[val.ctypes.data]], [[-1]]) == [KeyStatus.INVALID]


def test_registered_buffers_move_in_place_and_other_memory_is_registered_for_the_batch_only(pool):
    te = pool._backend.te
    seen = watch_batches(pool)
    keys = [f"r{i}" for i in range(4)]
    vals = np.stack([value_of(k, 200_000) for k in keys])
    outs = np.zeros_like(vals)
    base = te.stats().regions
    # nobody registered either buffer: one temporary region per object, gone afterwards
    assert pool.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals]) == [0] * 4
    assert pool.batch_get_into(keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs]) == [200_000] * 4
    assert (outs == vals).all()
    assert seen == [("write", 4, 4), ("read", 4, 4)]
    assert te.stats().regions == base
    # registered: no temporary region, the same bytes
    pool.register_buffer(vals.ctypes.data, vals.nbytes)
    pool.register_buffer(outs.ctypes.data, outs.nbytes)
    outs[:] = 0
    seen.clear()
    keys2 = [k + "-again" for k in keys]
    assert pool.batch_put_from(keys2, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals]) == [0] * 4
    assert pool.batch_get_into(keys2, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs]) == [200_000] * 4
    assert (outs == vals).all()
    assert seen == [("write", 4, 0), ("read", 4, 0)]
    assert te.stats().regions == base + 2
    # a piece that runs past its registered buffer's end is registered for the batch
    pool.unregister_buffer(outs.ctypes.data)
    pool.register_buffer(outs.ctypes.data, outs.nbytes - 1)
    outs[:] = 0
    seen.clear()
    assert pool.batch_get_into(keys2, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs]) == [200_000] * 4
    assert (outs == vals).all()
    assert seen == [("read", 4, 1)]
    assert te.stats().regions == base + 2
