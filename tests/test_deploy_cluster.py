"""A deployment across hosts, end to end: 2 prefill + 1 decode workers on three hosts, a
leading ``serve`` on a fourth and a standby on a fifth, etcd on the test's own bridge,
all started as processes the way a user starts them (deploy_helpers.py), and a
``RemoteCluster`` in the test. Hosts are network namespaces (veth pairs on a private
subnet the test makes), or distinct loopback addresses where namespaces cannot be made;
KV goes over TCP either way (``--transports tcp``).

One deployment serves the whole module (starting one costs ~10 s of torch imports);
before each test the ``dep`` fixture brings it back to what every test starts from (etcd
up, a leader and a standby, 2 prefill + 1 decode workers serving), replacing whatever an
earlier test killed or cut, so no test depends on which ran before it. Faults: a worker with the wrong token, one of another model, etcd
stopped for 5 s, a decode worker SIGKILLed mid-request, a host gone from the network,
the leader killed. Every wait is bounded; teardown stops every process and removes the
namespaces.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from deploy_helpers import Deployment, make_hosts, wait_until  # noqa: E402
from etcd_helpers import EtcdServer, required_etcd_binary  # noqa: E402
from netns_helpers import require  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts  # noqa: E402

import mooncake_rs as mc  # noqa: E402
from mooncake_rs.engine import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=8)
# hosts: 0, 1 prefill; 2 decode; 3 the leader serve; 4 the standby; 5 a spare
P0, P1, D0, SERVE_A, SERVE_B, SPARE = range(6)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    binary = required_etcd_binary()
    tmp = tmp_path_factory.mktemp("deploy")
    with make_hosts(6) as hosts:
        server = EtcdServer(binary, tmp / "etcd", host=hosts.gateway)
        server.start()
        d = Deployment(hosts, server, tmp)
        d.roles = {}  # type: ignore[attr-defined]  # worker name -> role, for the restore below
        d.host_of = {}  # type: ignore[attr-defined]  # worker name -> host
        d.serves = {"serve-a": SERVE_A, "serve-b": SERVE_B}  # type: ignore[attr-defined]
        d.next_port = 7020  # type: ignore[attr-defined]
        try:
            d.serve("serve-a", SERVE_A)
            assert d.wait_log("serve-a", "leading"), d.log_tail()
            d.serve("serve-b", SERVE_B)  # the standby
            for name, host, role in (("p0", P0, "prefill"), ("p1", P1, "prefill"), ("d0", D0, "decode")):
                d.worker(name, host, role)
                d.roles[name], d.host_of[name] = role, host  # type: ignore[attr-defined]
            client = d.client()
            assert wait_until(lambda: len(client.instances()) == 3, 90), d.log_tail()
            d.client_ = client  # type: ignore[attr-defined]
            yield d
            client.close()
        finally:
            d.close()
            server.stop()
        procs = list(d.procs.values())
    assert all(p.poll() is not None for p in procs), "a deployment process outlived the test"


@pytest.fixture
def dep(deployment):
    """The module's deployment as every test starts from it (see the module doc)."""
    _restore(deployment)
    return deployment


def _live(d, role: str) -> list[str]:
    return sorted(n for n, r in d.roles.items() if r == role and d.procs[n].poll() is None)


def _start_worker(d, role: str, host: int) -> str:
    """A new worker of ``role`` on ``host`` (a name and a port no earlier one used)."""
    name = f"{role[0]}{d.next_port}"
    d.worker(name, host, role, port=d.next_port)
    d.next_port += 1
    d.roles[name], d.host_of[name] = role, host
    return name


def _restore(d) -> None:
    if d.etcd.proc is None:
        d.etcd.start()
    for name, host in list(d.serves.items()):
        if d.procs[name].poll() is not None:  # a killed leader or standby: another in its place
            del d.serves[name]
            new = f"serve-{d.next_port}"
            d.serve(new, host, port=d.next_port)
            d.next_port += 1
            d.serves[new] = host
    for role, want in (("prefill", 2), ("decode", 1)):
        for _ in range(want - len(_live(d, role))):
            _start_worker(d, role, SPARE)
    live = set(_live(d, "prefill")) | set(_live(d, "decode"))

    def serving() -> bool:
        try:
            return _names(d.client_) == live
        except mc.MooncakeError:  # the client reconnecting to a new leader
            return False

    assert wait_until(serving, 90), (live, d.log_tail())


def _names(client) -> set[str]:
    return set(client.instances().values())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics text")


