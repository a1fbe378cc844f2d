"""Where decoded events land: the block index, per medium or per tier.

- :class:`MediumIndex`: one :class:`~mooncake_rs.BlockIndex` per medium (``GPU``,
  ``CPU``, ``DISK``, and any other an engine names), for the indexer API, which answers
  per medium.
- :class:`TierTarget`: one existing ``BlockIndex`` with its tiers, e.g.
  ``conductor.index``, so a :class:`~mooncake_rs.Conductor` routes on what external
  engines hold: GPU as ``gpu`` (the engine's own device cache: nothing to load), CPU as
  ``dram``, disk as ``ssd``; the conductor prices each tier's load (``ttft_optimal``,
  ``TransferCostModel.dram_bandwidth`` / ``ssd_bandwidth``).

A target maps a medium to a *key* (the index or tier it writes); the ingestor keeps per
block which media hold it and removes a key only when no medium with that key still
holds the block.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .._core import BlockIndex

__all__ = ["canonical_medium", "Target", "MediumIndex", "TierTarget", "STANDARD_MEDIA"]

STANDARD_MEDIA = ("GPU", "CPU", "DISK")
"""Media every indexer answer lists (0 where nothing matched)."""

_TIER_OF = {"GPU": "gpu", "CPU": "dram", "DISK": "ssd"}
"""The index tier of a canonical medium (TierTarget)."""

_ALIASES = {
    "GPU": "GPU", "NPU": "GPU", "HBM": "GPU", "DEVICE": "GPU",
    "CPU": "CPU", "CPU_PINNED": "CPU", "DRAM": "CPU", "HOST": "CPU",
    "DISK": "DISK", "SSD": "DISK", "NVME": "DISK", "FILE": "DISK",
}


def canonical_medium(medium: str | None) -> str:
    """The upper-case medium name (vLLM's ``"GPU"``/``"CPU"``, Mooncake's gpu/cpu/disk, SGLang's CPU_PINNED...).

    ``None`` is the engine's own device cache (vLLM leaves it unset for GPU blocks).
    Unknown names are kept, upper-cased, as media of their own.
    """
    if medium is None:
        return "GPU"
    m = medium.upper()
    return _ALIASES.get(m, m)


class Target(Protocol):
    def key_of(self, medium: str) -> str: ...
    def insert(self, slot: int, hashes: list[int], key: str) -> None: ...
    def remove(self, slot: int, hashes: list[int], key: str) -> None: ...
    def clear(self, slot: int) -> None: ...


class MediumIndex:
    """One ``BlockIndex`` per medium; slots are instance ids in every index."""

    def __init__(self) -> None:
        self.indexes: dict[str, BlockIndex] = {m: BlockIndex() for m in STANDARD_MEDIA}

    def key_of(self, medium: str) -> str:
        return medium

    def index(self, medium: str) -> BlockIndex:
        idx = self.indexes.get(medium)
        if idx is None:
            idx = self.indexes[medium] = BlockIndex()
        return idx

    def insert(self, slot: int, hashes: list[int], key: str) -> None:
        self.index(key).insert(slot, hashes)

    def remove(self, slot: int, hashes: list[int], key: str) -> None:
        idx = self.indexes.get(key)
        if idx is not None:
            idx.remove(slot, hashes)

    def clear(self, slot: int) -> None:
        for idx in self.indexes.values():
            idx.remove_instance(slot)

    def media(self) -> Iterable[str]:
        return self.indexes.keys()


class TierTarget:
    """An existing ``BlockIndex`` (e.g. ``conductor.index``): GPU -> gpu, DISK -> ssd,
    CPU and any other medium -> dram."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index

    def key_of(self, medium: str) -> str:
        return _TIER_OF.get(medium, "dram")

    def insert(self, slot: int, hashes: list[int], key: str) -> None:
        self.index.insert(slot, hashes, key)

    def remove(self, slot: int, hashes: list[int], key: str) -> None:
        self.index.remove(slot, hashes, key)

    def clear(self, slot: int) -> None:
        self.index.remove_instance(slot)
