#!/usr/bin/env python3
"""Transfer engine benchmark, side by side with the physical references, in one run.

  python benches/transfer_bench.py [--budget 0.6] [--rounds 3] [--peer] [--only latency]

* shm: 4 MiB requests x 64 (256 MiB working set) to a peer process, vs np.copyto of the
  same 256 MiB;
* TCP loopback: 64 KiB / 512 KiB / 4 MiB requests in batches of 32 and 64 to a peer
  process, vs a plain Python socket stream between two processes moving the same bytes
  from and to the same offsets; with --auth also with a token, one column per wire
  protection (--auth-modes: encrypted, integrity), each with its CPU-s/GB on both ends;
* offsets (like for like): call k of a case moves ``total`` = size x batch bytes from
  offset ``base_k = (k * total) % (WS - total + 1)`` of the sender's 256 MiB buffer to the
  same offset of the receiver's, for the socket reference and for every engine row alike
  ("walk"). Why walking and not one fixed window: transfers in serving move KV of distinct
  slots of large arenas, so neither end finds its bytes in cache; a fixed window (the
  first ``total`` bytes every call) stays cache-resident on both ends while it fits in the
  last-level cache (512 KiB x 32 = 16 MiB does, 4 MiB x 32 = 128 MiB mostly does not), and
  then measures the cache, not the path. Until issue 26's k26a the reference streamed a
  fixed window while the engine rows walked; that reference is still measured and printed
  (``socket fixed``), and --cross also runs the engine rows at the fixed window, so the
  effect of the pattern on each side is visible in the same run;
* latency of one 4 KiB TCP write (submit + wait) vs a plain 4 KiB -> 8 B socket ping-pong,
  with and without the inline send and an auth token, each split into its stages by the
  batch's own timestamps (Python -> engine, engine round trip, waiter wake-up);
* Python overhead of submit + wait of 64 local 64-byte transfers;
* --peer: also runs Mooncake's te_bench.py (peers/mooncake, needs the peer venv in $MC_PEER_VENV).

Every child is started by this script and stopped by it (or by its own alarm).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
from pathlib import Path
import socket
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np

import mooncake_rs as mc

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "tests", "transfer_peer.py")
MOONCAKE = os.environ.get("MOONCAKE_PEER_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "peers" / "mooncake"))
MiB = 1 << 20
WS = 256 * MiB


def med(xs):
    return statistics.median(xs)


def timed(fn, budget, min_reps=3, max_reps=2000):
    out = []
    t_end = time.perf_counter() + budget
    while len(out) < min_reps or (time.perf_counter() < t_end and len(out) < max_reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def cpu_s(*pids):
    """CPU seconds the processes' threads have run so far (schedstat: ns, every thread),
    so a figure counts the work both ends did, whatever else loads the machine."""
    total = 0
    for pid in pids:
        for stat in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            try:
                with open(stat) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that just ended
    return total / 1e9


def start_peer(**cfg):
    cfg.setdefault("lifetime_s", 240)
    p = subprocess.Popen([sys.executable, PEER, json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())


def stop(p):
    try:
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait(10)
    except Exception:
        p.kill()
        p.wait()


def close_all(engines, ref, peers) -> None:
    """Closes the bench's engines, its reference and its peer processes."""
    for e in engines:
        e.close()
    ref.close()
    for p, _ in peers.values():
        stop(p)


# ---- plain socket reference (child process) -------------------------------------------

SOCK_CHILD = textwrap.dedent(
    """
    import socket, sys, signal
    signal.alarm(240)
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(WS_BYTES))
    def recv_exact(n, off=0):
        got = 0
        while got < n:
            k = c.recv_into(buf[(off + got) % len(buf):][: n - got])
            if k == 0:
                sys.exit(0)
            got += k
    while True:
        hdr = bytearray(24)
        got = 0
        while got < 24:
            k = c.recv_into(memoryview(hdr)[got:])
            if k == 0:
                sys.exit(0)
            got += k
        mode, n = int.from_bytes(hdr[:8], "little"), int.from_bytes(hdr[8:16], "little")
        base = int.from_bytes(hdr[16:], "little")
        if mode == 0:          # stream: receive n bytes in chunks into buf[base:], ack once
            chunk = n >> 40
            total = n & ((1 << 40) - 1)
            off = 0
            while off < total:
                k = min(chunk, total - off)
                recv_exact(k, base + off)
                off += k
            c.sendall(b"a")
        else:                  # ping-pong: n rounds of 4 KiB -> 8 B
            for _ in range(n):
                recv_exact(4096)
                c.sendall(b"12345678")
    """
).replace("WS_BYTES", str(WS))


