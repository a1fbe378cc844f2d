"""BlockIndex.match_prefix from Python: 64-block prompts, 16 instances, 1M blocks indexed.

Target: p50 <= 10 us per call (including converting 64 Python ints to 128-bit hashes).

    python benches/index_bench.py [--blocks 1000000] [--calls 20000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from mooncake_rs import BlockIndex, PrefixHasher


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=20_000)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    hasher = PrefixHasher(16)
    idx = BlockIndex()
    chains = []
    t0 = time.perf_counter()
    entries = 0
    while entries < args.blocks:
        batch = [rng.integers(0, 2**31, 64 * 16, dtype=np.int32) for _ in range(256)]
        for c, hs in enumerate(hasher.hash_many(batch)):
            idx.insert(c % 16 if False else random.Random(len(chains)).randrange(16), hs)
            entries += len(hs)
            chains.append(hs)
    build_s = time.perf_counter() - t0
    print(f"indexed {entries:,} blocks ({len(chains):,} chains of 64) on 16 instances in {build_s:.1f} s")
    for name, pick in (("same prompt", lambda i: chains[0]), ("random prompt", lambda i: chains[(i * 7919) % len(chains)])):
        lat = []
        for i in range(args.calls):
            hs = pick(i)
            t = time.perf_counter_ns()
            idx.match_prefix(hs)
            lat.append(time.perf_counter_ns() - t)
        lat.sort()
        print(
            f"match_prefix {name:>13}: p50 {lat[len(lat) // 2] / 1e3:.2f} us, "
            f"p99 {lat[int(len(lat) * 0.99)] / 1e3:.2f} us, mean {statistics.fmean(lat) / 1e3:.2f} us"
        )
    s = idx.stats()
    print(f"index: {s.blocks:,} blocks, {s.entries:,} entries, {s.bytes_per_entry:.1f} bytes/entry")


if __name__ == "__main__":
    main()
