"""A real etcd for tests: Debian's ``etcd-server`` binary on 127.0.0.1, random ports, a
temporary data directory; stopped (and, if need be, killed) when the test ends.

Where etcd is not installed the tests that need it skip, unless ``MOONCAKE_REQUIRE_ETCD=1``
(set by ``.ci/run``, which installs it), where they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ports import free_port


def etcd_binary() -> str | None:
    return os.environ.get("MOONCAKE_ETCD") or shutil.which("etcd")


class EtcdServer:
    """One etcd member; ``stop()`` / ``start()`` keep its ports and data (an outage)."""

    def __init__(self, binary: str, data_dir: Path, host: str = "127.0.0.1") -> None:
        self.binary, self.data_dir = binary, data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://{host}:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.data_dir.with_suffix(".log"), "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", str(self.data_dir),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}"],
            stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.data_dir.with_suffix('.log')}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy in {timeout_s} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def required_etcd_binary() -> str:
    """The etcd binary; skips the test when there is none, or fails it under
    ``MOONCAKE_REQUIRE_ETCD=1`` (CI: a required facility never silently skips)."""
    binary = etcd_binary()
    if binary is None:
        if os.environ.get("MOONCAKE_REQUIRE_ETCD") == "1":
            pytest.fail("etcd is required here (MOONCAKE_REQUIRE_ETCD=1) but not installed: apt-get install etcd-server")
        pytest.skip("etcd not installed (apt-get install etcd-server)")
    return binary


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(required_etcd_binary(), tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_url(etcd: EtcdServer) -> str:
    """The client URL of a fresh etcd (the ``etcd`` fixture), for tests that only point at it."""
    return etcd.url
