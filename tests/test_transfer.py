"""Transfer engine, in one process: API, local path, checks, asyncio."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_rs as mc


@pytest.fixture()
def pair():
    reg = mc.TransferRegistry()
    with mc.TransferEngine("a", registry=reg) as a, mc.TransferEngine("b", registry=reg) as b:
        yield a, b, reg


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_allocate_is_shared_numpy_memory_and_registry_finds_engines(pair):
    a, b, reg = pair
    assert reg.names() == ["a", "b"]
    assert reg.address_of("b") == b.address and b.address.startswith("127.0.0.1:")
    r = a.allocate(10000)
    assert r.length >= 10000 and r.shared and not r.readonly
    x = np.asarray(r)
    x[:] = 7
    assert bytes(memoryview(r)[:3]) == b"\x07\x07\x07"
    with pytest.raises(mc.InvalidArgument, match="already registered"):
        mc.TransferEngine("a", registry=reg)
    assert "a" not in mc.TransferRegistry.default().names()  # engines joined `reg` only
    with pytest.raises(mc.InvalidArgument):
        a.allocate(0)


def test_local_read_write_between_engines_and_self(pair):
    a, b, _ = pair
    ra, rb = a.allocate(1 << 21), b.allocate(1 << 21)
    src = rand(ra.length, 1)
    np.asarray(ra)[:] = src
    p = a.connect("b")
    assert (p.name, p.transport) == ("b", "local")
    st_ = a.submit([mc.TransferRequest("write", ra, 0, p, rb.id, 0, ra.length)]).wait()
    assert st_[0].ok and st_[0].bytes == ra.length and st_[0].error is None and st_[0].state == "done"
    assert hashlib.sha256(memoryview(rb)).digest() == hashlib.sha256(src).digest()
    buf = bytearray(4096)
    local = a.register(buf)
    me = a.connect("a")
    reqs = [mc.TransferRequest("read", local, i * 64, me, ra, 1000 + i * 64, 64) for i in range(64)]
    out = a.submit(reqs).wait()
    assert all(s.ok for s in out) and len(out) == 64
    assert bytes(buf) == src[1000 : 1000 + 4096].tobytes()


def test_register_any_buffer_and_regions(pair):
    a, b, _ = pair
    arr = np.zeros((16, 256), dtype=np.float32)
    r = a.register(arr)
    assert r.length == arr.nbytes and not r.shared
    ro = a.register(b"immutable", readonly=True)
    assert ro.readonly
    with pytest.raises(mc.InvalidArgument, match="readonly=True"):
        a.register(b"immutable")
    with pytest.raises(mc.InvalidArgument, match="buffer"):
        a.register(42)
    with pytest.raises(mc.InvalidArgument):
        a.register(np.zeros((8, 8))[:, ::2])  # not contiguous
    again = b.register(a.allocate(8192))  # a Region of another engine
    assert again.shared and again.length == 8192
    assert a.unregister(r) and not a.unregister(r.id)
    assert a.stats().regions == 2


def test_local_side_errors_raise_invalid_argument(pair):
    a, b, _ = pair
    p = a.connect("b")
    r = a.allocate(4096)
    ro = a.register(b"x" * 100, readonly=True)
    rb = b.allocate(4096)
    with pytest.raises(mc.InvalidArgument, match="outside"):
        a.submit([mc.TransferRequest("write", r, 4000, p, rb.id, 0, 200)])
    with pytest.raises(mc.InvalidArgument, match="read-only"):
        a.submit([mc.TransferRequest("read", ro, 0, p, rb.id, 0, 10)])
    with pytest.raises(mc.InvalidArgument, match="op"):
        mc.TransferRequest("copy", r, 0, p, rb.id, 0, 1)
    with pytest.raises(mc.InvalidArgument, match="TransferRequest"):
        a.submit([1, 2])
    with pytest.raises(mc.InvalidArgument, match="timeout_s"):
        a.submit([], timeout_s=-1)
    with pytest.raises(mc.InvalidArgument):
        mc.TransferEngine("z", transports=("carrier-pigeon",))


def test_remote_refusals_are_typed_statuses_and_memory_untouched(pair):
    a, b, _ = pair
    p = a.connect("b")
    r = a.allocate(8192)
    np.asarray(r)[:] = 1
    ro = b.allocate(4096, readonly=True)
    rw = b.allocate(4096)
    np.asarray(rw)[:] = 9
    before = (bytes(memoryview(ro)), bytes(memoryview(rw)))
    out = a.submit(
        [
            mc.TransferRequest("write", r, 0, p, ro.id, 0, 10),
            mc.TransferRequest("write", r, 0, p, rw.id, 4000, 200),
            mc.TransferRequest("write", r, 0, p, 12345, 0, 10),
        ]
    ).wait()
    assert [s.code for s in out] == ["read_only", "out_of_bounds", "no_such_region"]
    assert all(not s.ok and s.category == "TransferFailed" for s in out)
    with pytest.raises(mc.TransferFailed, match="read-only"):
        out[0].raise_for_error()
    assert (bytes(memoryview(ro)), bytes(memoryview(rw))) == before
    assert b.stats().refused == 3


def test_await_cancel_and_closed_engine(pair):
    a, b, _ = pair
    p = a.connect("b")
    r, rb = a.allocate(1 << 22), b.allocate(1 << 22)

    async def go():
        return await a.submit([mc.TransferRequest("write", r, 0, p, rb.id, 0, r.length)])

    res = asyncio.run(go())
    assert res[0].ok and res[0].bytes == 1 << 22
    batch = a.submit([mc.TransferRequest("read", r, 0, p, rb.id, 0, 4096)])
    batch.cancel()  # already done (inline copy): cancel leaves it done
    assert batch.done and batch.status()[0].ok and len(batch) == 1
    b.close()
    out = a.submit([mc.TransferRequest("read", r, 0, p, rb.id, 0, 4096)]).wait(timeout_s=5)
    assert out[0].code == "closed"
    a.close()
    assert a.closed
    with pytest.raises(mc.TransferFailed):
        a.allocate(10)
    with pytest.raises(mc.TransferFailed):
        a.connect("b")


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["read", "write"]), st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 3000)),
        min_size=1,
        max_size=12,
    )
)
def test_random_batches_match_a_numpy_model(ops):
    reg = mc.TransferRegistry()
    with mc.TransferEngine("x", registry=reg, transports=["local"]) as x, mc.TransferEngine(
        "y", registry=reg, transports=["local"]
    ) as y:
        rx, ry = x.allocate(8192), y.allocate(8192)
        mx, my = rand(8192, 3), rand(8192, 4)
        np.asarray(rx)[:] = mx
        np.asarray(ry)[:] = my
        p = x.connect("y")
        for op, lo, ro, n in ops:  # one request per batch: order is defined
            out = x.submit([mc.TransferRequest(op, rx, lo, p, ry.id, ro, n)]).wait()
            assert out[0].ok
            if op == "write":
                my[ro : ro + n] = mx[lo : lo + n]
            else:
                mx[lo : lo + n] = my[ro : ro + n]
        assert np.array_equal(np.asarray(rx), mx) and np.array_equal(np.asarray(ry), my)


def test_store_arena_registers_and_receives_a_transfer():
    """TransferEngine.register(store): bytes pushed into a reserved slot commit intact."""
    import numpy as np

    from mooncake_rs import Store, TransferEngine, TransferRequest

    block = 4096
    store = Store(block, 8 * block)
    with TransferEngine("arena-a") as a:
        src = a.allocate(block)
        payload = np.random.default_rng(3).integers(0, 256, block, dtype=np.uint8)
        np.asarray(src)[:] = payload
        dst = a.register(store)
        assert dst.length >= 8 * block
        w = store.reserve(77)
        peer = a.connect("arena-a")
        req = TransferRequest("write", src, 0, peer, dst.id, w.offset, block)
        assert all(s.ok for s in a.submit([req], timeout_s=5).wait())
        w.commit()
        assert store.slot_offset(77) == req.remote_offset
        assert bytes(memoryview(store.get(77))) == payload.tobytes()
        assert not np.asarray(dst).flags.writeable  # the arena is not writable from Python


def test_connections_per_endpoint_defaults_to_automatic_and_rejects_zero():
    """Issue 26: with a token the default opens as many connections per endpoint as the
    host's cores make useful (1 without a token); 0 is not a count."""
    with pytest.raises(mc.InvalidArgument, match="connections_per_endpoint"):
        mc.TransferEngine("zero", listen="", connections_per_endpoint=0)
    with pytest.raises(mc.InvalidArgument, match="connections_per_endpoint"):
        mc.TransferEngine("many", listen="", connections_per_endpoint=65)
    reg = mc.TransferRegistry()
    with mc.TransferEngine("srv", auth_token="t", transports=["tcp"], registry=reg) as srv, \
            mc.TransferEngine("plain", transports=["tcp"], registry=reg) as open_srv, \
            mc.TransferEngine("cli", listen="", auth_token="t", transports=["tcp"], registry=mc.TransferRegistry()) as cli, \
            mc.TransferEngine("cli2", listen="", transports=["tcp"], registry=mc.TransferRegistry()) as cli2, \
            mc.TransferEngine("cli3", listen="", auth_token="t", transports=["tcp"], connections_per_endpoint=3,
                              registry=mc.TransferRegistry()) as cli3:
        # Half the cores the process may use, 1 to 4 (the rule is unit-tested in Rust).
        assert 1 <= cli.connect("srv", srv.address).connections <= 4
        # without a token: two where the process may use two cores or more
        assert cli2.connect("plain", open_srv.address).connections == min(2, len(os.sched_getaffinity(0)))
        p3 = cli3.connect("srv", srv.address)
        assert p3.connections == 3
        src, dst = cli3.allocate(3 << 20), srv.allocate(3 << 20)
        data = rand(3 << 20, 5)
        np.asarray(src)[:] = data
        reqs = [mc.TransferRequest("write", src, i << 20, p3, dst.id, i << 20, 1 << 20) for i in range(3)]
        assert all(s.ok for s in cli3.submit(reqs).wait())
        assert np.array_equal(np.asarray(dst), data)


