"""The transfer engine between two "hosts" (network namespaces joined by veth pairs and
a bridge, tests/netns_helpers.py): KV bytes cross a real network interface, not
loopback, with the auth token and per-frame tags on; checked byte for byte. And a host
whose cable is cut in the middle of a transfer: the other side's batch ends with an
error within its I/O deadline (silence, no FIN or RST), it does not hang until the
batch's own timeout. (benches/transfer_netns_bench.py times the same path.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from netns_helpers import TestHosts, require


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    require()  # skips without namespaces, fails instead under MOONCAKE_REQUIRE_NETNS=1


PEER = os.path.join(os.path.dirname(__file__), "transfer_peer.py")
TOKEN = "netns-test-token-0123456789abcdef"
MiB = 1 << 20

# The initiator, run on host 1: writes seeded bytes into the peer's `dst`, reads its
# `src` back, prints what it saw as one JSON line.
_INITIATOR = textwrap.dedent("""
    import hashlib, json, sys, time
    import numpy as np
    import mooncake_rs as mc
    addr, token, src, dst, n, io_timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5]), float(sys.argv[6])
    with mc.TransferEngine("init", listen="", auth_token=token, transports=["tcp"], io_timeout_s=io_timeout,
                           connect_timeout_s=5.0) as eng:
        p = eng.connect("srv", addr)
        mine = eng.allocate(n)
        np.asarray(mine)[:] = np.random.default_rng(99).integers(0, 256, n, dtype=np.uint8)
        pulled = eng.allocate(n)
        print(json.dumps({"connected": p.transport}), flush=True)
        t0 = time.monotonic()
        reqs = [mc.TransferRequest("write", mine, 0, p, dst, 0, n), mc.TransferRequest("read", pulled, 0, p, src, 0, n)]
        try:
            out = eng.submit(reqs, timeout_s=60).wait()
            status = [(s.ok, s.bytes, str(s.error) if not s.ok else "") for s in out]
        except Exception as e:  # a typed transfer error is an answer too
            status = [(False, 0, f"{type(e).__name__}: {e}")]
        print(json.dumps({"status": status, "seconds": time.monotonic() - t0,
                          "pulled": hashlib.sha256(memoryview(pulled)).hexdigest()}), flush=True)
""")


def seeded(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(a)).hexdigest()


class Peer:
    """transfer_peer.py on a host: regions `src` (seed 11) and `dst` (seed 12)."""

    def __init__(self, hosts: TestHosts, i: int, n: int) -> None:
        cfg = {"name": "srv", "listen": f"{hosts.ip(i)}:0", "auth_token": TOKEN, "transports": ["tcp"],
               "lifetime_s": 120, "regions": [{"name": "src", "length": n, "seed": 11},
                                              {"name": "dst", "length": n, "seed": 12}]}
        self.proc = hosts.popen(i, [sys.executable, PEER, json.dumps(cfg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        info = json.loads(self.proc.stdout.readline())
        self.address: str = info["address"]
        self.regions: dict[str, int] = info["regions"]

    def sha(self, name: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"sum {self.regions[name]}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


def initiator(hosts: TestHosts, i: int, peer: Peer, n: int, io_timeout_s: float) -> subprocess.Popen[str]:
    return hosts.popen(i, [sys.executable, "-c", _INITIATOR, peer.address, TOKEN, str(peer.regions["src"]),
                           str(peer.regions["dst"]), str(n), str(io_timeout_s)], stdout=subprocess.PIPE, text=True)


def read_json(p: subprocess.Popen[str], timeout_s: float) -> dict:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = p.stdout.readline()
    assert line, f"initiator ended without an answer (rc {p.poll()})"
    assert time.monotonic() < deadline
    return json.loads(line)


def test_kv_bytes_cross_hosts_byte_for_byte() -> None:
    n = 24 * MiB + 4096  # many slices (1 MiB each) and a ragged tail
    with TestHosts(2) as hosts:
        peer = Peer(hosts, 0, n)
        assert peer.address.startswith(hosts.ip(0) + ":")  # served on host 0's interface
        init = initiator(hosts, 1, peer, n, io_timeout_s=10.0)
        assert read_json(init, 30) == {"connected": "tcp"}
        got = read_json(init, 90)
        assert [s[:2] for s in got["status"]] == [[True, n], [True, n]], got
        assert got["pulled"] == sha(seeded(n, 11))  # what host 0 holds, read from host 1
        assert peer.sha("dst") == sha(seeded(n, 99))  # what host 1 wrote, landed on host 0
        assert init.wait(30) == 0


def test_a_host_cut_mid_transfer_fails_the_batch_within_its_deadline() -> None:
    n = 512 * MiB  # long enough on a veth (with per-frame tags) that the cut lands while it moves
    io_timeout = 2.0
    with TestHosts(2) as hosts:
        peer = Peer(hosts, 0, n)
        init = initiator(hosts, 1, peer, n, io_timeout_s=io_timeout)
        assert read_json(init, 30) == {"connected": "tcp"}
        time.sleep(0.3)
        t_cut = time.monotonic()
        hosts.cut(0)  # silence: no FIN, no RST
        got = read_json(init, 60)
        waited = time.monotonic() - t_cut
        oks = [s[0] for s in got["status"]]
        if all(oks):  # the whole transfer beat the cut (a fast machine): nothing to check
            pytest.skip(f"the transfer finished in {got['seconds']:.2f}s, before the cut")
        assert not all(oks), got
        # every slice in flight waits at most its I/O deadline (plus scheduling on a busy
        # machine); nothing hangs until the batch's own 60 s timeout
        assert waited < io_timeout * 3 + 10, (waited, got)
        assert init.wait(30) == 0
