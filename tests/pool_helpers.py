"""Store nodes for tests: ``mooncake-rs store`` processes (on network-namespace hosts or
on 127.0.0.1) and seeded values a test on another host can check byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TOKEN = "pool-test-token-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def value_of(key: str, size: int) -> np.ndarray:
    """The bytes a test stores under ``key``: a function of the key alone, so a reader
    knows what it must get (and another key's bytes never pass for them)."""
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little") ^ len(key) ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


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