class SocketRef:
    def __init__(self):
        self.p = subprocess.Popen([sys.executable, "-c", SOCK_CHILD], stdout=subprocess.PIPE, text=True)
        port = int(self.p.stdout.readline())
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.data = memoryview(np.random.default_rng(0).integers(0, 256, WS, dtype=np.uint8))

    def stream(self, chunk, total, base=0):
        """Sends ``data[base:base+total]`` in ``chunk``-byte sends into the child's
        ``buf[base:base+total]``; returns after the child acknowledged the last byte."""
        assert base + total <= WS, (base, total)
        self.s.sendall((0).to_bytes(8, "little") + ((chunk << 40) | total).to_bytes(8, "little")
                       + base.to_bytes(8, "little"))
        off = 0
        while off < total:
            k = min(chunk, total - off)
            self.s.sendall(self.data[base + off : base + off + k])
            off += k
        assert self.s.recv(1) == b"a"

    def pingpong(self, n):
        self.s.sendall((1).to_bytes(8, "little") + n.to_bytes(8, "little") + bytes(8))
        lat = []
        msg = self.data[:4096]
        ack = bytearray(8)
        for _ in range(n):
            t0 = time.perf_counter()
            self.s.sendall(msg)
            got = 0
            while got < 8:
                got += self.s.recv_into(memoryview(ack)[got:])
            lat.append(time.perf_counter() - t0)
        return lat

    def close(self):
        self.s.close()
        self.p.wait(10)


# ---- cases ---------------------------------------------------------------------------


def bench_overhead(budget):
    with mc.TransferEngine("bench-local", transports=["local"], registry=mc.TransferRegistry()) as e:
        src, dst = e.allocate(MiB), e.register(bytearray(4096))
        me = e.connect("bench-local")
        reqs = [mc.TransferRequest("read", dst, i * 64, me, src.id, i * 64, 64) for i in range(64)]
        for _ in range(300):
            e.submit(reqs).wait()
        n = 5000
        reps = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                e.submit(reqs).wait()
            reps.append((time.perf_counter() - t0) / n * 1e6)
    return {"submit_wait_64_local_us": med(reps)}


def bench_shm(budget):
    peer, info = start_peer(name="bench-shm", regions=[{"name": "r", "length": WS, "fill": False}])
    out = {}
    try:
        with mc.TransferEngine("bench-shm-init", registry=mc.TransferRegistry()) as e:
            p = e.connect("bench-shm", info["address"])
            assert p.transport == "shm"
            mine = e.allocate(WS)
            np.asarray(mine)[:] = 1
            rid = info["regions"]["r"]
            for op in ("write", "read"):
                reqs = [mc.TransferRequest(op, mine, i * 4 * MiB, p, rid, i * 4 * MiB, 4 * MiB) for i in range(64)]
                assert all(s.ok for s in e.submit(reqs).wait())  # maps + faults the pages in
                lat = timed(lambda: e.submit(reqs).wait(), budget)
                out[f"shm_{op}_GBps"] = WS / med(lat) / 1e9
        a = np.ones(WS, dtype=np.uint8)
        b = np.zeros(WS, dtype=np.uint8)
        np.copyto(b, a)
        out["copyto_GBps"] = WS / med(timed(lambda: np.copyto(b, a), budget)) / 1e9
    finally:
        stop(peer)
    return out


# Token variants: label -> wire_protection ("tcpauth" keeps its name from earlier runs).
AUTH_VARIANTS = {"encrypted": "tcpauth", "integrity": "tcpint"}
LABEL_TEXT = {"tcp": "", "tcpauth": "encrypted ", "tcpint": "integrity "}


def call_base(pattern, k, total):
    """Offset of call ``k``'s first byte on both ends: "walk" steps through the whole
    buffer call by call (the like-for-like pattern: module docstring), "fixed" is 0."""
    return (k * total) % (WS - total + 1) if pattern == "walk" else 0


