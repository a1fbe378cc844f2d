"""A pool run without a cluster token (``mooncake-rs store --plaintext``), as Mooncake
Store's TCP runs: bytes equal over TCP, and a client and a node that disagree about the
token fail at once with a typed error that says which side to change."""

from __future__ import annotations

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, value_of

from mooncake_rs.errors import InvalidArgument, TransferFailed, Unauthorized
from mooncake_rs.net.plain_socket import connect_plain
from mooncake_rs.net import auth_socket
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.node import StoreNode

pytestmark = [pytest.mark.timeout(120)]
PREFIX = "/mooncake/plain"


@pytest.fixture
def plain_node(etcd_url):
    with StoreNode(name="p", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token=None, plaintext=True,
                   etcd=etcd_url, prefix=PREFIX, chunk_bytes=64 << 10, transports=("tcp",)) as n:
        yield n


def test_plaintext_pool_moves_the_same_bytes_over_tcp(etcd_url, plain_node):
    with DistributedStore.connect(etcd_url, plaintext=True, prefix=PREFIX, transports=("tcp",)) as s:
        keys = [f"k{i}" for i in range(6)]
        sizes = [100, 4096, 4097, 65_536, 300_001, 1 << 20]
        vals = [value_of(k, n) for k, n in zip(keys, sizes)]
        assert s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals]) == [0] * 6
        outs = [np.zeros(n, np.uint8) for n in sizes]
        assert s.batch_get_into(keys, [[o.ctypes.data] for o in outs], [[n] for n in sizes]) == sizes
        for v, o in zip(vals, outs):
            assert (v == o).all()
        assert s.get("k0") == vals[0].tobytes()
        assert s.batch_exists(["k1", "nope"]) == [True, False]
        out = np.zeros(8, np.uint8)
        assert s.batch_get_into(["nope"], [[out.ctypes.data]], [[8]]) == [KeyStatus.MISSING]
    assert plain_node.segment.exists("k5")


def test_a_token_client_and_a_plaintext_node_refuse_each_other_at_once(etcd_url, plain_node):
    with pytest.raises(Unauthorized, match="plaintext"):
        auth_socket.connect(plain_node.address, TOKEN, timeout_s=5)
    with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX) as s:
        with pytest.raises(TransferFailed):
            s.put("x", b"y" * 10)
    assert not plain_node.segment.exists("x")


def test_a_plaintext_client_and_a_token_node_refuse_each_other_at_once(etcd_url):
    with StoreNode(name="t", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix=PREFIX + "t") as node:
        with pytest.raises(Unauthorized, match="requires the cluster token"):
            connect_plain(node.address, timeout_s=5)
        with DistributedStore.connect(etcd_url, plaintext=True, prefix=PREFIX + "t") as s:
            with pytest.raises(TransferFailed):
                s.put("x", b"y" * 10)
        assert not node.segment.exists("x")


def test_plaintext_is_asked_for_by_name(etcd_url):
    with pytest.raises(InvalidArgument, match="plaintext"):
        StoreNode(name="n", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=None)
    with pytest.raises(InvalidArgument, match="not both"):
        StoreNode(name="n", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=TOKEN, plaintext=True)
    with pytest.raises(InvalidArgument, match="drop auth_token"):
        DistributedStore.connect(etcd_url, auth_token=TOKEN, plaintext=True, prefix=PREFIX)


def test_the_facade_reaches_a_plaintext_deployment_by_environment(etcd_url, plain_node, monkeypatch):
    from mooncake_rs.compat.config import plaintext_from_env
    from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore

    monkeypatch.setenv("MOONCAKE_RS_PLAINTEXT", "maybe")
    with pytest.raises(InvalidArgument, match="MOONCAKE_RS_PLAINTEXT"):
        plaintext_from_env()
    monkeypatch.setenv("MOONCAKE_RS_PLAINTEXT", "1")
    monkeypatch.setenv("MOONCAKE_AUTH_TOKEN", TOKEN)  # ignored: the nodes hold none
    monkeypatch.setenv("MOONCAKE_CLUSTER", "plain")
    monkeypatch.setenv("MOONCAKE_RS_TRANSPORTS", "tcp")
    monkeypatch.setattr("mooncake_rs.compat.mooncake_store.pool_prefix", lambda: PREFIX)
    url = "etcd://" + etcd_url[len("http://"):]
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", url, 0, 16 << 20, "tcp", "", url) == 0
    try:
        v = value_of("f", 5000).tobytes()
        assert s.put("f", v) == 0
        assert s.get("f") == v
        assert s.batch_is_exist(["f", "g"]) == [1, 0]
    finally:
        s.close()
