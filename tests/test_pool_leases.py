"""Holds with a deadline (``mooncake-rs store --lease-ttl``; pool/holds.py): a client that
hangs with its connection open loses its reservations and leases after the deadline, the
node reuses the slots, and the client's late reads and writes of them are refused by the
transfer engine (never the bytes of the object that took the slots); a client that keeps
talking keeps them. Bounded in time: TTL 1 s, every wait capped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, env, value_of

from mooncake_rs import TransferRequest
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.holds import slot_runs
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import Commit, Exists, Lookup, Reserve

pytestmark = [pytest.mark.timeout(120)]
PREFIX = "/mooncake/leases"
TTL = 1.0
HERE = Path(__file__).resolve().parent


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="a", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix=PREFIX, chunk_bytes=64 << 10, transports=("tcp",), lease_ttl_s=TTL) as n:
        yield n


def connect(etcd_url: str) -> DistributedStore:
    return DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX, transports=("tcp",))


def fill_class_until_ok(node: StoreNode, deadline_s: float = 10.0) -> np.ndarray:
    """Puts one object as large as the whole large-value class, straight into the segment:
    it succeeds only once every slot is free (so also the ones a hold kept)."""
    seg = node.segment
    sc = seg.classes[1]
    whole = np.full(sc.capacity_chunks * sc.chunk_bytes, 0xAB, np.uint8)
    end = time.monotonic() + deadline_s
    while seg.put_from("whole", [whole.ctypes.data], [whole.nbytes]) != KeyStatus.OK:
        assert time.monotonic() < end, "the expired holds' slots were never given back"
        time.sleep(0.1)
    return whole


def test_slot_runs_cover_consecutive_slots_once():
    assert slot_runs([], 8) == []
    assert slot_runs([0, 8, 16, 40, 48, 8], 8) == [(0, 24), (40, 16), (8, 8)]


def test_bytes_round_trip_through_granted_slots(etcd_url, node):
    with connect(etcd_url) as s:
        keys = [f"k{i}" for i in range(5)]
        vals = [value_of(k, 70_000 * (i + 1) + 3) for i, k in enumerate(keys)]
        assert s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals]) == [0] * 5
        dst = [np.zeros(v.nbytes, np.uint8) for v in vals]
        assert s.batch_get_into(keys, [[d.ctypes.data] for d in dst], [[d.nbytes] for d in dst]) == \
            [v.nbytes for v in vals]
        for v, d in zip(vals, dst):
            assert np.array_equal(v, d)
    # every grant went with its hold
    assert all(not node.te.grants(r) for r in node.regions)


def test_a_silent_clients_lease_and_reservation_end_and_late_access_is_refused(etcd_url, node):
    seg = node.segment
    with connect(etcd_url) as writer:
        writer.put("old", value_of("old", 300_000))
    with connect(etcd_url) as s:
        be = s.backend
        link = be.nodes.link("a")
        leased = link.call(Lookup, keys=["old"], engine=be.name)
        reserved = link.call(Reserve, keys=["never"], sizes=[200_000], engine=be.name)
        assert leased.statuses == [0] and reserved.statuses == [0]
        with connect(etcd_url) as other:
            assert other.remove("old")  # removal never waits for the reader
        # the client says nothing from here on, its connection open: after the deadline
        # (and the grace) its slots come back and another object takes all of them
        whole = fill_class_until_ok(node)
        assert sum(c.expired_holds for c in node._conns) == 2
        # its late read of the slots the lease named is refused: nothing lands
        dst = np.zeros(64 << 10, np.uint8)
        local = be.te.register(dst)
        st = be.te.submit([TransferRequest("read", local, 0, link.peer, leased.regions[0], leased.offsets[0][0],
                                           dst.nbytes)], timeout_s=10).wait()[0]
        assert not st.ok and st.code == "no_grant", st
        assert not dst.any()
        # its late write into the slots it had reserved is refused: the object there keeps its bytes
        src = np.full(64 << 10, 0x11, np.uint8)
        wsrc = be.te.register(src)
        st = be.te.submit([TransferRequest("write", wsrc, 0, link.peer, reserved.regions[0],
                                           reserved.offsets[0][0], src.nbytes)], timeout_s=10).wait()[0]
        assert not st.ok and st.code == "no_grant", st
        got = seg.get_bytes("whole")
        assert isinstance(got, bytes) and got == whole.tobytes()
        # its commit finds nothing to publish
        assert link.call(Commit, put_ids=reserved.put_ids, ok=[True]).values == [int(KeyStatus.INVALID)]
        assert not seg.exists("never")
        assert node.te.stats().grant_refusals >= 2


def test_a_client_that_keeps_talking_keeps_its_lease(etcd_url, node):
    with connect(etcd_url) as s:
        v = value_of("kept", 200_000)
        s.put("kept", v)
        be = s.backend
        link = be.nodes.link("a")
        leased = link.call(Lookup, keys=["kept"], engine=be.name)
        end = time.monotonic() + 3 * TTL
        while time.monotonic() < end:  # any request renews the connection's holds
            link.call(Exists, keys=["kept"])
            time.sleep(TTL / 4)
        assert sum(c.expired_holds for c in node._conns) == 0
        dst = np.zeros(v.nbytes, np.uint8)
        local = be.te.register(dst)
        reqs = [TransferRequest("read", local, i * (64 << 10), link.peer, leased.regions[0], off,
                                min(64 << 10, v.nbytes - i * (64 << 10)))
                for i, off in enumerate(leased.offsets[0])]
        assert all(st.ok for st in be.te.submit(reqs, timeout_s=10).wait())
        assert np.array_equal(dst, v)


def test_a_stopped_client_process_loses_its_lease_and_reads_nothing_late(etcd_url, node):
    with connect(etcd_url) as writer:
        writer.put("held", value_of("held", 250_000))
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), e["PYTHONPATH"]])
    p = subprocess.Popen([sys.executable, str(HERE / "pool_hung_client.py"), etcd_url, PREFIX, "held", "250000"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=e)
    try:
        assert json.loads(p.stdout.readline())["lease"] > 0
        os.kill(p.pid, signal.SIGSTOP)  # hung: alive, its connection open, silent
        with connect(etcd_url) as other:
            assert other.remove("held")
        fill_class_until_ok(node)
        os.kill(p.pid, signal.SIGCONT)
        p.stdin.write("go\n")
        p.stdin.flush()
        out = json.loads(p.stdout.readline())
        assert out == {"ok": False, "code": "no_grant", "untouched": True, "own_bytes": False}, out
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)


def test_a_node_with_a_deadline_needs_the_clients_engine_name(etcd_url, node):
    with connect(etcd_url) as s:
        s.put("x", value_of("x", 100_000))
        from mooncake_rs.pool.links import NodeDown

        with pytest.raises(NodeDown, match="engine by name"):
            s.backend.nodes.link("a").call(Lookup, keys=["x"])
    with pytest.raises(InvalidArgument, match="lease-ttl"):
        StoreNode(name="b", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=TOKEN, lease_ttl_s=-1)