def bench_tcp(budget, sizes, batches, rounds, auth=False, auth_conns=None, auth_modes=("encrypted", "integrity"),
              cross=False):
    """TCP requests against the plain socket stream, interleaved per round; with ``auth``
    also engine pairs holding a token, one per wire protection of ``auth_modes``
    (encrypted: AES-256-GCM frames; integrity: BLAKE3-tagged frames in clear), in the
    same rounds. The reference runs at both offset patterns (``call_base``); our rows at
    "walk", and with ``cross`` at "fixed" too."""
    token = "bench-token-0123456789"
    variants = [("tcp", None, None)] + ([(AUTH_VARIANTS[m], token, m) for m in auth_modes] if auth else [])
    peers = {label: start_peer(name=f"bench-{label}", regions=[{"name": "r", "length": WS, "fill": False}],
                               transports=["tcp"], auth_token=tok, wire_protection=mode)
             for label, tok, mode in variants}
    ref = SocketRef()
    out = {}
    engines = []
    try:
        sides = {}
        for label, tok, mode in variants:
            conns = {"connections_per_endpoint": auth_conns} if tok and auth_conns else {}
            e = mc.TransferEngine(f"bench-{label}-init", auth_token=tok, transports=["tcp"],
                                  registry=mc.TransferRegistry(), wire_protection=mode, **conns)
            engines.append(e)
            info = peers[label][1]
            p = e.connect(f"bench-{label}", info["address"])
            out[f"{label}_connections"] = p.connections
            mine = e.allocate(WS)
            np.asarray(mine)[:] = 1
            rid = info["regions"]["r"]
            # fault in the peer's pages once (tmpfs allocates on first touch)
            for op in ("write", "read"):
                warm = [mc.TransferRequest(op, mine, i * 4 * MiB, p, rid, i * 4 * MiB, 4 * MiB) for i in range(64)]
                assert all(s.ok for s in e.submit(warm, timeout_s=60).wait())
            sides[label] = (e, p, mine, rid)
        acc: dict[str, list[float]] = {}
        patterns = ("walk", "fixed") if cross else ("walk",)
        for _ in range(rounds):  # cases interleaved, ours next to the reference, per round
            for size in sizes:
                for nb in batches:
                    total = size * nb
                    for pattern in ("walk", "fixed"):  # the reference both ways, every run
                        sk = "sock" if pattern == "walk" else "sockfix"
                        k = [0]

                        def ref_one():
                            ref.stream(size, total, call_base(pattern, k[0], total))
                            k[0] += 1

                        c0 = cpu_s(os.getpid(), ref.p.pid)
                        ref_lat = timed(ref_one, budget)
                        sock_cpu = (cpu_s(os.getpid(), ref.p.pid) - c0) / (total * len(ref_lat) / 1e9)
                        acc.setdefault(f"{sk}_{size}_{nb}_GBps", []).append(total / med(ref_lat) / 1e9)
                        acc.setdefault(f"{sk}_{size}_{nb}_cpu_s_per_GB", []).append(sock_cpu)
                    for pattern in patterns:
                        sk = "sock" if pattern == "walk" else "sockfix"
                        sock = acc[f"{sk}_{size}_{nb}_GBps"][-1]
                        for label0, (e, p, mine, rid) in sides.items():
                            label = label0 if pattern == "walk" else f"{label0}@fixed"
                            plain_label = "tcp" if pattern == "walk" else "tcp@fixed"
                            for op in ("write", "read"):
                                k = [0]

                                def one():
                                    base = call_base(pattern, k[0], total)
                                    k[0] += 1
                                    reqs = [
                                        mc.TransferRequest(op, mine, base + i * size, p, rid, base + i * size, size)
                                        for i in range(nb)
                                    ]
                                    st = e.submit(reqs, timeout_s=60).wait()
                                    assert all(s.ok for s in st), st[0]

                                one()
                                c0 = cpu_s(os.getpid(), peers[label0][0].pid)
                                lat = timed(one, budget)
                                cpu = (cpu_s(os.getpid(), peers[label0][0].pid) - c0) / (total * len(lat) / 1e9)
                                key = f"{label}_{op}_{size}_{nb}"
                                acc.setdefault(f"{key}_cpu_s_per_GB", []).append(cpu)
                                v = total / med(lat) / 1e9
                                acc.setdefault(f"{key}_GBps", []).append(v)
                                # Ratios within the round (the load moves between rounds), to the
                                # reference that moved the same offsets.
                                acc.setdefault(f"{key}_x_sock", []).append(v / sock)
                                if pattern == "walk":  # and to the old (fixed-window) reference
                                    acc.setdefault(f"{key}_x_sockfix", []).append(
                                        v / acc[f"sockfix_{size}_{nb}_GBps"][-1])
                                if label0 != "tcp":
                                    plain = acc[f"{plain_label}_{op}_{size}_{nb}_GBps"][-1]
                                    acc.setdefault(f"{key}_x_plain", []).append(v / plain)
                                    plain_cpu = acc[f"{plain_label}_{op}_{size}_{nb}_cpu_s_per_GB"][-1]
                                    acc.setdefault(f"{key}_cpu_x_plain", []).append(cpu / plain_cpu)
        out.update({key: med(v) for key, v in acc.items()})
        out.update({f"{key}_range": [min(v), max(v)] for key, v in acc.items() if "_x_" in key})
    finally:
        close_all(engines, ref, peers)
    return out


