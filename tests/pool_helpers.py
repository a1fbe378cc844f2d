"""Store nodes for tests: ``mooncake-rs store`` processes (on network-namespace hosts or
on 127.0.0.1) and seeded values a test on another host can check byte for byte."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

TOKEN = "pool-test-token-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def value_of(key: str, size: int) -> np.ndarray:
    """The bytes a test stores under ``key``: a function of the key alone, so a reader
    knows what it must get (and another key's bytes never pass for them)."""
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little") ^ len(key) ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def assert_stored(reader, keys: list[str], values: list[np.ndarray]) -> None:  # noqa: ANN001 - a DistributedStore
    """Every key is in the pool and reads back byte for byte (``values[i]`` under ``keys[i]``)."""
    assert reader.batch_exists(keys) == [True] * len(keys)
    outs = [np.zeros(v.nbytes, np.uint8) for v in values]
    got = reader.batch_get_into(keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs])
    assert got == [v.nbytes for v in values]
    for k, o, v in zip(keys, outs, values):
        assert np.array_equal(o, v), k


def env() -> dict[str, str]:
    e = dict(os.environ, MOONCAKE_AUTH_TOKEN=TOKEN, MOONCAKE_LOG="warn")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), e.get("PYTHONPATH", "")])
    return e


def start_node(popen, etcd_url: str, host: str, port: int, name: str, cluster: str, dram: str = "64MB",
               extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Starts a node with ``popen(argv, **kw)``; returns it and its ready line."""
    argv = [sys.executable, "-m", "mooncake_rs", "store", "--etcd", etcd_url, "--listen", f"{host}:{port}",
            "--dram-bytes", dram, "--name", name, "--cluster", cluster, "--tcp-only", "--ttl", "2", *extra]
    p = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env())
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "ready" in line or p.poll() is not None:
            break
    assert "ready" in line, f"store node {name} did not start (rc={p.poll()})"
    return p, line.strip()


@contextmanager
def local_pool(etcd_dir: Path, cluster: str, dram: str = "64MB") -> Iterator[str]:
    """A real etcd and one store node on 127.0.0.1 (another process) registered in it, for
    the ``with`` block; yields the etcd URL. Skips (or fails under MOONCAKE_REQUIRE_ETCD=1)
    without etcd."""
    from etcd_helpers import EtcdServer, required_etcd_binary

    etcd = EtcdServer(required_etcd_binary(), etcd_dir)
    etcd.start()
    node = None
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        node, _ = start_node(subprocess.Popen, etcd.url, "127.0.0.1", port, "n0", cluster, dram=dram)
        yield etcd.url
    finally:
        if node is not None:
            node.kill()
            node.wait(10)
        etcd.stop()
