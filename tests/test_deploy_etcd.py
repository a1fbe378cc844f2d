"""Membership on a real etcd (issue 12's foundation): the client, worker registration,
the conductor's view of the members, leader election, and the faults: a SIGKILLed worker,
a killed leader, etcd stopped and started again, a worker with another model, a name
taken twice, a malformed record."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import msgspec
import pytest

from etcd_helpers import EtcdServer, etcd  # noqa: F401  (the fixture)
from mooncake_rs.deploy import EtcdClient, LeaderElection, Membership, ModelFingerprint, WorkerRecord, WorkerRegistration
from mooncake_rs.client.records import encode_record, worker_key
from mooncake_rs.errors import InvalidArgument, ServiceUnavailable

PREFIX = "/mooncake/test"
FP = ModelFingerprint(model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)


def record(name: str, role: str = "prefill", fp: ModelFingerprint = FP) -> WorkerRecord:
    return WorkerRecord(name=name, role=role, control=f"127.0.0.1:{7000 + len(name)}", transfer="127.0.0.1:7100",
                        fingerprint=fp, block_bytes=16384, capacity_blocks=64)


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_client_keys_leases_and_transactions(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url)
    c.put(b"/a/1", b"x")
    c.put(b"/a/2", b"y")
    c.put(b"/b", b"z")
    kvs, rev = c.get_prefix(b"/a/")
    assert [(kv.key, kv.value) for kv in kvs] == [(b"/a/1", b"x"), (b"/a/2", b"y")] and rev >= 3
    assert c.create(b"/a/1", b"other") is False and c.get(b"/a/1").value == b"x"  # type: ignore[union-attr]
    lease = c.lease_grant(1)
    assert c.create(b"/a/3", b"leased", lease)
    assert c.get(b"/a/3").lease == lease  # type: ignore[union-attr]
    assert wait_for(lambda: c.get(b"/a/3") is None, 6.0), "a key under an expired lease stays"
    assert c.lease_keepalive(lease) == 0
    c.lease_revoke(lease)  # gone already: fine
    assert c.delete(b"/b") and c.get(b"/b") is None


def test_client_errors_are_typed_and_bounded() -> None:
    with pytest.raises(InvalidArgument, match="http://HOST:PORT"):
        EtcdClient("ftp://example:2379")
    with pytest.raises(InvalidArgument, match="both user and password"):
        EtcdClient("http://example:2379", user="root")
    with pytest.raises(InvalidArgument, match="use https://"):
        EtcdClient("http://example:2379", ca_file="ca.pem")
    with pytest.raises(InvalidArgument, match="etcd TLS files"):
        EtcdClient("https://example:2379", ca_file="/nonexistent/ca.pem")
    with socketless_port() as port:
        c = EtcdClient(f"http://127.0.0.1:{port}", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="unreachable"):
            c.get(b"/x")
        assert time.monotonic() - t0 < 5


class socketless_port:
    """A port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc: object) -> None:
        pass


def test_membership_sees_joins_and_leaves_in_order(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url)
    events: list[tuple[str, str]] = []
    m = Membership(c, PREFIX, fingerprint=FP, on_join=lambda r: events.append(("join", r.name)),
                   on_leave=lambda n: events.append(("leave", n)), check_s=0.2)
    try:
        a = WorkerRegistration(c, PREFIX, record("p0")).register()
        assert m.wait_until(lambda ms: "p0" in ms, 5)
        b = WorkerRegistration(c, PREFIX, record("d0", "decode")).register()
        assert m.wait_until(lambda ms: set(ms) == {"p0", "d0"}, 5)
        assert m.members()["d0"].role == "decode" and m.available
        a.close()  # revoke: leaves at once, not after the TTL
        assert m.wait_until(lambda ms: set(ms) == {"d0"}, 2)
        b.close()
        assert m.wait_until(lambda ms: not ms, 2)
        assert events == [("join", "p0"), ("join", "d0"), ("leave", "p0"), ("leave", "d0")]
    finally:
        m.close()


