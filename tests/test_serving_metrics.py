"""The cluster's metrics: how a request's ending is counted (finished, cancelled, failed,
timed out), the KV-usage gauges the instances' heartbeats carry, and the in-process
heartbeat (a wedged instance thread is declared down). In-process clusters of the tiny
model; every wait is bounded; no test asserts a timing."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs import TransferFailed, TransferTimeout  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.errors import MooncakeError  # noqa: E402
from mooncake_rs.serving.metrics import ClusterMetrics  # noqa: E402
from mooncake_rs.serving.protocol import Beat, Codec  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=8)
ENDLESS = SamplingParams(max_tokens=3900, ignore_eos=True)  # never finishes within a test's bounds


def eventually(cond, what: str, bound_s: float = 60.0):
    end = time.monotonic() + bound_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"still not true after {bound_s}s: {what}")
        time.sleep(0.05)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics text")


def labelled(text: str, name: str) -> dict[str, float]:
    """``name{instance="i"} v`` lines as {i: v}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + '{instance="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


# ---- the counters themselves
def test_cluster_metrics_count_each_outcome_once():
    m = ClusterMetrics()
    for outcome in ("cancelled", "cancelled", "failed", "timed_out"):
        m.ended(outcome)
    s = m.summary()
    assert (s["cancelled"], s["failed"], s["timed_out"]) == (2, 2, 1)  # a deadline is a failure too
    text = m.prometheus()
    assert metric(text, "mooncake_requests_cancelled_total") == 2
    assert metric(text, "mooncake_requests_failed_total") == 2
    assert metric(text, "mooncake_requests_timed_out_total") == 1


def test_beat_is_additive_on_the_wire():
    codec = Codec()
    bare = codec.decode_body(codec.encode(Beat())[4:])  # what a beat before the instance exists carries
    assert bare == Beat() and bare.kv_pages == -1
    full = Beat(10, 4, 3, 8, 3 * 1024, 2, 1)
    assert codec.decode_body(codec.encode(full)[4:]) == full


@pytest.fixture(scope="module")
def cluster():
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=4 << 20,
                 seed=5, heartbeat_timeout_s=2.0) as c:
        yield c


def test_cancel_is_not_a_failure(cluster):
    c = cluster
    before = c.metrics.summary()
    h = c.submit(list(range(40, 40 + 2 * BLOCK)), ENDLESS)
    next(iter(h))
    assert h.cancel()  # the caller's choice: a stop string, a client gone
    eventually(lambda: c.metrics.cancelled == before["cancelled"] + 1, "the cancel was counted")
    # with an error of the caller's, and failed=False: still a cancel
    h2 = c.submit(list(range(90, 90 + 2 * BLOCK)), ENDLESS)
    next(iter(h2))
    assert h2.cancel(MooncakeError("stop string matched"), failed=False)
    with pytest.raises(MooncakeError, match="stop string"):
        h2.result(timeout=5)
    eventually(lambda: c.metrics.cancelled == before["cancelled"] + 2, "the second cancel was counted")
    # failed=True: the caller says it is a failure
    h3 = c.submit(list(range(140, 140 + 2 * BLOCK)), ENDLESS)
    next(iter(h3))
    assert h3.cancel(MooncakeError("the caller gave up on a broken request"), failed=True)
    eventually(lambda: c.metrics.failed == before["failed"] + 1, "the failure was counted")
    assert c.metrics.cancelled == before["cancelled"] + 2 and c.metrics.timed_out == before["timed_out"]
    text = c.metrics_text()
    assert metric(text, "mooncake_requests_cancelled_total") == before["cancelled"] + 2
    assert metric(text, "mooncake_requests_failed_total") == before["failed"] + 1


