"""Multi-source prefix fetch (serving/multisource.py) through real transfer engines and
stores: a run pulled from two or three holders at once is byte-for-byte what one holder
gives, for any split; a holder that fails mid-fetch is read around (fallback) or the
whole run is dropped (no block of it committed, no slot left reserved)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mooncake_rs import TransferRegistry
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.serving.arena import StoreSlots
from mooncake_rs.serving.multisource import FetchSource, Holder, MultiFetch, share_ranges, split_blocks
from mooncake_rs.serving.transport import Transport

BB = 4096  # block bytes
N = 24  # blocks in the run


class Node:
    """One instance's store and transport, in-process."""

    def __init__(self, name: str, reg: TransferRegistry, slots: int = 64, link: float | None = None) -> None:
        self.name = name
        self.store = StoreSlots(BB, BB * slots, shared_memory=False, scope=0)
        self.t = Transport(name, self.store.store, reg, link, peers_write=False)

    def fill(self, blocks: dict[int, bytes], order: list[int]) -> None:
        for k in order:  # a different order per holder: the same block sits at other offsets
            assert self.store.store.put(k, np.frombuffer(blocks[k], dtype=np.uint8))

    def source(self, hid: int, keys: list[int]) -> FetchSource:
        offs = [self.store.store.slot_offset(k) for k in keys]
        assert None not in offs
        return FetchSource(hid, self.t.endpoint, offs)

    def content(self, k: int) -> bytes | None:
        b = self.store.lookup(k)
        if b is None:
            return None
        try:
            return bytes(np.asarray(b))
        finally:
            b.release()

    def close(self) -> None:
        self.t.close()


@pytest.fixture()
def cluster():
    rng = random.Random(16)
    reg = TransferRegistry()
    keys = [rng.getrandbits(128) for _ in range(N)]
    blocks = {k: rng.randbytes(BB) for k in keys}
    holders = [Node(f"h{i}", reg) for i in range(3)]
    for i, h in enumerate(holders):
        order = keys[:]
        random.Random(i).shuffle(order)
        h.fill(blocks, order)
    made: list[Node] = []

    def reader(name: str) -> Node:
        n = Node(name, reg)
        made.append(n)
        return n

    yield keys, blocks, holders, reader
    for n in holders + made:
        n.close()


def test_split_follows_free_bandwidth() -> None:
    assert split_blocks(10, [Holder(0), Holder(1)]) == [5, 5]
    assert split_blocks(11, [Holder(0), Holder(1)]) == [6, 5]  # ties to the earlier holder
    # one flow already on holder 1's link: it has half the free bandwidth of holder 0
    assert split_blocks(9, [Holder(0, 1e9), Holder(1, 1e9, flows=1)]) == [6, 3]
    assert split_blocks(8, [Holder(0, 3e9), Holder(1, 1e9)]) == [6, 2]
    assert split_blocks(0, [Holder(0), Holder(1)]) == [0, 0]
    assert split_blocks(2, [Holder(0, 1.0), Holder(1, 1e-9)]) == [2, 0]
    assert split_blocks(4, [Holder(0, 0.0), Holder(1, 0.0)]) == [2, 2]  # nothing free: even
    for n in range(40):
        for hs in ([Holder(0, 1.0, 3), Holder(1, 2.0), Holder(2, 5.0, 1)], [Holder(0)]):
            c = split_blocks(n, hs)
            assert sum(c) == n and min(c) >= 0
    assert [list(r) for r in share_ranges([2, 0, 3])] == [[0, 1], [], [2, 3, 4]]
    with pytest.raises(InvalidArgument, match="at least one holder"):
        split_blocks(3, [])
    with pytest.raises(InvalidArgument, match="finite"):
        split_blocks(3, [Holder(0, float("nan"))])


