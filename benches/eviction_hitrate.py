"""Hit rate of each eviction policy replaying the synthetic Mooncake-format trace.

Keys are the trace's ``hash_ids``. For each request: hit = the leading run of its
blocks already cached (``BlockCache.lookup_prefix``), then all its blocks are inserted
in prompt order (``BlockCache.insert``). Capacities: 1%, 5% and 20% of the distinct
blocks. The trace is read from its shared path, never copied.

    python benches/eviction_hitrate.py [--trace PATH]
"""

from __future__ import annotations

import argparse
import json
import time

from mooncake_rs import BlockCache

POLICIES = ["lru", "s3fifo", "prefix"]
FRACTIONS = [0.01, 0.05, 0.20]


def load(path: str) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def replay(requests: list[list[int]], capacity: int, policy: str) -> float:
    cache = BlockCache(capacity, policy)
    hit = total = 0
    for keys in requests:
        hit += cache.lookup_prefix(keys)
        total += len(keys)
        cache.insert(keys)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="/work/shared/traces/synthetic_trace.jsonl")
    args = ap.parse_args()
    requests = load(args.trace)
    distinct = len({k for r in requests for k in r})
    print(f"trace: {len(requests)} requests, {sum(map(len, requests))} blocks, {distinct} distinct")
    header = "| capacity | blocks | " + " | ".join(POLICIES) + " | best vs lru |"
    print(header)
    print("|" + "---|" * (len(POLICIES) + 3))
    for frac in FRACTIONS:
        cap = max(1, int(distinct * frac))
        t = time.perf_counter()
        rates = {p: replay(requests, cap, p) for p in POLICIES}
        best = max(rates, key=lambda p: rates[p])
        cells = " | ".join(f"{rates[p]:.2%}" for p in POLICIES)
        print(f"| {frac:.0%} | {cap} | {cells} | {best} {rates[best] / max(rates['lru'], 1e-12):.2f}x |"
              f"  ({time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
