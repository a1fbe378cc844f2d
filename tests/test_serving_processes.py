"""Cluster with processes=True: equality with a single Engine, cross-instance reuse over
shared memory, a SIGKILLed worker, and a clean close (no processes, no segments)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs import TransferFailed  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts, shm_segments  # noqa: E402

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def procs():
    from mooncake_rs import Cluster

    before = shm_segments()
    c = Cluster(ModelConfig.tiny(), prefill=2, decode=2, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                seed=5, processes=True)
    yield c, before
    c.close()


def test_greedy_outputs_equal_a_single_engine(procs):
    c, _ = procs
    prompts = shared_prefix_prompts(5, seed=2) + [[7], list(range(2 * BLOCK))]
    ref = reference_outputs(prompts, GREEDY, seed=5)
    assert [o.token_ids for o in c.generate(prompts, GREEDY)] == ref
    outs = c.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.reused_tokens for o in outs) > 0
    assert [list(c.submit(p, GREEDY)) for p in prompts[:2]] == ref[:2]


def test_prefix_fetched_from_another_worker(procs):
    c, _ = procs
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    holder = c.generate([prefix + [4]], GREEDY)[0].metrics.prefill_instance
    filler = c.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
    out = c.submit(prefix + [8, 8, 8], GREEDY).result(60)
    filler.result(60)
    assert out.metrics.prefill_instance != holder
    assert out.metrics.fetched_tokens > 0
    assert out.token_ids == reference_outputs([prefix + [8, 8, 8]], GREEDY, seed=5)[0]


def test_killed_worker_fails_its_requests_and_the_rest_go_on(procs):
    c, before = procs
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    handles = [c.submit(p, long) for p in shared_prefix_prompts(6, seed=4)]
    victim = 2 if sum(h.decode_instance == 2 for h in handles) else 3
    deadline = time.monotonic() + 30
    while not any(h.decode_instance == victim and not h.done for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(h.decode_instance == victim and not h.done for h in handles)
    pid = c.pid_of(victim)
    os.kill(pid, signal.SIGKILL)
    for h in handles:
        if h.decode_instance == victim:
            with pytest.raises(TransferFailed, match="died"):
                h.result(timeout=15)
        else:
            assert len(h.result(timeout=60).token_ids) == 400
    assert victim not in c.instances()
    # the conductor dropped it: new requests go to the surviving decode instance
    outs = c.generate(shared_prefix_prompts(3, seed=8), GREEDY)
    assert {o.metrics.decode_instance for o in outs} == {5 - victim}
    assert c.metrics.failed >= 1


def test_close_leaves_no_processes_and_no_segments(procs):
    c, before = procs
    pids = [c.pid_of(i) for i in c.instances()]
    # the workers' arenas (other processes on the machine may hold mooncake_rs.* of their own)
    def mine():
        return {n for n in shm_segments() if any(n.startswith(f"mooncake_rs.{p}.") for p in pids)}

    assert all(pids) and len(mine()) >= len(pids)
    c.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not mine()
    c.close()  # idempotent
