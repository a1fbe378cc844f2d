"""A remote put without its Reserve round trip: the node holds spare slots for the
client's next put (``Reserve.spares``), the put writes into them and names their keys
with a ``Bind`` sent beside its writes (protocol.py; node.py ``_bind``; the core's
landing_table.rs ``expect_unbound`` / ``arm``).

What must hold: a put into spares that returned OK is visible to every other client at
once, byte for byte, whether its keys reached the node before or after its bytes; it
sends neither a Reserve nor a Commit; a Bind the node refuses (its spares expired) costs
the put a retry, never its data; spares held for another size, or by a closed
connection, are given back; concurrent puts of one client never share a spare.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, assert_stored, value_of

from mooncake_rs._core import LandingWatch
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.links import NodeDown
from mooncake_rs.pool.metrics import segment_metrics
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import Bind, Commit, Reserve

pytestmark = [pytest.mark.timeout(120)]

CHUNK = 64 << 10
PREFIX = "/mooncake/spares"
N = 6  # objects a put
SIZE = 3 * CHUNK + 5  # (three slots and 5 bytes of a fourth)


def node_at(etcd_url: str, **kw) -> StoreNode:
    return StoreNode(name="a", listen="127.0.0.1:0", dram_bytes=64 << 20, auth_token=TOKEN, etcd=etcd_url,
                     prefix=PREFIX, chunk_bytes=CHUNK, **kw)


def connect(etcd_url: str, tcp_only: bool = True) -> DistributedStore:
    return DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX,
                                    transports=("tcp",) if tcp_only else ("tcp", "shm"), tcp_connections=2)


def watch_requests(node: StoreNode, delay_bind_s: float = 0.0) -> list[object]:
    """The Reserves, Binds and Commits the node handles from now on, in order; a Bind
    handled ``delay_bind_s`` late (its put's bytes land first)."""
    seen: list[object] = []
    handlers = dict(StoreNode._handlers)
    for kind in (Reserve, Bind, Commit):
        real = StoreNode._handlers[kind]

        def handle(self: StoreNode, msg: object, conn: object, real=real) -> object:
            seen.append(msg)
            if isinstance(msg, Bind) and delay_bind_s:
                time.sleep(delay_bind_s)
            return real(self, msg, conn)

        handlers[kind] = handle
    node._handlers = handlers  # type: ignore[misc]
    return seen


def kinds(seen: list[object]) -> list[str]:
    """Each request's type; a Reserve of no key (the next put's spares alone) as "Spares"."""
    return ["Spares" if isinstance(m, Reserve) and not m.keys else type(m).__name__ for m in seen]


def put(s: DistributedStore, tag: str, n: int = N, size: int = SIZE) -> tuple[list[str], list[np.ndarray]]:
    keys = [f"{tag}-{i}" for i in range(n)]
    values = [value_of(k, size) for k in keys]
    st = s.batch_put_from(keys, [[v.ctypes.data] for v in values], [[v.nbytes] for v in values])
    assert st == [KeyStatus.OK] * n, st
    return keys, values


def node_spares(node: StoreNode, want: int) -> int:
    """The spare slots the node holds for its connections, once they are ``want`` (a
    put's ask for the next put's is not waited for) or 5 s passed."""
    deadline = time.monotonic() + 5
    while (n := sum(c.spare_count for c in list(node._conns))) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


@pytest.mark.parametrize("bind_late", [False, True], ids=["keys first", "bytes first"])
def test_a_put_into_spares_sends_no_reserve_and_is_visible_when_it_returns(etcd_url, bind_late):
    with node_at(etcd_url) as node, connect(etcd_url) as writer, connect(etcd_url, tcp_only=False) as reader:
        seen = watch_requests(node, delay_bind_s=0.3 if bind_late else 0.0)
        # a TCP peer's writes land from the first put; the second put of that size also
        # asks for spares, every later one writes into them and, once its bytes landed,
        # asks for the next put's
        written = [put(writer, f"p{r}") for r in range(5)]
        deadline = time.monotonic() + 5  # (the last ask is not waited for by its put)
        while len(seen) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kinds(seen) == ["Reserve", "Reserve"] + ["Bind", "Spares"] * 3
        asks = [m for m in seen if isinstance(m, Reserve) and m.spares]
        assert len(asks) == 4 and all(m.spares == N and m.spare_size == SIZE for m in asks)
        for keys, values in written:
            assert_stored(reader, keys, values)
        m = segment_metrics(node.segment)
        assert m.puts_into_spares == 3 * N and m.puts == m.puts_landed == 5 * N
        # the next put's spares are held, counted as they land, nothing else waited for
        assert node_spares(node, N) == N and node.landing.pending == N
        assert not any(c._outcomes for c in node._conns)


def test_a_put_of_a_key_stored_already_into_spares_keeps_the_first_value(etcd_url):
    with node_at(etcd_url) as node, connect(etcd_url) as writer, connect(etcd_url) as reader:
        for r in range(2):
            put(writer, f"warm{r}")
        keys, values = put(writer, "first")
        seen = watch_requests(node)
        other = [value_of(k + "-other", SIZE) for k in keys]
        st = writer.batch_put_from(keys, [[v.ctypes.data] for v in other], [[v.nbytes] for v in other])
        assert st == [KeyStatus.OK] * N  # (put-if-absent: OK, the stored value stays)
        assert "Bind" in kinds(seen) and "Reserve" not in kinds(seen)
        assert_stored(reader, keys, values)


def test_a_refused_bind_costs_a_retry_never_the_data(etcd_url):
    # a node with a lease deadline: a client silent for it loses its holds, spares included
    with node_at(etcd_url, lease_ttl_s=0.4) as node, connect(etcd_url) as writer, connect(etcd_url) as reader:
        for r in range(2):
            put(writer, f"warm{r}")
        link = writer.backend.nodes.link("a")
        assert link.spares.held(SIZE) == N
        assert node_spares(node, 0) == 0, "the spares expired with the holds"
        time.sleep(1.2)  # (past the expired holds' grace: their slots are free to be taken again)
        seen = watch_requests(node)
        keys, values = put(writer, "after")
        # the Bind is refused whole, the writes into revoked slots fail, the put reserves
        assert kinds(seen)[:2] == ["Bind", "Commit"] and "Reserve" in kinds(seen)
        assert_stored(reader, keys, values)
        keys2, values2 = put(writer, "again")
        assert_stored(reader, keys2, values2)
        assert_stored(reader, keys, values)


def test_spares_of_another_size_and_of_a_closed_connection_are_given_back(etcd_url):
    with node_at(etcd_url) as node, connect(etcd_url, tcp_only=False) as reader:
        with connect(etcd_url) as writer:
            for r in range(3):
                put(writer, f"a{r}")
            assert node_spares(node, N) == N
            # another object size: the node holds the new size's spares only
            small = CHUNK + 1
            written = [put(writer, f"b{r}", n=4, size=small) for r in range(3)]
            link = writer.backend.nodes.link("a")
            assert link.spares.size == small and link.spares.held(small) == 4
            assert node_spares(node, 4) == 4 and node.landing.pending == 4
            for keys, values in written:
                assert_stored(reader, keys, values)
        # the writer closed: its spares are aborted and no longer watched
        deadline = time.monotonic() + 5
        while node.landing.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.landing.pending == 0
        assert not [c for c in node._conns if c.reservations]


def test_a_client_whose_sizes_alternate_asks_for_no_spares(etcd_url):
    with node_at(etcd_url) as node, connect(etcd_url) as writer, connect(etcd_url) as reader:
        seen = watch_requests(node)
        written = [put(writer, f"alt{r}", size=SIZE if r % 2 else CHUNK + 1) for r in range(6)]
        assert kinds(seen) == ["Reserve"] * 6 and not any(m.spares for m in seen)
        assert node_spares(node, 0) == 0 and node.landing.pending == 0
        for keys, values in written:
            assert_stored(reader, keys, values)


def test_spares_of_all_connections_together_stay_within_an_eighth_of_the_class(etcd_url):
    many = 24  # 24 x SIZE: about 4.5 MiB, more than half of an eighth of the node's class
    with node_at(etcd_url) as node, connect(etcd_url) as a, connect(etcd_url) as b, \
            connect(etcd_url, tcp_only=False) as reader:
        sc = node.segment.classes[node.segment.class_of(SIZE)]
        assert 2 * many * SIZE > sc.capacity_chunks * sc.chunk_bytes // 8 >= many * SIZE
        for r in range(2):
            put(a, f"a{r}", n=many)
        assert node_spares(node, many) == many
        for r in range(3):  # b asks, and gets none while a holds its own
            assert_stored(reader, *put(b, f"b{r}", n=many))
        assert node_spares(node, many) == many and b.backend.nodes.link("a").spares.held(SIZE) == 0
        a.close()  # a's spares go back with its connection
        assert node_spares(node, 0) == 0
        for r in range(3, 5):
            assert_stored(reader, *put(b, f"b{r}", n=many))
        assert b.backend.nodes.link("a").spares.held(SIZE) == many


def test_concurrent_puts_of_one_client_never_share_a_spare(etcd_url):
    with node_at(etcd_url) as node, connect(etcd_url) as writer, connect(etcd_url) as reader:
        for r in range(2):
            put(writer, f"warm{r}")
        written: list[tuple[list[str], list[np.ndarray]]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def run(t: int) -> None:
            try:
                for r in range(6):
                    kv = put(writer, f"t{t}-{r}")
                    with lock:
                        written.append(kv)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert len(written) == 24
        for keys, values in written:
            assert_stored(reader, keys, values)
        assert segment_metrics(node.segment).puts_into_spares > 0


def test_a_bind_of_what_is_not_a_spare_is_refused_whole(etcd_url):
    with node_at(etcd_url) as node, connect(etcd_url) as writer:
        for r in range(2):
            put(writer, f"warm{r}")
        link = writer.backend.nodes.link("a")
        assert link.spares.held(SIZE) == N  # (reads the last put's ask for them)
        spare_ids = [e[0] for e in link.spares._held]
        for bad, why in [(dict(put_ids=[spare_ids[0], 10**9], keys=["x", "y"]), "not an unbound spare"),
                         (dict(put_ids=[spare_ids[0], spare_ids[0]], keys=["x", "y"]), "not an unbound spare"),
                         (dict(put_ids=spare_ids[:2], keys=["x"]), "one non-empty key per spare"),
                         (dict(put_ids=spare_ids[:1], keys=[""]), "one non-empty key per spare"),
                         (dict(put_ids=[], keys=[]), "one non-empty key per spare")]:
            with pytest.raises(NodeDown, match=why):
                link.submit(Bind, **bad).result()
        assert node_spares(node, N) == N, "nothing changed"
        assert not link.broken
        # a Commit of a spare that no Bind named publishes nothing: its slots go back
        assert link.submit(Commit, put_ids=spare_ids[:1], ok=[True]).result().values == [int(KeyStatus.INVALID)]
        assert node_spares(node, N - 1) == N - 1 and len(node.segment) == 2 * N


def test_landing_watch_unbound_objects_and_arm_argument_errors():
    calls: list[tuple[list[int], object]] = []
    w = LandingWatch(lambda ids, tok: calls.append((ids, tok)) or 0)
    with pytest.raises(InvalidArgument, match="differ in length"):
        w.expect_unbound([1, 2], [1], [[0]], [10])
    with pytest.raises(InvalidArgument, match="not watched"):
        w.expect_unbound([1], [5], [[0]], [10])
    with pytest.raises(InvalidArgument, match="arm"):
        w.arm([1], "t")
    assert w.pending == 0 and not calls


def test_segment_reserve_unbound_gives_keyless_slots_as_far_as_they_fit():
    from mooncake_rs.pool.segment import ObjectSegment

    seg = ObjectSegment(20 * CHUNK, chunk_bytes=CHUNK)
    cap = seg.classes[seg.class_of(SIZE)].capacity_chunks
    assert 12 < cap < 24, cap
    got = seg.reserve_unbound(3, SIZE)  # 4 slots each
    assert [r.key for r in got] == [""] * 3 and len({r.meta.oid for r in got}) == 3
    assert all(r.meta.size == SIZE and len(r.offsets) == 4 for r in got)
    assert len({o for r in got for o in r.offsets}) == 12, "no slot given twice"
    assert len(seg.reserve_unbound(3, SIZE)) == cap // 4 - 3, "as many as fit"
    assert seg.counters.puts_no_space == 0, "spares are not puts"
    assert seg.reserve_unbound(0, SIZE) == [] and seg.reserve_unbound(2, -1) == []
    for r in got:
        seg.abort(r)
    assert len(seg.reserve_unbound(3, SIZE)) == 3, "aborted slots are free again"
    assert len(seg) == 0
