"""Batches of objects in and out of one segment with one Rust call per size class: every
object of a ``batch_put_from`` / ``batch_get_into`` is cut into its chunks and copied
straight between the caller's memory and the store's slots by ``Store.put_objects_from``
/ ``get_objects_into`` (GIL released, no staging buffer). Python does only the object
table: an id and a record per object, and the statuses.

Objects given as several pieces (``*_multi_buffers``), and a batch the store cannot hold
at once (the Rust call reserves every slot of it first), take the segment's per-object
path (``put_from`` / ``get_into``), which is the reference these are tested against.
"""

from __future__ import annotations


from ..errors import MooncakeError
from .chunks import chunk_key
from .objects import ObjectMeta
from .segment import ObjectSegment
from .status import KeyStatus

__all__ = ["put_batch", "get_batch"]


class _Plan:
    """The objects of one size class, in batch order, as three lists the store takes:
    object ids, addresses and sizes. ``Store.put_objects_from`` / ``get_objects_into``
    cut each object into its chunks (keys ``oid | j``, ``chunk_keys``' layout) in Rust:
    building the per-chunk lists here was about a fifth of a local batch's Python
    (measured with cProfile, 32 x 512 KiB in 256 KiB chunks). Keys and sizes are Python
    ints: numpy's calls per batch cost 126 us after the 20 ms pause a caller spends
    between batches on a shared host (a list of 64 ints: 22 us)."""

    def __init__(self) -> None:
        self.objects: list[tuple[int, str, ObjectMeta, int]] = []  # (index, key, meta, address)
        self.oids: list[int] = []
        self.addrs: list[int] = []
        self.sizes: list[int] = []

    def add(self, index: int, key: str, meta: ObjectMeta, addr: int) -> None:
        self.objects.append((index, key, meta, addr))
        self.oids.append(meta.oid)
        self.addrs.append(addr)
        self.sizes.append(meta.size)


def put_batch(seg: ObjectSegment, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
              pin: bool) -> list[KeyStatus]:
    out: list[KeyStatus] = [KeyStatus.OK] * len(keys)
    plans = [_Plan() for _ in seg.classes]
    for i, (key, p, s) in enumerate(zip(keys, ptrs, sizes)):
        if key in seg._objects:
            seg.counters.puts_existing += 1
            continue
        if len(p) != 1 or len(s) != 1 or not isinstance(p[0], int) or p[0] <= 0:
            out[i] = seg.put_from(key, p, s, pin)
            continue
        meta = seg._new_meta(s[0], pin)
        if isinstance(meta, KeyStatus):
            seg.counters.puts_no_space += meta is KeyStatus.NO_SPACE
            out[i] = meta
            continue
        plans[meta.cls].add(i, key, meta, p[0])
    for cls, plan in enumerate(plans):
        if not plan.objects:
            continue
        store = seg.classes[cls].store
        try:
            store.put_objects_from(plan.oids, plan.addrs, plan.sizes)
        except MooncakeError:  # the class cannot hold the whole batch at once: object by object
            for i, key, meta, addr in plan.objects:
                out[i] = seg.put_from(key, [addr], [meta.size], pin)
            continue
        for i, key, meta, _ in plan.objects:
            out[i] = _pin_and_publish(seg, store, key, meta)
    seg._maybe_reap()
    return out


def _pin_and_publish(seg: ObjectSegment, store: object, key: str, meta: ObjectMeta) -> KeyStatus:
    if meta.pinned:
        try:
            for j in range(meta.nchunks):
                store.pin(chunk_key(meta.oid, j))  # type: ignore[attr-defined]
        except MooncakeError:  # a chunk evicted before its pin: no room kept for it
            seg._drop_chunks(meta)
            seg.counters.puts_no_space += 1
            return KeyStatus.NO_SPACE
    return seg._publish(key, meta)


def get_batch(seg: ObjectSegment, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
    out: list[int] = [0] * len(keys)
    plans = [_Plan() for _ in seg.classes]
    for i, (key, p, s) in enumerate(zip(keys, ptrs, sizes)):
        meta = seg._objects.get(key)
        if meta is None:
            seg.counters.misses += 1
            out[i] = KeyStatus.MISSING
            continue
        if len(p) != 1 or len(s) != 1 or not isinstance(p[0], int) or p[0] <= 0:
            out[i] = seg.get_into(key, p, s)
            continue
        if s[0] < meta.size:
            out[i] = KeyStatus.INVALID
            continue
        plans[meta.cls].add(i, key, meta, p[0])
    for cls, plan in enumerate(plans):
        if not plan.objects:
            continue
        found = seg.classes[cls].store.get_objects_into(plan.oids, plan.addrs, plan.sizes)
        for (i, key, meta, _), whole in zip(plan.objects, found):
            if whole:
                seg.counters.hits += 1
                out[i] = meta.size
                continue
            # in the table but a chunk is gone (evicted, damaged on SSD): dropped whole
            seg.counters.failed_reads += 1
            with seg._lock:
                seg._forget(key, meta)
            seg._drop_chunks(meta)
            out[i] = KeyStatus.MISSING
    return out
