"""What a worker's store holds, in the store's own event wire form, so that a conductor
that was not there when the blocks came (a new leader of the ``serve`` processes, or
the first one a worker meets) can be told all of it at once.

The worker's instance feeds it every batch of store events it drains (``apply``); the
view keeps one record per held key with its tier, and ``snapshot()`` encodes them as
``stored`` events: the bytes ``Conductor.apply_store_events`` takes. Per-key work is in
Python, once per event; the set is bounded by the store's slots.

Event semantics are the index's (``StoreEvent::index_effect`` in the core): ``stored``,
``demoted`` and ``promoted`` make the block held in the event's tier; ``evicted`` and
``removed`` drop it from that tier. A block can be held in both tiers at once (promoted
to DRAM while its SSD copy stays, or a demotion that lands after a promotion), so the
view keeps a set of tiers per key, as the index does.
"""

from __future__ import annotations

__all__ = ["Holdings"]

_MAGIC = b"MCE1"
_RECORD = 18  # kind (u8), tier (u8), key (u128 LE)
_STORED, _EVICTED, _DEMOTED, _PROMOTED, _REMOVED = range(5)  # the wire's kind codes


class Holdings:
    def __init__(self) -> None:
        self._tiers: dict[bytes, int] = {}  # 16-byte key -> bit set of tiers (1: dram, 2: ssd)

    def __len__(self) -> int:
        return len(self._tiers)

    def apply(self, events: bytes) -> None:
        """One drained batch (``MCE1`` + 18-byte records)."""
        if not events.startswith(_MAGIC) or (len(events) - 4) % _RECORD:
            raise ValueError("not a store event batch (MCE1 + 18-byte records)")
        held = self._tiers
        for off in range(4, len(events), _RECORD):
            kind, bit = events[off], 1 << events[off + 1]
            key = events[off + 2:off + _RECORD]
            if kind in (_STORED, _PROMOTED, _DEMOTED):
                held[key] = held.get(key, 0) | bit
            else:  # evicted or removed: from that tier
                left = held.get(key, 0) & ~bit
                if left:
                    held[key] = left
                else:
                    held.pop(key, None)

    def snapshot(self) -> bytes:
        """Every held block as a ``stored`` event in each tier it is held in."""
        return _MAGIC + b"".join(bytes((_STORED, tier)) + key for key, bits in self._tiers.items()
                                 for tier in (0, 1) if bits >> tier & 1)
