"""Cluster in-process mode: equality with a single Engine, cross-instance prefix reuse,
streaming, metrics, rejection, calibration."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from mooncake_rs import Overloaded, PrefixHasher  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts  # noqa: E402

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def cluster():
    from mooncake_rs import Cluster

    c = Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20, seed=3)
    yield c
    c.close()


def test_import_does_not_pull_torch():
    code = "import sys, mooncake_rs; assert 'torch' not in sys.modules; mooncake_rs.Cluster; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_greedy_outputs_equal_a_single_engine(cluster):
    prompts = shared_prefix_prompts(6, seed=1) + [[5], list(range(BLOCK)), list(range(3 * BLOCK))]
    ref = reference_outputs(prompts, GREEDY, seed=3)
    outs = cluster.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    # again, now with the shared prefix in the stores: reused, same tokens
    outs2 = cluster.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs2] == ref
    assert sum(o.metrics.reused_tokens for o in outs2) > 0
    for p, o in zip(prompts, outs2):
        m = o.metrics
        assert m.reused_tokens + m.computed_tokens == len(p)
        assert m.reused_tokens % BLOCK == 0 and m.reused_tokens <= len(p) - 1
        assert m.prefill_instance in (0, 1) and m.decode_instance == 2
        assert m.ttft_s > 0
    # the first round sent KV to the decode instance; the second only what it lacked
    assert sum(o.metrics.transferred_bytes for o in outs) > sum(o.metrics.transferred_bytes for o in outs2)


def test_prefix_reused_across_instances(cluster):
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    a = prefix + [1, 2, 3]
    first = cluster.generate([a], GREEDY)[0]
    holder = first.metrics.prefill_instance
    # Load the holder with a long unrelated prompt, then send a request sharing the prefix:
    # the conductor sends it to the other instance, which fetches the prefix blocks.
    filler = cluster.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
    h = cluster.submit(prefix + [9, 9], GREEDY)
    out = h.result(60)
    filler.result(60)
    m = out.metrics
    assert m.prefill_instance != holder
    assert m.fetched_tokens > 0 and m.reused_tokens >= m.fetched_tokens
    assert out.token_ids == reference_outputs([prefix + [9, 9]], GREEDY, seed=3)[0]


def test_streaming_yields_the_generated_tokens(cluster):
    prompts = shared_prefix_prompts(3, seed=5)
    want = [o.token_ids for o in cluster.generate(prompts, GREEDY)]
    got = [list(cluster.submit(p, GREEDY)) for p in prompts]
    assert got == want

    async def collect(p):
        return [t async for t in cluster.submit(p, GREEDY)]

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    assert asyncio.run(main()) == want


def test_metrics_text_is_prometheus(cluster):
    cluster.generate(shared_prefix_prompts(2, seed=9), GREEDY)
    text = cluster.metrics_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    values = dict(ln.rsplit(" ", 1) for ln in lines)
    assert float(values["mooncake_requests_finished_total"]) >= 2
    assert 'mooncake_ttft_seconds{quantile="0.99"}' in values
    assert all(float(v) >= 0 for v in values.values())
    tot = cluster.metrics
    assert tot.reused_tokens + tot.computed_tokens == tot.prompt_tokens


def test_tbt_is_mean_of_longest_tenth():
    from mooncake_rs.serving.metrics import tbt_of

    assert tbt_of([]) == 0.0
    assert tbt_of([1.0] * 9 + [11.0]) == 11.0
    assert tbt_of([float(i) for i in range(1, 21)]) == pytest.approx(19.5)


def test_overloaded_raised_and_reported():
    from mooncake_rs import Cluster

    with Cluster("tiny", prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=4 << 20,
                 ttft_slo_s=1e-9, rejection="early") as c:
        with pytest.raises(Overloaded):
            c.submit([1, 2, 3], GREEDY)
        with pytest.raises(Overloaded):
            c.generate([[1, 2, 3]], GREEDY)
        outs = c.generate([[1, 2, 3], [4, 5]], GREEDY, on_reject="report")
        assert [o.finish_reason for o in outs] == ["rejected", "rejected"]
        assert c.metrics.rejected == 4
        assert "mooncake_requests_rejected_total 4" in c.metrics_text()


def test_calibrate_fits_the_prefill_model(cluster):
    points = [(BLOCK, 0), (8 * BLOCK, 0), (32 * BLOCK, 0), (4 * BLOCK, 4 * BLOCK), (8 * BLOCK, 16 * BLOCK)]
    model = cluster.calibrate(points, repeats=2)
    assert [(n - c, c) for n, c, _ in cluster.calibration] == points
    assert all(s > 0 for _, _, s in cluster.calibration)
    assert min(model.c0, model.c_new, model.c_new2, model.c_cross) >= 0
    assert model.predict(32 * BLOCK, 0) >= model.predict(BLOCK, 0) > 0
    assert cluster.conductor.config.prefill_model.c_new == model.c_new
    # the cluster keeps serving, with the same index
    assert cluster.generate([[1, 2, 3]], GREEDY)[0].token_ids == reference_outputs([[1, 2, 3]], GREEDY, seed=3)[0]


def test_bad_arguments():
    from mooncake_rs import Cluster, InvalidArgument

    with pytest.raises(InvalidArgument):
        Cluster("tiny", prefill=0)
    with pytest.raises(InvalidArgument):
        Cluster("tiny", block_size=0)


def test_ssd_tier_serves_blocks_evicted_from_dram(tmp_path):
    """A prefill store too small for two prompts demotes the first one's blocks to its
    SSD tier; asking for that prompt again reuses them from SSD (promoted back), and the
    conductor's index followed the tiers."""
    import time

    from mooncake_rs import Cluster

    rng = random.Random(11)
    a = [rng.randrange(256) for _ in range(10 * BLOCK)] + [1]
    b = [rng.randrange(256) for _ in range(10 * BLOCK)] + [2]
    ref = reference_outputs([a, b], GREEDY, seed=3)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=16 * 8192,
                 ssd_path=str(tmp_path), seed=3) as c:
        assert c.generate([a], GREEDY)[0].token_ids == ref[0]
        assert c.generate([b], GREEDY)[0].token_ids == ref[1]
        first_block = PrefixHasher(BLOCK).hash(a)[0]
        deadline = time.monotonic() + 20
        while (0, "ssd") not in c.conductor.index.holders(first_block):
            assert time.monotonic() < deadline, c.conductor.index.holders(first_block)
            time.sleep(0.05)
        again = c.generate([a], GREEDY)[0]
        assert again.token_ids == ref[0]
        assert again.metrics.reused_tokens > 0
    assert any((tmp_path / "prefill-0").iterdir())  # the tier lives in the instance's own directory


def test_the_admission_learns_this_clusters_service_cost_from_the_prefill_reports():
    """Issue 26: the TTFT estimate is the latency floor plus the queue and work at the
    service scale the prefill instances measure (``PrefillReport.busy_s``): after a few
    requests both have left their starting values (1 and 0), and every estimate is
    finite. (No timing is asserted: only that the measurements reached the conductor.)"""
    from mooncake_rs import Cluster

    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=0, ttft_slo_s=30.0, rejection="early") as c:
        cond = c.conductor
        assert cond.calibration_scales(c._core.now())[0] == 1.0 and cond.calibration_floor(c._core.now()) == 0.0
        rng = random.Random(5)
        for _ in range(12):  # one at a time: a cold start admits one per idle instance
            out = c.generate([[rng.randrange(1, 200) for _ in range(40)]], SamplingParams(max_tokens=2, ignore_eos=True))
            assert len(out[0].token_ids) == 2
        scale, _ = cond.calibration_scales(c._core.now())
        assert scale != 1.0 and 0.2 <= scale <= 100.0
        d = cond.preview(10**9, [], 40, c._core.now(), expected_output_len=2)
        assert d.est_ttft_s >= cond.calibration_floor(c._core.now()) and d.est_ttft_s < float("inf")
