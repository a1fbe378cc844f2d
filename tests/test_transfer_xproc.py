"""Transfer engine across processes on 127.0.0.1: every transport and op byte for byte,
a SIGKILLed peer, a failed endpoint, refusals and authentication."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import mooncake_rs as mc

PEER = os.path.join(os.path.dirname(__file__), "transfer_peer.py")
MiB = 1 << 20


class PeerProc:
    """A child process serving regions (see transfer_peer.py)."""

    def __init__(self, **cfg):
        cfg.setdefault("lifetime_s", 60)
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [sys.executable, PEER, json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        assert line, "peer process failed to start"
        info = json.loads(line)
        self.address: str = info["address"]
        self.regions: dict[str, int] = info["regions"]

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sha(self, name: str) -> str:
        return self.ask(f"sum {self.regions[name]}")

    def stats(self) -> dict:
        return json.loads(self.ask("stats"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture()
def peers():
    started: list[PeerProc] = []

    def start(**cfg) -> PeerProc:
        p = PeerProc(**cfg)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def expected(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)


def sha(a) -> str:
    return hashlib.sha256(memoryview(a)).hexdigest()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_random_data_every_op_byte_for_byte(peers, transport):
    n = 6 * MiB + 4096
    srv = peers(regions=[{"name": "src", "length": n, "seed": 11}, {"name": "dst", "length": n, "seed": 12}])
    ts = ["shm", "tcp"] if transport == "shm" else ["tcp"]
    with mc.TransferEngine("init", transports=ts, registry=mc.TransferRegistry()) as eng:
        p = eng.connect("srv", srv.address)
        assert p.transport == transport
        mine = eng.allocate(n)
        data = expected(n, 99)
        np.asarray(mine)[:] = data
        src, dst = srv.regions["src"], srv.regions["dst"]
        pulled = eng.allocate(n)
        # writes: many requests of mixed sizes; reads: the whole region in one request
        sizes = [4096, 65536, 512 * 1024, 4 * MiB + 12345]
        reqs, off = [], 0
        while off < n:
            ln = min(sizes[len(reqs) % len(sizes)], n - off)
            reqs.append(mc.TransferRequest("write", mine, off, p, dst, off, ln))
            off += ln
        reqs.append(mc.TransferRequest("read", pulled, 0, p, src, 0, n))
        out = eng.submit(reqs, timeout_s=60).wait()
        assert all(s.ok for s in out), [s for s in out if not s.ok]
        assert sum(s.bytes for s in out) == 2 * n
        assert srv.sha("dst") == sha(data)
        assert sha(pulled) == sha(expected(n, 11))
        served = srv.stats()["bytes_served"]
        assert (served == 0) if transport == "shm" else (served == 2 * n)


@pytest.mark.parametrize("copy", ["direct", "staging"])
def test_restricted_region_of_another_process_byte_for_byte(peers, copy, monkeypatch):
    # One copy by the region's server into this process's buffers, or (forced) two through
    # a staging buffer: the same bytes, every write and read counted by the server's
    # staged path (no TCP), odd sizes and offsets across the chunk size.
    monkeypatch.setenv("MOONCAKE_STAGED_COPY", copy)
    n = 5 * MiB + 777
    srv = peers(auth_token="t", regions=[{"name": "arena", "length": 8 * MiB, "seed": 21, "restricted": True}])
    arena = srv.regions["arena"]
    assert int(srv.ask(f"grant {arena} init3 1000 {n}")) > 0
    with mc.TransferEngine("init3", auth_token="t", registry=mc.TransferRegistry()) as eng:
        p = eng.connect("peer", srv.address)
        assert p.transport == "shm"
        mine = eng.allocate(n)
        data = expected(n, 31)
        np.asarray(mine)[:n] = data
        sizes = [4096 + 3, 128 * 1024, MiB - 1, MiB + 1, 2 * MiB + 5]
        reqs, off = [], 0
        while off < n:
            ln = min(sizes[len(reqs) % len(sizes)], n - off)
            reqs.append(mc.TransferRequest("write", mine, off, p, arena, 1000 + off, ln))
            off += ln
        out = eng.submit(reqs, timeout_s=60).wait()
        assert all(s.ok for s in out), [s for s in out if not s.ok]
        pulled = eng.allocate(n + 64)
        out = eng.submit([mc.TransferRequest("read", pulled, 64, p, arena, 1000, n)], timeout_s=60).wait()
        assert out[0].ok, out[0]
        assert sha(np.asarray(pulled)[64 : 64 + n]) == sha(data)
        # Outside the grant: refused, nothing moved.
        out = eng.submit([mc.TransferRequest("write", mine, 0, p, arena, 0, 1000)]).wait()
        assert not out[0].ok and out[0].code == "no_grant"
    st = srv.stats()
    assert st["bytes_staged"] == n and st["bytes_staged_read"] == n, st
    whole = np.asarray(expected(8 * MiB, 21)).copy()
    whole[1000 : 1000 + n] = data
    assert srv.sha("arena") == sha(whole)


def test_non_shared_region_of_a_same_host_peer_goes_over_tcp(peers):
    srv = peers(regions=[{"name": "plain", "length": MiB, "seed": 5, "shared": False}])
    with mc.TransferEngine("init2", registry=mc.TransferRegistry()) as eng:
        p = eng.connect("srv", srv.address)
        assert p.transport == "shm"
        buf = eng.allocate(MiB)
        out = eng.submit([mc.TransferRequest("read", buf, 0, p, srv.regions["plain"], 0, MiB)]).wait()
        assert out[0].ok
        assert sha(buf) == sha(expected(MiB, 5))
        assert srv.stats()["bytes_served"] == MiB


def test_sigkilled_peer_fails_its_requests_others_go_on(peers):
    victim = peers(name="victim", regions=[{"name": "r", "length": 64 * MiB, "fill": False}])
    other = peers(name="other", regions=[{"name": "r", "length": 64 * MiB, "fill": False}])
    with mc.TransferEngine("init3", transports=["tcp"], registry=mc.TransferRegistry()) as eng:
        pv, po = eng.connect("victim", victim.address), eng.connect("other", other.address)
        mine = eng.allocate(64 * MiB)
        data = expected(64 * MiB, 3)
        np.asarray(mine)[:] = data

        def writes(p, rid, rounds):
            return [
                mc.TransferRequest("write", mine, (i % 16) * 4 * MiB, p, rid, (i % 16) * 4 * MiB, 4 * MiB)
                for i in range(rounds)
            ]

        doomed = eng.submit(writes(pv, victim.regions["r"], 256), timeout_s=30)  # 1 GiB: long enough
        fine = eng.submit(writes(po, other.regions["r"], 16), timeout_s=30)
        deadline = time.monotonic() + 20
        while not any(s.ok for s in doomed.status()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert any(s.ok for s in doomed.status()), "the batch never got going"
        os.kill(victim.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = doomed.wait()
        assert time.monotonic() - t0 < 25
        assert all(s.state != "pending" for s in out)
        failed = [s for s in out if not s.ok]
        assert failed and {s.code for s in failed} <= {"connection_lost"}, {s.code for s in failed}
        assert all(s.ok for s in fine.wait())
        again = eng.submit(writes(po, other.regions["r"], 16), timeout_s=30).wait()
        assert all(s.ok for s in again)
        assert other.sha("r") == sha(data)
        late = eng.submit(writes(pv, victim.regions["r"], 1), timeout_s=5).wait()
        assert late[0].code == "connection_lost"


class CuttingProxy:
    """Forwards one TCP endpoint and cuts every connection after `budget` bytes."""

    def __init__(self, target: str, budget: int):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.budget = budget
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.cut = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        self.sock.settimeout(30)
        try:
            while True:
                c, _ = self.sock.accept()
                threading.Thread(target=self.pipe, args=(c,), daemon=True).start()
        except OSError:
            pass

    def pipe(self, c):
        s = socket.create_connection(self.target, timeout=30)
        c.settimeout(30)
        moved = [0]

        def one_way(a, b, count):
            try:
                while True:
                    d = a.recv(65536)
                    if not d:
                        break
                    b.sendall(d)
                    if count:
                        moved[0] += len(d)
                        if moved[0] > self.budget:
                            self.cut.set()
                            break
            except OSError:
                pass
            for x in (a, b):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        t = threading.Thread(target=one_way, args=(s, c, False), daemon=True)
        t.start()
        one_way(c, s, True)
        t.join(30)
        c.close()
        s.close()

    def close(self):
        self.sock.close()


def test_one_of_two_endpoints_fails_transfer_completes_on_the_other(peers):
    srv = peers(listen="127.0.0.1:0,127.0.0.1:0", regions=[{"name": "r", "length": 32 * MiB, "fill": False}])
    ep0, ep1 = srv.address.split(",")
    proxy = CuttingProxy(ep0, budget=3 * MiB)
    try:
        with mc.TransferEngine("init4", transports=["tcp"], slice_size=256 * 1024, connections_per_endpoint=1,
                               registry=mc.TransferRegistry()) as eng:
            p = eng.connect("srv", f"{proxy.address},{ep1}")
            assert p.connections == 2
            mine = eng.allocate(32 * MiB)
            data = expected(32 * MiB, 8)
            np.asarray(mine)[:] = data
            reqs = [mc.TransferRequest("write", mine, i * 4 * MiB, p, srv.regions["r"], i * 4 * MiB, 4 * MiB) for i in range(8)]
            out = eng.submit(reqs, timeout_s=60).wait()
            assert proxy.cut.is_set(), "the proxy never cut its connection"
            assert all(s.ok for s in out), [s for s in out if not s.ok]
            assert p.connections == 1
            assert eng.stats().retries >= 1
            assert srv.sha("r") == sha(data)
    finally:
        proxy.close()


def test_refusals_and_wrong_token_are_typed(peers):
    srv = peers(
        auth_token="s3cret",
        regions=[{"name": "ro", "length": 8192, "readonly": True, "seed": 1}, {"name": "rw", "length": 8192, "seed": 2}],
    )
    before = (srv.sha("ro"), srv.sha("rw"))
    for bad in (None, "wrong"):
        with mc.TransferEngine("intruder", auth_token=bad, transports=["tcp"], registry=mc.TransferRegistry()) as eng:
            with pytest.raises(mc.TransferFailed, match="auth"):
                eng.connect("srv", srv.address)
    # the tokenless client gives up before proving; the server counts the wrong token on
    # its own thread, which may run after the client has seen the refusal (a CI run read 0)
    deadline = time.monotonic() + 10
    while srv.stats()["auth_failures"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.stats()["auth_failures"] == 1
    for ts in (["tcp"], ["shm", "tcp"]):
        with mc.TransferEngine("ok", auth_token="s3cret", transports=ts, registry=mc.TransferRegistry()) as eng:
            p = eng.connect("srv", srv.address)
            mine = eng.allocate(16384)
            out = eng.submit(
                [
                    mc.TransferRequest("write", mine, 0, p, srv.regions["ro"], 0, 100),
                    mc.TransferRequest("write", mine, 0, p, srv.regions["rw"], 8000, 1000),
                    mc.TransferRequest("read", mine, 0, p, srv.regions["rw"], 2**63, 10),
                    mc.TransferRequest("read", mine, 0, p, 424242, 0, 10),
                    mc.TransferRequest("read", mine, 0, p, srv.regions["ro"], 0, 8192),
                ],
                timeout_s=20,
            ).wait()
            assert [s.code for s in out] == ["read_only", "out_of_bounds", "out_of_bounds", "no_such_region", None], ts
            assert out[4].ok and sha(memoryview(mine)[:8192]) == before[0]
            with pytest.raises(mc.TransferFailed):
                out[0].raise_for_error()
    assert (srv.sha("ro"), srv.sha("rw")) == before
