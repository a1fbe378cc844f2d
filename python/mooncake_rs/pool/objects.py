"""The records of a node's objects and its size classes (segment.py uses them): what an
object is (oid, size, class, chunks, pinned), a class's Rust ``Store``, reservations and
leases held for remote writers and readers, and the segment's counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .._core import LeasedRun, ReservedObject, Store

__all__ = ["ObjectMeta", "SegmentCounters", "SizeClass", "Reservation", "Lease", "clip_sizes"]


class ObjectMeta(NamedTuple):
    oid: int
    size: int
    cls: int
    nchunks: int
    pinned: bool


@dataclass
class SegmentCounters:
    puts: int = 0
    puts_existing: int = 0
    puts_no_space: int = 0
    #: remote puts' objects published as their last byte landed (no Commit: node.py ``_landed``)
    puts_landed: int = 0
    #: remote puts' objects written into spare slots a client held, named by its Bind (node.py ``_bind``)
    puts_into_spares: int = 0
    hits: int = 0
    misses: int = 0
    #: in the table, but a chunk was gone when read ("present but failed to read")
    failed_reads: int = 0
    objects_evicted: int = 0
    removes: int = 0
    #: objects found again on disk when a durable segment opened / dropped there (damaged)
    recovered: int = 0
    recovery_dropped: int = 0


class SizeClass:
    def __init__(self, chunk_bytes: int, dram_bytes: int, ssd_path: str | None, ssd_bytes: int,
                 eviction: str, shared_memory: bool) -> None:
        self.chunk_bytes = chunk_bytes
        self.ssd = bool(ssd_path and ssd_bytes)
        self.store = Store(chunk_bytes, dram_bytes, ssd_path=ssd_path if self.ssd else None,
                           ssd_bytes=ssd_bytes if self.ssd else 0, eviction=eviction, shared_memory=shared_memory)
        st = self.store.stats()
        # with an SSD tier every chunk is written through to it (durable.py): its slots
        # are the capacity, DRAM a cache in front of them
        self.capacity_chunks = st.slots_ssd if self.ssd else st.slots_dram


@dataclass
class Reservation:
    """Slots reserved for one object a remote writer fills in place, then commits: the
    Rust ``ReservedObject`` (one per object, ``Store.reserve_objects``) and its chunks'
    slot offsets."""

    key: str
    meta: ObjectMeta
    slots: ReservedObject
    offsets: list[int]


@dataclass
class Lease:
    """One object's chunks held for a remote reader (released by ``release()``)."""

    meta: ObjectMeta
    run: LeasedRun
    offsets: list[int]

    def release(self) -> None:
        self.run.release()


def clip_sizes(sizes: list[int], total: int) -> list[int]:
    """The piece sizes that cover the first ``total`` bytes."""
    out, left = [], total
    for n in sizes:
        take = min(n, left)
        out.append(take)
        left -= take
    return out