def test_wire_protection_integrity_moves_the_same_bytes_and_must_match():
    """Issue 26: `wire_protection="integrity"` (frames authenticated, KV bytes in clear)
    moves the bytes an encrypted session moves; a bad value, the option without a token,
    and engines configured differently are typed errors that say what to set."""
    with pytest.raises(mc.InvalidArgument, match="integrity"):
        mc.TransferEngine("bad", listen="", auth_token="t", wire_protection="mac")
    with pytest.raises(mc.InvalidArgument, match="auth_token"):
        mc.TransferEngine("tokenless", listen="", wire_protection="integrity")
    data = rand(5 << 20, 9)
    got = {}
    for mode in ("integrity", "encrypted", None):
        reg = mc.TransferRegistry()
        with mc.TransferEngine("srv", auth_token="t", transports=["tcp"], registry=reg, wire_protection=mode) as srv, \
                mc.TransferEngine("cli", listen="", auth_token="t", transports=["tcp"], wire_protection=mode,
                                  registry=mc.TransferRegistry()) as cli:
            peer = cli.connect("srv", srv.address)
            src, dst, back = cli.allocate(len(data)), srv.allocate(len(data)), cli.allocate(len(data))
            np.asarray(src)[:] = data
            half = len(data) // 2
            reqs = [mc.TransferRequest("write", src, 0, peer, dst.id, 0, half),
                    mc.TransferRequest("write", src, half, peer, dst.id, half, len(data) - half)]
            assert all(s.ok for s in cli.submit(reqs).wait())
            assert all(s.ok for s in cli.submit([mc.TransferRequest("read", back, 0, peer, dst.id, 0, len(data))]).wait())
            got[mode] = (np.asarray(dst).tobytes(), np.asarray(back).tobytes())
    assert got["integrity"] == got["encrypted"] == got[None] == (data.tobytes(), data.tobytes())
    reg = mc.TransferRegistry()
    with mc.TransferEngine("srv", auth_token="t", transports=["tcp"], registry=reg, wire_protection="integrity") as srv, \
            mc.TransferEngine("cli", listen="", auth_token="t", transports=["tcp"],
                              registry=mc.TransferRegistry()) as cli:
        with pytest.raises(mc.TransferFailed, match="wire_protection mismatch") as e:
            cli.connect("srv", srv.address)
        assert "integrity" in str(e.value) and "encrypted" in str(e.value)


