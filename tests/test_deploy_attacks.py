"""Attacks on a deployment from someone who does NOT hold the cluster token (issue 26,
items 2 and 3): a relay between a client and the leader (put there through etcd, or on
the network path), a forged worker record in etcd pointing at a relay, and a worker
attached away from its conductor. Processes started as a user starts them
(deploy_helpers.py) on loopback addresses; the relay is relay_helpers.Relay.
"""

from __future__ import annotations

import time

import msgspec
import pytest

pytest.importorskip("torch")

from deploy_helpers import TOKEN, Deployment, LoopbackHosts, wait_until  # noqa: E402
from etcd_helpers import EtcdServer, required_etcd_binary  # noqa: E402
from relay_helpers import Relay  # noqa: E402

import mooncake_rs as mc  # noqa: E402
from mooncake_rs.deploy import EtcdClient, RemoteCluster  # noqa: E402
from mooncake_rs.net import auth_socket  # noqa: E402
from mooncake_rs.client.records import decode_record, encode_record, leader_key, worker_key  # noqa: E402
from mooncake_rs.engine import SamplingParams  # noqa: E402
from mooncake_rs.net.framing import read_message  # noqa: E402
from mooncake_rs.serving.protocol import PROTOCOL_VERSION, Attach, Codec, InitFailed, Ready  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=6)
#: a prompt whose msgpack encoding is easy to find in a byte stream (ints 128..255: 0xcc + 1 byte)
PROMPT = list(range(200, 232))
PREFIX = "/mooncake/t"


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory):
    binary = required_etcd_binary()
    tmp = tmp_path_factory.mktemp("attacks")
    with LoopbackHosts(3) as hosts:
        server = EtcdServer(binary, tmp / "etcd")
        server.start()
        d = Deployment(hosts, server, tmp)
        try:
            d.serve("serve", 0)
            assert d.wait_log("serve", "leading"), d.log_tail()
            d.worker("p0", 1, "prefill")
            d.worker("d0", 2, "decode")
            client = d.client()
            assert wait_until(lambda: len(client.instances()) == 2, 90), d.log_tail()
            d.client_ = client  # type: ignore[attr-defined]
            d.listen = f"{hosts.ip(0)}:7100"  # type: ignore[attr-defined]
            d.reference = client.generate([PROMPT], GREEDY, timeout_s=60)[0].token_ids  # type: ignore[attr-defined]
            yield d
            client.close()
        finally:
            d.close()
            server.stop()


def _names(client) -> set[str]:
    return set(client.instances().values())


def _generate_or_error(client, timeout_s: float = 30.0):
    try:
        return client.generate([PROMPT], GREEDY, timeout_s=timeout_s)[0].token_ids
    except mc.MooncakeError as e:
        return e


def test_a_relay_between_client_and_leader_reads_nothing_and_changes_nothing(dep):
    """Item 2: a relay without the token on the path forwards the mutual handshake end
    to end. It must see no prompt, and what it changes must fail the request with a
    typed error, never hand the client other tokens."""
    passive = Relay(dep.listen)
    try:
        with RemoteCluster(address=passive.address, auth_token=TOKEN) as c:
            assert c.generate([PROMPT], GREEDY, timeout_s=60)[0].token_ids == dep.reference
        assert passive.connections == 1
        assert msgspec.msgpack.encode(PROMPT) not in bytes(passive.upstream), "the prompt crossed the relay in clear"
    finally:
        passive.close()
    active = Relay(dep.listen, tamper=True)
    try:
        with RemoteCluster(address=active.address, auth_token=TOKEN, connect_timeout_s=5) as c:
            got = _generate_or_error(c)
        assert active.rewritten == 0, "the relay could rewrite the tokens the client got"
        assert isinstance(got, mc.ServiceUnavailable), got  # the tampered session was cut: a typed error
    finally:
        active.close()
    assert _generate_or_error(dep.client_) == dep.reference  # the service is unharmed


