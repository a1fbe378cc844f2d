"""Small-key calls of a client whose pool has one store node (the one-request path of
``RemoteBackend.put_values`` / ``RankedAsks``: no ranking, no list of asks) against a
simple reference: a dict of what was put; statuses typed when the node refuses."""

from __future__ import annotations

import socket
import subprocess

import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, start_node

from mooncake_rs.errors import BlockNotFound, StoreFull, TransferFailed
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.node import StoreNode

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="one", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix="/mooncake/small", chunk_bytes=64 << 10) as n:
        yield n


def connect(etcd_url: str) -> DistributedStore:
    return DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/small", transports=("tcp",))


def test_small_puts_gets_and_exists_match_a_reference(etcd_url, node):
    ref: dict[str, bytes] = {}
    with connect(etcd_url) as pool:
        for i in range(200):
            key, value = f"k{i % 150}", bytes([i % 251]) * (1 + i * 13 % 4096)
            pool.put(key, value)  # a key put again keeps its first value (put-if-absent)
            ref.setdefault(key, value)
        batch = {f"b{i}": bytes([i]) * (i + 1) for i in range(40)}
        assert pool.batch_put_values(list(batch), list(batch.values())) == [KeyStatus.OK] * 40
        ref.update(batch)
        keys = sorted(ref) + ["absent-1", "absent-2"]
        assert pool.batch_get_bytes(keys) == [ref.get(k) for k in keys]
        assert [pool.get(k) for k in ref] == list(ref.values())
        assert pool.batch_exists(keys) == [k in ref for k in keys]
        with pytest.raises(BlockNotFound):
            pool.get("absent-1")


def test_a_refused_small_put_is_typed_and_the_others_stay_ok(etcd_url, node):
    """A node full of pinned small values answers NO_SPACE for the keys it cannot take:
    the one-node path reports each key's own status (not "all OK"), and StoreFull."""
    with connect(etcd_url) as pool:
        statuses: list[KeyStatus] = []
        for i in range(0, 2000, 50):
            keys = [f"pin{j}" for j in range(i, i + 50)]
            statuses += pool.batch_put_values(keys, [b"p" * 100] * 50, pin=True)
            if KeyStatus.NO_SPACE in statuses:
                break
        assert KeyStatus.NO_SPACE in statuses, "the small class never filled"
        first_refused = statuses.index(KeyStatus.NO_SPACE)
        assert all(s == KeyStatus.OK for s in statuses[:first_refused])
        stored = [f"pin{j}" for j, s in enumerate(statuses) if s == KeyStatus.OK]
        refused = [f"pin{j}" for j, s in enumerate(statuses) if s != KeyStatus.OK]
        assert pool.batch_exists(stored) == [True] * len(stored)
        assert pool.batch_exists(refused) == [False] * len(refused)
        with pytest.raises(StoreFull):
            pool.put("one-more", b"x" * 100, pin=True)


def test_a_node_killed_makes_small_calls_typed_failures(etcd_url):
    """A node SIGKILLed under a one-node pool: a small put raises TransferFailed (not OK),
    a get of a key it held reports it missing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, _ = start_node(subprocess.Popen, etcd_url, "127.0.0.1", port, "killed", "small-kill")
    try:
        pool = DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/small-kill",
                                        transports=("tcp",), io_timeout_s=5.0)
        with pool:
            pool.put("before", b"v" * 64)
            assert pool.get("before") == b"v" * 64
            proc.kill()
            proc.wait(10)
            with pytest.raises(TransferFailed):
                pool.put("after", b"v" * 64)
            assert pool.batch_get_bytes(["before"]) == [None]
    finally:
        proc.kill()
        proc.wait(10)
