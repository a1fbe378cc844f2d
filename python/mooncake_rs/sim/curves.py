"""Cache hit rate against capacity (the paper's Fig. 9), on the store's eviction code."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .._core import BlockCache
from ..errors import InvalidArgument
from .trace import BLOCK_TOKENS, Request

__all__ = ["hit_rate_curve"]


def hit_rate_curve(
    trace: Sequence[Request],
    capacities_tokens: Iterable[int],
    eviction: str = "lru",
    *,
    block_tokens: int = BLOCK_TOKENS,
) -> dict[int, float]:
    """Hit rate of one cache of each capacity (tokens) replaying ``trace`` in order.

    No timing: requests in trace order; a request's hit is the leading run of its
    blocks already cached; then all its blocks are cached (touched in prompt order, one
    access, by the store's ``eviction`` policy through :class:`~mooncake_rs.BlockCache`).
    Hit rate = hit blocks / all prompt blocks. A prompt's blocks are its full blocks
    (``input_length // block_tokens`` leading ``hash_ids``): a partial last block is
    never cached by the product. A capacity below one block caches nothing (hit rate 0).
    """
    caps = list(capacities_tokens)
    for c in caps:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InvalidArgument(f"capacities must be integers >= 0 tokens, got {c!r}")
    BlockCache(1, eviction)  # an unknown policy name -> InvalidArgument
    chains = [r.hash_ids[: r.input_length // block_tokens] for r in trace]
    total = sum(len(k) for k in chains)
    out: dict[int, float] = {}
    for cap in caps:
        blocks = cap // block_tokens
        if blocks == 0 or total == 0:
            out[cap] = 0.0
            continue
        cache = BlockCache(blocks, eviction)
        contains = cache.contains
        insert = cache.insert
        hit = 0
        for keys in chains:
            for k in keys:
                if not contains(k):
                    break
                hit += 1
            insert(keys)
        out[cap] = hit / total
    return out
