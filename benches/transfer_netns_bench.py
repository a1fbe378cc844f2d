"""KV bandwidth between two "hosts": network namespaces joined by veth pairs and a bridge
(tests/netns_helpers.py), so bytes cross a real network interface, not loopback.

Host 0 serves a registered region (a TransferEngine listening on its interface); host 1
writes `--mib` MiB into it in 1 MiB requests, then reads them back, `--rounds` times,
with and without an auth token (per-frame BLAKE3 tags). The reference, in the same
rounds: a plain Python socket stream of the same bytes between the same two hosts
(`sendall` of 1 MiB chunks into `recv_into`), one direction. Prints the median GB/s of
each case and its ratio to the socket stream. Needs root (CAP_NET_ADMIN):

    python benches/transfer_netns_bench.py --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from netns_helpers import TestHosts, available  # noqa: E402

# host 0: serves a region (engine case) or accepts one socket stream (reference).
_SERVER = textwrap.dedent("""
    import json, socket, sys, time
    import mooncake_rs as mc
    mode, ip, n, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
    if mode == "engine":
        with mc.TransferEngine("srv", listen=ip + ":0", auth_token=token, transports=["tcp"]) as eng:
            r = eng.allocate(n)
            print(json.dumps({"address": eng.address, "region": r.id}), flush=True)
            sys.stdin.readline()  # until the client is done
    else:
        s = socket.create_server((ip, 0))
        print(json.dumps({"address": "%s:%d" % s.getsockname()}), flush=True)
        c, _ = s.accept()
        view, got = memoryview(bytearray(1 << 20)), 0
        while got < n:
            k = c.recv_into(view)
            if not k:
                break
            got += k
        c.sendall(b"k")
        sys.stdin.readline()
""")

# host 1: the client; prints the seconds of each timed pass as JSON.
_CLIENT = textwrap.dedent("""
    import json, socket, sys, time
    import mooncake_rs as mc
    mode, address, n, token, region = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None, int(sys.argv[5])
    req, batch = int(sys.argv[6]), int(sys.argv[7])  # bytes per request, requests per batch (0: one batch)
    out = {}
    if mode == "engine":
        with mc.TransferEngine("cli", listen="", auth_token=token, transports=["tcp"]) as eng:
            p = eng.connect("srv", address)
            mine = eng.allocate(n)
            for op in ("write", "read"):
                reqs = [mc.TransferRequest(op, mine, off, p, region, off, min(req, n - off)) for off in range(0, n, req)]
                eng.submit(reqs[:8], timeout_s=60).wait()  # warm the connection
                step = batch or len(reqs)
                t0 = time.perf_counter()
                for i in range(0, len(reqs), step):
                    st = eng.submit(reqs[i:i + step], timeout_s=120).wait()
                    assert all(s.ok for s in st), [s for s in st if not s.ok][:1]
                out[op] = time.perf_counter() - t0
    else:
        host, port = address.rsplit(":", 1)
        c = socket.create_connection((host, int(port)))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = memoryview(bytearray(1 << 20))
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            c.sendall(chunk[: min(len(chunk), n - sent)])
            sent += min(len(chunk), n - sent)
        assert c.recv(1) == b"k"
        out["stream"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
""")


def one(hosts: TestHosts, mode: str, n: int, token: str, *, req: int = 1 << 20, batch: int = 0,
        server: int = 0, client: int = 1) -> dict[str, float]:
    """One pass between host ``server`` and host ``client``: ``n`` bytes in requests of
    ``req`` bytes, ``batch`` requests a batch (0: all in one batch); GB/s per op."""
    srv = hosts.popen(server, [sys.executable, "-c", _SERVER, mode, hosts.ip(server), str(n), token],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None and srv.stdin is not None
    info = json.loads(srv.stdout.readline())
    cli = hosts.popen(client, [sys.executable, "-c", _CLIENT, mode, info["address"], str(n), token,
                               str(info.get("region", 0)), str(req), str(batch)], stdout=subprocess.PIPE, text=True)
    out, _ = cli.communicate(timeout=300)
    srv.stdin.write("done\n")
    srv.stdin.flush()
    srv.wait(30)
    if cli.returncode != 0:
        raise RuntimeError(f"{mode} client failed (rc {cli.returncode})")
    return {k: n / v / 1e9 for k, v in json.loads(out).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not available():
        sys.exit("network namespaces need CAP_NET_ADMIN (run as root)")
    n = a.mib << 20
    rows: dict[str, list[float]] = {}
    with TestHosts(2) as hosts:
        for _ in range(a.rounds):  # cases interleaved round by round: the same noise for each
            rows.setdefault("socket stream (reference)", []).append(one(hosts, "stream", n, "")["stream"])
            for token, label in (("", "no token"), ("netns-bench-token-0123456789abcdef", "auth token")):
                r = one(hosts, "engine", n, token)
                rows.setdefault(f"engine write, {label}", []).append(r["write"])
                rows.setdefault(f"engine read, {label}", []).append(r["read"])
    ref = statistics.median(rows["socket stream (reference)"])
    print(f"== transfer engine across network namespaces (veth + bridge), {a.mib} MiB in 1 MiB requests, "
          f"median of {a.rounds} rounds")
    for label, v in rows.items():
        m = statistics.median(v)
        print(f"  {label:28s} {m:6.2f} GB/s  x stream {m / ref:4.2f}  (range {min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