def test_deadlines_are_failures_and_timed_out(cluster):
    c = cluster
    before = c.metrics.summary()
    # a deadline given at submit (the router's tick ends it) ...
    h = c.submit(list(range(3 * BLOCK + 5)), ENDLESS, timeout_s=0.3)
    with pytest.raises(TransferTimeout, match="deadline"):
        for _ in h:
            pass
    # ... and a result() that times out (the handle cancels it with TransferTimeout)
    h2 = c.submit(list(range(7, 7 + 2 * BLOCK)), ENDLESS)
    with pytest.raises(TransferTimeout):
        h2.result(timeout=0.3)
    eventually(lambda: c.metrics.timed_out == before["timed_out"] + 2, "both deadlines counted")
    assert c.metrics.failed == before["failed"] + 2
    assert c.metrics.cancelled == before["cancelled"]
    # finished requests still count as finished, and are right
    prompts = shared_prefix_prompts(2, seed=7)
    done = c.metrics.finished
    assert [o.token_ids for o in c.generate(prompts, GREEDY)] == reference_outputs(prompts, GREEDY, seed=5)
    assert c.metrics.finished == done + 2


def test_kv_usage_gauges_follow_a_running_request(cluster):
    c = cluster
    dec = str(c.decode_ids[0])
    pre = str(c.prefill_ids[0])

    def idle_usage():
        u = c.kv_usage()
        return u if len(u) == 2 and all(v["kv_used_blocks"] == 0 for v in u.values()) else None

    idle = eventually(idle_usage, "every instance reports an idle KV cache")
    total = idle[c.decode_ids[0]]["kv_free_blocks"]
    assert total > 0
    h = c.submit([(3 * i + 1) % 256 for i in range(4 * BLOCK)], ENDLESS)
    next(iter(h))
    # the decode instance's next beat shows the request's pages taken
    def busy():
        t = c.metrics_text()
        return t if labelled(t, "mooncake_kv_used_blocks").get(dec, 0) > 0 else None

    text = eventually(busy, "the decode instance reports the request's pages")
    used = labelled(text, "mooncake_kv_used_blocks")[dec]
    assert used + labelled(text, "mooncake_kv_free_blocks")[dec] == total
    assert used >= 4  # at least the prompt's blocks
    # the prefill instance stored the prompt's blocks in its DRAM store (its last beat may
    # predate the commit: wait for the next one)
    def stored():
        t = c.metrics_text()
        return t if labelled(t, "mooncake_store_used_blocks").get(pre, 0) >= 4 else None

    text = eventually(stored, "the prefill instance reports the prompt's blocks")
    assert labelled(text, "mooncake_store_slots")[pre] >= labelled(text, "mooncake_store_used_blocks")[pre]
    assert labelled(text, "mooncake_store_used_bytes")[pre] > 0
    assert set(labelled(text, "mooncake_heartbeat_age_seconds")) == {dec, pre}
    # the text format: one TYPE line per family, and a family's samples together
    types = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    names = [ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")]
    runs = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    assert len(runs) == len(set(runs)), runs
    assert dec in labelled(text, "mooncake_engine_running") and dec in labelled(text, "mooncake_engine_waiting")
    # the one request decodes there (a beat may predate its admission: wait for the next)
    eventually(lambda: c.kv_usage()[c.decode_ids[0]]["engine_running"] == 1, "the decode engine runs it")
    assert c.kv_usage()[c.decode_ids[0]]["engine_waiting"] == 0
    # the beats agree with the instances' own (round-trip) stats once it ends
    h.cancel()
    eventually(idle_usage, "the pages are free again")
    stats = c.instance_stats()
    assert c.kv_usage()[c.decode_ids[0]]["kv_free_blocks"] == stats[c.decode_ids[0]]["free_pages"]


# ---- in-process heartbeats
def test_a_wedged_in_process_instance_is_marked_down(monkeypatch):
    from mooncake_rs import Cluster
    from mooncake_rs.serving import instance as instance_mod

    gate = threading.Event()  # set: the instance named ``wedge_name`` blocks in its loop
    release = threading.Event()
    wedged = threading.Event()
    wedge_name = "decode-0"
    orig = instance_mod.Instance.flush_store_events

    def flush(self):
        if gate.is_set() and self.spec.name == wedge_name and not release.is_set():
            wedged.set()
            release.wait(60)  # blocked on purpose, for a bounded time
        return orig(self)

    monkeypatch.setattr(instance_mod.Instance, "flush_store_events", flush)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=2, block_size=BLOCK, seed=5, heartbeat_timeout_s=1.0) as c:
        try:
            wedged_id = next(i for i, n in c.instances().items() if n == wedge_name)
            # a request that lives on the instance about to wedge
            for k in range(20):
                h = c.submit([(7 * k + 5 * i) % 256 for i in range(2 * BLOCK)], ENDLESS)
                if h.decode_instance == wedged_id:
                    break
                h.cancel()
            else:
                pytest.skip("the conductor never chose decode-0")
            next(iter(h))
            gate.set()
            assert wedged.wait(30)
            with pytest.raises(TransferFailed, match="stopped responding") as e:
                for _ in h:
                    pass
            assert wedge_name in str(e.value) and "heartbeat" in str(e.value)
            eventually(lambda: wedged_id not in c.instances(), "the wedged instance is no longer live")
            assert c.metrics.failed >= 1
            # later requests go to the other decode instance, and are right
            prompts = shared_prefix_prompts(3, seed=11)
            outs = c.generate(prompts, GREEDY, timeout_s=120)
            assert [o.token_ids for o in outs] == reference_outputs(prompts, GREEDY, seed=5)
            assert all(o.metrics.decode_instance != wedged_id for o in outs)
            assert str(wedged_id) not in labelled(c.metrics_text(), "mooncake_kv_used_blocks")
        finally:
            release.set()
        # once it wakes, the fenced thread reads Stop and exits
        member = c._core.members[wedged_id]
        member.thread.join(30)
        assert not member.thread.is_alive()