def test_registration_refuses_another_model_and_a_taken_name(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url)
    with WorkerRegistration(c, PREFIX, record("p0")):
        other = FP.__class__(**{**{f: getattr(FP, f) for f in FP.__struct_fields__}, "dtype": "bfloat16"})
        with pytest.raises(InvalidArgument, match="dtype: 'float32' != 'bfloat16'"):
            WorkerRegistration(c, PREFIX, record("p1", fp=other)).register()
        with pytest.raises(InvalidArgument, match="already registered"):
            WorkerRegistration(c, PREFIX, record("p0")).register()
    # the cluster's fingerprint outlives its workers: a later worker of another model is
    # still refused
    with pytest.raises(InvalidArgument, match="block_size: 16 != 32"):
        bad = FP.__class__(**{**{f: getattr(FP, f) for f in FP.__struct_fields__}, "block_size": 32})
        WorkerRegistration(c, PREFIX, record("p2", fp=bad)).register()


def test_membership_refuses_malformed_and_foreign_records(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url)
    c.put(worker_key(PREFIX, "junk"), b"\xff not json")
    foreign = FP.__class__(**{**{f: getattr(FP, f) for f in FP.__struct_fields__}, "model": "llama-7b"})
    c.put(worker_key(PREFIX, "alien"), encode_record(record("alien", fp=foreign)))
    c.put(worker_key(PREFIX, "liar"), encode_record(record("someone-else")))
    with Membership(c, PREFIX, fingerprint=FP, check_s=0.2) as m:
        assert wait_for(lambda: set(m.refused) == {"junk", "alien", "liar"}, 5), m.refused
        assert "malformed" in m.refused["junk"] and "model: 'tiny' != 'llama-7b'" in m.refused["alien"]
        assert m.members() == {}
        with WorkerRegistration(c, PREFIX, record("p0")):
            assert m.wait_until(lambda ms: set(ms) == {"p0"}, 5)


_WORKER = textwrap.dedent("""
    import sys, time
    from mooncake_rs.deploy import EtcdClient, ModelFingerprint, WorkerRecord, WorkerRegistration
    fp = ModelFingerprint(model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    rec = WorkerRecord(name=sys.argv[2], role="prefill", control="127.0.0.1:1", transfer="127.0.0.1:2",
                       fingerprint=fp, block_bytes=16384, capacity_blocks=64)
    WorkerRegistration(EtcdClient(sys.argv[1]), "/mooncake/test", rec, ttl_s=2).register()
    print("registered", flush=True)
    time.sleep(60)
""")


