"""Adaptive roles in a real Cluster (serving/roles.py, ``Cluster.switch_role``): an
instance moves between the prefill and the decode pool while another thread keeps
submitting requests; every request finishes with the greedy outputs of a single Engine,
none fails, and the switched instance then serves its new role."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.errors import InvalidArgument  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(400)
GREEDY = SamplingParams(max_tokens=8)
PROMPTS = shared_prefix_prompts(10, prefix_len=3 * BLOCK + 5, seed=16) + shared_prefix_prompts(6, prefix_len=20,
                                                                                                 seed=17)


@pytest.fixture(scope="module")
def ref() -> list[list[int]]:
    return reference_outputs(PROMPTS, GREEDY, seed=3)


class Stream:
    """Submits the prompts round and round from a thread of its own until stopped."""

    def __init__(self, c, pause_s: float = 0.01) -> None:
        self.c = c
        self.lock = threading.Lock()  # held around submit + append: a mark taken under it is exact
        self.sent: list[tuple[int, object]] = []  # (prompt index, handle)
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.pause_s = pause_s
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            with self.lock:
                try:
                    self.sent.append((i % len(PROMPTS), self.c.submit(PROMPTS[i % len(PROMPTS)], GREEDY)))
                except BaseException as e:  # noqa: BLE001 - the test fails on it
                    self.errors.append(e)
                    return
            i += 1
            time.sleep(self.pause_s)

    def mark(self) -> int:
        with self.lock:
            return len(self.sent)

    def wait_for(self, n: int, timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        while self.mark() < n:
            assert time.monotonic() < end and not self.errors, self.errors
            time.sleep(0.01)

    def finish(self, ref) -> list:
        self.stop.set()
        self.t.join(30)
        assert not self.errors, self.errors
        outs = [h.result(120) for _, h in self.sent]
        for (i, _), o in zip(self.sent, outs):
            assert o.token_ids == ref[i], (i, o.metrics)
        return outs


def _run_switches(c, ref, per_phase: int) -> None:
    s = Stream(c)
    s.wait_for(per_phase)
    # prefill-1 -> decode while requests stream in: pools P={0}, D={1,2}
    r = c.switch_role(1, "decode")
    assert (r.old_role, r.new_role) == ("prefill", "decode") and c.decode_ids == [1, 2]
    s.wait_for(s.mark() + per_phase)
    # decode-0 (id 2) -> prefill: P={0,2}, D={1}; from here on every request decodes on 1
    c.switch_role(2, "prefill")
    m1 = s.mark()
    assert c.prefill_ids == [0, 2] and c.decode_ids == [1]
    # what its store kept as a decode instance (the prompts' blocks it received) is in
    # the index under it now: announced from its store's held_events right after the switch
    from mooncake_rs import PrefixHasher

    first = PrefixHasher(BLOCK, seed=0).hash(PROMPTS[0])[0]
    end = time.monotonic() + 10
    while not any(i == 2 for i, _ in c.conductor.index.holders(first)):
        assert time.monotonic() < end, c.conductor.index.holders(first)
        time.sleep(0.02)
    s.wait_for(m1 + per_phase)
    # prefill-0 -> decode: P={2}, D={0,1}; from here on every request prefills on 2
    c.switch_role(0, "decode")
    m2 = s.mark()
    s.wait_for(m2 + per_phase)
    outs = s.finish(ref)
    later = outs[m1:m2]
    assert later and all(o.metrics.decode_instance == 1 for o in later), [o.metrics.decode_instance for o in later]
    last = outs[m2:]
    assert last and all(o.metrics.prefill_instance == 2 for o in last), [o.metrics.prefill_instance for o in last]
    assert c.metrics.failed == 0 and c.metrics.finished == len(outs)
    # nothing is left held anywhere once the stream has ended
    end = time.monotonic() + 30
    while True:
        st = c.instance_stats()
        if all(not x["requests"] and not x["pinned_requests"] and x["free_pages"] == x["pages"] for x in st.values()):
            break
        assert time.monotonic() < end, st
        time.sleep(0.05)
    c.conductor.check_integrity()
    assert c.conductor.snapshot().requests == 0


def test_role_switches_under_load_lose_no_request(ref) -> None:
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        _run_switches(c, ref, per_phase=8)


def test_role_switches_in_worker_processes(ref) -> None:
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, processes=True) as c:
        _run_switches(c, ref, per_phase=5)


def test_a_switched_decode_instance_gets_its_engines_capacities() -> None:
    """A prefill instance switched to decode is registered with the batch and KV tokens its
    engine reported, as the instance started as decode is (not the conductor's default batch
    of 256, which would let admission overfill it)."""
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, engine_kwargs={"max_num_seqs": 7}) as c:
        c.switch_role(1, "decode")
        dec = {d.id: d for d in c.conductor.snapshot().decode}
        assert dec[1].max_batch == dec[2].max_batch == 7
        assert dec[1].kv_capacity_tokens == dec[2].kv_capacity_tokens


def test_switch_role_refusals(ref) -> None:
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        with pytest.raises(InvalidArgument, match="role must be"):
            c.switch_role(0, "both")
        with pytest.raises(InvalidArgument, match="not a live instance"):
            c.switch_role(9, "decode")
        with pytest.raises(InvalidArgument, match="last live prefill"):
            c.switch_role(0, "decode")
        with pytest.raises(InvalidArgument, match="timeout_s"):
            c.switch_role(0, "decode", timeout_s=0)
        r = c.switch_role(0, "prefill")  # the role it has: nothing to do
        assert r.old_role == r.new_role == "prefill" and r.total_s == 0.0
        # nothing was drained by the refusals: requests still go through
        assert c.generate([PROMPTS[0]], GREEDY)[0].token_ids == ref[0]
    with (Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, seed=3, kv_grants=True) as c,
          pytest.raises(InvalidArgument, match="kv_grants")):
        c.switch_role(0, "decode")


def test_switch_role_beside_calibrate_and_stats(ref) -> None:
    """``switch_role``, ``calibrate`` and ``instance_stats`` from three threads at once:
    each call's answer carries its query id, so none takes another's reply, and the
    conductor ``calibrate`` rebuilds knows the switched pools."""
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        start = threading.Barrier(3)
        done = threading.Event()
        got: dict[str, object] = {}
        errors: list[BaseException] = []

        def run(name, fn) -> None:
            start.wait(10)
            try:
                got[name] = fn()
            except BaseException as e:  # noqa: BLE001 - the test fails on it
                errors.append(e)

        def stats_until_done() -> int:
            n = 0
            while not done.is_set():
                assert set(c.instance_stats()) == {0, 1, 2}
                n += 1
            return n

        threads = [threading.Thread(target=run, args=("switch", lambda: c.switch_role(1, "decode"))),
                   threading.Thread(target=run, args=("calibrate", lambda: c.calibrate(
                       [(BLOCK, 0), (2 * BLOCK, 0), (2 * BLOCK, BLOCK), (4 * BLOCK, BLOCK)], repeats=1))),
                   threading.Thread(target=run, args=("stats", stats_until_done))]
        for t in threads:
            t.start()
        threads[0].join(120)
        threads[1].join(120)
        done.set()
        threads[2].join(60)
        assert not errors, errors
        assert got["switch"].new_role == "decode" and got["stats"] >= 1
        assert len(c.calibration) == 4
        assert c.prefill_ids == [0] and c.decode_ids == [1, 2]
        snap = c.conductor.snapshot(0.0)
        assert [p.id for p in snap.prefill] == [0] and sorted(d.id for d in snap.decode) == [1, 2]
        assert c.generate([PROMPTS[0]], GREEDY)[0].token_ids == ref[0]