def test_a_restarted_server_is_redialed_by_the_next_batch():
    """A peer whose connections are all lost is redialed by the engine at its known
    address (same token and name): while nobody listens the batch fails with
    connection_lost, once the server is back the next batch lands there."""

    def server(listen="127.0.0.1:0"):
        return mc.TransferEngine("srv", auth_token="tok", transports=["tcp"], listen=listen,
                                 registry=mc.TransferRegistry())

    srv = server()
    addr = srv.address
    cli = mc.TransferEngine("cli", auth_token="tok", transports=["tcp"], registry=mc.TransferRegistry())
    try:
        peer = cli.connect("srv", addr)
        region = srv.allocate(1 << 20)
        src = cli.allocate(1 << 20)
        np.asarray(src)[:] = rand(1 << 20, 5)

        def write(r):
            return cli.submit([mc.TransferRequest("write", src, 0, peer, r.id, 0, 65536)], timeout_s=10).wait()[0]

        assert write(region).ok
        srv.close()
        # The first batch after the close may meet a connection not yet seen lost; then
        # every batch redials, and fails while nothing listens.
        for _ in range(200):
            st = write(region)
            assert not st.ok and st.code == "connection_lost", st.error
            if "redialing" in st.error:
                break
            time.sleep(0.02)
        assert "redialing" in st.error, st.error
        assert cli.stats().reconnects == 0
        srv = server(addr)
        region2 = srv.allocate(1 << 20)
        assert region2.id == region.id
        st = write(region2)
        assert st.ok, st.error
        assert bytes(memoryview(region2)[:65536]) == bytes(memoryview(src)[:65536])
        assert cli.stats().reconnects == 1
    finally:
        cli.close()
        srv.close()