def test_outputs_equal_a_single_engine_and_a_prefix_is_fetched_over_tcp(dep):
    c = dep.client_
    prompts = shared_prefix_prompts(4, seed=2) + [[7], list(range(2 * BLOCK))]
    ref = reference_outputs(prompts, GREEDY)
    assert [o.token_ids for o in c.generate(prompts, GREEDY, timeout_s=120)] == ref
    outs = c.generate(prompts, GREEDY, timeout_s=120)  # the shared prefix is in the stores now
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.reused_tokens for o in outs) > 0
    assert [list(c.submit(p, GREEDY)) for p in prompts[:2]] == ref[:2]  # streaming

    # a prefix computed on one prefill host, fetched by the other: load the holder with
    # a long prompt so the conductor sends the next request to the other one
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    holder = c.generate([prefix + [4]], GREEDY, timeout_s=60)[0].metrics.prefill_instance
    filler = c.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
    out = c.submit(prefix + [8, 8, 8], GREEDY).result(60)
    filler.result(60)
    assert out.metrics.prefill_instance != holder
    assert out.metrics.fetched_tokens > 0
    assert out.token_ids == reference_outputs([prefix + [8, 8, 8]], GREEDY)[0]
    # the KV crossed hosts through the transfer engines, TCP only (--transports tcp): the
    # prefill workers' engines moved it (into the decode worker, and the fetched prefix)
    stats = c.instance_stats()
    names = c.instances()
    moved = {names[i]: s["copied_bytes"] for i, s in stats.items()}
    assert all(moved[p] > 0 for p in _live(dep, "prefill")), moved
    assert "mooncake_requests_finished_total" in c.metrics_text()


def test_remote_errors_are_typed_and_cancel_reaches_the_service(dep):
    c = dep.client_
    with pytest.raises(mc.InvalidArgument, match="vocabulary"):
        c.submit([1, 10**6], GREEDY)  # outside the tiny model's vocabulary: refused by the service
    with pytest.raises(mc.InvalidArgument):
        c.submit([], GREEDY)  # refused by the client itself
    before = _metric(c.metrics_text(), "mooncake_requests_cancelled_total")
    h = c.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=5000, ignore_eos=True))
    assert wait_until(lambda: len(h.tokens) > 0, 60)
    assert h.cancel()
    with pytest.raises(mc.MooncakeError, match="cancelled"):
        h.result(5)
    assert wait_until(lambda: _metric(c.metrics_text(), "mooncake_requests_cancelled_total") == before + 1, 10), \
        c.metrics_text()


def test_a_worker_with_the_wrong_token_is_refused(dep, tmp_path: Path):
    c = dep.client_
    bad = tmp_path / "bad-token"
    bad.write_text("not-the-cluster-token-at-all-000")
    p = dep.worker("intruder", SPARE, "prefill", port=7010, token_file=bad)
    # it proves its token to the leader before registering: refused, it exits 2 with one
    # line that says so, and never registers (the leader logs the refusal too)
    assert p.wait(120) == 2, dep.log_tail()
    log = dep.logs["intruder"].read_text()
    assert "refused this worker's cluster token" in log and "registered" not in log, log
    assert wait_until(lambda: any("refused" in dep.logs[s].read_text(errors="replace") for s in dep.serves), 20), \
        dep.log_tail()
    assert "intruder" not in _names(c)
    assert c.generate([[1, 2, 3]], GREEDY, timeout_s=60)[0].token_ids == reference_outputs([[1, 2, 3]], GREEDY)[0]
    # a client with the wrong token is refused too, with a typed error
    with pytest.raises(mc.Unauthorized):
        mc.Cluster.connect(address=c.address, auth_token="not-the-cluster-token-at-all-000")


def test_a_worker_of_another_model_is_refused(dep):
    # another seed of the random-weight preset is another model: its KV must never mix
    p = dep.worker("other", SPARE, "prefill", port=7011, extra=["--seed", "1"])
    assert p.wait(120) == 2
    log = dep.logs["other"].read_text()
    assert "fingerprint" in log or "model" in log, log
    assert "other" not in _names(dep.client_)


def test_etcd_stopped_for_5s(dep):
    c = dep.client_
    long = SamplingParams(max_tokens=64, ignore_eos=True)
    running = [c.submit(p, long) for p in shared_prefix_prompts(2, seed=9)]
    dep.etcd.stop()
    t0 = time.monotonic()
    # routing continues on the last known membership
    during = c.generate([[5, 6, 7, 8]], GREEDY, timeout_s=60)[0]
    assert during.token_ids == reference_outputs([[5, 6, 7, 8]], GREEDY)[0]
    time.sleep(max(0.0, 5.0 - (time.monotonic() - t0)))
    dep.etcd.start()
    assert [len(h.result(60).token_ids) for h in running] == [64, 64]
    assert wait_until(lambda: _names(c) == set(_live(dep, "prefill") + _live(dep, "decode")), 30), dep.log_tail()
    after = c.generate([[9, 10, 11]], GREEDY, timeout_s=60)[0]
    assert after.token_ids == reference_outputs([[9, 10, 11]], GREEDY)[0]


