"""One store node on 127.0.0.1 (in this process, and as ``mooncake-rs store``): /metrics,
the cluster token, a dead client's reservations and leases, node records in etcd."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, env, start_node, value_of

from mooncake_rs.errors import InvalidArgument, ServiceUnavailable, TransferFailed
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import Lookup, Reserve

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="a", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix="/mooncake/unit", chunk_bytes=64 << 10) as n:
        yield n


def connect(etcd_url: str, **kw) -> DistributedStore:
    return DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/unit", **kw)


def test_metrics_endpoint_counts_keys_hits_and_misses(etcd_url, node):
    with connect(etcd_url) as s:
        v = value_of("m", 200_000)
        s.put("m", v)
        assert s.get("m") == v.tobytes()
        out = np.zeros(10, np.uint8)
        assert s.batch_get_into(["nope"], [[out.ctypes.data]], [[10]]) == [KeyStatus.MISSING]
    with urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'mooncake_pool_keys{node="a"} 1' in text
    assert 'mooncake_pool_object_hits{node="a"} 1' in text
    assert 'mooncake_pool_object_misses{node="a"} 1' in text


def test_a_client_with_the_wrong_token_is_refused(etcd_url, node):
    with DistributedStore.connect(etcd_url, auth_token="another-token-0123456789abcdef", prefix="/mooncake/unit") as s:
        with pytest.raises(TransferFailed):
            s.put("x", b"y" * 10)
        assert s.batch_exists(["x"]) == [False]
    assert node.listener.refused >= 1 and not node.segment.exists("x")


def test_no_nodes_is_a_typed_error(etcd_url):
    with pytest.raises(ServiceUnavailable):
        connect(etcd_url, timeout_s=0.5)


def test_a_dead_clients_reservations_and_leases_are_released(etcd_url, node):
    seg = node.segment
    with connect(etcd_url) as s:
        s.put("held", value_of("held", 300_000))
        link = s.backend.nodes.link("a")
        rep = link.call(Reserve, keys=["never-committed"], sizes=[500_000])
        assert rep.statuses == [0]
        leased = link.call(Lookup, keys=["held"])
        assert leased.statuses == [0]
        # the reserved slots are not visible, the leased ones are pinned by the lease
        assert not seg.exists("never-committed")
        # while the reservation and the lease live, the whole class cannot be taken
        sc = seg.classes[1]
        whole = np.ones(sc.capacity_chunks * sc.chunk_bytes, np.uint8)
        assert seg.put_from("whole", [whole.ctypes.data], [whole.nbytes]) == KeyStatus.NO_SPACE
    # the client closed its connection without Commit / Release: everything is given back
    deadline = time.monotonic() + 10
    while seg.put_from("whole", [whole.ctypes.data], [whole.nbytes]) != KeyStatus.OK:
        assert time.monotonic() < deadline, "a dead client's reservation or lease still holds slots"
        time.sleep(0.05)
    seg.reap_evicted()
    assert not seg.exists("held")  # evicted to make room: it was no longer leased
    seg.check_integrity()


def test_the_cli_refuses_bad_flags_and_serves(etcd_url, tmp_path):
    r = subprocess.run([sys.executable, "-m", "mooncake_rs", "store", "--etcd", etcd_url, "--listen", "127.0.0.1:0",
                        "--dram-bytes", "16MB", "--ssd-path", str(tmp_path)], capture_output=True, text=True,
                       env=env(), timeout=60)
    assert r.returncode != 0 and "--ssd-bytes" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mooncake_rs", "store", "--etcd", etcd_url, "--listen", "127.0.0.1:0",
                        "--dram-bytes", "lots"], capture_output=True, text=True, env=env(), timeout=60)
    assert r.returncode != 0 and "byte count" in r.stderr
    p, line = start_node(subprocess.Popen, etcd_url, "127.0.0.1", 0, "cli", "unit2", dram="16MB",
                         extra=("--ssd-path", str(tmp_path / "ssd"), "--ssd-bytes", "64MB"))
    try:
        assert "control=127.0.0.1:" in line and "metrics=" in line
        with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/unit2") as s:
            s.put("k", b"v" * 5000)
            m = s.metrics()
            assert m.keys == 1 and m.capacity_ssd > 0
    finally:
        p.terminate()
        p.wait(10)


def test_store_node_arguments_are_checked():
    with pytest.raises(InvalidArgument):
        StoreNode(name="x", listen="nohostport", dram_bytes=32 << 20, auth_token=TOKEN)
    with pytest.raises(InvalidArgument):
        StoreNode(name="x", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token="short")


@pytest.mark.parametrize("transports", [("tcp",), ("tcp", "shm")])
def test_pieces_across_chunk_boundaries_match_a_reference(etcd_url, node, transports):
    """vLLM's shape: each key's value is several pieces (one per layer) whose boundaries
    fall anywhere relative to the node's 64 KiB chunks; read back into other pieces."""
    rng = np.random.default_rng(7)
    with connect(etcd_url, transports=transports) as s:
        src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        s.register_buffer(src.ctypes.data, src.nbytes)  # registered: written in place
        keys, ptrs, sizes, refs = [], [], [], []
        for k in range(6):
            cuts = np.sort(rng.choice(np.arange(1, 150_000), size=4, replace=False))
            bounds = [0, *cuts.tolist(), 150_000 + 1000 * k]
            base = k * 160_000
            keys.append(f"mb{k}")
            ptrs.append([src.ctypes.data + base + a for a in bounds[:-1]])
            sizes.append([b - a for a, b in zip(bounds, bounds[1:])])
            refs.append(src[base: base + bounds[-1]].copy())
        assert s.batch_put_from(keys, ptrs, sizes) == [KeyStatus.OK] * len(keys)
        dst = np.zeros(2 << 20, np.uint8)  # not registered: registered for the call only
        out_ptrs, out_sizes, views = [], [], []
        for k, ref in enumerate(refs):
            pieces = [1000, 70_000, ref.size - 71_000]
            base = k * 300_000
            offs = [base, base + 2000, base + 80_000]  # gaps between the pieces
            out_ptrs.append([dst.ctypes.data + o for o in offs])
            out_sizes.append(pieces)
            views.append([(o, n) for o, n in zip(offs, pieces)])
        assert s.batch_get_into(keys, out_ptrs, out_sizes) == [r.size for r in refs]
        for ref, parts in zip(refs, views):
            got = np.concatenate([dst[o: o + n] for o, n in parts])
            assert (got == ref).all()
