"""``mooncake-rs demo``: prefix hashing and the block index at work.

Replays a generated multi-turn chat workload over a few instances, twice: once routing
each request to a random instance, once to the instance with the longest cached prefix
(``BlockIndex.best_prefix``). Each instance keeps every block it has seen (no eviction
yet). Prints the prefix hit rate per instance and overall for both routings.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from ._core import BlockIndex, PrefixHasher
from .workload import ChatWorkload, generate_chat_workload


@dataclass
class RoutingResult:
    name: str
    hit_blocks: dict[int, int]
    total_blocks: dict[int, int]
    seconds: float

    def rate(self, instance: int | None = None) -> float:
        if instance is None:
            total = sum(self.total_blocks.values())
            return sum(self.hit_blocks.values()) / total if total else 0.0
        t = self.total_blocks.get(instance, 0)
        return self.hit_blocks.get(instance, 0) / t if t else 0.0


def replay(
    hashes: list[list[int]], instances: int, cache_aware: bool, seed: int = 0, progress: bool = True
) -> RoutingResult:
    """Routes each request, counts its already-cached prefix blocks, then caches it."""
    index = BlockIndex()
    rng = random.Random(seed)
    hit = {i: 0 for i in range(instances)}
    total = {i: 0 for i in range(instances)}
    name = "cache-aware" if cache_aware else "random"
    start = time.perf_counter()
    for hs in tqdm(hashes, desc=f"routing ({name})", unit="req", disable=not progress, leave=False):
        best = index.best_prefix(hs) if cache_aware else None
        target = best[0] if best is not None else rng.randrange(instances)
        matched = index.match_prefix(hs).get(target, 0)
        hit[target] += matched
        total[target] += len(hs)
        index.insert(target, hs, "dram")
    index.check_integrity()
    return RoutingResult(name, hit, total, time.perf_counter() - start)


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
    results = [replay(hashes, instances, cache_aware, seed, progress) for cache_aware in (False, True)]
    header = f"{'instance':>10} " + " ".join(f"{r.name:>12}" for r in results)
    print("\nprefix hit rate (blocks already cached on the chosen instance / prompt blocks)")
    print(header)
    for i in range(instances):
        print(f"{i:>10} " + " ".join(f"{r.rate(i):>12.1%}" for r in results))
    print(f"{'all':>10} " + " ".join(f"{r.rate():>12.1%}" for r in results))
    print(
        "\nRouting by BlockIndex.best_prefix sends each turn to the instance that already "
        "holds its conversation,\nso most of every prompt is reused instead of recomputed."
    )
    return results
