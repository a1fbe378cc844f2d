"""One store node on 127.0.0.1 (a ``mooncake-rs store --tcp-only`` subprocess) and this
process as its client through the Mooncake facade, looping one kind of call, for
profiling the pool's remote path (``perf record -p`` the two PIDs it prints) and for A/B
runs of two checkouts (the node runs the same ``mooncake_rs`` as this process: put the
other checkout's ``python/`` first on PYTHONPATH).

    python benches/pool_loop.py small [--plaintext] [--keys 3000]
        put 128 B x N, get x N, batch_is_exist x100 (second pass over fresh keys; the
        first warms up): ops/s and the client's and the node's CPU per put/get call
    python benches/pool_loop.py bulk [--plaintext] [--seconds 8] [--size 4MiB] [--node-arg=--lease-ttl=30]
        batch_put_from / batch_get_into of 32 values in a loop: GB/s (medians)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ports import free_port  # noqa: E402

from etcd_helpers import EtcdServer, etcd_binary  # noqa: E402
from pool_helpers import TOKEN  # noqa: E402


def node_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(a: argparse.Namespace, etcd_url: str) -> subprocess.Popen:
    import mooncake_rs

    env = dict(os.environ, MOONCAKE_LOG="warn", PYTHONPATH=str(Path(mooncake_rs.__file__).parents[1]))
    if not a.plaintext:
        env["MOONCAKE_AUTH_TOKEN"] = TOKEN
    argv = [sys.executable, "-m", "mooncake_rs", "store", "--etcd", etcd_url, "--listen",
            f"127.0.0.1:{free_port()}", "--dram-bytes", "1GB", "--cluster", "loop", "--tcp-only", "--ttl", "2",
            *(["--plaintext"] if a.plaintext else []), *a.node_arg]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = p.stdout.readline()
    if "ready" not in line:
        p.kill()
        raise SystemExit(f"the store node did not start: {line!r}")
    return p


def small(s, node: subprocess.Popen, n: int) -> None:
    val = b"v" * 128
    for rnd in range(2):
        keys = [f"s{rnd}-{i}" for i in range(n)]
        c0, n0 = time.process_time(), node_cpu_s(node.pid)
        t = time.perf_counter()
        for k in keys:
            assert s.put(k, val) == 0
        put = n / (time.perf_counter() - t)
        t = time.perf_counter()
        for k in keys:
            assert s.get(k) == val
        get = n / (time.perf_counter() - t)
        cli, nod = time.process_time() - c0, node_cpu_s(node.pid) - n0
        t = time.perf_counter()
        for i in range(0, n, 100):
            assert s.batch_is_exist(keys[i:i + 100]) == [1] * len(keys[i:i + 100])
        bie = n / (time.perf_counter() - t)
    print(f"put {put:,.0f}/s  get {get:,.0f}/s  batch_is_exist x100 {bie:,.0f} keys/s  CPU a put/get call: "
          f"client {cli / (2 * n) * 1e6:.1f} us, node {nod / (2 * n) * 1e6:.1f} us")


def bulk(s, seconds: float, size: int) -> None:
    vals = np.random.default_rng(0).integers(0, 256, (32, size), dtype=np.uint8)
    dst = np.zeros_like(vals)
    assert s.register_buffer(vals.ctypes.data, vals.nbytes) == 0 and s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    ptrs, dptrs = [v.ctypes.data for v in vals], [d.ctypes.data for d in dst]
    put_t, get_t, r = [], [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        keys = [f"b{r}-{i}" for i in range(32)]
        t = time.perf_counter()
        assert s.batch_put_from(keys, ptrs, [size] * 32) == [0] * 32
        put_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert s.batch_get_into(keys, dptrs, [size] * 32) == [size] * 32
        get_t.append(time.perf_counter() - t)
        s.remove_all(True)
        r += 1
    assert (dst == vals).all()
    gb = 32 * size / 1e9
    print(f"batch_put_from {gb / statistics.median(put_t):.2f} GB/s  batch_get_into {gb / statistics.median(get_t):.2f} "
          f"GB/s  ({r} rounds of 32 x {size} B)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["small", "bulk"])
    ap.add_argument("--plaintext", action="store_true", help="a --plaintext node and client (no token)")
    ap.add_argument("--keys", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--size", type=int, default=4 << 20)
    ap.add_argument("--node-arg", action="append", default=[], help="one more argument of the store node (repeat)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer(etcd_binary(), Path(tmp) / "etcd")
        etcd.start()
        node = start(a, etcd.url)
        try:
            os.environ.update(MOONCAKE_CLUSTER="loop", MOONCAKE_RS_TRANSPORTS="tcp")
            if a.plaintext:
                os.environ["MOONCAKE_RS_PLAINTEXT"] = "1"
            else:
                os.environ["MOONCAKE_AUTH_TOKEN"] = TOKEN
            from mooncake_rs.compat import install_as_mooncake

            install_as_mooncake()
            from mooncake.store import MooncakeDistributedStore

            s = MooncakeDistributedStore()
            url = "etcd://" + etcd.url[len("http://"):]
            assert s.setup("127.0.0.1", url, 0, 64 << 20, "tcp", "", url) == 0
            print(f"client pid {os.getpid()}, node pid {node.pid}", flush=True)
            small(s, node, a.keys) if a.kind == "small" else bulk(s, a.seconds, a.size)
            s.close()
        finally:
            node.terminate()
            node.wait(10)
            etcd.stop()


if __name__ == "__main__":
    main()
