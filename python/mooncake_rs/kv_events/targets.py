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
holds the block. Both targets also name, per key, the ``BlockIndex`` and tier it writes
(``sink``) and every index they hold (``all_indexes``), so the Rust ingest path can
write to them directly; a target without those is fed by the Python reference path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .._core import BlockIndex
from .._core import canonical_medium as _canonical_medium

__all__ = ["canonical_medium", "Target", "MediumIndex", "TierTarget", "STANDARD_MEDIA"]

STANDARD_MEDIA = ("GPU", "CPU", "DISK")
"""Media every indexer answer lists (0 where nothing matched)."""

_TIER_OF = {"GPU": "gpu", "CPU": "dram", "DISK": "ssd"}
"""The index tier of a canonical medium (TierTarget)."""


def canonical_medium(medium: str | None) -> str:
    """The upper-case medium name (vLLM's ``"GPU"``/``"CPU"``, Mooncake's gpu/cpu/disk, SGLang's CPU_PINNED...).

    ``None`` is the engine's own device cache (vLLM leaves it unset for GPU blocks).
    GPU aliases: NPU, HBM, DEVICE; CPU: CPU_PINNED, DRAM, HOST; DISK: SSD, NVME, FILE,
    STORAGE (vLLM's offloading tier behind CPU: a file system or object store).
    Unknown names are kept, upper-cased, as media of their own. (The table is in Rust,
    shared with the Rust ingest path.)
    """
    return _canonical_medium(medium)


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

    def sink(self, key: str) -> tuple[BlockIndex, str | None]:
        """The index a key writes, and its tier (``None``: inserts as ``dram``, removes any tier)."""
        return self.index(key), None

    def all_indexes(self) -> list[BlockIndex]:
        return list(self.indexes.values())

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

    def sink(self, key: str) -> tuple[BlockIndex, str | None]:
        """The index a key writes, and its tier (the key is the tier)."""
        return self.index, key

    def all_indexes(self) -> list[BlockIndex]:
        return [self.index]
