"""The types :class:`.ingest.Ingestor` and its reference share: the hasher protocol, what
feeds one instance, and the counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidArgument

if TYPE_CHECKING:
    from .targets import Target

__all__ = ["BlockHasher", "InstanceFeed", "IngestStats"]


class BlockHasher(Protocol):
    """``PrefixHasher`` or ``Xxh3RollingHasher``: chained hashes of full blocks."""

    @property
    def block_size(self) -> int: ...
    def hash(self, tokens: Any, parent: int | None = None, extras: Any = None) -> list[int]: ...


class InstanceFeed:
    """Feeds one instance (``slot``, a u64 id) of ``target`` from that instance's event
    stream, hashing blocks with ``hasher``: what both ingestors are."""

    def __init__(self, target: "Target", slot: int, hasher: BlockHasher) -> None:
        if slot < 0 or slot >= 1 << 64:
            raise InvalidArgument(f"slot must be a u64 instance id, got {slot}")
        self.target = target
        self.slot = slot
        self.hasher = hasher
        self.block_size = hasher.block_size


@dataclass
class IngestStats:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    resets: int = 0
    """Entries dropped because events were lost (a gap without replay, a restart)."""
    orphans: int = 0
    """``BlockStored`` events whose parent we never saw (skipped: we cannot chain them)."""
    mismatched: int = 0
    """``BlockStored`` events whose block size or token count does not fit our hasher."""
    unknown_removed: int = 0
    """Removed engine hashes we had no entry for."""
    unknown_events: int = 0
    evicted: int = 0
    """Hash-map entries dropped when full (their blocks left the index)."""
    media_overflow: int = 0
    """Events naming a medium beyond the 8 one instance can track (skipped)."""
    other_groups: int = 0
    """Events of a KV cache group that does not decide what the instance holds (not full
    attention: sliding window, mamba...; or beyond the 64 tracked): skipped."""
