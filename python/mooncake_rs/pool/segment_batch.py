"""Batches of objects in and out of one segment with one Rust call per size class: every
chunk of every object of a ``batch_put_from`` / ``batch_get_into`` is copied straight
between the caller's memory and the store's slots by ``Store.put_from_addresses`` /
``get_into_addresses`` (GIL released, large batches over several threads, no staging
buffer). Python does only the object table: an id and a record per object, and the
statuses.

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
    """The chunks of one size class's objects, in batch order. Chunk keys are Python ints
    (``oid | j``, the store takes any iterable of ints) built in the loop that lists the
    addresses: numpy's ten calls per batch cost 14 us with warm caches but 126 us after
    the 20 ms pause a caller spends between batches on a shared host (measured; a list of
    64 ints: 22 us), and that cold cost is what a batch pays."""

    def __init__(self) -> None:
        self.objects: list[tuple[int, str, ObjectMeta, int]] = []  # (index, key, meta, address)
        self.keys: list[int] = []
        self.addrs: list[int] = []
        self.lens: list[int] = []

    def add(self, index: int, key: str, meta: ObjectMeta, addr: int, chunk_bytes: int) -> None:
        self.objects.append((index, key, meta, addr))
        oid, size = meta.oid, meta.size
        for j in range(meta.nchunks):
            self.keys.append(oid | j)
            self.addrs.append(addr + j * chunk_bytes)
            self.lens.append(max(0, min(chunk_bytes, size - j * chunk_bytes)))


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
        plans[meta.cls].add(i, key, meta, p[0], seg.classes[meta.cls].chunk_bytes)
    for cls, plan in enumerate(plans):
        if not plan.objects:
            continue
        store = seg.classes[cls].store
        try:
            store.put_from_addresses(plan.keys, plan.addrs, plan.lens)
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
        plans[meta.cls].add(i, key, meta, p[0], seg.classes[meta.cls].chunk_bytes)
    for cls, plan in enumerate(plans):
        if not plan.objects:
            continue
        found = seg.classes[cls].store.get_into_addresses(plan.keys, plan.addrs, plan.lens)
        pos = 0
        for i, key, meta, _ in plan.objects:
            whole = all(found[pos:pos + meta.nchunks])
            pos += meta.nchunks
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
