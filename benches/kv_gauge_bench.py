"""KV-usage gauges from heartbeats vs the instance_stats() round trip, and what the
in-process heartbeat costs the serving loop.

1. ``Cluster.metrics_text()`` (which now includes per-instance KV / store gauges read
   from the instances' latest heartbeats) against ``Cluster.instance_stats()`` (a round
   trip to every instance), alternating in one run, idle and with 8 requests decoding.
2. The same 64 requests through an in-process cluster with the heartbeat (and so the
   loop's beat check and usage snapshot) on (``heartbeat_timeout_s=10``) and off
   (``None``), alternating rounds in one run.

    python benches/kv_gauge_bench.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mooncake_rs import Cluster
from mooncake_rs.engine import ModelConfig, SamplingParams

ENDLESS = SamplingParams(max_tokens=3900, ignore_eos=True)


def scrape_vs_round_trip(n: int) -> None:
    def measure(c):
        a, b = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            c.metrics_text()
            a.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.instance_stats()
            b.append(time.perf_counter() - t0)
        return statistics.median(a), statistics.median(b)

    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=16, seed=0) as c:
        c.generate([[i % 256 for i in range(64)]], SamplingParams(max_tokens=4))
        for label in ("idle", "8 decoding"):
            hs = []
            if label != "idle":
                hs = [c.submit([(i * 7 + k) % 256 for i in range(64)], ENDLESS) for k in range(8)]
                for h in hs:
                    next(iter(h))
            ma, mb = measure(c)
            print(f"{label:>10}: metrics_text median {ma * 1e6:.0f} us, instance_stats median {mb * 1e6:.0f} us "
                  f"(round trip / scrape {mb / ma:.1f}x)")
            for h in hs:
                h.cancel()


def loop_cost(rounds: int) -> None:
    prompts = [[(i * 3 + k) % 256 for i in range(48)] for k in range(64)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    times: dict[str, list[float]] = {"beat on": [], "beat off": []}
    for _ in range(rounds):
        for label, hb in (("beat on", 10.0), ("beat off", None)):
            with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, seed=0, heartbeat_timeout_s=hb,
                         prefix_reuse=False) as c:
                c.generate(prompts[:4], params)  # warm-up
                t0 = time.perf_counter()
                c.generate(prompts, params)
                times[label].append(time.perf_counter() - t0)
    on, off = statistics.median(times["beat on"]), statistics.median(times["beat off"])
    print(f"64 requests x 16 tokens, in-process 1+1: median {on:.3f} s with the beat, {off:.3f} s without "
          f"(ratio {on / off:.2f}; rounds {times})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrapes", type=int, default=100)
    a = ap.parse_args()
    scrape_vs_round_trip(a.scrapes)
    loop_cost(a.rounds)
