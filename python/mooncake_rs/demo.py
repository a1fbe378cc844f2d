"""``mooncake-rs demo``: prefix hashing and the block index at work.

Replays a generated multi-turn chat workload over a few instances two ways: routing
each request to a random instance, and to the instance with the longest cached prefix
(``BlockIndex.match_prefix``; ties and misses go to the least loaded). Each instance
keeps every block it has seen (no eviction here). Prints per-instance load and prefix
hit rate. The conductor (``mooncake_rs.Conductor``) refines the cache-aware choice with
queue, prefill and transfer time estimates.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from ._core import BlockIndex, PrefixHasher
from .workload import ChatWorkload, generate_chat_workload


ROUTINGS = ("random", "cache-aware")


@dataclass
class RoutingResult:
    name: str
    hit_blocks: dict[int, int]
    total_blocks: dict[int, int]
    requests: dict[int, int]
    seconds: float

    def rate(self, instance: int | None = None) -> float:
        if instance is None:
            total = sum(self.total_blocks.values())
            return sum(self.hit_blocks.values()) / total if total else 0.0
        t = self.total_blocks.get(instance, 0)
        return self.hit_blocks.get(instance, 0) / t if t else 0.0


def choose(routing: str, matches: dict[int, int], load: dict[int, int], rng: random.Random) -> int:
    """The instance a request goes to under ``routing``."""
    instances = sorted(load)
    if routing == "random":
        return rng.choice(instances)
    # Longest cached prefix; ties (and no match at all) go to the least loaded.
    return max(instances, key=lambda i: (matches.get(i, 0), -load[i], -i))


def replay(
    hashes: list[list[int]],
    instances: int,
    routing: str,
    seed: int = 0,
    progress: bool = True,
) -> RoutingResult:
    """Routes each request, counts its already-cached prefix blocks, then caches it."""
    index = BlockIndex()
    rng = random.Random(seed)
    hit = {i: 0 for i in range(instances)}
    total = {i: 0 for i in range(instances)}
    load = {i: 0 for i in range(instances)}
    start = time.perf_counter()
    for hs in tqdm(hashes, desc=f"routing ({routing})", unit="req", disable=not progress, leave=False):
        matches = index.match_prefix(hs)
        target = choose(routing, matches, load, rng)
        hit[target] += matches.get(target, 0)
        total[target] += len(hs)
        load[target] += 1
        index.insert(target, hs, "dram")
    index.check_integrity()
    return RoutingResult(routing, hit, total, load, time.perf_counter() - start)


def run(
    instances: int = 4,
    conversations: int = 200,
    turns: int = 5,
    block_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> list[RoutingResult]:
    cfg = ChatWorkload(conversations=conversations, turns=turns, seed=seed)
    requests = generate_chat_workload(cfg)
    hasher = PrefixHasher(block_size, seed=seed)
    t0 = time.perf_counter()
    hashes = hasher.hash_many([r.prompt for r in requests])
    hash_s = time.perf_counter() - t0
    tokens = sum(len(r.prompt) for r in requests)
    print(
        f"workload: {len(requests)} requests from {conversations} conversations x {turns} turns, "
        f"{tokens:,} prompt tokens, {cfg.system_prompts} shared system prompts"
    )
    print(f"hashed {sum(map(len, hashes)):,} blocks of {block_size} tokens in {hash_s * 1e3:.1f} ms")
    results = [replay(hashes, instances, routing, seed, progress=progress) for routing in ROUTINGS]
    print("\nrequests routed / prefix hit rate (blocks already cached there / prompt blocks)")
    print(f"{'instance':>10} " + " ".join(f"{r.name:>20}" for r in results))
    for i in range(instances):
        print(f"{i:>10} " + " ".join(f"{r.requests[i]:>8} / {r.rate(i):>9.1%}" for r in results))
    print(f"{'all':>10} " + " ".join(f"{sum(r.requests.values()):>8} / {r.rate():>9.1%}" for r in results))
    print(
        "\nCache-aware routing sends each turn to the instance that already holds its conversation,"
        "\nso most of every prompt is reused instead of recomputed."
    )
    return results
