"""The processes of benches/pool_bench.py, one role each (``python pool_bench_roles.py ROLE
ARGS-JSON``); each prints one JSON line of results. The Mooncake roles run under the
peer venv's python (no mooncake_rs there); ours under the project's."""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
# (value size, rounds) for batches of 32. A 512 KiB batch lasts ~8 ms, and one pair of
# batches (the pool's and the engine's beside it) reads 0.4-1.3x of the other on this host:
# 24 pairs, not 8, so a run's median of them moves less than the 0.8x target's margin.
BULK = [(512 * KiB, 24), (4 * MiB, 8)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def start_master(host: str, log: str) -> tuple[subprocess.Popen, int, str]:
    rpc, metrics, http = free_port(host), free_port(host), free_port(host)
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    p = subprocess.Popen([exe, f"--rpc_address={host}", f"--rpc_port={rpc}", f"--metrics_host={host}",
                          f"--metrics_port={metrics}", "--rpc_thread_num=2", "--logtostderr=true",
                          "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
                          f"--http_metadata_server_port={http}"], stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    if not (wait_port(host, rpc) and wait_port(host, http)):
        p.kill()
        raise RuntimeError("mooncake_master did not start")
    return p, rpc, f"http://{host}:{http}/metadata"


def open_store(a: dict):
    """The store under test, through Mooncake's API (ours: the facade)."""
    if a["impl"] == "ours":
        from mooncake_rs.compat import install_as_mooncake

        install_as_mooncake()
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(a["host"], a["meta"], a["segment"], a.get("local_buffer", 256 * MiB), "tcp", "", a["master"])
    assert rc == 0, f"setup returned {rc}"
    return s


def memcpy_gbps(n: int = 128 * MiB) -> float:
    """This process's own memcpy (ctypes.memmove, libc) right now: the control of a local
    row, since both stores' local paths are one memcpy per byte."""
    import ctypes

    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.ones_like(src)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)
        ts.append(time.perf_counter() - t)
    return n / 1e9 / statistics.median(ts)


SETTLE_S = 0.02


def settle() -> None:
    """The same short pause before every timed batch, for both stores. On a machine
    oversubscribed by other work, Linux's scheduler runs a thread that just woke up ahead of
    the busy ones for a while: a batch that waits on RPCs inside (Mooncake's, on its master)
    keeps getting that credit, a batch that only copies does not, and without a pause
    before each timed batch the figures compare scheduling more than copying (measured:
    one 16 MiB memmove, 1.6-6.8 GB/s in a busy loop, 8.0-8.2 GB/s right after a 5 ms
    sleep, same process, same minute)."""
    time.sleep(SETTLE_S)


class SameRoundEngine:
    """Our transfer engine's own batch of the same bytes, timed in the same rounds as the
    pool's batches (beside each one, same hosts, same link, same minute), against a
    plain engine on the node's host (``te-server``): the like-for-like reference of the
    remote rows' "pool / our engine" ratio. The engine figure taken by ``te-client`` in its
    own process, after the pool's rows, moves with the load of another minute."""

    def __init__(self, info: dict) -> None:
        import mooncake_rs as mc

        self.mc = mc
        self.eng = mc.TransferEngine("same-rounds", listen="", auth_token=info["token"], transports=["tcp"])
        self.peer = self.eng.connect("srv", info["address"])
        self.region = info["region"]
        self.local = None

    def use(self, vals: np.ndarray) -> None:
        if self.local is not None:
            self.eng.unregister(self.local)
        self.local = self.eng.register(vals)
        self.size = vals.shape[1]

    def batch(self, op: str) -> float:
        """Seconds for one batch of 32 objects of the pool's size (``op``: write / read)."""
        reqs = [self.mc.TransferRequest(op, self.local, i * self.size, self.peer, self.region, i * self.size,
                                        self.size) for i in range(32)]
        settle()
        t = time.perf_counter()
        for st in self.eng.submit(reqs, timeout_s=60).wait():
            st.raise_for_error()
        return time.perf_counter() - t

    def close(self) -> None:
        if self.local is not None:
            self.eng.unregister(self.local)
        self.eng.close()


def bulk(s, tag: str, te: SameRoundEngine | None = None) -> dict:
    """The bulk rows; with ``te``, also our engine's batch of the same bytes beside each of
    the pool's batches (before or after it, alternately), and per size and op the median
    of the per-pair ratios (engine time / pool time: the pool's throughput as a share of
    the engine's)."""
    out = {"memcpy 128 MiB in this process (control)": memcpy_gbps()}
    for size, rounds in BULK:
        vals = np.random.default_rng(size).integers(0, 256, (32, size), dtype=np.uint8)
        dst = np.zeros_like(vals)
        assert s.register_buffer(vals.ctypes.data, vals.nbytes) == 0
        assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        if te is not None:
            te.use(vals)
        ptrs = [vals[i].ctypes.data for i in range(32)]
        dptrs = [dst[i].ctypes.data for i in range(32)]
        put_t, get_t = [], []
        te_put, te_get = [], []  # the engine's batch beside each of the pool's
        for r in range(rounds):
            keys = [f"{tag}-{size}-{r}-{i}" for i in range(32)]
            # the engine's batch goes before the pool's in every other pair, so neither
            # is always the one that follows the other (its write lands in the engine's
            # own region, before any of its reads, which read those bytes back into vals)
            if te is not None and r % 2:
                te_put.append(te.batch("write"))
            settle()
            t = time.perf_counter()
            rc = s.batch_put_from(keys, ptrs, [size] * 32)
            put_t.append(time.perf_counter() - t)
            assert all(x == 0 for x in rc), rc
            if te is not None and not r % 2:
                te_put.append(te.batch("write"))
            for g in range(2):
                if te is not None and (r + g) % 2:
                    te_get.append(te.batch("read"))
                dst[:] = 0
                settle()
                t = time.perf_counter()
                rc = s.batch_get_into(keys, dptrs, [size] * 32)
                get_t.append(time.perf_counter() - t)
                assert all(x == size for x in rc), rc
                if te is not None and not (r + g) % 2:
                    te_get.append(te.batch("read"))
            assert (dst == vals).all()
            s.remove_all(True)
        s.unregister_buffer(vals.ctypes.data)
        s.unregister_buffer(dst.ctypes.data)
        gb = 32 * size / 1e9
        name = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        out[f"batch_put_from 32 x {name}"] = gb / statistics.median(put_t)
        out[f"batch_get_into 32 x {name}"] = gb / statistics.median(get_t)
        if te is not None:
            for row, pool_t, eng_t in ((f"batch_put_from 32 x {name}", put_t, te_put),
                                       (f"batch_get_into 32 x {name}", get_t, te_get)):
                out.setdefault("same rounds", {})[row] = {
                    "te GB/s": gb / statistics.median(eng_t),
                    "pool / te": statistics.median(e / p for e, p in zip(eng_t, pool_t)),
                    # per pair, in round order (a put's first rounds reserve: docs/store-service.md)
                    "pool / te per pair": [round(e / p, 3) for e, p in zip(eng_t, pool_t)]}
    return out


def small(s, tag: str, n: int = 2000, passes: int = 5) -> dict:
    """128 B keys: each row the median of ``passes`` passes (a pass: ``n`` puts of fresh
    keys, ``n`` gets of them, then ``batch_is_exist`` of them 100 a call, five times over;
    the pool emptied between passes). One pass of 20 ``batch_is_exist`` calls lasts ~1 ms:
    alone it was no figure."""
    val = b"v" * 128
    put, get, bie = [], [], []
    for p in range(passes):
        keys = [f"{tag}-small-{p}-{i}" for i in range(n)]
        t = time.perf_counter()
        for k in keys:
            assert s.put(k, val) == 0
        put.append(n / (time.perf_counter() - t))
        t = time.perf_counter()
        for k in keys:
            assert len(s.get(k)) == 128
        get.append(n / (time.perf_counter() - t))
        for _ in range(5):
            t = time.perf_counter()
            for i in range(0, n, 100):
                assert s.batch_is_exist(keys[i:i + 100]) == [1] * 100
            bie.append(n / (time.perf_counter() - t))
        s.remove_all(True)
    return {"put 128 B": statistics.median(put), "get 128 B": statistics.median(get),
            "batch_is_exist x100 (keys/s)": statistics.median(bie)}


def role_store(a: dict) -> dict:
    """bulk + small keys through Mooncake's API."""
    master = None
    if a["impl"] == "mooncake" and a.get("start_master"):
        master, rpc, meta = start_master(a["host"], a["log"])
        a = dict(a, master=f"{a['host']}:{rpc}", meta=meta)
    try:
        s = open_store(a)
        res = {}
        if "bulk" in a["parts"]:
            te = SameRoundEngine(a["te"]) if a.get("te") else None
            try:
                res.update(bulk(s, a["impl"], te))
            finally:
                if te is not None:
                    te.close()
        if "small" in a["parts"]:
            res.update(small(s, a["impl"]))
        s.close()
        return res
    finally:
        if master is not None:
            master.kill()


def role_mc_owner(a: dict) -> dict:
    """A Mooncake client that owns the only segment, on its own host (the remote rows)."""
    master, rpc, meta = start_master(a["host"], a["log"])
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup(a["host"], meta, a["segment"], 16 * MiB, "tcp", "", f"{a['host']}:{rpc}") == 0
    print(json.dumps({"master": f"{a['host']}:{rpc}", "meta": meta}), flush=True)
    try:
        sys.stdin.read()  # until the orchestrator closes our stdin
    finally:
        s.close()
        master.kill()
    return {}


def role_te_server(a: dict) -> dict:
    import mooncake_rs as mc

    with mc.TransferEngine("srv", listen=f"{a['host']}:0", auth_token=a["token"], transports=["tcp"]) as eng:
        region = eng.allocate(160 * MiB)
        print(json.dumps({"address": eng.address, "region": region.id}), flush=True)
        sys.stdin.read()
    return {}


def role_te_client(a: dict) -> dict:
    import mooncake_rs as mc

    out = {}
    with mc.TransferEngine("cli", listen="", auth_token=a["token"], transports=["tcp"]) as eng:
        peer = eng.connect("srv", a["address"])
        for size, rounds in BULK:
            buf = np.random.default_rng(1).integers(0, 256, 32 * size, dtype=np.uint8)
            local = eng.register(buf)
            for op in ("write", "read"):
                ts = []
                for _ in range(2 * rounds):
                    reqs = [mc.TransferRequest(op, local, i * size, peer, a["region"], i * size, size) for i in range(32)]
                    settle()
                    t = time.perf_counter()
                    for st in eng.submit(reqs, timeout_s=60).wait():
                        st.raise_for_error()
                    ts.append(time.perf_counter() - t)
                name = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
                out[f"te {op} 32 x {name}"] = 32 * size / 1e9 / statistics.median(ts)
            eng.unregister(local)
        out.update(te_small(mc, eng, peer, a["region"]))
    return out


SMALL_CALLS = 2000
#: the floor rows report the median of this many passes of SMALL_CALLS (a pass of a few
#: ms on shared cores can lose a whole scheduling slice)
FLOOR_PASSES = 5


def te_small(mc, eng, peer, region: int) -> dict:
    """The floor of a synchronous 128 B request/response over the link: one transfer
    engine request of 128 B, submitted and waited for, SMALL_CALLS times a pass (the Rust
    sender and server; Python only for submit/wait; several threads a side). Every reply
    is checked: the read returns the bytes the write put there."""
    src = np.arange(256, dtype=np.uint8) % 251
    dst = np.zeros(256, dtype=np.uint8)
    ls, ld = eng.register(src), eng.register(dst)
    out = {}
    for op, local in (("write", ls), ("read", ld)):
        req = [mc.TransferRequest(op, local, 0, peer, region, 0, 128)]
        for _ in range(50):  # warm-up
            eng.submit(req, timeout_s=10).wait()[0].raise_for_error()
        rates = []
        for _ in range(FLOOR_PASSES):
            t = time.perf_counter()
            for _ in range(SMALL_CALLS):
                eng.submit(req, timeout_s=10).wait()[0].raise_for_error()
            rates.append(SMALL_CALLS / (time.perf_counter() - t))
        out[f"te {op} 128 B"] = statistics.median(rates)
    assert (dst[:128] == src[:128]).all()
    eng.unregister(ls)
    eng.unregister(ld)
    return out


def role_echo_server(a: dict) -> dict:
    """A plain-socket echo of 128 B messages in Python (the floor of any design with
    Python on both ends: one recv and one send per call, no framing or decoding)."""
    srv = socket.create_server((a["host"], 0))
    print(json.dumps({"address": "%s:%d" % srv.getsockname()[:2]}), flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        msg = conn.recv(128)
        if not msg:
            break
        while len(msg) < 128:
            more = conn.recv(128 - len(msg))
            if not more:
                return {}
            msg += more
        conn.sendall(msg)
    return {}


def role_echo_client(a: dict) -> dict:
    host, _, port = a["address"].rpartition(":")
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = bytes(range(128))

        def once() -> None:
            s.sendall(msg)
            got = b""
            while len(got) < 128:
                more = s.recv(128 - len(got))
                if not more:
                    raise RuntimeError("echo server closed")
                got += more
            if got != msg:
                raise RuntimeError("echo returned other bytes")

        for _ in range(50):
            once()
        rates = []
        for _ in range(FLOOR_PASSES):
            t = time.perf_counter()
            for _ in range(SMALL_CALLS):
                once()
            rates.append(SMALL_CALLS / (time.perf_counter() - t))
        return {"python socket echo 128 B": statistics.median(rates)}


def _link_facts(s: socket.socket) -> dict:
    """What bounds a bulk TCP stream on this link, read from inside the namespace: the
    socket's buffer sizes after connect (autotuning grows them later), the netns's
    tcp_rmem / tcp_wmem autotuning ranges, and the congestion control."""
    def sysctl(name: str) -> str:
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as f:
                return f.read().strip()
        except OSError:
            return "?"
    return {"SO_SNDBUF": s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            "SO_RCVBUF": s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
            "tcp_wmem": sysctl("tcp_wmem"), "tcp_rmem": sysctl("tcp_rmem"),
            "tcp_congestion_control": sysctl("tcp_congestion_control")}


_STREAM_OP = struct.Struct(">cQI")  # op (W: client sends, R: server sends, Q: quit), piece bytes, pieces


def _recv_exact_into(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = s.recv_into(view[got:])
        if n == 0:
            raise RuntimeError("stream peer closed")
        got += n


def role_stream_server(a: dict) -> dict:
    """The link's own ceiling for bulk bytes: a plain socket stream, no framing per piece,
    no protocol (the other end of ``stream-client``). One thread per connection."""
    import threading

    region = np.zeros(160 * MiB, dtype=np.uint8)
    srv = socket.create_server((a["host"], 0))
    print(json.dumps({"address": "%s:%d" % srv.getsockname()[:2]}), flush=True)

    def serve(conn: socket.socket, base: int) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if a.get("cc"):  # a congestion control other than the namespace's (an experiment)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, a["cc"].encode())
        mem = memoryview(region)
        hdr = bytearray(_STREAM_OP.size)
        while True:
            _recv_exact_into(conn, memoryview(hdr))
            op, size, count = _STREAM_OP.unpack(hdr)
            if op == b"Q":
                return
            for i in range(count):
                off = (base + i * size) % (len(region) - size)
                if op == b"W":
                    _recv_exact_into(conn, mem[off:off + size])
                else:
                    conn.sendall(mem[off:off + size])
            if op == b"W":
                conn.sendall(b"k")

    threads = []
    for c in range(a.get("connections", 1)):
        conn, _ = srv.accept()
        t = threading.Thread(target=serve, args=(conn, c * 80 * MiB), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return {}


def role_stream_client(a: dict) -> dict:
    """32 pieces of each BULK size over a plain socket stream, written then read, timed like
    the store rows (same rounds, the same pause before each batch); with ``connections`` >
    1 the pieces are split over that many connections, one thread each. Reads check the
    bytes: the server sends back what the last write of the same size put there."""
    import threading

    host, _, port = a["address"].rpartition(":")
    nconn = a.get("connections", 1)
    socks = [socket.create_connection((host, int(port))) for _ in range(nconn)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if a.get("cc"):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, a["cc"].encode())
    facts = _link_facts(socks[0])
    out: dict = {}
    tag = ("stream" if nconn == 1 else f"stream x{nconn}") + (f" {a['cc']}" if a.get("cc") else "")
    for size, rounds in BULK:
        src = np.random.default_rng(size).integers(0, 256, 32 * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        per = 32 // nconn

        def one(op: bytes, c: int) -> None:
            s = socks[c]
            s.sendall(_STREAM_OP.pack(op, size, per))
            buf = memoryview(src if op == b"W" else dst)
            for i in range(c * per, (c + 1) * per):
                piece = buf[i * size:(i + 1) * size]
                if op == b"W":
                    s.sendall(piece)
                else:
                    _recv_exact_into(s, piece)
            if op == b"W" and s.recv(1) != b"k":
                raise RuntimeError("stream server did not acknowledge")

        for op, name in ((b"W", "write"), (b"R", "read")):
            ts = []
            for _ in range(2 * rounds):
                settle()
                t = time.perf_counter()
                if nconn == 1:
                    one(op, 0)
                else:
                    th = [threading.Thread(target=one, args=(op, c)) for c in range(nconn)]
                    for x in th:
                        x.start()
                    for x in th:
                        x.join()
                ts.append(time.perf_counter() - t)
            label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
            out[f"{tag} {name} 32 x {label}"] = 32 * size / 1e9 / statistics.median(ts)
        if not (dst == src).all():
            raise RuntimeError("the stream read back other bytes than it wrote")
    for s in socks:
        s.sendall(_STREAM_OP.pack(b"Q", 0, 0))
        s.close()
    out["link facts"] = facts
    return out


ROLES = {"store": role_store, "mc-owner": role_mc_owner, "te-server": role_te_server, "te-client": role_te_client,
         "echo-server": role_echo_server, "echo-client": role_echo_client,
         "stream-server": role_stream_server, "stream-client": role_stream_client}

if __name__ == "__main__":
    args = json.loads(sys.argv[2])
    print(json.dumps(ROLES[sys.argv[1]](args)), flush=True)
