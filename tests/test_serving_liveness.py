"""Liveness and deadlines of a Cluster (issue 17, item 12): a request that times out is
cancelled on every instance (nothing keeps running, no slot or page stays taken); a
worker stopped with SIGSTOP is declared down by the heartbeat watchdog, its requests fail
with a typed error, later requests go to the other instances, and the cluster still
closes cleanly. Every wait is bounded; no test asserts a timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs import InvalidArgument, TransferFailed, TransferTimeout  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts, shm_segments  # noqa: E402

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=8)
# long enough that a sub-second deadline always ends it early on CPU (the model's context
# is 4096 tokens; nothing here waits for it to finish)
ENDLESS = SamplingParams(max_tokens=3900, ignore_eos=True)


def eventually(cond, what: str, bound_s: float = 60.0) -> None:
    """Waits until ``cond()`` holds (a bound for a hung test, not a timing claim)."""
    end = time.monotonic() + bound_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"still not true after {bound_s}s: {what}")
        time.sleep(0.05)


def nothing_left(c) -> bool:
    """No request anywhere: not in the cluster, not in the conductor, not on an instance
    (no role state, no pins, every KV page free)."""
    if c.conductor.snapshot().requests:
        return False
    for st in c.instance_stats().values():
        if st["requests"] or st["pinned_requests"] or st["free_pages"] != st["pages"]:
            return False
    return True


def assert_drained(c) -> None:
    eventually(lambda: nothing_left(c), f"the cancelled requests are gone: {c.instance_stats()}")


@pytest.fixture(scope="module")
def cluster():
    from mooncake_rs import Cluster

    c = Cluster(ModelConfig.tiny(), prefill=2, decode=2, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                seed=5, processes=True, heartbeat_timeout_s=2.0)
    try:
        yield c
    finally:
        for i in list(c.instances()):  # a test that failed midway may leave a worker stopped
            pid = c.pid_of(i)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        c.close()


def test_heartbeat_timeout_is_validated():
    from mooncake_rs import Cluster

    for bad in (0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(InvalidArgument, match="heartbeat_timeout_s"):
            Cluster("tiny", heartbeat_timeout_s=bad)


def test_generate_timeout_cancels_the_request_everywhere(cluster):
    c = cluster
    before = c.metrics.failed
    with pytest.raises(TransferTimeout):
        c.generate([shared_prefix_prompts(1, seed=3)[0]], ENDLESS, timeout_s=0.3)
    eventually(lambda: c.metrics.failed == before + 1, "the router ended the request")
    assert_drained(c)
    # and the instances it ran on go on serving
    prompts = shared_prefix_prompts(3, seed=6)
    assert [o.token_ids for o in c.generate(prompts, GREEDY)] == reference_outputs(prompts, GREEDY, seed=5)


def test_result_timeout_and_submit_deadline_cancel(cluster):
    c = cluster
    h = c.submit(shared_prefix_prompts(1, seed=9)[0], ENDLESS)
    with pytest.raises(TransferTimeout, match="cancelled"):
        h.result(timeout=0.3)
    assert h.done
    # a deadline given at submit holds with nobody waiting: the stream ends with the error
    h2 = c.submit(list(range(3 * BLOCK + 5)), ENDLESS, timeout_s=0.3)
    with pytest.raises(TransferTimeout, match="deadline"):
        for _ in h2:
            pass
    # an explicit cancel, mid-stream
    h3 = c.submit(list(range(40, 40 + 2 * BLOCK)), ENDLESS)
    next(iter(h3))
    assert h3.cancel()
    assert not h3.cancel()  # already ended
    with pytest.raises(Exception, match="cancelled"):
        h3.result(timeout=5)
    assert_drained(c)


def test_in_process_deadline_cancels_too():
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, seed=5) as c:
        with pytest.raises(TransferTimeout):
            c.generate([list(range(2 * BLOCK + 3)), [9] * 50], ENDLESS, timeout_s=0.3)
        assert_drained(c)
        eventually(lambda: c.metrics.failed == 2, "both requests ended")
        prompts = shared_prefix_prompts(2, seed=7)
        assert [o.token_ids for o in c.generate(prompts, GREEDY)] == reference_outputs(prompts, GREEDY, seed=5)


def test_cancel_at_any_point_leaves_nothing_and_corrupts_nothing():
    # cancelled at different points of their life (routing, prefix fetch, prefill while KV
    # streams into the decode slots, decode): afterwards nothing is held anywhere and the
    # shared prefix they stored or fetched still gives the reference output
    import random

    from mooncake_rs import Cluster

    rng = random.Random(41)
    prefix = [rng.randrange(256) for _ in range(20 * BLOCK)]
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, seed=5) as c:
        for i, p in enumerate(prompts):
            h = c.submit(p, ENDLESS)
            time.sleep(0.004 * i)
            h.cancel()
        assert_drained(c)
        check = [prompts[0], prefix + [1, 2, 3]]
        assert [o.token_ids for o in c.generate(check, GREEDY)] == reference_outputs(check, GREEDY, seed=5)
        assert_drained(c)


def _stop_and_expect_down(c, victim: int, handles) -> None:
    pid = c.pid_of(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        for h in handles:
            if victim in (h.prefill_instance, h.decode_instance):
                with pytest.raises(TransferFailed, match="stopped responding"):
                    h.result(timeout=60)  # a bound, far above heartbeat_timeout_s
            else:
                assert h.result(timeout=120).token_ids
        eventually(lambda: victim not in c.instances(), "the hung instance is marked down")
    finally:
        if victim in c.instances():  # the watchdog did not act: let the process go on
            os.kill(pid, signal.SIGCONT)
    eventually(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
               "the hung worker was killed")


def test_worker_beats_carry_kv_usage(cluster):
    # worker processes report their KV and store use on the heartbeat (no round trip);
    # while a request decodes its decode instance's pages show as used, and the counts
    # agree with the instance's own stats once it is idle again
    c = cluster
    eventually(lambda: set(c.kv_usage()) == set(c.instances()), "every live worker has beaten")
    h = c.submit(list(range(5, 5 + 3 * BLOCK)), ENDLESS)
    next(iter(h))
    eventually(lambda: c.kv_usage().get(h.decode_instance, {}).get("kv_used_blocks", 0) >= 3,
               "the decode worker reports the request's pages")
    before = c.metrics.cancelled
    assert h.cancel()
    eventually(lambda: c.metrics.cancelled == before + 1, "the cancel is counted as cancelled")
    assert_drained(c)
    eventually(lambda: all(u["kv_used_blocks"] == 0 for u in c.kv_usage().values()), "the pages are free again")

    def gauges_match() -> bool:
        # a gauge is the instance's last beat, so up to one beat period old: a prefill may
        # still commit the cancelled request's blocks after its last beat; the next agrees
        stats = c.instance_stats()
        return all(u["kv_free_blocks"] == stats[i]["free_pages"] and u["store_used_blocks"] == stats[i]["blocks"]
                   for i, u in c.kv_usage().items())

    eventually(gauges_match, "the beat gauges agree with the instances' own stats (at most a beat later)")


def test_stopped_prefill_worker_is_marked_down(cluster):
    c = cluster
    victim = 0
    os.kill(c.pid_of(victim), signal.SIGSTOP)
    try:
        # submitted while it is stopped: the ones routed to it must fail, not hang
        handles = [c.submit(p, GREEDY) for p in shared_prefix_prompts(6, seed=21)]
    except BaseException:
        os.kill(c.pid_of(victim), signal.SIGCONT)
        raise
    _stop_and_expect_down(c, victim, handles)
    outs = c.generate(shared_prefix_prompts(4, seed=22), GREEDY)
    assert {o.metrics.prefill_instance for o in outs} == {1}
    assert_drained(c)


def test_stopped_decode_worker_fails_its_requests_and_the_rest_go_on(cluster):
    c = cluster
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    handles = [c.submit(p, long) for p in shared_prefix_prompts(6, seed=31)]
    decodes = {h.decode_instance for h in handles}
    victim = 2 if 2 in decodes else 3
    eventually(lambda: any(h.decode_instance == victim and not h.done for h in handles) or
               all(h.done for h in handles), "a request decodes on the victim")
    assert any(h.decode_instance == victim and not h.done for h in handles)
    _stop_and_expect_down(c, victim, handles)
    prompts = shared_prefix_prompts(3, seed=32)
    outs = c.generate(prompts, GREEDY)
    assert {o.metrics.decode_instance for o in outs} == {5 - victim}
    assert [o.token_ids for o in outs] == reference_outputs(prompts, GREEDY, seed=5)
    assert_drained(c)


_PAUSED_CLUSTER = """
import sys, time
from mooncake_rs import Cluster
from mooncake_rs.engine import ModelConfig, SamplingParams
c = Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, seed=5, processes=True, heartbeat_timeout_s=1.0)
print("ready", flush=True)
sys.stdin.readline()  # the test stops and resumes this process meanwhile
time.sleep(1.0)
out = c.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]
print("alive", len(c.instances()), len(out.token_ids), flush=True)
c.close()
"""


def test_a_paused_cluster_does_not_kill_its_healthy_workers():
    # the cluster's own process stopped longer than heartbeat_timeout_s: the beats were
    # queued, not missing, so no worker may be declared down when it resumes
    p = subprocess.Popen([sys.executable, "-c", _PAUSED_CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(p.pid, signal.SIGCONT)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["alive", "2", "4"]
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)


def test_close_after_hung_workers_is_clean(cluster):
    c = cluster
    pids = [c.pid_of(i) for i in (0, 1, 2, 3)]
    c.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not {n for n in shm_segments() if any(n.startswith(f"mooncake_rs.{p}.") for p in pids)}

