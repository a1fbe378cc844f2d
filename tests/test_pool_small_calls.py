"""Small-key calls of a client whose pool has one store node (the one-request path of
``RemoteBackend.put_values`` / ``RankedAsks``: no ranking, no list of asks) against a
simple reference: a dict of what was put; statuses typed when the node refuses."""

from __future__ import annotations

import random
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
        # one key a call (the node's one-key lookup) answers as the many-key lookup does
        assert [pool.batch_get_bytes([k])[0] for k in keys] == pool.batch_get_bytes(keys)
        big = bytes(range(256)) * 400  # (past INLINE_MAX: the one-key get reads it as the batch does)
        pool.put("big", big)
        assert pool.get("big") == big and pool.batch_get_bytes(["big", "absent-1"]) == [big, None]
        assert pool.batch_exists(keys) == [k in ref for k in keys]
        assert pool.batch_exists_flags(keys) == [int(k in ref) for k in keys]
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


def test_batch_exists_and_sizes_match_per_key_calls_and_a_reference_across_replicas_and_a_lost_node(etcd_url):
    """Three nodes, keys put with one and with two replicas; random key sets of present and
    missing keys: one batch call (each node asked once about its keys) answers as a call
    per key and as the reference (what was put, and where placement put it) do, before and
    after one node is SIGKILLed: a two-replica key stays present, a one-replica key on the
    lost node reads as missing, never present elsewhere."""
    from mooncake_rs.pool.placement import rank_nodes

    rng = random.Random(24)
    names = ["m0", "m1", "m2"]
    procs = []
    try:
        for name in names:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs.append(start_node(subprocess.Popen, etcd_url, "127.0.0.1", port, name, "small-multi")[0])
        pool = DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/small-multi",
                                        transports=("tcp",), wait_nodes=3, io_timeout_s=5.0)
        with pool:
            put: dict[str, tuple[int, int]] = {}  # key -> (size, replicas)
            for replicas in (1, 2):
                keys = [f"r{replicas}-{i}" for i in range(120)]
                vals = [bytes([i % 251]) * rng.randint(1, 4096) for i in range(len(keys))]
                assert pool.batch_put_values(keys, vals, replicas=replicas) == [KeyStatus.OK] * len(keys)
                put.update({k: (len(v), replicas) for k, v in zip(keys, vals)})
            universe = list(put) + [f"absent-{i}" for i in range(80)]

            def check(lost: str | None) -> None:
                def present(k: str) -> bool:
                    if k not in put:
                        return False
                    holders = rank_nodes(k, names)[:put[k][1]]
                    return any(h != lost for h in holders)

                for _ in range(6):
                    keys = rng.sample(universe, rng.randint(1, 150))
                    want = [present(k) for k in keys]
                    assert pool.batch_exists(keys) == want
                    assert [pool.batch_exists([k])[0] for k in keys] == want
                    assert pool.batch_sizes(keys) == [put[k][0] if w else None for k, w in zip(keys, want)]

            check(None)
            lost = names[1]
            procs[1].kill()
            procs[1].wait(10)
            assert any(rank_nodes(k, names)[0] == lost for k in put if put[k][1] == 1)  # (the case is there)
            check(lost)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_batch_exists_of_a_one_node_pool_matches_the_node_itself(etcd_url, node):
    """The one-node path (one request, the node's list returned as it is) against the
    node's own table, on random sets of present and missing keys; then after removals."""
    rng = random.Random(7)
    with connect(etcd_url) as pool:
        keys = [f"one-{i}" for i in range(300)]
        assert pool.batch_put_values(keys[:200], [b"x" * (1 + i) for i in range(200)]) == [KeyStatus.OK] * 200
        for step in range(8):
            if step == 4:
                assert pool.batch_remove(keys[:50]) == [True] * 50
            sample = rng.sample(keys, rng.randint(1, 300))
            assert pool.batch_exists(sample) == [node.segment.exists(k) for k in sample]
            assert pool.batch_exists_flags(sample) == [int(node.segment.exists(k)) for k in sample]
            assert pool.batch_sizes(sample) == [node.segment.size_of(k) for k in sample]
