"""A Cluster's prefix fetch from two holders at once vs from one (issue 16, DualPath's
multi-path loading in the real request path), with emulated links.

One in-process ``Cluster(prefill=3, decode=1, link_bandwidth=--link, multipath=True)``;
each run takes a fresh prefix of ``--blocks`` blocks and: computes it on instance A;
with A drained (``Conductor.drain_instance``: no new request, its blocks stay
fetchable), has it fetched by B; with A and B drained, sends a third request sharing it,
which lands on C and is the one timed. Runs alternate ``cluster.multipath`` False / True
(the attribute is read at each submit), so single-source and two-source fetches
interleave on the same instances. Reported: the median of the prefill instance's fetch
time (``RequestMetrics.fetch_s``: from the fetch's start to its last block in) and of
the TTFT, each mode, and their ratios. Every timed request's output is checked against a
single Engine's greedy output, and the two-source runs must have read from 2 holders.

    python benches/multipath_cluster_bench.py [--blocks 64] [--link 1e7] [--runs 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mooncake_rs import Cluster
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=64, help="prefix blocks fetched (16 tokens each)")
    ap.add_argument("--link", type=float, default=1e7, help="bytes/s of every instance's emulated link")
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each mode")
    a = ap.parse_args()
    params = SamplingParams(max_tokens=4)
    model = ModelConfig.tiny()
    ref_engine = Engine(model, block_size=BLOCK, seed=0)
    rng = random.Random(0)
    fetch_s: dict[bool, list[float]] = {False: [], True: []}
    ttft: dict[bool, list[float]] = {False: [], True: []}
    slots = 3 * (a.runs + 1) * (a.blocks + 2) + 64  # every run's prefix stays held everywhere
    with Cluster(model, prefill=3, decode=1, block_size=BLOCK, dram_bytes_per_instance=slots * 8192, seed=0,
                 link_bandwidth=a.link, multipath=True, start_timeout_s=300) as c:
        bb = c._layout_bytes
        for run in range(-1, a.runs):  # run -1 of each mode: warm-up, not counted
            for multipath in (False, True):
                prefix = [rng.randrange(256) for _ in range(a.blocks * BLOCK)]
                c.multipath = False
                first = c.generate([prefix + [1]], params)[0].metrics.prefill_instance
                c.conductor.drain_instance(first)
                second = c.generate([prefix + [2]], params)[0].metrics.prefill_instance
                keys = c._core.hasher.hash_blocks(prefix)
                end = time.monotonic() + 30  # the index hears of the second copy through store events
                while sum(n >= a.blocks for n in c.conductor.index.match_prefix(keys).values()) < 2:
                    assert time.monotonic() < end, "the index never showed two holders"
                    time.sleep(0.005)
                c.conductor.drain_instance(second)
                c.multipath = multipath
                prompt = prefix + [3, 4]
                out = c.generate([prompt], params)[0]
                c.conductor.undrain_instance(first)
                c.conductor.undrain_instance(second)
                m = out.metrics
                assert m.prefill_instance not in (first, second)
                assert m.fetched_tokens == a.blocks * BLOCK, m
                assert m.fetch_sources == (2 if multipath else 1), m
                want = ref_engine.generate([prompt], params)[0].token_ids
                assert out.token_ids == want, "the output differs from a single Engine's"
                if run >= 0:
                    fetch_s[multipath].append(m.fetch_s)
                    ttft[multipath].append(m.ttft_s)
    mib = a.blocks * bb / (1 << 20)
    print(f"Cluster prefix fetch of {a.blocks} blocks x {bb // 1024} KiB = {mib:.2f} MiB (tiny model), "
          f"emulated links of {a.link / 1e6:g} MB/s, median of {a.runs} interleaved runs")
    f1, f2 = statistics.median(fetch_s[False]), statistics.median(fetch_s[True])
    t1, t2 = statistics.median(ttft[False]), statistics.median(ttft[True])
    print(f"  fetch  single source : {f1 * 1e3:8.1f} ms   two sources: {f2 * 1e3:8.1f} ms   ratio {f1 / f2:.2f}x")
    print(f"  TTFT   single source : {t1 * 1e3:8.1f} ms   two sources: {t2 * 1e3:8.1f} ms   ratio {t1 / t2:.2f}x")
    print("  (outputs equal a single Engine's in every run; two-source runs read from 2 holders)")


if __name__ == "__main__":
    main()
