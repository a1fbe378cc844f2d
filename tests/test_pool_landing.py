"""A remote put over TCP without its Commit round trip: the store node publishes each
object when its last byte lands, before the transfer engine answers that write
(``Reserve.commit_on_landing``, node.py ``_landed``, the core's landing_table.rs).

What must hold: a put that returned OK is visible to every other client at once, byte
for byte; no Commit is sent for it; an object that landed but could not be published
fails its put with the reason; a reservation that ends before its bytes land is no
longer waited for; a client that does not ask (or writes through shared memory) commits
as before.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

import mooncake_rs as mc
from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, assert_stored, value_of

from mooncake_rs._core import LandingWatch
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.metrics import segment_metrics
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import INLINE_MAX, Commit, Reserve, Reserved

pytestmark = [pytest.mark.timeout(120)]

CHUNK = 64 << 10
PREFIX = "/mooncake/landing"


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="a", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix=PREFIX, chunk_bytes=CHUNK) as n:
        yield n


def connect(etcd_url: str, **kw) -> DistributedStore:
    return DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX, **kw)


def count_commits(node: StoreNode) -> list[Commit]:
    """The Commits the node handles from now on (its handler table is looked up per request)."""
    seen: list[Commit] = []
    handlers = dict(StoreNode._handlers)

    def commit(self: StoreNode, msg: Commit, conn: object) -> object:
        seen.append(msg)
        return StoreNode._commit(self, msg, conn)

    handlers[Commit] = commit
    node._handlers = handlers  # type: ignore[misc]
    return seen


# sizes around the slot: one byte (sent inline), a slot less one, one slot, a slot and one, many
SIZES = [1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 12_345]


def put_all(s: DistributedStore, tag: str) -> tuple[list[str], list[np.ndarray]]:
    keys = [f"{tag}-{n}" for n in SIZES]
    values = [value_of(k, n) for k, n in zip(keys, SIZES)]
    st = s.batch_put_from(keys, [[v.ctypes.data] for v in values], [[v.nbytes] for v in values])
    assert st == [KeyStatus.OK] * len(keys)
    return keys, values


@pytest.mark.parametrize("route", ["client tcp-only", "node tcp-only"])
def test_a_put_over_tcp_is_published_when_its_last_byte_lands(etcd_url, route):
    # a client that only speaks TCP, or a same-host client of a node that offers no shared
    # memory (its peer is "shm", every region's route "tcp"): the node sees the writes land
    client_tcp = route == "client tcp-only"
    with StoreNode(name="a", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix=PREFIX, chunk_bytes=CHUNK, transports=("tcp", "shm") if client_tcp else ("tcp",)) as node, \
            connect(etcd_url, transports=("tcp",) if client_tcp else ("tcp", "shm"), tcp_connections=2) as writer, \
            connect(etcd_url) as reader:
        link = writer.backend.nodes.link("a")
        # a peer reached over TCP alone lands from the first put; a same-host (shm) peer's
        # first put finds out how its writes travel (and commits); the next ones land
        assert link.peer.transport == ("tcp" if client_tcp else "shm") and link.writes_land == client_tcp
        commits = count_commits(node)
        put_all(writer, "first")
        assert len(commits) == (0 if client_tcp else 1) and link.writes_land
        assert {link.peer.route(r) for r in node.regions} <= {"tcp", "unknown"}
        commits.clear()
        keys, values = put_all(writer, "tcp")
        # visible to another client the moment the put returned, and byte for byte
        assert_stored(reader, keys, values)
        # a key stored already costs nothing, and a second put of it is OK
        assert writer.batch_put_from(keys[:1], [[values[0].ctypes.data]], [[values[0].nbytes]]) == [KeyStatus.OK]
        assert commits == [], "nothing left to commit: every object was published as it landed"
        assert node.landing.pending == 0
        landed_puts = 2 if client_tcp else 1
        assert segment_metrics(node.segment).puts_landed == landed_puts * sum(n > INLINE_MAX for n in SIZES)


def test_a_client_on_shared_memory_still_commits(etcd_url, node):
    commits = count_commits(node)
    with connect(etcd_url) as s:
        link = s.backend.nodes.link("a")
        assert link.peer.transport == "shm"
        for tag in ("shm-1", "shm-2"):
            keys, values = put_all(s, tag)
            assert [s.get(k) for k in keys] == [v.tobytes() for v in values]
        assert {link.peer.route(r) for r in node.regions} <= {"shm", "unknown"} and not link.writes_land
    assert len(commits) == 2 and all(len(c.put_ids) == sum(n > INLINE_MAX for n in SIZES) for c in commits)
    assert node.landing.pending == 0


def test_a_landed_object_that_cannot_be_published_fails_its_put(etcd_url, node):
    seg = node.segment
    real = seg.commit_many

    def all_but_doomed(reservations, reap=True):  # "doomed" as if a chunk of it was evicted before its pin
        out = [KeyStatus.NO_SPACE] * len(reservations)
        kept = [j for j, res in enumerate(reservations) if res.key != "doomed"]
        for j, st in zip(kept, real([reservations[j] for j in kept], reap=reap)):
            out[j] = st
        for res in reservations:
            if res.key == "doomed":
                seg.abort(res)
        return out

    with connect(etcd_url, transports=("tcp",)) as s:
        put_all(s, "warm-up")  # (the first put to a node commits: its routes are not known yet)
        commits = count_commits(node)
        keys = ["before", "doomed", "after"]
        values = [value_of(k, 3 * CHUNK + 7) for k in keys]
        seg.commit_many = all_but_doomed  # type: ignore[method-assign]
        try:
            st = s.batch_put_from(keys, [[v.ctypes.data] for v in values], [[v.nbytes] for v in values])
        finally:
            seg.commit_many = real  # type: ignore[method-assign]
        assert st == [KeyStatus.OK, KeyStatus.NO_SPACE, KeyStatus.OK]
        assert s.batch_exists(keys) == [True, False, True]
        assert s.get("after") == values[2].tobytes()
        # one write of the group failed, so the client committed: every object got its outcome
        assert len(commits) == 1 and sorted(commits[0].ok) == [False, True, True]
        with node._conns_lock:
            assert all(not c._outcomes for c in node._conns)
        # the slots went back: the key can be put again
        assert s.batch_put_from(["doomed"], [[values[1].ctypes.data]], [[values[1].nbytes]]) == [KeyStatus.OK]
        assert s.get("doomed") == values[1].tobytes()


def test_a_reservation_that_ends_unlanded_is_not_waited_for(etcd_url, node):
    with connect(etcd_url, transports=("tcp",)) as s:
        link = s.backend.nodes.link("a")
        rep: Reserved = link.call(Reserve, keys=["r1", "r2", "empty"], sizes=[2 * CHUNK, 100, 0],
                                  engine=s.backend.name, commit_on_landing=True)
        assert rep.commit_on_landing and rep.statuses == [0, 0, 0]
        assert node.landing.pending == 2  # (nothing of an empty object lands)
        # the client gives one back (its transfer failed): the group can no longer complete
        link.call(Commit, put_ids=[rep.put_ids[0]], ok=[False])
        assert node.landing.pending == 0
        rep = link.call(Reserve, keys=["r3"], sizes=[CHUNK], engine=s.backend.name, commit_on_landing=True)
        assert node.landing.pending == 1
    # the connection closed with reservations open: they ended, and so did the wait
    deadline = time.monotonic() + 10
    while node.landing.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.landing.pending == 0
    assert not any(node.segment.exists(k) for k in ("r1", "r2", "r3", "empty"))


def test_a_reserve_without_the_flag_is_the_old_exchange(etcd_url, node):
    # left off the wire when not asked, so older nodes decode it as before
    wire = msgspec.msgpack.encode(Reserve(1, ["k"], [10]))
    assert b"commit_on_landing" not in wire
    assert b"commit_on_landing" in msgspec.msgpack.encode(Reserve(1, ["k"], [10], commit_on_landing=True))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Reserved(1, [], [], [], [], [])),
                                  type=Reserved).commit_on_landing is False
    with connect(etcd_url, transports=("tcp",)) as s:
        link = s.backend.nodes.link("a")
        rep: Reserved = link.call(Reserve, keys=["old"], sizes=[CHUNK], engine=s.backend.name)
        assert not rep.commit_on_landing and node.landing.pending == 0


def test_landing_watch_arguments():
    with pytest.raises(InvalidArgument, match="callable"):
        LandingWatch(42)  # type: ignore[arg-type]
    w = LandingWatch(lambda pids, token: 0)
    with pytest.raises(InvalidArgument, match="not watched"):
        w.expect([1], [1], [[0]], [10], None)
    with mc.TransferEngine("landing-args", listen="127.0.0.1:0", transports=["tcp"]) as te:
        region = te.allocate(4 * 4096)
        te.watch_writes(region, w, 4096)
        with pytest.raises(InvalidArgument, match="watched already"):
            te.watch_writes(region, LandingWatch(lambda pids, token: 0), 4096)
        with pytest.raises(InvalidArgument, match="differ in length"):
            w.expect([1, 2], [region.id], [[0]], [10], None)
        with pytest.raises(InvalidArgument, match="slots"):
            w.expect([1], [region.id], [[0]], [5000], None)  # two slots' bytes, one offset
        with pytest.raises(InvalidArgument, match="multiple"):
            w.expect([1], [region.id], [[100]], [10], None)
        with pytest.raises(InvalidArgument, match="empty"):
            w.expect([1], [region.id], [[]], [0], None)
        with pytest.raises(InvalidArgument, match="held twice"):
            w.expect([1, 2], [region.id] * 2, [[0], [0]], [10, 10], None)
        assert w.pending == 0
        w.expect([1, 2], [region.id] * 2, [[4096], [8192]], [10, 10], None)
        assert w.pending == 2 and w.forget(2) and not w.forget(1) and w.pending == 0


@pytest.mark.parametrize("answer", ["ok", "refuse", "raise"])
def test_the_callback_decides_the_writes_answer(answer, monkeypatch):
    calls = []

    def landed(pids: list[int], token: object) -> int:
        calls.append((pids, token))
        if answer == "raise":
            raise RuntimeError("publishing failed")
        return 0 if answer == "ok" else 3

    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: unraisable.append(u.exc_value))
    w = LandingWatch(landed)
    with mc.TransferEngine("landing-srv", listen="127.0.0.1:0", transports=["tcp"]) as srv, \
            mc.TransferEngine("landing-cli", listen="127.0.0.1:0", transports=["tcp"]) as cli:
        region = srv.allocate(4 * 4096)
        srv.watch_writes(region, w, 4096)
        # a group: object 9 (a slot and 100 bytes), object 4 (10 bytes)
        w.expect([9, 4], [region.id, region.id], [[8192, 0], [12288]], [4096 + 100, 10], "token")
        peer = cli.connect("landing-srv", srv.address)
        src = cli.allocate(8192)
        np.frombuffer(src, np.uint8)[:] = 7

        def write(local_offset: int, offset: int, length: int):
            req = mc.TransferRequest("write", src, local_offset, peer, region, offset, length)
            return cli.submit([req], timeout_s=10).wait()[0]

        assert write(0, 8192, 4096).ok
        assert write(0, 12288, 10).ok and calls == []
        st = write(4096, 0, 100)  # the group's last byte
        assert calls == [([9, 4], "token")]
        if answer == "ok":
            assert st.ok
        else:
            assert not st.ok and st.code == "refused_by_owner", st
        assert (answer == "raise") == bool(unraisable)
        assert w.pending == 0
        assert bytes(memoryview(region)[8192:8192 + 4096]) == b"\x07" * 4096


def test_a_watch_and_its_owner_are_collected():
    import gc
    import weakref

    class Owner:
        def __init__(self) -> None:
            self.watch = LandingWatch(self.landed)

        def landed(self, pids: list[int], token: object) -> int:
            return 0

    ref = weakref.ref(Owner())
    gc.collect()
    assert ref() is None, "the watch's callback kept its owner alive"
