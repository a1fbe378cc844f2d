"""Membership across "hosts": workers in network namespaces of their own register with an
etcd on the bridge address; one host's cable is cut (no FIN, no RST: silence) and that
worker leaves the conductor's view within its lease TTL while the other stays."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from etcd_helpers import EtcdServer, required_etcd_binary
from netns_helpers import TestHosts, require
from mooncake_rs.deploy import EtcdClient, Membership


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    require()  # skips without namespaces, fails instead under MOONCAKE_REQUIRE_NETNS=1


_WORKER = textwrap.dedent("""
    import sys, time
    from mooncake_rs.deploy import EtcdClient, ModelFingerprint, WorkerRecord, WorkerRegistration
    url, name, ip = sys.argv[1:4]
    fp = ModelFingerprint(model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    rec = WorkerRecord(name=name, role="prefill", control=ip + ":7000", transfer=ip + ":7001",
                       fingerprint=fp, block_bytes=16384, capacity_blocks=64)
    # a fresh etcd's first writes can take longer than the 0.5 s call deadline on a loaded
    # machine (its WAL fsyncs): keep trying, as a real worker would
    WorkerRegistration(EtcdClient(url, timeout_s=0.5), "/mooncake/netns", rec, ttl_s=2).register(wait_s=20)
    print("registered", flush=True)
    time.sleep(60)
""")


def test_a_host_cut_off_the_network_leaves_within_its_ttl(tmp_path: Path) -> None:
    binary = required_etcd_binary()

    with TestHosts(2) as hosts:
        server = EtcdServer(binary, tmp_path / "etcd", host=hosts.gateway)
        server.start()
        try:
            procs = [hosts.popen(i, [sys.executable, "-c", _WORKER, server.url, f"w{i}", hosts.ip(i)],
                                 stdout=subprocess.PIPE, text=True) for i in range(2)]
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "registered"
            with Membership(EtcdClient(server.url), "/mooncake/netns", check_s=0.2) as m:
                assert m.wait_until(lambda ms: set(ms) == {"w0", "w1"}, 5)
                assert m.members()["w1"].control == f"{hosts.ip(1)}:7000"  # it came from its own host
                hosts.cut(0)
                t0 = time.monotonic()
                assert m.wait_until(lambda ms: set(ms) == {"w1"}, 2 + 5), m.members()
                assert time.monotonic() - t0 < 7
                time.sleep(1.0)  # w1's keep-alives still pass: it stays
                assert set(m.members()) == {"w1"}
        finally:
            server.stop()
