"""The test hosts' own helper (tests/netns_helpers.py): a subnet that something on this
machine already routes must not be reused, or the replies to our hosts go to that other
interface and every host-to-gateway connection times out (a CI run failed this way: a
bridge a killed run left behind held the same /24). Checked with a real TCP connection
from a namespace to the gateway."""

from __future__ import annotations

import os
import socket
import sys

import pytest

import netns_helpers
from netns_helpers import TestHosts, require


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    require()  # skips without namespaces, fails instead under MOONCAKE_REQUIRE_NETNS=1


_ip = netns_helpers._ip


def _links() -> str:
    return _ip("-o", "link", "show").stdout


def _first_choice() -> int:
    """The octet a TestHosts of this process tries first."""
    octets = netns_helpers._OCTETS
    return octets[os.getpid() % len(octets)]


def _host_reaches_gateway(hosts: TestHosts, i: int) -> bool:
    with socket.socket() as srv:
        srv.bind((hosts.gateway, 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        probe = f"import socket; socket.create_connection(({hosts.gateway!r}, {port}), timeout=5).close()"
        p = hosts.popen(i, [sys.executable, "-c", probe])
        srv.settimeout(10)
        try:
            conn, _ = srv.accept()
            conn.close()
        except TimeoutError:
            return False
        return p.wait(10) == 0


def test_a_subnet_in_use_here_is_not_reused() -> None:
    taken = _first_choice()
    other = f"mrtaken{os.getpid() % 10000}"  # not a test bridge: never removed as a leftover
    _ip("link", "add", other, "type", "bridge")
    try:
        _ip("addr", "add", f"10.213.{taken}.1/24", "dev", other)
        _ip("link", "set", other, "up")
        with TestHosts(2) as hosts:
            assert hosts.octet != taken
            assert hosts.gateway != f"10.213.{taken}.1"
            assert _host_reaches_gateway(hosts, 0)
            assert _host_reaches_gateway(hosts, 1)
    finally:
        _ip("link", "del", other, check=False)


def test_a_bridge_a_killed_run_left_is_removed() -> None:
    taken = _first_choice()
    # what a run killed after deleting its namespaces but before its bridge leaves: a test
    # bridge with an address, its route (link down), no ports and no namespaces
    left = f"mrbr{90000 + os.getpid() % 10000}"
    _ip("link", "add", "name", left, "type", "bridge")
    try:
        _ip("addr", "add", f"10.213.{taken}.1/24", "dev", left)
        _ip("link", "set", left, "up")
        with TestHosts(1) as hosts:
            assert f" {left}:" not in _links()
            assert _host_reaches_gateway(hosts, 0)
    finally:
        _ip("link", "del", left, check=False)


def test_close_removes_everything_it_made() -> None:
    with TestHosts(2) as hosts:
        made = [hosts.bridge, *hosts._veths]
        spaces = list(hosts.names)
    links = _links()
    assert not [name for name in made if f" {name}:" in links or f" {name}@" in links]
    listed = _ip("netns", "list").stdout
    assert not [ns for ns in spaces if ns in listed.split()]