def test_a_lapsed_lease_of_a_live_worker_fails_nothing(dep):
    """A lease can lapse while etcd is away although the worker is fine: it registers
    again by itself, and the conductor (whose link to it kept beating) keeps it."""
    from mooncake_rs.deploy import EtcdClient
    from mooncake_rs.client.records import worker_key

    c = dep.client_
    etcd = EtcdClient(dep.etcd.url)
    [decode] = _live(dep, "decode")
    key = worker_key(f"/mooncake/{dep.cluster}", decode)
    old = etcd.get(key)
    assert old is not None
    running = c.submit([7, 7, 7], SamplingParams(max_tokens=300, ignore_eos=True))
    etcd.lease_revoke(old.lease)  # its key goes now, as if the lease had expired
    assert wait_until(lambda: (kv := etcd.get(key)) is not None and kv.lease != old.lease, 20), dep.log_tail()
    assert len(running.result(60).token_ids) == 300
    assert decode in _names(c)
    assert c.generate([[8, 9]], GREEDY, timeout_s=60)[0].token_ids == reference_outputs([[8, 9]], GREEDY)[0]


def test_sigkill_a_decode_worker_mid_request(dep):
    c = dep.client_
    long = SamplingParams(max_tokens=2000, ignore_eos=True)
    handles = [c.submit(p, long) for p in shared_prefix_prompts(3, seed=4)]
    assert wait_until(lambda: all(len(getattr(h, "tokens", [])) > 0 for h in handles), 60)
    [decode] = _live(dep, "decode")
    t0 = time.monotonic()
    dep.procs[decode].send_signal(signal.SIGKILL)
    for h in handles:
        with pytest.raises(mc.TransferFailed, match=decode):
            h.result(30)
    assert time.monotonic() - t0 < 15  # its link closed: failed at once, not at a timeout
    assert wait_until(lambda: decode not in _names(c), 10)
    with pytest.raises((mc.Overloaded, mc.MooncakeError)):
        c.generate([[1, 2]], GREEDY, timeout_s=30)  # no decode instance left
    # a new decode worker on the same host joins and serves
    new = _start_worker(dep, "decode", D0)
    assert wait_until(lambda: new in _names(c), 90), dep.log_tail()
    assert c.generate([[3, 4, 5]], GREEDY, timeout_s=60)[0].token_ids == reference_outputs([[3, 4, 5]], GREEDY)[0]


def test_a_host_gone_from_the_network(dep):
    if not dep.hosts.netns:
        require()  # a loopback address cannot be cut off: skip, or fail where namespaces are required
    c = dep.client_
    # a prefill worker on a host of its own (replacements share the spare host)
    victim = next(n for n in _live(dep, "prefill") if dep.host_of[n] != SPARE)
    dep.hosts.cut(dep.host_of[victim])  # no FIN, no RST: silence
    t0 = time.monotonic()
    assert wait_until(lambda: victim not in _names(c), 15), dep.log_tail()
    assert time.monotonic() - t0 < 10  # the heartbeat timeout (3 s) or the lease TTL (2 s)
    outs = c.generate(shared_prefix_prompts(3, seed=6), GREEDY, timeout_s=60)
    assert all(o.metrics.prefill_instance != -1 for o in outs)
    assert [o.token_ids for o in outs] == reference_outputs(shared_prefix_prompts(3, seed=6), GREEDY)
    dep.procs[victim].kill()
    new = _start_worker(dep, "prefill", SPARE)  # another host takes its place
    assert wait_until(lambda: new in _names(c), 90), dep.log_tail()


def test_killing_the_leader_the_standby_takes_over(dep):
    c = dep.client_
    before = c.address
    rng = random.Random(21)
    prefix = [rng.randrange(256) for _ in range(5 * BLOCK)]
    c.generate([prefix + [1]], GREEDY, timeout_s=60)  # its blocks are in a prefill worker's store
    leader = next(n for n in dep.serves if dep.procs[n].poll() is None and "leading" in dep.logs[n].read_text())
    dep.procs[leader].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    # the next request reconnects through etcd once the standby leads and has the workers
    deadline = time.monotonic() + 60
    out = None
    while out is None and time.monotonic() < deadline:
        try:
            out = c.generate([[2, 4, 6, 8]], GREEDY, timeout_s=30)[0]
        except (mc.ServiceUnavailable, mc.MooncakeError):
            time.sleep(0.2)
    assert out is not None, dep.log_tail()
    assert out.token_ids == reference_outputs([[2, 4, 6, 8]], GREEDY)[0]
    assert c.address != before
    assert time.monotonic() - t0 < 30
    assert wait_until(lambda: len(c.instances()) == 3, 30), dep.log_tail()
    # the new leader's index was rebuilt from the workers (each re-announced its store
    # when it attached): the prefix computed before the failover is reused after it
    again = c.generate([prefix + [2]], GREEDY, timeout_s=60)[0]
    assert again.metrics.reused_tokens >= 4 * BLOCK
    assert again.token_ids == reference_outputs([prefix + [2]], GREEDY)[0]
