"""What a worker's store holds, in the store's own event wire form, so that a conductor
that was not there when the blocks came (a new leader of the ``serve`` processes, or
the first one a worker meets) can be told all of it at once.

The worker's instance feeds it every batch of store events it drains (``apply``); the
view keeps one record per held key with its tier, and ``snapshot()`` encodes them as
``stored`` events: the bytes ``Conductor.apply_store_events`` takes. Per-key work is in
Python, once per event; the set is bounded by the store's slots.

Event semantics (the store's, see docs/store.md): ``stored`` / ``promoted`` / ``demoted``
leave the block held in the event's tier; ``evicted`` from the tier it is held in, or
``removed``, drops it.
"""

from __future__ import annotations

__all__ = ["Holdings"]

_MAGIC = b"MCE1"
_RECORD = 18  # kind (u8), tier (u8), key (u128 LE)
_STORED, _EVICTED, _DEMOTED, _PROMOTED, _REMOVED = range(5)


class Holdings:
    def __init__(self) -> None:
        self._tier: dict[bytes, int] = {}  # 16-byte key -> tier code (0 dram, 1 ssd)

    def __len__(self) -> int:
        return len(self._tier)

    def apply(self, events: bytes) -> None:
        """One drained batch (``MCE1`` + 18-byte records)."""
        if not events.startswith(_MAGIC) or (len(events) - 4) % _RECORD:
            raise ValueError("not a store event batch (MCE1 + 18-byte records)")
        held = self._tier
        for off in range(4, len(events), _RECORD):
            kind, tier = events[off], events[off + 1]
            key = events[off + 2:off + _RECORD]
            if kind in (_STORED, _PROMOTED, _DEMOTED):
                held[key] = tier
            elif kind == _REMOVED or (kind == _EVICTED and held.get(key) == tier):
                held.pop(key, None)

    def snapshot(self) -> bytes:
        """Every held block as a ``stored`` event in its tier."""
        return _MAGIC + b"".join(bytes((_STORED, tier)) + key for key, tier in self._tier.items())
