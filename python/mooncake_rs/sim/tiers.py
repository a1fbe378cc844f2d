"""The store's two tiers on a simulated prefill instance: DRAM and SSD.

Each tier is a metadata-only :class:`BlockCache` (the store's eviction code). What DRAM
evicts is demoted to SSD; what SSD evicts is dropped; a block stored again in DRAM (a
prefill that read it from SSD stores its prompt) leaves SSD, so the two tiers never hold
the same block. Every change is reported to the conductor's index with its tier, so the
index equals the caches (tests/test_sim_bandwidth.py checks it after whole runs).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._core import BlockCache, Conductor

__all__ = ["prefix_runs", "split_runs", "store_tiered"]


def prefix_runs(dram: BlockCache, ssd: BlockCache | None, keys: Sequence[int]) -> list[tuple[int, int]]:
    """The leading blocks of ``keys`` that the instance holds in either tier, as runs
    ``(blocks, on_ssd)`` in prompt order (a prefix may alternate between tiers). Each
    lookup is an access for the tier's eviction policy."""
    runs: list[tuple[int, int]] = []
    pos, n = 0, len(keys)
    while pos < n:
        a = dram.lookup_prefix(keys[pos:] if pos else keys)
        if a:
            runs.append((a, 0))
            pos += a
        if ssd is None or pos >= n:
            break
        b = ssd.lookup_prefix(keys[pos:])
        if not b:
            break
        runs.append((b, 1))
        pos += b
    return runs


def split_runs(runs: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """(DRAM blocks, SSD blocks) of ``runs`` within block positions ``[lo, hi)``."""
    dram = ssd = 0
    pos = 0
    for n, on_ssd in runs:
        a, b = max(pos, lo), min(pos + n, hi)
        if b > a:
            if on_ssd:
                ssd += b - a
            else:
                dram += b - a
        pos += n
    return dram, ssd


def store_tiered(conductor: Conductor, dram: BlockCache, ssd: BlockCache | None, instance: int, keys: Sequence[int]) -> int:
    """Puts ``keys`` in the instance's DRAM, demotes what that evicts to its SSD (or
    drops it without one) and tells the conductor every change with its tier. Returns
    how many blocks were written to SSD (they cost the instance's storage link)."""
    evicted = dram.insert(keys)
    demoted = 0
    if evicted:
        # (a key can be evicted twice by one chain: counted, demoted and written once)
        gone = list(dict.fromkeys(k for k in evicted if k not in dram))
        if gone:
            conductor.on_blocks_evicted(instance, gone, "dram")
            if ssd is not None:
                dropped = ssd.insert(gone)
                if dropped:
                    conductor.on_blocks_evicted(instance, [k for k in dropped if k not in ssd], "ssd")
                    landed = [k for k in gone if k in ssd]
                else:
                    landed = gone  # nothing left SSD, so every demoted block is there
                if landed:
                    conductor.on_blocks_stored(instance, landed, "ssd")
                demoted = len(landed)
        keys = [k for k in keys if k in dram]
    if ssd is not None and len(ssd):
        # promoted: back in DRAM, so out of SSD (the tiers stay disjoint)
        up = [k for k in keys if ssd.remove(k)]
        if up:
            conductor.on_blocks_evicted(instance, up, "ssd")
    conductor.on_blocks_stored(instance, keys)
    return demoted