def test_a_relay_put_at_the_leader_key_is_never_contacted(dep):
    """Item 2 through etcd: whoever can write to etcd puts a relay's address at
    ``{prefix}/leader``. A client holding the token ignores the unsigned record."""
    etcd = EtcdClient(dep.etcd.url)
    key = leader_key(PREFIX)
    real = etcd.get(key)
    assert real is not None
    relay = Relay(dep.listen)
    try:
        etcd.put(key, relay.address.encode(), lease=real.lease)
        with pytest.raises(mc.ServiceUnavailable, match="leader record"):
            RemoteCluster(etcd=dep.etcd.url, auth_token=TOKEN, cluster="t", connect_timeout_s=1.5)
        assert relay.connections == 0
    finally:
        etcd.put(key, real.value, lease=real.lease)  # (the leader does not write its key again)
        relay.close()
    with RemoteCluster(etcd=dep.etcd.url, auth_token=TOKEN, cluster="t") as c:
        assert c.generate([PROMPT], GREEDY, timeout_s=60)[0].token_ids == dep.reference


def test_a_forged_worker_record_attaches_nothing(dep):
    """Item 3: a copy of a worker's record under another name, its control address a
    relay to the real worker. The conductor ignores it (not signed for that key), so the
    real worker is never attached twice nor displaced, and keeps serving after the
    forged record is gone."""
    etcd = EtcdClient(dep.etcd.url)
    real = etcd.get(worker_key(PREFIX, "p0"))
    assert real is not None
    rec = decode_record(real.value)
    relay = Relay(rec.control)
    lease = etcd.lease_grant(30)
    try:
        forged = msgspec.structs.replace(rec, name="p0-copy", control=relay.address)
        etcd.put(worker_key(PREFIX, "p0-copy"), encode_record(forged), lease=lease)
        # and one that keeps p0's signature but another address, under p0's own lease
        moved = msgspec.structs.replace(rec, name="p0-moved", control=relay.address)
        etcd.put(worker_key(PREFIX, "p0-moved"), encode_record(moved), lease=real.lease)
        assert dep.wait_log("serve", "p0-moved refused: ignored", 10), dep.log_tail()
        assert dep.wait_log("serve", "p0-copy refused: ignored", 10), dep.log_tail()
        time.sleep(1.0)
        assert relay.connections == 0, "the conductor attached a forged record"
        assert _names(dep.client_) == {"p0", "d0"}
        assert _generate_or_error(dep.client_) == dep.reference
    finally:
        etcd.delete(worker_key(PREFIX, "p0-copy"))
        etcd.delete(worker_key(PREFIX, "p0-moved"))
        etcd.lease_revoke(lease)
        relay.close()
    time.sleep(1.0)
    assert _names(dep.client_) == {"p0", "d0"}
    assert _generate_or_error(dep.client_) == dep.reference


def _attach(control: str, name: str):
    """Attaches the worker at ``control`` as a conductor would (holding the token)."""
    sock = auth_socket.connect(control, TOKEN, timeout_s=5)
    sock.sendall(Codec().encode(Attach(PROTOCOL_VERSION, 99, name)))
    codec = Codec()
    while True:
        msg = read_message(sock, codec)
        if msg is None or isinstance(msg, (Ready, InitFailed)):
            return sock, msg


def test_a_worker_refuses_another_name_and_a_displaced_worker_is_attached_again(dep):
    """Item 3: a worker answers an ``Attach`` for another name with ``InitFailed`` and
    keeps its conductor; a worker whose attach was displaced (a stale leader, anything
    holding the token) is attached again by its conductor while its record is live."""
    etcd = EtcdClient(dep.etcd.url)
    control = decode_record(etcd.get(worker_key(PREFIX, "p0")).value).control
    sock, reply = _attach(control, "p0-copy")
    sock.close()
    assert isinstance(reply, InitFailed) and "'p0'" in reply.error, reply
    assert _generate_or_error(dep.client_) == dep.reference
    before = {n: i for i, n in dep.client_.instances().items()}
    sock, reply = _attach(control, "p0")  # displaces the service's link
    assert isinstance(reply, Ready), reply
    # the service's link to p0 closed; it attaches p0 again (a new instance id), which in
    # turn displaces this one
    assert wait_until(lambda: {n: i for i, n in dep.client_.instances().items()}.get("p0", before["p0"])
                      != before["p0"], 30), dep.log_tail()
    sock.close()
    assert _generate_or_error(dep.client_, 60) == dep.reference
