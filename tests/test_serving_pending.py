"""A session's next step routed behind its still-queued predecessor on the same prefill
instance (the conductor prices the predecessor's blocks as local there: pending
prefixes, docs/conductor.md) waits for the predecessor to store them and reuses them,
rather than computing them again. The tests hold every KV hand-off to the decode
instance (the transport's ``write``) so the predecessor cannot end before the next step
has arrived. The conductor counts a request as running from when the instance's engine
takes it (``Started``), not from its dispatch."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.serving import transport as T  # noqa: E402
from mooncake_rs.serving.prefill import shared_blocks  # noqa: E402
from serving_helpers import BLOCK, gate_transport, reference_outputs, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture()
def gated_write(monkeypatch):
    return gate_transport(monkeypatch, "write")


def test_shared_blocks_against_a_linear_scan():
    from mooncake_rs import PrefixHasher

    rng = random.Random(5)
    h = PrefixHasher(BLOCK)
    for _ in range(200):
        base = [rng.randrange(50) for _ in range(rng.randrange(0, 8 * BLOCK))]
        other = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(0, 4 * BLOCK))]
        a, b = h.hash_blocks(base), h.hash_blocks(other)
        limit = rng.randrange(0, 10)
        ref = 0
        while ref < min(len(a), len(b), limit) and a[ref] == b[ref]:
            ref += 1
        assert shared_blocks(a, b, limit) == ref


def _steps(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    first = [rng.randrange(256) for _ in range(5 * BLOCK + 3)]
    second = first + [rng.randrange(256) for _ in range(2 * BLOCK + 5)]
    third = second + [rng.randrange(256) for _ in range(BLOCK + 1)]
    return [first, second, third]


def _submit_held(c, gated_write, prompt: list[int]):
    """Submits ``prompt`` with every KV hand-off held, and waits until its own has started
    (so it cannot end before what is submitted next has arrived); its handle."""
    gated_write.open.clear()
    handle = c.submit(prompt, GREEDY)
    wait_for(lambda: gated_write.held, "the first step's KV hand-off started")
    return handle


def test_next_steps_queued_behind_their_predecessor_reuse_its_blocks(gated_write):
    from mooncake_rs import Cluster

    steps = _steps(11)
    ref = reference_outputs(steps, GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        p = c.prefill_ids[0]
        first = _submit_held(c, gated_write, steps[0])
        later = [c.submit(s, GREEDY) for s in steps[1:]]
        wait_for(lambda: c.instance_stats()[p]["requests"] == 3, "every step reached the prefill instance")
        time.sleep(0.2)  # time to compute them, had they not waited
        # the conductor sees what the instance does: the first step computing, the two
        # after it still queued (they are started when their engine takes them, ``Started``)
        load = c.conductor.snapshot().prefill[0]
        assert (load.id, load.running, load.queued) == (p, 1, 2)
        gated_write.open.set()
        outs = [h.result(60) for h in (first, *later)]
    assert [o.token_ids for o in outs] == ref
    # every step reuses every full block of the one before (the last prompt token is always computed)
    assert [o.metrics.reused_tokens for o in outs] == [0, 5 * BLOCK, 7 * BLOCK]
    for o, s in zip(outs, steps):
        assert o.metrics.computed_tokens == len(s) - o.metrics.reused_tokens


def test_an_unrelated_request_does_not_wait(gated_write):
    from mooncake_rs import Cluster

    steps = _steps(12)
    other = [7] * (3 * BLOCK)
    ref = reference_outputs([steps[0], other], GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        first = _submit_held(c, gated_write, steps[0])
        quick = c.submit(other, GREEDY)
        # it computes while the first is held: its own hand-off starts too
        wait_for(lambda: len(gated_write.held) >= 2 or quick.done, "the unrelated request computed")
        gated_write.open.set()
        assert first.result(60).token_ids == ref[0]
        out = quick.result(60)
    assert out.token_ids == ref[1] and out.metrics.reused_tokens == 0


def test_a_fetch_not_priced_as_a_prefetch_starts_at_its_dequeue(monkeypatch):
    """With the conductor's staging room at 0 (``Decision.prefetch`` False), a request's
    fetch starts once the request computing before it on its instance is done (its
    dequeue), as the conductor priced it; with room it starts as soon as the request
    reaches the instance (tests/test_serving_fetch.py)."""
    from mooncake_rs import Cluster
    from mooncake_rs.serving import prefill as PF
    from mooncake_rs.serving.config import ServingConfig

    args = ServingConfig.conductor_args
    monkeypatch.setattr(ServingConfig, "conductor_args",
                        lambda self, bs, dram=None: {**args(self, bs, dram), "prefetch_staging_bytes": 0.0})
    log: list[tuple[float, str, int]] = []
    read, on_outputs = T.Transport.read, PF.PrefillRole.on_outputs

    def logged_read(self, tag, ep, spans):
        log.append((time.monotonic(), "read", tag))
        read(self, tag, ep, spans)

    def logged_outputs(self, outs):
        on_outputs(self, outs)
        log.extend((time.monotonic(), "computed", int(o.request_id)) for o in outs if o.finished)

    monkeypatch.setattr(T.Transport, "read", logged_read)
    monkeypatch.setattr(PF.PrefillRole, "on_outputs", logged_outputs)
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    ref = reference_outputs([prefix + [9, 9]], GREEDY, seed=3)[0]
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        holder = c.generate([prefix + [1, 2, 3]], GREEDY)[0].metrics.prefill_instance
        long = c.submit([rng.randrange(256) for _ in range(3000)], SamplingParams(max_tokens=2))  # on the holder
        ahead = c.submit([rng.randrange(256) for _ in range(800)], SamplingParams(max_tokens=2))  # the other
        h = c.submit(prefix + [9, 9], GREEDY)  # behind `ahead`, fetching from the busier holder
        out = h.result(60)
        long.result(60)
        ahead.result(60)
    assert (long.prefill_instance, ahead.prefill_instance, h.prefill_instance) == (holder, 1 - holder, 1 - holder)
    assert out.metrics.fetched_tokens == 6 * BLOCK and out.token_ids == ref
    t_read = min(t for t, what, _ in log if what == "read")  # the one fetch of the run
    t_ahead = next(t for t, what, rid in log if what == "computed" and rid == ahead.request_id)
    assert t_read > t_ahead


def test_a_waiting_step_computes_what_its_cancelled_predecessor_did_not_store(gated_write):
    """The predecessor is cancelled while the next step waits for it: its blocks are
    never stored, so the step computes them itself (or, had the cancel come after the
    predecessor ended, reuses them); either way its output is right and nothing is left
    held on any instance."""
    from mooncake_rs import Cluster

    steps = _steps(13)
    ref = reference_outputs(steps[1:2], GREEDY, seed=3)[0]
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        p = c.prefill_ids[0]
        first = _submit_held(c, gated_write, steps[0])
        second = c.submit(steps[1], GREEDY)
        wait_for(lambda: c.instance_stats()[p]["requests"] == 2, "the second step reached the prefill instance")
        assert first.cancel()
        time.sleep(0.3)  # the cancel reaches the instance, which waits for the held copies to end
        gated_write.open.set()
        out = second.result(60)
        assert out.token_ids == ref and out.metrics.reused_tokens in (0, 5 * BLOCK)
        wait_for(lambda: all(not st["requests"] and not st["pinned_requests"] and st["free_pages"] == st["pages"]
                             for st in c.instance_stats().values()), "every instance let go of both steps")
