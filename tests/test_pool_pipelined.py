"""The pipelined control link (pool/links.py): several requests in flight on one
connection, from several threads; each answer reaches the request with its id; a posted
Release frees the node's leases without anyone waiting; a node that stops answering
ends every request in flight with NodeDown within the timeout, and the client then reports
missing keys, never another key's bytes."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, value_of

from mooncake_rs.compat.config import tcp_connections_from_env
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.links import NodeDown
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import Exists, FrameIO, Lookup, Reply, Sizes

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="p", listen="127.0.0.1:0", dram_bytes=64 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix="/mooncake/pipe", chunk_bytes=64 << 10) as n:
        yield n


def connect(etcd_url: str, **kw) -> DistributedStore:
    return DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/pipe", transports=("tcp",), **kw)


def test_many_requests_in_flight_each_gets_its_own_answer(etcd_url, node):
    with connect(etcd_url) as s:
        for i in range(20):
            s.put(f"k{i}", value_of(f"k{i}", 100 + 37 * i))
        link = s.backend.nodes.link("p")
        # 60 requests sent before any answer is read; answers matched by id, not by order
        sent = [(i, link.submit(Sizes, keys=[f"k{i % 20}", f"none{i}"])) for i in range(60)]
        for i, p in reversed(sent):
            assert p.result().values == [100 + 37 * (i % 20), int(KeyStatus.MISSING)]


def _run_threads(worker, n: int = 4) -> None:
    """``worker(t)`` for t in 0..n, each on its own thread, all joined (90 s each at most);
    the workers report their own failures."""
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)


def test_threads_sharing_one_client_read_their_own_bytes(etcd_url, node):
    sizes = [3000, 70_000, 300_000]  # inline, one chunk, several chunks
    errors: list[str] = []
    with connect(etcd_url) as s:
        def worker(t: int) -> None:
            try:
                for r in range(6):
                    keys = [f"t{t}-{r}-{j}" for j in range(len(sizes))]
                    vals = [value_of(k, n) for k, n in zip(keys, sizes)]
                    st = s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals])
                    assert st == [KeyStatus.OK] * len(keys), st
                    dst = [np.zeros(n, np.uint8) for n in sizes]
                    got = s.batch_get_into(keys + [f"missing-{t}-{r}"], [[d.ctypes.data] for d in dst] + [[dst[0].ctypes.data]],
                                           [[d.nbytes] for d in dst] + [[dst[0].nbytes]])
                    assert got == sizes + [int(KeyStatus.MISSING)], got
                    for k, d in zip(keys, dst):
                        assert np.array_equal(d, value_of(k, d.nbytes)), k
                    assert s.batch_exists(keys) == [True] * len(keys)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        _run_threads(worker)
        assert not errors, errors
        assert len(s.backend.nodes.links) == 1  # one connection carried all of it


def test_direct_calls_mixed_with_submits_and_posts_get_their_own_answers(etcd_url, node):
    """``NodeLink.call`` reads its own answer directly when the link is idle, else takes
    the pipelined path: calls from several threads, interleaved with submitted requests
    still unanswered and posted ones (whose answers the reader drops), each get the
    answer to their own request, as a reference dict says."""
    ref = {f"k{i}": 100 + 37 * i for i in range(30)}
    with connect(etcd_url) as s:
        for k, n in ref.items():
            s.put(k, value_of(k, n))
        link = s.backend.nodes.link("p")
        errors: list[str] = []

        def sizes_of(keys: list[str]) -> list[int]:
            return [ref.get(k, int(KeyStatus.MISSING)) for k in keys]

        def worker(t: int) -> None:
            try:
                for r in range(200):
                    keys = [f"k{(t * 7 + r) % 40}", f"k{r % 30}"]
                    if r % 5 == 0:  # an unanswered request in the table while others call
                        p = link.submit(Sizes, keys=keys)
                        assert link.call(Exists, keys=keys).values == [int(k in ref) for k in keys]
                        assert p.result().values == sizes_of(keys)
                    elif r % 7 == 0:  # an answer nobody waits for, read by whoever reads next
                        link.post(Exists, keys=keys)
                        assert link.call(Sizes, keys=keys).values == sizes_of(keys)
                    else:
                        assert link.call(Sizes, keys=keys).values == sizes_of(keys)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        worker(99)  # alone first: every call takes the direct path
        _run_threads(worker)
        assert not errors, errors
        assert not link.broken and not link._waiting and not link._reading


def test_a_direct_call_whose_answer_cannot_come_is_node_down(etcd_url, node):
    """A node that reads the request and dies before answering (its end of the stream
    closes): the direct call's reader gets NodeDown, the link is broken and not left
    "reading", and later calls fail at once."""
    with connect(etcd_url, io_timeout_s=5.0) as s:
        s.put("k", b"v" * 10)
        link = s.backend.nodes.link("p")
        mine, dying = socket.socketpair()
        real = link.sock
        link.sock, link.io = mine, FrameIO(mine, Reply, spin_s=1e-4)  # (the real node is left alone)

        def die() -> None:
            dying.recv(1 << 16)  # the request came
            dying.close()

        t = threading.Thread(target=die)
        t.start()
        with pytest.raises(NodeDown):
            link.call(Exists, keys=["k"])
        t.join(10)
        assert link.broken and not link._reading
        with pytest.raises(NodeDown):
            link.call(Exists, keys=["k"])
        real.close()


def test_a_posted_release_frees_the_leases(etcd_url, node):
    with connect(etcd_url) as s:
        v = value_of("big", 500_000)
        s.put("big", v)
        for _ in range(5):
            dst = np.zeros(v.nbytes, np.uint8)
            assert s.batch_get_into(["big"], [[dst.ctypes.data]], [[dst.nbytes]]) == [v.nbytes]
            assert np.array_equal(dst, v)
        # the Releases were posted: none waited for, all applied once the node read them
        sc = node.segment.classes[1]
        deadline = time.monotonic() + 10
        while True:
            whole = np.ones(sc.capacity_chunks * sc.chunk_bytes, np.uint8)
            if node.segment.put_from("whole", [whole.ctypes.data], [whole.nbytes]) == KeyStatus.OK:
                break  # "big" was evictable: no lease held it
            assert time.monotonic() < deadline, "a posted Release left a lease held"
            time.sleep(0.05)


def test_a_node_that_stops_answering_ends_requests_in_flight(etcd_url, node):
    with connect(etcd_url, io_timeout_s=1.0) as s:
        s.put("x", value_of("x", 200_000))
        hold = threading.Event()
        handle = node._handle

        def stalled(msg, conn):
            if isinstance(msg, (Exists, Lookup)):
                hold.wait(20)
            return handle(msg, conn)

        node._handle = stalled
        try:
            link = s.backend.nodes.link("p")
            p1, p2 = link.submit(Exists, keys=["x"]), link.submit(Exists, keys=["x"])
            t = time.monotonic()
            with pytest.raises(NodeDown):
                p1.result()
            with pytest.raises(NodeDown):
                p2.result()
            assert time.monotonic() - t < 5
            assert link.broken
            # the client's own calls: the key is reported missing (its only node is
            # unresponsive), never bytes of anything else
            dst = np.zeros(200_000, np.uint8)
            got = s.batch_get_into(["x"], [[dst.ctypes.data]], [[dst.nbytes]])
            assert got == [int(KeyStatus.MISSING)]
            assert not dst.any()
        finally:
            hold.set()
            node._handle = handle


def test_several_data_connections_per_node_move_the_same_bytes(etcd_url, node, monkeypatch):
    with pytest.raises(InvalidArgument, match="tcp_connections"):
        connect(etcd_url, tcp_connections=0)
    monkeypatch.setenv("MOONCAKE_RS_TCP_CONNECTIONS", "many")
    with pytest.raises(InvalidArgument, match="MOONCAKE_RS_TCP_CONNECTIONS"):
        tcp_connections_from_env()
    monkeypatch.delenv("MOONCAKE_RS_TCP_CONNECTIONS")
    assert tcp_connections_from_env() is None  # unset: the transfer engine's own rule
    monkeypatch.setenv("MOONCAKE_RS_TCP_CONNECTIONS", "3")
    assert tcp_connections_from_env() == 3
    with connect(etcd_url, tcp_connections=3) as s:
        keys = [f"c{i}" for i in range(8)]
        vals = [value_of(k, 1_300_000 + 4099 * i) for i, k in enumerate(keys)]  # each over several slices
        assert s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals]) == [KeyStatus.OK] * 8
        dst = [np.zeros(v.nbytes, np.uint8) for v in vals]
        assert s.batch_get_into(keys, [[d.ctypes.data] for d in dst], [[d.nbytes] for d in dst]) == [v.nbytes for v in vals]
        for k, d in zip(keys, dst):
            assert np.array_equal(d, value_of(k, d.nbytes)), k
