"""One engine instance's map from its own block hashes to ours, bounded in memory.

:class:`EngineHashMap` is the Rust map (``_core.EngineHashMap``) that
:class:`~mooncake_rs.interop.Ingestor` keeps per instance; :class:`DictEngineHashMap` is
the pure-Python version with the same API and semantics, described below, which the
reference ingestor (:mod:`.ingest_ref`) uses and the tests compare the Rust map with.

An engine's block hashes are opaque (Python ``hash()`` in old vLLM, SHA-256 bytes or
XXH3 in newer ones, each seeded its own way), so the index keys blocks by hashes we
recompute from the ``token_ids`` that ``BlockStored`` carries. ``BlockRemoved`` carries
only the engine's hashes: this map translates them back, and tells which media of the
instance hold each block (a block may sit on GPU and in CPU offload at once).

Each entry is one Python int, ``our_hash << 8 | media_bits``, to keep memory near
100 bytes per entry (a tuple or an object would double it). An entry stays after its
block left every medium, so a later ``BlockStored`` can still name it as its parent;
when the map is full the entry stored longest ago goes first (re-storing a block moves
it to the back), and the caller removes that block from the index, since its removal
could no longer be translated: the index under-reports rather than keeps stale blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

from .._core import EngineHashMap
from ..errors import InvalidArgument
from .events import EngineHash

__all__ = ["EngineHashMap", "DictEngineHashMap", "MEDIA_BITS"]

MEDIA_BITS = 8
"""Media one entry can track (bits of the low byte)."""
_MASK = (1 << MEDIA_BITS) - 1


class DictEngineHashMap:
    """``engine hash -> (our hash, media bit mask)``, at most ``capacity`` entries (a ``dict``)."""

    __slots__ = ("_map", "capacity", "evicted")

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise InvalidArgument(f"EngineHashMap capacity must be >= 1, got {capacity}")
        self._map: dict[EngineHash, int] = {}
        self.capacity = capacity
        self.evicted = 0
        """Entries dropped because the map was full."""

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, h: object) -> bool:
        return h in self._map

    def ours(self, h: EngineHash) -> int | None:
        """Our hash for an engine hash seen in a ``BlockStored`` (held or not)."""
        v = self._map.get(h)
        return None if v is None else v >> MEDIA_BITS

    def media(self, h: EngineHash) -> int:
        """The media bit mask that holds the block now (0: none or unknown)."""
        return self._map.get(h, 0) & _MASK

    def store(self, engine: list[EngineHash], ours: list[int], bit: int) -> list[tuple[int, int]]:
        """Record that ``engine[i]`` (= our ``ours[i]``) is now held in medium ``bit``.

        Returns ``(our old hash, media mask)`` of entries whose engine hash now names
        other tokens (the engine reused a hash), for the caller to drop from the index.
        """
        m = self._map
        pop = m.pop
        replaced: list[tuple[int, int]] = []
        for h, o in zip(engine, ours):
            old = pop(h, None)
            if old is None:
                m[h] = (o << MEDIA_BITS) | bit
            elif (old >> MEDIA_BITS) == o:
                m[h] = old | bit
            else:
                if old & _MASK:
                    replaced.append((old >> MEDIA_BITS, old & _MASK))
                m[h] = (o << MEDIA_BITS) | bit
        return replaced

    def remove(self, engine: list[EngineHash], bit: int, same_key: int) -> tuple[list[int], int]:
        """Clear medium ``bit`` for these engine hashes.

        Returns our hashes whose index entry must go (no other medium in ``same_key``,
        the media sharing the removed medium's index key, still holds them), and how many
        engine hashes were unknown.
        """
        m = self._map
        out: list[int] = []
        unknown = 0
        keep = same_key & ~bit
        for h in engine:
            v = m.get(h)
            if v is None:
                unknown += 1
                continue
            if v & bit:
                v &= ~bit
                m[h] = v
                if not (v & keep):
                    out.append(v >> MEDIA_BITS)
        return out, unknown

    def evict_overflow(self) -> list[tuple[int, int]]:
        """Drop the oldest entries beyond capacity; returns ``(our hash, media mask)`` of those still held."""
        m = self._map
        over = len(m) - self.capacity
        if over <= 0:
            return []
        out: list[tuple[int, int]] = []
        it = iter(m)
        victims = [next(it) for _ in range(over)]
        for h in victims:
            v = m.pop(h)
            if v & _MASK:
                out.append((v >> MEDIA_BITS, v & _MASK))
        self.evicted += over
        return out

    def clear(self) -> None:
        self._map.clear()

    def items(self) -> Iterator[tuple[EngineHash, int, int]]:
        """``(engine hash, our hash, media mask)`` of every entry, oldest first."""
        for h, v in self._map.items():
            yield h, v >> MEDIA_BITS, v & _MASK