def test_a_wedged_idle_prefill_thread_is_routed_around(monkeypatch):
    # wedged while idle: no request fails, it is dropped from the conductor, and what
    # comes later runs on the other prefill instance
    from mooncake_rs import Cluster
    from mooncake_rs.serving import instance as instance_mod

    release = threading.Event()
    gate = threading.Event()
    orig = instance_mod.Instance.flush_store_events

    def flush(self):
        if gate.is_set() and self.spec.name == "prefill-0" and not release.is_set():
            release.wait(60)  # blocked on purpose, for a bounded time
        return orig(self)

    monkeypatch.setattr(instance_mod.Instance, "flush_store_events", flush)
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, seed=5, heartbeat_timeout_s=1.0) as c:
        try:
            before = c.metrics.summary()
            gate.set()
            eventually(lambda: 0 not in c.instances(), "the wedged prefill instance is marked down")
            prompts = shared_prefix_prompts(4, seed=13)
            outs = c.generate(prompts, GREEDY, timeout_s=120)
            assert [o.token_ids for o in outs] == reference_outputs(prompts, GREEDY, seed=5)
            assert all(o.metrics.prefill_instance == 1 for o in outs)
            assert c.metrics.failed == before["failed"]  # it held no request
        finally:
            release.set()


def test_latency_histograms_are_cumulative_and_memory_is_bounded():
    """TTFT/TBT are exported as Prometheus histograms over every finished request (fixed
    buckets), next to summaries whose quantiles cover only the most recent requests: the
    cluster's metrics stay the same size however long it serves."""
    from mooncake_rs.base.metrics import RequestMetrics
    from mooncake_rs.serving.metrics import RECENT_SAMPLES, TTFT_BUCKETS, ClusterMetrics

    m = ClusterMetrics()
    n = RECENT_SAMPLES + 500
    for i in range(n):
        r = RequestMetrics()
        r.ttft_s = 0.001 * (i % 100)  # 0 .. 99 ms
        r.token_intervals = [0.002, 0.003]
        r.tbt_s = 0.003
        m.add(r)
    assert len(m.ttft) == RECENT_SAMPLES and len(m.tbt) == RECENT_SAMPLES
    text = m.prometheus()
    assert "# TYPE mooncake_request_ttft_seconds histogram" in text
    buckets = {}
    for line in text.splitlines():
        if line.startswith("mooncake_request_ttft_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets[le] = int(line.rsplit(" ", 1)[1])
    assert list(buckets) == [f"{b:g}" for b in TTFT_BUCKETS] + ["+Inf"]
    counts = list(buckets.values())
    assert counts == sorted(counts) and counts[-1] == n  # cumulative, every request counted
    # reference: how many observations are <= each bound, counted directly
    ttfts = [0.001 * (i % 100) for i in range(n)]
    for b in TTFT_BUCKETS:
        assert buckets[f"{b:g}"] == sum(1 for t in ttfts if t <= b), b
    assert f"mooncake_request_ttft_seconds_count {n}" in text
    assert f"mooncake_request_tbt_seconds_count {n}" in text
