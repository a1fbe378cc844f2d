""""Hosts" for tests: network namespaces on a private subnet that the test creates and
deletes, joined by veth pairs to a bridge in the test's own namespace.

    with TestHosts(2) as hosts:
        hosts.gateway            # "10.213.N.1": the bridge, reachable from every host
        hosts.ip(0)              # "10.213.N.10"
        hosts.popen(0, [...])    # a process "on" host 0
        hosts.cut(0)             # host 0 vanishes from the network (its cable is cut)

The subnet's third octet is one that no address or route of this machine uses, chosen
under a file lock, so concurrent runs do not collide and neither does a bridge that a
killed run left behind (its route would take the replies to our hosts); every name
carries the octet too, and ``close()`` removes all of them (also after a failed setup).
Such leftovers (a test bridge with no ports and no namespaces) are deleted on the way.
Needs CAP_NET_ADMIN (root here and in CI); ``available()`` says whether namespaces can
be made, so tests can fall back; ``require()`` skips a test that cannot run without them,
or fails it under ``MOONCAKE_REQUIRE_NETNS=1`` (CI sets it, so these tests cannot vanish
from a green run).
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import pytest

__all__ = ["TestHosts", "available", "require"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


@functools.cache
def available() -> bool:
    name = f"mrprobe{os.getpid() % 100000}"
    try:
        ok = _ip("netns", "add", name, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    if ok:
        _ip("netns", "del", name, check=False)
    return ok


def require() -> None:
    """Skips the calling test when namespaces cannot be made here; fails it instead when
    ``MOONCAKE_REQUIRE_NETNS=1`` (a required facility that is missing is an error)."""
    if available():
        return
    why = "network namespaces cannot be made here (they need CAP_NET_ADMIN: root, and the ip command)"
    if os.environ.get("MOONCAKE_REQUIRE_NETNS") == "1":
        pytest.fail(f"{why}, but MOONCAKE_REQUIRE_NETNS=1 requires them")
    pytest.skip(why)


_OCTETS = range(16, 216)
_SETUP_LOCK = os.path.join(tempfile.gettempdir(), "mooncake-rs-test-hosts.lock")


def _remove_leftovers() -> None:
    """Deletes test bridges that no run owns any more: no port on them and none of their
    namespaces left (what a run killed between its setup and its ``close()`` leaves)."""
    namespaces = _ip("netns", "list", check=False).stdout
    bridges = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    for m in re.finditer(r"^\d+: (mrbr(\d+))[:@]", bridges, re.M):
        bridge, tag = m.group(1), m.group(2)
        if _ip("-o", "link", "show", "master", bridge, check=False).stdout.strip():
            continue
        if re.search(rf"^mrh{tag}x\d+\b", namespaces, re.M):
            continue
        _ip("link", "del", bridge, check=False)


def _free_octet() -> int:
    """A third octet of 10.213.0.0/16 that no address, route or test link here uses (the
    first free one after a start taken from the process id, so concurrent runs spread)."""
    addresses = _ip("-o", "-4", "addr", "show", check=False).stdout
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    used = {int(o) for o in re.findall(r"\b10\.213\.(\d+)\.", addresses + routes)}
    links = _ip("-o", "link", "show", check=False).stdout + _ip("netns", "list", check=False).stdout
    used |= {int(t) for t in re.findall(r"\bmr(?:br|h|v)(\d+)", links)}
    start = os.getpid() % len(_OCTETS)
    for k in range(len(_OCTETS)):
        octet = _OCTETS[(start + k) % len(_OCTETS)]
        if octet not in used:
            return octet
    raise RuntimeError("no free 10.213.X.0/24 subnet for test hosts: every one is in use on this machine")


class TestHosts:
    __test__ = False  # not a pytest test class

    def __init__(self, n: int) -> None:
        self.n = n
        self.octet = 0  # chosen in __enter__, under the setup lock
        self.bridge = ""
        self.names: list[str] = []
        self._veths: list[str] = []
        self.gateway = ""
        self._procs: list[subprocess.Popen[Any]] = []

    def ip(self, i: int) -> str:
        assert self.octet, "TestHosts: enter the context first (it chooses the subnet)"
        return f"10.213.{self.octet}.{10 + i}"

    def __enter__(self) -> "TestHosts":
        with open(_SETUP_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                _remove_leftovers()
                self._name(_free_octet())
                self._make()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return self

    def _name(self, octet: int) -> None:
        self.octet = octet
        self.bridge = f"mrbr{octet}"
        self.names = [f"mrh{octet}x{i}" for i in range(self.n)]
        self._veths = [f"mrv{octet}x{i}" for i in range(self.n)]
        self.gateway = f"10.213.{octet}.1"

    def _make(self) -> None:
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            # a fixed address: a bridge otherwise takes the lowest of its ports' MACs, and
            # cutting that port would change the gateway's MAC under the other hosts'
            # ARP caches (they would lose the gateway too, for the ARP timeout)
            _ip("link", "set", self.bridge, "address", f"02:6d:72:00:{self.octet:02x}:01")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (ns, veth) in enumerate(zip(self.names, self._veths)):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> "subprocess.Popen[Any]":
        """Starts ``argv`` inside host ``i``; killed by ``close()`` if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], **kw)
        self._procs.append(p)
        return p

    def cut(self, i: int) -> None:
        """Host ``i`` drops off the network: deleting the bridge end of its veth deletes
        both ends, so its peers see silence, not a closed connection."""
        _ip("link", "del", self._veths[i], check=False)

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for veth in self._veths:
            _ip("link", "del", veth, check=False)
        for ns in self.names:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()
