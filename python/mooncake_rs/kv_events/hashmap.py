"""One engine instance's map from its own block hashes to ours, bounded in memory.

:class:`EngineHashMap` is the Rust map (``_core.EngineHashMap``) that
:class:`~mooncake_rs.kv_events.Ingestor` keeps per instance; :class:`DictEngineHashMap` is
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

Entries are keyed by (engine hash, KV cache group): a hybrid model's groups each
publish their blocks, and the caller says which groups decide. Several entries may map
to one hash of ours (the same tokens under several engine hashes, or in several
groups): a block stays held while, for every deciding group, some entry of that group
maps to it and holds it on a medium of the index key in question (:meth:`held`), so
removing, reusing or evicting one entry does not drop a block the others still hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._core import EngineHashMap
from ..errors import InvalidArgument
from .events import EngineHash

__all__ = ["EngineHashMap", "DictEngineHashMap", "MEDIA_BITS", "MAX_GROUPS"]

MEDIA_BITS = 8
"""Media one entry can track (bits of the low byte)."""
MAX_GROUPS = 64
"""KV cache groups one map tells apart (a mask of them decides holding)."""
_MASK = (1 << MEDIA_BITS) - 1


class DictEngineHashMap:
    """``(engine hash, group) -> (our hash, media bit mask)``, at most ``capacity`` entries (a ``dict``)."""

    __slots__ = ("_map", "_rings", "capacity", "evicted")

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise InvalidArgument(f"EngineHashMap capacity must be >= 1, got {capacity}")
        self._map: dict[Any, int] = {}
        # our hash -> the keys of the entries mapping to it (a dict as an ordered set)
        self._rings: dict[int, dict[Any, None]] = {}
        self.capacity = capacity
        self.evicted = 0
        """Entries dropped because the map was full."""

    @staticmethod
    def _key(h: Any, group: int) -> Any:
        """Group 0's entries are keyed by the engine hash itself, others by (group, hash)."""
        if not 0 <= group < MAX_GROUPS:
            raise InvalidArgument(f"group must be a group number in 0..{MAX_GROUPS}, got {group}")
        return h if group == 0 else (group, h)

    @staticmethod
    def _split(k: Any) -> tuple[EngineHash, int]:
        return (k[1], k[0]) if type(k) is tuple else (k, 0)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, h: object) -> bool:
        return type(h) is not tuple and h in self._map

    def ours(self, h: EngineHash, group: int = 0) -> int | None:
        """Our hash for an engine hash of ``group`` seen in a ``BlockStored`` (held or not)."""
        v = self._map.get(self._key(h, group))
        return None if v is None else v >> MEDIA_BITS

    def media(self, h: EngineHash, group: int = 0) -> int:
        """The media bit mask that holds the block now (0: none or unknown)."""
        return self._map.get(self._key(h, group), 0) & _MASK

    def held(self, ours: int, mask: int, deciding: int = 1) -> bool:
        """Whether our block is held on a medium of ``mask`` by every group of the mask
        ``deciding`` (some entry of each group maps to it and holds one of those media)."""
        have = 0
        m = self._map
        for k in self._rings.get(ours, ()):
            if m[k] & mask:
                have |= 1 << self._split(k)[1]
        return have & deciding == deciding

    def _ring_add(self, ours: int, k: Any) -> None:
        self._rings.setdefault(ours, {})[k] = None

    def _ring_del(self, ours: int, k: Any) -> None:
        ring = self._rings[ours]
        del ring[k]
        if not ring:
            del self._rings[ours]

    def store(self, engine: list[EngineHash], ours: list[int], bit: int, group: int = 0) -> list[tuple[int, int]]:
        """Record that ``engine[i]`` (= our ``ours[i]``) of ``group`` is now held in medium ``bit``.

        Returns ``(our old hash, media mask)`` of entries whose engine hash now names
        other tokens (the engine reused a hash), for the caller to drop from the index
        where no other entry still holds them (:meth:`held`).
        """
        m = self._map
        pop = m.pop
        replaced: list[tuple[int, int]] = []
        for h, o in zip(engine, ours):
            k = self._key(h, group)
            old = pop(k, None)
            if old is None:
                m[k] = (o << MEDIA_BITS) | bit
                self._ring_add(o, k)
            elif (old >> MEDIA_BITS) == o:
                m[k] = old | bit
            else:
                if old & _MASK:
                    replaced.append((old >> MEDIA_BITS, old & _MASK))
                self._ring_del(old >> MEDIA_BITS, k)
                m[k] = (o << MEDIA_BITS) | bit
                self._ring_add(o, k)
        return replaced

    def remove(
        self, engine: list[EngineHash], bit: int, same_key: int, group: int = 0, deciding: int = 1
    ) -> tuple[list[int], int]:
        """Clear medium ``bit`` for these engine hashes of ``group``.

        Returns our hashes whose index entry must go (held by the cleared entry and no
        longer :meth:`held` on a medium of ``same_key``, the media sharing the removed
        medium's index key, by every group of ``deciding``), and how many engine hashes
        were unknown.
        """
        m = self._map
        out: list[int] = []
        unknown = 0
        for h in engine:
            k = self._key(h, group)
            v = m.get(k)
            if v is None:
                unknown += 1
                continue
            if v & bit:
                v &= ~bit
                m[k] = v
                if not self.held(v >> MEDIA_BITS, same_key, deciding):
                    out.append(v >> MEDIA_BITS)
        return out, unknown

    def evict_overflow(self) -> list[tuple[int, int]]:
        """Drop the oldest entries beyond capacity; returns ``(our hash, media mask)`` of
        those still held (the caller drops them where no other entry holds them)."""
        m = self._map
        over = len(m) - self.capacity
        if over <= 0:
            return []
        out: list[tuple[int, int]] = []
        it = iter(m)
        victims = [next(it) for _ in range(over)]
        for k in victims:
            v = m.pop(k)
            self._ring_del(v >> MEDIA_BITS, k)
            if v & _MASK:
                out.append((v >> MEDIA_BITS, v & _MASK))
        self.evicted += over
        return out

    def clear(self) -> None:
        self._map.clear()
        self._rings.clear()

    def items(self) -> Iterator[tuple[EngineHash, int, int]]:
        """``(engine hash, our hash, media mask)`` of every entry, oldest first."""
        for k, v in self._map.items():
            yield self._split(k)[0], v >> MEDIA_BITS, v & _MASK
