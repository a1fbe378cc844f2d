"""Per-peer grants on restricted regions (issue 17, items 1 and 9).

A decode engine registers its arena `restricted=True`; a prefill engine may then write
only the ranges the decode engine granted to its name, until the grant is revoked or
expires. Checked on the in-process, TCP and same-host (shm-capable) paths.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

import mooncake_rs as mc
from test_transfer_xproc import PeerProc  # the peer-process harness (tests/ is on sys.path)

TOKEN = "rights-test-token"
PATHS = {
    "local": ("local",),
    "tcp": ("tcp",),
    "shm": ("shm", "tcp"),
}


@pytest.fixture(params=list(PATHS))
def trio(request):
    transports = PATHS[request.param]
    reg = mc.TransferRegistry()

    def make(name: str) -> mc.TransferEngine:
        listen = "" if transports == ("local",) else "127.0.0.1:0"
        return mc.TransferEngine(name, listen=listen, auth_token=TOKEN, transports=transports, registry=reg)

    with make("decode-0") as d, make("prefill-0") as p, make("prefill-1") as q:
        addr = d.address or None
        # Over tcp/shm, connect by address: a same-host peer, not the registry's memcpy.
        yield request.param, d, p, p.connect("decode-0", addr), q, q.connect("decode-0", addr)


def write(eng, peer, local, region, offset, length, local_offset=0):
    req = mc.TransferRequest("write", local, local_offset, peer, region, offset, length)
    return eng.submit([req], timeout_s=10).wait()[0]


def read(eng, peer, local, region, offset, length):
    req = mc.TransferRequest("read", local, 0, peer, region, offset, length)
    return eng.submit([req], timeout_s=10).wait()[0]


def test_grants_gate_a_restricted_region(trio):
    path, d, p, pp, q, qp = trio
    arena = d.allocate(1 << 16, restricted=True)
    assert arena.restricted and not d.allocate(16).restricted
    assert not arena.shared  # never offered over shm
    view = np.asarray(arena)
    view[:] = 0xAA
    src = p.allocate(1 << 16)
    np.asarray(src)[:] = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    other = q.allocate(1 << 16)
    np.asarray(other)[:] = 0x33

    st = write(p, pp, src, arena, 4096, 8192)
    assert st.code == "no_grant" and not st.ok, (path, st)
    assert "grant(" in st.error  # the message says what to do
    with pytest.raises(mc.TransferFailed, match="no live grant"):
        st.raise_for_error()
    assert (view == 0xAA).all()
    assert d.stats().grant_refusals == 1 and d.stats().refused >= 1

    gid = d.grant(arena, "prefill-0", 4096, 8192, write=True)
    assert [(g.peer, g.offset, g.length, g.write, g.expires_in_s) for g in d.grants(arena)] == [
        ("prefill-0", 4096, 8192, True, None)
    ]
    assert write(p, pp, src, arena, 4096, 8192).ok
    assert (view[4096:12288] == np.asarray(src)[:8192]).all()
    assert (view[:4096] == 0xAA).all() and (view[12288:] == 0xAA).all()
    # One byte past the grant, another range, another peer: refused, nothing moved.
    before = view.copy()
    assert write(p, pp, src, arena, 12287, 2).code == "no_grant"
    assert write(p, pp, src, arena, 0, 16).code == "no_grant"
    assert write(q, qp, other, arena, 4096, 16).code == "no_grant"
    assert (view == before).all()

    assert d.revoke(arena, "prefill-0", gid) == 1
    assert write(p, pp, src, arena, 4096, 16).code == "no_grant"
    assert d.grants(arena) == []

    d.grant(arena, "prefill-0", 0, 4096, write=False)
    assert read(p, pp, src, arena, 0, 4096).ok
    assert write(p, pp, src, arena, 0, 16).code == "no_grant"
    assert d.revoke(arena, "prefill-0") == 1

    d.grant(arena, "prefill-0", 0, 4096, expires_s=0.02)
    time.sleep(0.15)  # well past the expiry; no timing is asserted
    assert write(p, pp, src, arena, 0, 16).code == "no_grant"
    assert d.stats().grant_refusals >= 7

    d.grant(arena, "prefill-0", 0, 4096)
    assert write(p, pp, src, arena, 0, 16).ok
    assert d.unregister(arena)
    assert write(p, pp, src, arena, 0, 16).code == "no_such_region"


def test_restricted_regions_go_through_the_server_even_on_the_same_host():
    with (
        mc.TransferEngine("decode-0", auth_token=TOKEN, registry=mc.TransferRegistry()) as d,
        mc.TransferEngine("prefill-0", auth_token=TOKEN, registry=mc.TransferRegistry()) as p,
    ):
        peer = p.connect("decode-0", d.address)
        assert peer.transport == "shm"
        src = p.allocate(4096)
        open_region = d.allocate(4096)
        assert write(p, peer, src, open_region, 0, 4096).ok
        assert d.stats().bytes_served == 0  # mapped and copied by the peer itself
        arena = d.allocate(4096, restricted=True)
        d.grant(arena, "prefill-0", 0, 4096)
        assert write(p, peer, src, arena, 0, 4096).ok
        assert d.stats().bytes_served == 4096  # the server moved (and checked) it
        # ... from the peer's staging buffer (a sealed memfd it was handed), not over TCP
        assert d.stats().bytes_staged == 4096
        d.revoke(arena, "prefill-0")
        assert write(p, peer, src, arena, 0, 4096).code == "no_grant"
        assert d.stats().bytes_staged == 4096 and d.stats().grant_refusals == 1


def test_register_restricted_buffer_and_bad_grants():
    reg = mc.TransferRegistry()
    with (
        mc.TransferEngine("decode-0", listen="", registry=reg) as d,
        mc.TransferEngine("prefill-0", listen="", registry=reg) as p,
    ):
        buf = bytearray(4096)
        r = d.register(buf, restricted=True)
        assert r.restricted
        peer = p.connect("decode-0")
        src = p.register(bytearray(b"x" * 4096))
        assert write(p, peer, src, r, 0, 10).code == "no_grant"
        d.grant(r.id, "prefill-0", 0, 10)
        assert write(p, peer, src, r, 0, 10).ok and bytes(buf[:11]) == b"x" * 10 + b"\0"
        open_region = d.register(bytearray(64))
        with pytest.raises(mc.InvalidArgument, match="not restricted"):
            d.grant(open_region, "prefill-0", 0, 10)
        with pytest.raises(mc.InvalidArgument, match="outside region"):
            d.grant(r, "prefill-0", 4000, 200)
        with pytest.raises(mc.InvalidArgument, match="not registered"):
            d.grant(12345, "prefill-0", 0, 1)
        with pytest.raises(mc.InvalidArgument):
            d.grant(r, "prefill-0", 0, 1, expires_s=0)
        with pytest.raises(mc.InvalidArgument):
            d.grant(r, "prefill-0", 0, 1, expires_s=float("nan"))
        ro = d.register(bytearray(64), remote_readonly=True, restricted=True)
        with pytest.raises(mc.InvalidArgument, match="read-only"):
            d.grant(ro, "prefill-0", 0, 10, write=True)
        g = d.grant(r, "prefill-0", 0, 1, expires_s=1e300)  # "never", not an error
        assert any(x.id == g and x.expires_in_s is None for x in d.grants(r))
        assert d.revoke(r, "nobody") == 0


def test_per_peer_tokens_keep_the_cluster_token_from_claiming_a_grant():
    cluster = "cluster-token"

    def make(name: str, token: str, **kw) -> mc.TransferEngine:
        return mc.TransferEngine(name, auth_token=token, transports=("tcp",), registry=mc.TransferRegistry(), **kw)

    with (
        make("decode-0", cluster, peer_tokens={"prefill-0": "prefill-0-token"}) as d,
        make("prefill-0", "prefill-0-token") as p,
        make("prefill-0", cluster) as fake,  # the shared token under the granted name
    ):
        arena = d.allocate(4096, restricted=True)
        d.grant(arena, "prefill-0", 0, 4096)
        peer = p.connect("decode-0", d.address)
        assert write(p, peer, p.allocate(4096), arena, 0, 4096).ok
        with pytest.raises(mc.TransferFailed, match="authentication"):
            fake.connect("decode-0", d.address)
        deadline = time.monotonic() + 10  # the server counts right after refusing
        while d.stats().auth_failures == 0:
            assert time.monotonic() < deadline, "the refused impostor was not counted"
            time.sleep(0.005)
    with pytest.raises(mc.InvalidArgument, match="needs auth_token"):
        mc.TransferEngine("x", peer_tokens={"p": "t"}, registry=mc.TransferRegistry())


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")])
def test_grants_across_processes(transports):
    """The decode side is another process; its arena is restricted and granted by command."""
    decode = PeerProc(
        name="decode-0",
        auth_token=TOKEN,
        transports=list(transports),
        regions=[{"name": "arena", "length": 1 << 16, "restricted": True, "fill": False}],
    )
    try:
        arena = decode.regions["arena"]
        with mc.TransferEngine(
            "prefill-0", auth_token=TOKEN, transports=transports, registry=mc.TransferRegistry()
        ) as p:
            peer = p.connect("decode-0", decode.address)
            assert peer.transport == ("shm" if "shm" in transports else "tcp")
            src = p.allocate(1 << 16)
            data = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
            np.asarray(src)[:] = data
            zeros = hashlib.sha256(bytes(1 << 16)).hexdigest()

            assert write(p, peer, src, arena, 0, 4096).code == "no_grant"
            assert decode.sha("arena") == zeros
            assert int(decode.ask(f"grant {arena} prefill-0 8192 4096")) >= 1
            assert write(p, peer, src, arena, 8192, 4096, local_offset=8192).ok
            assert write(p, peer, src, arena, 8192, 4097, local_offset=8192).code == "no_grant"
            want = bytearray(1 << 16)
            want[8192:12288] = data[8192:12288].tobytes()
            assert decode.sha("arena") == hashlib.sha256(want).hexdigest()
            assert decode.ask(f"revoke {arena} prefill-0") == "1"
            assert write(p, peer, src, arena, 8192, 16).code == "no_grant"
            s = decode.stats()
            assert s["grant_refusals"] == 3 and s["bytes_served"] == 4096  # through the server, even same-host
            # same host: staged (the server copied it out of our staging buffer), else TCP
            assert s["bytes_staged"] == (4096 if "shm" in transports else 0)
    finally:
        decode.close()