LAT_CASES = (  # (key, what, inline_send_bytes, auth token)
    ("queued", "submit hands the frame to the sender thread", 0, None),
    ("inline", "submit sends on the idle connection itself (default)", 16384, None),
    ("queued_token", "queued, with an auth token (frames sealed with AES-256-GCM, as serving runs)", 0, "tok"),
    ("inline_token", "inline, with an auth token", 16384, "tok"),
)


def bench_latency(rounds, n=500):
    """One 4 KiB TCP write (submit + wait) against a plain 4 KiB -> 8 B socket ping-pong,
    interleaved round by round; each of ours split by the batch's own timestamps into
    Python -> engine (until the batch exists), engine (send, peer, reply, receiver thread)
    and wake-up (finished -> wait() returned to Python)."""
    peers = {tok: start_peer(name=f"lat-{tok or 'open'}", regions=[{"name": "r", "length": MiB, "fill": False}],
                             transports=["tcp"], auth_token=tok) for tok in {c[3] for c in LAT_CASES}}
    ref = SocketRef()
    engines = []
    acc: dict[str, list[float]] = {}
    try:
        cases = []
        for key, _, inline, tok in LAT_CASES:
            e = mc.TransferEngine(f"lat-init-{key}", transports=["tcp"], registry=mc.TransferRegistry(), auth_token=tok,
                                  inline_send_bytes=inline)
            engines.append(e)
            _, info = peers[tok]
            p = e.connect(f"lat-{tok or 'open'}", info["address"])
            mine = e.allocate(MiB)
            cases.append((key, e, [mc.TransferRequest("write", mine, 0, p, info["regions"]["r"], 0, 4096)]))
        ref.pingpong(200)
        for _, e, small in cases:
            for _ in range(200):
                e.submit(small).wait()
        for _ in range(rounds):
            pp = med(ref.pingpong(n)) * 1e6
            acc.setdefault("sock_pingpong_p50_us", []).append(pp)
            for key, e, small in cases:
                tot, enter, eng, wake = [], [], [], []
                for _ in range(n):
                    t0 = time.monotonic_ns()
                    b = e.submit(small)
                    b.wait()
                    t1 = time.monotonic_ns()
                    s0, s1 = b.submitted_ns, b.finished_ns
                    tot.append(t1 - t0)
                    enter.append(s0 - t0)
                    eng.append(s1 - s0)
                    wake.append(t1 - s1)
                for name, v in (("p50", tot), ("enter", enter), ("engine", eng), ("wake", wake)):
                    acc.setdefault(f"lat_{key}_{name}_us", []).append(med(v) / 1e3)
                # The load on a shared machine moves between rounds: ratios are taken
                # within a round (same minute as its ping-pong), then their median.
                acc.setdefault(f"lat_{key}_ratio", []).append(med(tot) / 1e3 / pp)
                acc.setdefault(f"lat_{key}_p99_us", []).append(sorted(tot)[int(len(tot) * 0.99)] / 1e3)
    finally:
        close_all(engines, ref, peers)
    out = {k: med(v) for k, v in acc.items()}
    out["tcp_4k_write_p50_us"] = out["lat_inline_p50_us"]
    out["tcp_4k_write_p99_us"] = out["lat_inline_p99_us"]
    return out


