"""Who can reach a Cluster's KV arenas (issue 17, item 1).

An in-process Cluster opens no listener at all; a worker Cluster's transfer engines
listen on loopback but require the cluster's private token, so a local process without
it (raw sockets or our own library) cannot read or write an arena.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

import mooncake_rs as mc  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state whose socket is held by process ``pid``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_an_in_process_cluster_listens_nowhere():
    before = listening_ports(os.getpid())
    with mc.Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK,
                    dram_bytes_per_instance=4 << 20) as c:
        out = c.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3
        assert listening_ports(os.getpid()) == before


def test_worker_arenas_refuse_a_peer_without_the_cluster_token():
    with mc.Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK,
                    dram_bytes_per_instance=4 << 20, processes=True) as c:
        out = c.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3
        pids = [c.pid_of(i) for i in c.instances()]
        assert all(pids)
        with mc.TransferEngine("intruder", listen="") as te:
            for pid in pids:
                ports = listening_ports(pid)
                assert ports, "a worker should listen for its peers"
                for port in ports:
                    with pytest.raises(mc.TransferFailed, match="token"):
                        te.connect("victim", f"127.0.0.1:{port}")
                    with mc.TransferEngine("guesser", listen="", auth_token="not-the-token") as g:
                        with pytest.raises(mc.TransferFailed, match="token"):
                            g.connect("victim", f"127.0.0.1:{port}")
        # The cluster still serves after the attempts.
        out2 = c.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0))
        assert out2[0].token_ids == out[0].token_ids
