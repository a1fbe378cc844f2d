"""The pool across hosts: network-namespace hosts (netns_helpers) each running a
``mooncake-rs store`` node, etcd on the test's bridge, clients on other hosts; every byte
crosses TCP. Put on one host, get on another; a SIGKILLed node with 2 replicas and with
1; a full pool's -200 and its recovery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from etcd_helpers import EtcdServer, required_etcd_binary
from netns_helpers import TestHosts, available
from pool_helpers import TOKEN, env, start_node, value_of

from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore, ReplicateConfig
from mooncake_rs.client.records import cluster_prefix
from mooncake_rs.pool import DistributedStore, KeyStatus

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HERE = Path(__file__).resolve().parent
NODES = 3
CLIENT = 3  # the host a writer runs on


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    binary = required_etcd_binary()
    if not available():
        pytest.skip("network namespaces need CAP_NET_ADMIN")
    tmp = tmp_path_factory.mktemp("pool")
    with TestHosts(NODES + 1) as hosts:
        server = EtcdServer(binary, tmp / "etcd", host=hosts.gateway)
        server.start()
        try:
            yield hosts, server
        finally:
            server.stop()


_clusters = iter(range(1000))


@pytest.fixture
def pool(net):
    """Three fresh nodes of a cluster of their own; yields (hosts, etcd url, cluster, procs)."""
    hosts, server = net
    cluster = f"t{next(_clusters)}"
    procs = []
    try:
        for i in range(NODES):
            p, _ = start_node(lambda argv, **kw: hosts.popen(i, argv, **kw), server.url, hosts.ip(i), 7500 + i,
                              f"n{i}", cluster, dram="32MB", extra=("--chunk-bytes", "64KB"))
            procs.append(p)
        yield hosts, server.url, cluster, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def client(url: str, cluster: str) -> DistributedStore:
    return DistributedStore.connect(url, auth_token=TOKEN, prefix=cluster_prefix(cluster), wait_nodes=NODES,
                                    transports=("tcp",), io_timeout_s=3.0)


def read_all(s: DistributedStore, sizes: dict[str, int]) -> dict[str, int | bytes]:
    keys = list(sizes)
    outs = [np.zeros(sizes[k], np.uint8) for k in keys]
    got = s.batch_get_into(keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs])
    return {k: (o.tobytes() if g == o.nbytes else g) for k, o, g in zip(keys, outs, got)}


def test_put_on_one_host_get_on_another_byte_for_byte(pool):
    hosts, url, cluster, _ = pool
    n, size = 24, 300_000
    w = hosts.popen(CLIENT, [sys.executable, str(HERE / "pool_client_helper.py"), "put", url, cluster, str(n),
                             str(size), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    out, err = w.communicate(timeout=120)
    assert w.returncode == 0 and "done" in out, err[-2000:]
    with client(url, cluster) as s:
        sizes = {f"k{i}": size + i for i in range(n)}
        got = read_all(s, sizes)
        for k, v in got.items():
            assert v == value_of(k, sizes[k]).tobytes(), k
        assert s.batch_exists(list(sizes)) == [True] * n
        m = s.metrics()
        assert m.keys == 2 * n  # two replicas each
        assert m.nodes == NODES


def _put(s: DistributedStore, n: int, replicas: int) -> dict[str, int]:
    sizes = {f"r{replicas}-{i}": 70_000 + 997 * i for i in range(n)}
    vals = {k: value_of(k, sz) for k, sz in sizes.items()}
    st = s.batch_put_from(list(vals), [[v.ctypes.data] for v in vals.values()], [[v.nbytes] for v in vals.values()],
                          replicas=replicas)
    assert st == [KeyStatus.OK] * n
    return sizes


def test_a_node_sigkilled_with_two_replicas_every_key_still_readable(pool):
    hosts, url, cluster, procs = pool
    with client(url, cluster) as s:
        sizes = _put(s, 40, replicas=2)
        procs[0].kill()
        procs[0].wait(10)
        got = read_all(s, sizes)
        for k, v in got.items():
            assert v == value_of(k, sizes[k]).tobytes(), (k, v if isinstance(v, int) else len(v))
        assert s.metrics().replicas_lost > 0  # some keys' first replica was on the dead node


def test_a_node_sigkilled_with_one_replica_its_keys_are_missing_never_wrong(pool):
    hosts, url, cluster, procs = pool
    with client(url, cluster) as s:
        sizes = _put(s, 40, replicas=1)
        procs[1].kill()
        procs[1].wait(10)
        t0 = time.monotonic()
        got = read_all(s, sizes)
        elapsed = time.monotonic() - t0
        missing = [k for k, v in got.items() if v == KeyStatus.MISSING]
        for k, v in got.items():
            assert v == KeyStatus.MISSING or v == value_of(k, sizes[k]).tobytes(), k
        assert 0 < len(missing) < len(sizes)
        assert elapsed < 30  # a bound, not a timing: far above what a healthy run takes
        # one key at a time too, through the facade's codes
        f = MooncakeDistributedStore()
        f._store = s  # the same client, seen through the Mooncake API
        buf = np.zeros(max(sizes.values()), np.uint8)
        assert f.get_into(missing[0], buf.ctypes.data, buf.nbytes) == -704
        assert f.is_exist(missing[0]) == 0
        f._store = None


def test_a_full_pool_returns_minus_200_and_recovers_after_removals(pool):
    hosts, url, cluster, _ = pool
    os.environ["MOONCAKE_AUTH_TOKEN"] = TOKEN
    os.environ["MOONCAKE_CLUSTER"] = cluster
    try:
        f = MooncakeDistributedStore()
        assert f.setup("127.0.0.1", f"etcd://{url[len('http://'):]}", 0, 16 << 20, "tcp", "", "") == 0
    finally:
        del os.environ["MOONCAKE_CLUSTER"]
    val = value_of("full", 4 << 20)
    pin = ReplicateConfig()
    pin.with_hard_pin = True
    rcs = [f.put_from(f"p{i}", val.ctypes.data, val.nbytes, pin) for i in range(40)]  # 160 MB > 3 x 30 MB
    assert rcs[0] == 0 and -200 in rcs
    stored = [f"p{i}" for i, r in enumerate(rcs) if r == 0]
    assert set(rcs) <= {0, -200}
    assert f.put_from("more", val.ctypes.data, val.nbytes) == -200
    for k in stored:  # wherever "more" is placed, its node has room again
        assert f.remove(k) == 0
    assert f.put_from("more", val.ctypes.data, val.nbytes) == 0
    out = np.zeros(val.nbytes, np.uint8)
    assert f.get_into("more", out.ctypes.data, out.nbytes) == val.nbytes and (out == val).all()
    f.close()


def test_small_values_travel_inline_large_ones_by_transfer_same_bytes(pool):
    hosts, url, cluster, _ = pool
    sizes = {f"s{n}": n for n in (1, 100, 4095, 4096, 4097, 8191, 65536 + 3)}
    with client(url, cluster) as w:
        vals = {k: value_of(k, n) for k, n in sizes.items()}
        assert w.batch_put_from(list(vals), [[v.ctypes.data] for v in vals.values()],
                                [[v.nbytes] for v in vals.values()], replicas=2) == [KeyStatus.OK] * len(vals)
    with client(url, cluster) as r:
        got = read_all(r, sizes)
        assert all(got[k] == vals[k].tobytes() for k in sizes)
        assert r.batch_get_bytes(list(sizes) + ["absent"]) == [vals[k].tobytes() for k in sizes] + [None]
        # pieces smaller than the value: refused, not truncated
        small = np.zeros(10, np.uint8)
        assert r.batch_get_into(["s100"], [[small.ctypes.data]], [[10]]) == [KeyStatus.INVALID]


def test_a_plaintext_node_with_a_lease_deadline_across_hosts(net):
    """``--plaintext --lease-ttl 1`` on host 0, the client here: bytes equal over the
    bridge without a token; a lease held by a client silent past the deadline is refused
    when read late (nothing lands)."""
    from mooncake_rs import TransferRequest
    from mooncake_rs.pool.protocol import Lookup

    hosts, server = net
    cluster = f"t{next(_clusters)}"
    p, _ = start_node(lambda argv, **kw: hosts.popen(0, argv, **kw), server.url, hosts.ip(0), 7600, "plain0",
                      cluster, dram="32MB", extra=("--chunk-bytes", "64KB", "--plaintext", "--lease-ttl", "1"))
    try:
        with DistributedStore.connect(server.url, plaintext=True, prefix=cluster_prefix(cluster),
                                      transports=("tcp",), io_timeout_s=3.0) as s:
            keys = [f"p{i}" for i in range(4)]
            vals = [value_of(k, 150_000 + 777 * i) for i, k in enumerate(keys)]
            assert s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals]) == [0] * 4
            dst = [np.zeros(v.nbytes, np.uint8) for v in vals]
            assert s.batch_get_into(keys, [[d.ctypes.data] for d in dst], [[d.nbytes] for d in dst]) == \
                [v.nbytes for v in vals]
            assert all(np.array_equal(v, d) for v, d in zip(vals, dst))
            be = s.backend
            link = be.nodes.link("plain0")
            leased = link.call(Lookup, keys=["p0"], engine=be.name)
            assert leased.statuses == [0]
            time.sleep(3.0)  # silent: past the deadline (1 s), the reaper's pass and the grace (1 s)
            late = np.zeros(64 << 10, np.uint8)
            st = be.te.submit([TransferRequest("read", be.te.register(late), 0, link.peer, leased.regions[0],
                                               leased.offsets[0][0], late.nbytes)], timeout_s=10).wait()[0]
            assert not st.ok and st.code == "no_grant", st
            assert not late.any()
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
