"""How one object (a string key, a value of any length) lives in fixed-size store slots.

An object is cut into chunks of its size class's ``chunk_bytes``; chunk ``i`` is stored in
the Rust ``Store`` under the 128-bit key ``oid | i``, where ``oid`` is a fresh random id
whose low :data:`CHUNK_BITS` bits are zero, drawn for every put. So chunks of two objects
(or two puts of one key) never share a key, a chunk's object is found from its key alone
(``key & ~mask``: how an eviction event is traced back to its object), and a read can
never return another object's bytes. ``chunk_keys`` builds one object's keys as a
``(n, 2)`` uint64 array, the store's key-buffer form.
"""

from __future__ import annotations

import os
import random

import numpy as np

__all__ = ["CHUNK_BITS", "new_oid", "chunk_keys", "chunk_key", "oid_of", "evicted_oids", "stored_keys"]

CHUNK_BITS = 24
_LOW_MASK = (1 << 64) - 1
_CHUNK_MASK = (1 << CHUNK_BITS) - 1

_EVENT = np.dtype([("kind", "u1"), ("tier", "u1"), ("lo", "<u8"), ("hi", "<u8")])
_STORED, _EVICTED, _SSD = 0, 1, 1


# ids need to be unique, not secret: a PRNG seeded from the OS, no syscall per put
_rng = random.Random(os.urandom(32))


def new_oid() -> int:
    return _rng.getrandbits(128) & ~_CHUNK_MASK


def chunk_keys(oid: int, n: int) -> np.ndarray:
    keys = np.empty((n, 2), dtype=np.uint64)
    keys[:, 0] = np.arange(n, dtype=np.uint64) | np.uint64(oid & _LOW_MASK)
    keys[:, 1] = oid >> 64
    return keys


def chunk_key(oid: int, i: int) -> int:
    return oid | i


def oid_of(key: int) -> int:
    return key & ~_CHUNK_MASK


def evicted_oids(encoded: bytes, ssd_tier: bool) -> set[int]:
    """Objects that lost a chunk, from ``StoreEvents.to_bytes()``: a DRAM eviction when
    the store has no SSD tier (the chunk is gone), an SSD eviction otherwise."""
    if len(encoded) <= 4:
        return set()
    ev = np.frombuffer(encoded, dtype=_EVENT, offset=4)
    hit = ev["kind"] == _EVICTED
    if ssd_tier:
        hit &= ev["tier"] == _SSD
    if not hit.any():
        return set()
    lo = ev["lo"][hit] & np.uint64(~_CHUNK_MASK & _LOW_MASK)
    hi = ev["hi"][hit]
    return {int(h) << 64 | int(l) for l, h in zip(lo.tolist(), hi.tolist())}


def stored_keys(encoded: bytes, tier: int = _SSD) -> list[int]:
    """The keys of ``stored`` events in ``tier`` (what a store announces for every block its
    SSD tier recovered when it opened), from ``StoreEvents.to_bytes()``."""
    if len(encoded) <= 4:
        return []
    ev = np.frombuffer(encoded, dtype=_EVENT, offset=4)
    hit = (ev["kind"] == _STORED) & (ev["tier"] == tier)
    return [int(h) << 64 | int(l) for l, h in zip(ev["lo"][hit].tolist(), ev["hi"][hit].tolist())]