def run_peer():
    py = os.environ.get("MC_PEER_VENV", os.path.join(tempfile.gettempdir(), "peer-mc")) + "/bin/python"
    if not os.path.exists(py):
        print("peer venv missing: skipping te_bench.py")
        return None
    res = os.environ.setdefault("MCPEER_RESULTS", os.path.join(tempfile.gettempdir(), "mcpeer-results"))
    env = dict(os.environ, MCPEER_NO_NETNS=os.environ.get("MCPEER_NO_NETNS", "1"))
    r = subprocess.run([py, os.path.join(MOONCAKE, "te_bench.py"), "--rounds", "1", "--batches", "32"],
                       env=env, capture_output=True, text=True, timeout=200)
    print(r.stdout[-3000:])
    files = sorted(glob.glob(os.path.join(res, "te_bench-*.json")))
    if r.returncode != 0 or not files:
        print("te_bench failed:", r.stderr[-2000:])
        return None
    data = json.load(open(files[-1]))
    out = {}
    for c in data["cases"]:
        if c["mode"] == "sync" and c["batch"] == 32:
            out[f"te_{c['op']}_{c['block']}_GBps"] = c["round_GBps_median"]
        if c["mode"] == "single" and c["op"] == "write":
            out["te_4k_write_p50_us"] = c["median_us"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per case")
    ap.add_argument("--peer", action="store_true", help="also run Mooncake's te_bench.py")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--rounds", type=int, default=3, help="TCP rounds (median of rounds)")
    ap.add_argument("--lat-rounds", type=int, default=9, help="latency rounds (median of per-round ratios)")
    ap.add_argument("--only", choices=("latency", "tcp"), help="only the 4 KiB write latency (and --peer's), "
                                                                 "or only the TCP bandwidth cases")
    ap.add_argument("--auth", action="store_true", help="TCP cases also with an auth token (protected frames)")
    ap.add_argument("--auth-modes", default="encrypted,integrity",
                    help="wire_protection of the token engines, one column each (encrypted, integrity)")
    ap.add_argument("--sizes", default="64,512,4096", help="TCP request sizes in KiB")
    ap.add_argument("--auth-conns", type=int, default=None,
                    help="connections_per_endpoint of the token engine (default: the engine's automatic choice)")
    ap.add_argument("--cross", action="store_true",
                    help="also run our TCP rows at the reference's old fixed window (offset 0 every call)")
    args = ap.parse_args()
    sizes = [int(k) << 10 for k in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.time()
    r = {}
    if args.only is None:
        r.update(bench_overhead(args.budget))
        r.update(bench_shm(args.budget))
    if args.only != "latency":
        modes = tuple(m for m in args.auth_modes.split(",") if m)
        if not set(modes) <= set(AUTH_VARIANTS):
            ap.error(f"--auth-modes: {args.auth_modes!r}; use a comma-separated subset of {sorted(AUTH_VARIANTS)}")
        r.update(bench_tcp(args.budget, sizes, batches, args.rounds, auth=args.auth, auth_conns=args.auth_conns,
                           auth_modes=modes, cross=args.cross))
    if args.only == "tcp":
        print_tcp(r, sizes, batches, None)
        print(json.dumps(r))
        return
    r.update(bench_latency(args.lat_rounds))
    peer = run_peer() if args.peer else None
    if peer:
        r.update(peer)
    print(f"\n== transfer engine ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s)")
    print_latency(r, peer)
    if args.only == "latency":
        print(json.dumps(r))
        return
    print(f"python overhead, submit+wait of 64 local transfers: {r['submit_wait_64_local_us']:.1f} us (target <= 20)")
    c = r["copyto_GBps"]
    for op in ("write", "read"):
        v = r[f"shm_{op}_GBps"]
        print(f"shm 4 MiB x 64 {op:5s}: {v:6.2f} GB/s  vs np.copyto {c:6.2f} GB/s  ratio {v / c:.2f} (target >= 0.8)")
    print_tcp(r, sizes, batches, peer)
    print(json.dumps(r))


def print_tcp(r, sizes, batches, peer):
    labels = [lab for base in LABEL_TEXT for lab in (base, f"{base}@fixed")]

    def text(label):
        return (LABEL_TEXT[label.split("@")[0]] or "no token ") + ("at fixed window " if "@" in label else "")

    for size in sizes:
        for nb in batches:
            s, sf = r[f"sock_{size}_{nb}_GBps"], r[f"sockfix_{size}_{nb}_GBps"]
            print(f"tcp {size >> 10:5d} KiB x {nb}: socket {s:5.2f} GB/s (walking offsets, the reference) | "
                  f"socket fixed window (old reference) {sf:5.2f} GB/s")
            for label in labels:
                line = ""
                for op in ("write", "read"):
                    key = f"{label}_{op}_{size}_{nb}"
                    v = r.get(f"{key}_GBps")
                    if v is None:
                        continue
                    lo, hi = r[f"{key}_x_sock_range"]
                    line += f" | {op} {v:5.2f} GB/s {r[f'{key}_x_sock']:.2f}x [{lo:.2f}-{hi:.2f}]"
                    if f"{key}_x_sockfix" in r:
                        line += f" (old ref {r[f'{key}_x_sockfix']:.2f}x)"
                    if label.split("@")[0] != "tcp":
                        line += f" {{{r[f'{key}_x_plain']:.2f}x no token}}"
                if line:
                    print(f"    {text(label).rstrip()}{line}")
            if peer and f"te_write_{size}_GBps" in peer and nb == 32:
                print(f"    mooncake TE write {peer[f'te_write_{size}_GBps']:.2f} read {peer[f'te_read_{size}_GBps']:.2f}")
            cpu = [f"socket {r[f'sock_{size}_{nb}_cpu_s_per_GB']:.2f}",
                   f"socket fixed {r[f'sockfix_{size}_{nb}_cpu_s_per_GB']:.2f}"]
            for label in labels:
                for op in ("write", "read"):
                    c = r.get(f"{label}_{op}_{size}_{nb}_cpu_s_per_GB")
                    if c is not None:
                        cpu.append(f"{text(label)}{op} {c:.2f}"
                                   + (f" ({r[f'{label}_{op}_{size}_{nb}_cpu_x_plain']:.2f}x no token)"
                                      if label.split("@")[0] != "tcp" else ""))
            print(f"    CPU s/GB, both ends: {' | '.join(cpu)}")
    if any(f"{label}_connections" in r for label in ("tcpauth", "tcpint")):
        print("connections per endpoint: " + ", ".join(
            f"{LABEL_TEXT[label] or 'no token '}{r[f'{label}_connections']}" for label in LABEL_TEXT
            if f"{label}_connections" in r))
    print("Nx [lo-hi]: median [range] over rounds of the ratio to the socket stream of the same round at the same "
          "offsets (target >= 0.9x); old ref: to the fixed-window socket stream; {Nx no token}: token to no token, "
          "same round and offsets")


def print_latency(r, peer):
    pp = r["sock_pingpong_p50_us"]
    print(f"4 KiB TCP write, submit + wait, p50 (median of rounds); plain socket ping-pong 4 KiB -> 8 B: {pp:.1f} us")
    print(f"{'case':14s} {'p50 us':>7s} {'x ping-pong':>11s} {'p99 us':>7s} | {'py->engine':>10s} {'engine':>7s} {'wake-up':>7s}")
    for key, what, _, _ in LAT_CASES:
        g = lambda n: r[f"lat_{key}_{n}_us"]  # noqa: E731
        print(f"{key:14s} {g('p50'):7.1f} {r[f'lat_{key}_ratio']:10.2f}x {g('p99'):7.1f} | {g('enter'):10.1f} "
              f"{g('engine'):7.1f} {g('wake'):7.1f}   {what}")
    if peer and "te_4k_write_p50_us" in peer:
        print(f"mooncake TE, same run: {peer['te_4k_write_p50_us']:.1f} us ({peer['te_4k_write_p50_us'] / pp:.2f}x)")
    print("x ping-pong: median over rounds of (our p50 / the ping-pong's p50 of the same round); "
          "target: inline <= 2x")


if __name__ == "__main__":
    main()
