"""The block store of one serving instance: a DRAM arena cut into fixed slots.

The serving layer stores KV blocks through this small slot store (content-addressed by
block hash, LRU eviction, leases, reserve-then-commit, stored/evicted events) over an
arena that is the instance's transfer-engine region, so peers read and write slots by
(region, offset). It follows ``mooncake_rs.Store`` (issue 3) in the subset serving needs;
serving does not use ``Store`` itself yet because a reserved block's slot offset is not
exposed there (see docs/serving.md, Limits). The ``SHM_*`` names locate the transfer
engine's shared-memory segments (``/dev/shm/mooncake_rs.<pid>.<n>``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..errors import InvalidArgument, StoreFull

__all__ = ["ArenaStore", "SHM_DIR", "SHM_PREFIX"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mooncake_rs."
_ALIGN = 64


class ArenaStore:
    """``dram_bytes // slot_bytes`` slots of ``block_bytes`` each (thread-safe).

    Slots are identified by index; ``offset(slot)`` is its byte offset in :attr:`buf`.
    A slot is *free*, *reserved* (being filled, invisible to lookups) or *committed*
    under a key. Committed slots with no lease are evicted in LRU order when a
    reservation finds no free slot; a lease (``lookup`` / ``pin``) keeps a slot in place.
    """

    @staticmethod
    def arena_bytes(block_bytes: int, dram_bytes: int) -> int:
        """Bytes of the arena ``ArenaStore(block_bytes, dram_bytes)`` uses."""
        slot = -(-int(block_bytes) // _ALIGN) * _ALIGN
        return max(int(dram_bytes) // slot, 0) * slot

    def __init__(self, block_bytes: int, dram_bytes: int, *, buf: np.ndarray | None = None) -> None:
        if block_bytes < 1:
            raise InvalidArgument("block_bytes must be >= 1")
        self.block_bytes = int(block_bytes)
        self.slot_bytes = -(-self.block_bytes // _ALIGN) * _ALIGN
        self.num_slots = int(dram_bytes) // self.slot_bytes
        if self.num_slots < 2:
            raise InvalidArgument(f"dram_bytes {dram_bytes} holds fewer than 2 blocks of {block_bytes} bytes; raise it")
        size = self.num_slots * self.slot_bytes
        if buf is not None:  # memory registered elsewhere (a transfer engine's region)
            if buf.dtype != np.uint8 or buf.nbytes < size:
                raise InvalidArgument(f"buf must be a uint8 buffer of at least {size} bytes")
            self.buf = buf[:size]
        else:
            self.buf = np.zeros(size, dtype=np.uint8)
        self._lock = threading.Lock()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._by_key: OrderedDict[int, int] = OrderedDict()  # LRU order, oldest first
        self._key_of: dict[int, int] = {}
        self._leases: dict[int, int] = {}
        self._events: list[tuple[str, int]] = []
        self.evictions = 0

    # ---- slots
    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, slot: int) -> np.ndarray:
        o = slot * self.slot_bytes
        return self.buf[o:o + self.block_bytes]

    def reserve(self) -> int:
        """A free slot to fill (evicting the least recently used unleased block if needed)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            for key, slot in self._by_key.items():
                if not self._leases.get(slot):
                    del self._by_key[key]
                    del self._key_of[slot]
                    self._events.append(("evicted", key))
                    self.evictions += 1
                    return slot
        raise StoreFull(f"all {self.num_slots} slots are leased or reserved; raise dram_bytes_per_instance")

    def commit(self, slot: int, key: int, *, lease: bool = False) -> int:
        """Publishes a reserved slot under ``key``; returns the slot that holds ``key`` (an
        existing copy wins: the reserved slot is then freed)."""
        with self._lock:
            have = self._by_key.get(key)
            if have is not None:
                self._free.append(slot)
                slot = have
                self._by_key.move_to_end(key)
            else:
                self._by_key[key] = slot
                self._key_of[slot] = key
                self._events.append(("stored", key))
            if lease:
                self._leases[slot] = self._leases.get(slot, 0) + 1
            return slot

    def abandon(self, slot: int) -> None:
        """Frees a reserved, uncommitted slot."""
        with self._lock:
            self._free.append(slot)

    def lookup(self, key: int) -> int | None:
        """The slot of ``key`` with a lease taken (``release`` it), or None."""
        with self._lock:
            slot = self._by_key.get(key)
            if slot is None:
                return None
            self._by_key.move_to_end(key)
            self._leases[slot] = self._leases.get(slot, 0) + 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            n = self._leases.get(slot, 0) - 1
            if n > 0:
                self._leases[slot] = n
            else:
                self._leases.pop(slot, None)

    def contains(self, key: int) -> bool:
        with self._lock:
            return key in self._by_key

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def drain_events(self) -> list[tuple[str, int]]:
        with self._lock:
            ev, self._events = self._events, []
            return ev
