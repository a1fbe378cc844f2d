"""The KV pool service (integrations/pool) without vLLM: reserve / write / commit / lookup
through a real TransferEngine, leases, checksums, events, a full pool, typed errors, and a
client's state dropped with its connection."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

import mooncake_rs as mc
from etcd_helpers import etcd  # noqa: F401  (the fixture)
from mooncake_rs.integrations.pool import KVPoolServer, PoolClient, PoolConfig

TOKEN = "pool-test-token-0123456789abcdef"
BB = 4096


@pytest.fixture
def pool():
    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=8 * BB)) as p:
        yield p


def _keys(*ks):
    return bytes(mc.BlockHashes(list(ks)))


def _save(client, eng, peer, region, keys, data):
    r = client.reserve(_keys(*keys))
    src = eng.register(data)
    reqs = [mc.TransferRequest("write", src, i * BB, peer, region, off, BB)
            for i, off in enumerate(r.offsets) if off >= 0]
    assert all(s.ok for s in eng.submit(reqs).wait())
    return r, client.commit(r.reservation, [off >= 0 for off in r.offsets])


def test_save_then_load_is_byte_exact_with_checksums_and_events(pool):
    c = PoolClient(pool.address, TOKEN)
    opened = c.open(BB, "layout-a")
    eng = mc.TransferEngine("client", listen="")
    peer = eng.connect(opened.engine_name, opened.engine_address)
    data = np.random.default_rng(0).integers(0, 256, 3 * BB, dtype=np.uint8)
    r, stored = _save(c, eng, peer, opened.region, [11, 12, 13], data)
    assert stored == 3 and r.present == 0 and r.full == 0
    found = c.lookup(_keys(11, 12, 13, 14), lease_s=5)
    assert found.count == 3 and found.lease
    assert found.checksums == [zlib.crc32(data[i * BB:(i + 1) * BB]) for i in range(3)]
    out = np.zeros_like(data)
    dst = eng.register(out)
    reqs = [mc.TransferRequest("read", dst, i * BB, peer, opened.region, off, BB) for i, off in enumerate(found.offsets)]
    assert all(s.ok for s in eng.submit(reqs).wait())
    assert np.array_equal(out, data)
    assert pool.stats()["leases_held"] == 1
    c.release(found.lease)
    assert pool.stats()["leases_held"] == 0
    ev = c.events(0)
    assert ev.kinds == ["stored"] * 3 and mc.BlockHashes(ev.keys).tolist() == [11, 12, 13]
    assert c.events(ev.next).kinds == []
    # a second save of held keys is skipped and counted
    r2, stored2 = _save(c, eng, peer, opened.region, [11, 15], data[:2 * BB].copy())
    assert r2.offsets[0] == -1 and r2.present == 1 and stored2 == 1
    assert c.remove(_keys(12)) == 1 and pool.stats()["corrupt_removed"] == 1
    assert c.lookup(_keys(11, 12)).count == 1
    eng.close()
    c.close()


def test_a_full_pool_skips_and_counts(pool):
    c = PoolClient(pool.address, TOKEN)
    c.open(BB, "l")
    r = c.reserve(_keys(*range(1, 11)))  # 8 slots
    assert r.full == 2 and r.offsets[-2:] == [-1, -1]
    assert pool.stats()["saves_skipped_full"] == 2
    assert c.commit(r.reservation, [False] * 10) == 0  # aborted: the slots come back
    assert c.reserve(_keys(*range(1, 9))).full == 0
    c.close()


def test_typed_errors_and_layout_mismatch(pool):
    c = PoolClient(pool.address, TOKEN)
    with pytest.raises(mc.InvalidArgument, match="not open"):
        c.lookup(_keys(1))
    c.open(BB, "l")
    with pytest.raises(mc.InvalidArgument, match="one pool serves one model layout"):
        c.open(2 * BB, "l")
    with pytest.raises(mc.InvalidArgument, match="no reservation"):
        c.commit(12345, [])
    with pytest.raises(mc.Unauthorized):
        PoolClient(pool.address, "another-token-0123456789abcdef").stats()
    c.close()


def test_a_closed_connection_releases_its_leases_and_reservations(pool):
    a = PoolClient(pool.address, TOKEN)
    a.open(BB, "l")
    r = a.reserve(_keys(1, 2))
    assert a.commit(r.reservation, [True, True]) == 2
    a.lookup(_keys(1, 2), lease_s=60)
    a.reserve(_keys(3))
    assert pool.stats()["leases_held"] == 1 and pool.stats()["reservations_held"] == 1
    a.close()
    deadline = time.monotonic() + 5
    while pool.stats()["leases_held"] and time.monotonic() < deadline:
        time.sleep(0.02)
    st = pool.stats()
    assert st["leases_held"] == 0 and st["reservations_held"] == 0 and st["saves_aborted"] == 1
    pool.store.check_integrity()


def _store(pool_address, keys):
    c = PoolClient(pool_address, TOKEN)
    opened = c.open(BB, "l")
    r = c.reserve(_keys(*keys))
    # the bytes do not matter here: what is tested is who holds which key
    assert c.commit(r.reservation, [True] * len(keys)) == len(keys)
    c.close()
    return opened


def test_follower_names_the_pool_holding_the_longest_prefix(pool):
    from mooncake_rs.integrations.pool import PoolFollower

    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=8 * BB)) as other:
        _store(pool.address, [1, 2])
        _store(other.address, [1, 2, 3, 4])
        clients: dict[str, PoolClient] = {}
        local_events = []
        f = PoolFollower(pool.address, lambda a: clients.setdefault(a, PoolClient(a, TOKEN)), peers=(other.address,),
                         on_local_events=lambda s, g: local_events.append((list(s), list(g))))
        assert f.best_pool(mc.BlockHashes([1, 2, 3, 4, 5])) == (other.address, 4)
        assert local_events == [([1, 2], [])]  # only the local pool's events go to the callback
        PoolClient(other.address, TOKEN).remove(_keys(2))
        f.poll(force=True)
        assert f.best_pool(mc.BlockHashes([1, 2, 3])) == (pool.address, 2)
        for c in clients.values():
            c.close()


def test_pools_registered_in_etcd_are_followed(pool, etcd):
    from mooncake_rs.integrations.pool import PoolFollower, PoolRegistration, pool_addresses

    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=8 * BB)) as other:
        regs = [PoolRegistration(etcd.url, "host-a", pool.address), PoolRegistration(etcd.url, "host-b", other.address)]
        assert sorted(pool_addresses(etcd.url)) == sorted([pool.address, other.address])
        _store(other.address, [7, 8, 9])
        f = PoolFollower(pool.address, lambda a: PoolClient(a, TOKEN), etcd=etcd.url)
        assert f.best_pool(mc.BlockHashes([7, 8, 9])) == (other.address, 3)
        regs[1].close()  # a pool that leaves is no longer listed
        assert pool_addresses(etcd.url) == [pool.address]
        regs[0].close()


def test_submit_spans_moves_what_the_requests_would():
    """TransferEngine.submit_spans: one batch from two offset buffers, the same bytes as a
    TransferRequest per span; mismatched lists are a typed error."""
    with mc.TransferEngine("spans-a", listen="") as a:
        src = a.allocate(1 << 16)
        dst = a.allocate(1 << 16)
        np.asarray(src)[:] = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
        peer = a.connect("spans-a")
        local = np.array([0, 4096, 40960], dtype=np.uint64)
        remote = [8192, 0, 16384]
        statuses = a.submit_spans("write", src, local, peer, dst.id, remote, 1024).wait()
        assert [s.ok for s in statuses] == [True] * 3
        for lo, ro in zip(local.tolist(), remote):
            assert np.array_equal(np.asarray(dst)[ro:ro + 1024], np.asarray(src)[lo:lo + 1024])
        with pytest.raises(mc.InvalidArgument, match="one each per request"):
            a.submit_spans("read", src, [0, 1], peer, dst.id, [0], 8)