def test_a_sigkilled_worker_leaves_within_its_ttl(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url)
    p = subprocess.Popen([sys.executable, "-c", _WORKER, etcd.url, "crashy"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "registered"
        with Membership(c, PREFIX, check_s=0.2) as m:
            assert m.wait_until(lambda ms: "crashy" in ms, 5)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            t0 = time.monotonic()
            assert m.wait_until(lambda ms: "crashy" not in ms, 2 + 5), "a dead worker's key outlived its lease"
            assert time.monotonic() - t0 <= 7
    finally:
        p.kill()
        p.wait(timeout=10)


_LEADER = textwrap.dedent("""
    import sys, time
    from mooncake_rs.deploy import EtcdClient, LeaderElection
    e = LeaderElection(EtcdClient(sys.argv[1]), "/mooncake/test", "serve-a", ttl_s=2)
    assert e.campaign(timeout_s=10)
    print("leading", flush=True)
    time.sleep(60)
""")


def test_the_standby_takes_over_when_the_leader_is_killed(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url)
    p = subprocess.Popen([sys.executable, "-c", _LEADER, etcd.url], stdout=subprocess.PIPE, text=True)
    standby = LeaderElection(c, PREFIX, "serve-b", ttl_s=2, poll_s=0.1)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "leading"
        assert standby.leader() == "serve-a"
        assert standby.campaign(timeout_s=0.5) is False and not standby.is_leader
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        assert standby.campaign(timeout_s=10), "the standby never took over"
        assert standby.is_leader and standby.leader() == "serve-b"
        # a third candidate does not depose it while it keeps its lease
        third = LeaderElection(c, PREFIX, "serve-c", ttl_s=2, poll_s=0.1)
        assert third.campaign(timeout_s=3) is False
        standby.resign()
        assert third.campaign(timeout_s=5) and third.leader() == "serve-c"
        third.resign()
    finally:
        p.kill()
        p.wait(timeout=10)
        standby.resign()


def test_etcd_outage_keeps_the_last_view_and_recovers(etcd: EtcdServer) -> None:
    c = EtcdClient(etcd.url, timeout_s=0.5)
    reg = WorkerRegistration(c, PREFIX, record("p0"), ttl_s=5).register()
    m = Membership(c, PREFIX, fingerprint=FP, check_s=0.2)
    try:
        assert m.wait_until(lambda ms: "p0" in ms, 5) and wait_for(lambda: m.available, 5)
        etcd.stop()
        assert wait_for(lambda: not m.available, 5), "the outage was not noticed"
        assert set(m.members()) == {"p0"}, "routing lost its last known members during the outage"
        with pytest.raises(ServiceUnavailable):
            WorkerRegistration(c, PREFIX, record("p1")).register()
        time.sleep(1.0)
        etcd.start()
        assert wait_for(lambda: m.available, 10), "membership did not recover after etcd came back"
        assert set(m.members()) == {"p0"}
        late = WorkerRegistration(c, PREFIX, record("p1")).register(wait_s=10)  # a restarted etcd's first write can be slow
        assert m.wait_until(lambda ms: set(ms) == {"p0", "p1"}, 5)
        assert m.resyncs >= 2
        late.close()
    finally:
        reg.close()
        m.close()


def test_register_waits_for_etcd_when_asked(etcd: EtcdServer) -> None:
    # a worker started while etcd is down: once (the default) fails at once; with wait_s
    # it keeps trying and registers as soon as etcd is back
    import threading

    c = EtcdClient(etcd.url, timeout_s=0.5)
    with pytest.raises(InvalidArgument, match="wait_s"):
        WorkerRegistration(c, PREFIX, record("w-bad")).register(wait_s=-1)
    etcd.stop()
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        WorkerRegistration(c, PREFIX, record("w-once")).register()
    assert time.monotonic() - t0 < 5
    with pytest.raises(ServiceUnavailable):  # gives up after its wait
        WorkerRegistration(c, PREFIX, record("w-short")).register(wait_s=1.0)
    threading.Timer(1.5, etcd.start).start()
    reg = WorkerRegistration(c, PREFIX, record("w-wait"), ttl_s=5).register(wait_s=30)
    try:
        assert reg.lease_id is not None
        kv = c.get(worker_key(PREFIX, "w-wait"))
        assert kv is not None and kv.value == encode_record(record("w-wait"))
    finally:
        reg.close()


def test_a_forged_fingerprint_cannot_keep_workers_out(etcd: EtcdServer) -> None:
    """Issue 26: ``{prefix}/fingerprint`` was unsigned, so an etcd writer could put another
    model's there and every worker was refused. With the cluster token it is signed: a
    worker ignores one that does not verify (unsigned, or a bad signature) and puts its
    own; a signed one of another model still refuses a worker."""
    from mooncake_rs.client.records import sign_fingerprint, verify_fingerprint, records_key

    c = EtcdClient(etcd.url)
    prefix, token = "/mooncake/fp-forged", "fp-test-token-0123456789abcdef"
    key = f"{prefix}/fingerprint".encode()
    other = FP.__class__(**{**{f: getattr(FP, f) for f in FP.__struct_fields__}, "model": "another"})
    forgeries = [
        msgspec.json.encode(other),  # what an unsigned cluster writes
        sign_fingerprint(other, records_key("not-the-cluster-token"), key),  # signed with another key
        sign_fingerprint(other, records_key(token), b"/mooncake/elsewhere/fingerprint"),  # copied from another key
        b"\xff not json",
    ]
    for i, forged in enumerate(forgeries):
        c.put(key, forged)
        with WorkerRegistration(c, prefix, record(f"w{i}"), token=token):
            fp, why = verify_fingerprint(c.get(key).value, records_key(token), key)
            assert why is None and fp == FP, (i, why)
    # a signed fingerprint of another model is the cluster's: a worker of this one is refused
    c.put(key, sign_fingerprint(other, records_key(token), key))
    with pytest.raises(InvalidArgument, match="model: 'another' != 'tiny'"):
        WorkerRegistration(c, prefix, record("w9"), token=token).register()
    # without a token nothing can be verified: what is there is the cluster's (the
    # threat model says so)
    c.put(key, msgspec.json.encode(other))
    with pytest.raises(InvalidArgument, match="model: 'another' != 'tiny'"):
        WorkerRegistration(c, "/mooncake/fp-forged", record("w8")).register()
