"""A deployment across "hosts" for tests, started the way a user starts one: an etcd, then
``python -m mooncake_rs worker ...`` and ``python -m mooncake_rs serve --etcd ...`` as
processes on the hosts, and a ``RemoteCluster`` client in the test process.

Hosts are network namespaces (``netns_helpers.TestHosts``: veth pairs on a private
subnet the test makes and removes) where they can be made, else distinct loopback
addresses (``LoopbackHosts``: 127.0.0.x). Either way every worker runs with
``--transports tcp``, so KV really crosses TCP (never shared memory, which the "hosts"
could otherwise share). Each process logs to a file under the test's tmp_path (shown
when a check fails); ``close()`` stops all of them.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from etcd_helpers import EtcdServer
from netns_helpers import TestHosts, available

__all__ = ["LoopbackHosts", "Deployment", "make_hosts", "TOKEN"]

TOKEN = "test-cluster-token-0123456789abcdef"


class LoopbackHosts:
    """Hosts as distinct loopback addresses (no namespaces): nothing can be cut.

    Each instance takes its own random 127.a.b.0/24 (all of 127/8 is loopback on Linux),
    so the fixed ports the deployments use never collide with another suite running on
    the same machine at the same time."""

    __test__ = False
    netns = False

    def __init__(self, n: int) -> None:
        self.n = n
        self.gateway = "127.0.0.1"
        self._net = f"127.{random.randrange(1, 255)}.{random.randrange(0, 256)}"
        self._procs: list[subprocess.Popen[Any]] = []

    def ip(self, i: int) -> str:
        return f"{self._net}.{10 + i}"

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> "subprocess.Popen[Any]":
        p = subprocess.Popen(list(argv), **kw)
        self._procs.append(p)
        return p

    def __enter__(self) -> "LoopbackHosts":
        return self

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_hosts(n: int) -> Any:
    if available():
        h = TestHosts(n)
        h.netns = True  # type: ignore[attr-defined]
        return h
    return LoopbackHosts(n)


class Deployment:
    """What runs on ``hosts``: ``etcd`` (on the gateway), workers and serve processes."""

    def __init__(self, hosts: Any, etcd: EtcdServer, tmp: Path, cluster: str = "t") -> None:
        self.hosts, self.etcd, self.tmp, self.cluster = hosts, etcd, tmp, cluster
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN)
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.logs: dict[str, Path] = {}

    def _start(self, name: str, host: int, args: Sequence[str], env: dict[str, str] | None = None) -> Any:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        out = open(log, "ab")
        e = dict(os.environ, MOONCAKE_LOG="info", **(env or {}))
        p = self.hosts.popen(host, [sys.executable, "-m", "mooncake_rs", *args], stdout=out, stderr=out,
                             stdin=subprocess.DEVNULL, env=e)
        out.close()
        self.procs[name] = p
        return p

    def worker(self, name: str, host: int, role: str, *, port: int = 7000, token_file: Path | None = None,
               model: str = "tiny", extra: Sequence[str] = ()) -> Any:
        return self._start(name, host, [
            "worker", "--role", role, "--model", model, "--etcd", self.etcd.url,
            "--listen", f"{self.hosts.ip(host)}:{port}", "--name", name, "--cluster", self.cluster,
            "--auth-token-file", str(token_file or self.token_file), "--transports", "tcp", "--ttl", "2",
            "--heartbeat", "0.25", *extra])

    def serve(self, name: str, host: int, *, port: int = 7100, extra: Sequence[str] = ()) -> Any:
        return self._start(name, host, [
            "serve", "--etcd", self.etcd.url, "--listen", f"{self.hosts.ip(host)}:{port}", "--cluster", self.cluster,
            "--auth-token-file", str(self.token_file), "--lease-ttl", "2", "--heartbeat-timeout", "3", *extra])

    def client(self, timeout_s: float = 60.0) -> Any:
        from mooncake_rs import Cluster

        return Cluster.connect(etcd=self.etcd.url, auth_token=TOKEN, cluster=self.cluster,
                               connect_timeout_s=timeout_s)

    def wait_log(self, name: str, text: str, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.logs[name].read_text(errors="replace"):
                return True
            time.sleep(0.1)
        return False

    def log_tail(self, n: int = 30) -> str:
        out = []
        for name, path in self.logs.items():
            lines = path.read_text(errors="replace").splitlines()[-n:]
            out.append(f"---- {name}\n" + "\n".join(lines))
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def wait_until(pred: Any, timeout_s: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