@pytest.mark.parametrize("counts", [[N, 0], [0, N], [N // 2, N - N // 2], [1, N - 1], [N - 1, 1], [7, 17]])
def test_two_sources_equal_one_source_byte_for_byte(cluster, counts) -> None:
    keys, blocks, (a, b, _), reader = cluster
    one, two = reader("single"), reader("dual")
    r1 = MultiFetch(one.t, one.store, keys, [a.source(0, keys)]).run()
    r2 = MultiFetch(two.t, two.store, keys, [a.source(0, keys), b.source(1, keys)], counts).run()
    assert r1.error is None and r2.error is None
    assert r1.fetched == r2.fetched == N and r2.bytes == r1.bytes == N * BB
    assert r2.per_holder == {h: c for h, c in zip((0, 1), counts) if c}
    for blk in r1.blocks + r2.blocks:
        blk.release()
    for k in keys:
        got1, got2 = one.content(k), two.content(k)
        assert got1 == got2 == blocks[k]
    one.store.store.check_integrity()
    two.store.store.check_integrity()


def test_three_sources_random_splits(cluster) -> None:
    keys, blocks, holders, reader = cluster
    rng = random.Random(3)
    for trial in range(6):
        cuts = sorted(rng.randint(0, N) for _ in range(2))
        counts = [cuts[0], cuts[1] - cuts[0], N - cuts[1]]
        r = reader(f"r{trial}")
        res = MultiFetch(r.t, r.store, keys, [h.source(i, keys) for i, h in enumerate(holders)], counts).run()
        assert res.error is None and res.fetched == N
        for blk in res.blocks:
            blk.release()
        assert all(r.content(k) == blocks[k] for k in keys)


def test_blocks_held_already_are_kept_not_copied(cluster) -> None:
    keys, blocks, (a, b, _), reader = cluster
    r = reader("partial")
    r.fill(blocks, keys[:5])
    res = MultiFetch(r.t, r.store, keys, [a.source(0, keys), b.source(1, keys)]).run()
    assert res.error is None and len(res.blocks) == N and res.fetched == N - 5
    assert res.bytes == (N - 5) * BB
    for blk in res.blocks:
        blk.release()
    assert all(r.content(k) == blocks[k] for k in keys)


def _unregister(node: Node) -> None:
    """The holder's arena goes away (as when its instance dies): reads from it fail."""
    assert node.t.te.unregister(node.t.region)


def test_a_failed_holder_is_read_around(cluster) -> None:
    keys, blocks, (a, b, _), reader = cluster
    r = reader("fallback")
    srcs = [a.source(0, keys), b.source(1, keys)]
    _unregister(b)
    res = MultiFetch(r.t, r.store, keys, srcs, [N // 2, N - N // 2]).run()
    assert res.error is None, res.error
    assert res.refetched == N - N // 2 and res.per_holder == {0: N}
    for blk in res.blocks:
        blk.release()
    assert all(r.content(k) == blocks[k] for k in keys)
    r.store.store.check_integrity()


@pytest.mark.parametrize("fail", ["second", "both"])
def test_a_run_that_cannot_complete_commits_nothing(cluster, fail) -> None:
    keys, blocks, (a, b, _), reader = cluster
    r = reader("nofallback")
    r.fill(blocks, keys[:2])  # held blocks are released, not lost
    srcs = [a.source(0, keys), b.source(1, keys)]
    _unregister(b)
    if fail == "both":
        _unregister(a)
    res = MultiFetch(r.t, r.store, keys, srcs, [N // 2, N - N // 2], fallback=fail == "both").run()
    assert res.error is not None and "holder" in res.error
    assert res.blocks == [] and res.fetched == 0
    # none of the run's blocks was committed (also not the share that came in), none is
    # left reserved: every other slot can be taken again
    assert [k for k in keys[2:] if r.store.store.contains(k)] == []
    st = r.store.store.stats()
    assert st.blocks_dram == 2
    held = [r.store.reserve(k) for k in keys[2:]]
    for wb in held:
        wb.abort()
    r.store.store.check_integrity()
    # the fetch can be made again once the holder is back (here: from the one that works)
    if fail == "second":
        res = MultiFetch(r.t, r.store, keys, [a.source(0, keys)]).run()
        assert res.error is None
        for blk in res.blocks:
            blk.release()
        assert all(r.content(k) == blocks[k] for k in keys)


def test_abort_mid_fetch_frees_everything(cluster) -> None:
    keys, _, (a, b, _), reader = cluster
    r = reader("abort")
    f = MultiFetch(r.t, r.store, keys, [a.source(0, keys), b.source(1, keys)])
    f.start()
    f.abort()
    assert [k for k in keys if r.store.store.contains(k)] == []
    r.store.store.check_integrity()
    with pytest.raises(InvalidArgument, match="finish"):
        MultiFetch(r.t, r.store, keys, [a.source(0, keys)]).finish()


def test_bad_splits_are_refused(cluster) -> None:
    keys, _, (a, b, _), reader = cluster
    r = reader("bad")
    with pytest.raises(InvalidArgument, match="does not cover"):
        MultiFetch(r.t, r.store, keys, [a.source(0, keys), b.source(1, keys)], [1, 1])
    with pytest.raises(InvalidArgument, match="offsets"):
        MultiFetch(r.t, r.store, keys, [FetchSource(0, a.t.endpoint, [0])])
    with pytest.raises(InvalidArgument, match="at least one source"):
        MultiFetch(r.t, r.store, keys, [])
