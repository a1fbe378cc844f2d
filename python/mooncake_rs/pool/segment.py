"""One node's share of the pool: objects (string key -> bytes of any length) kept in the
Rust tiered ``Store`` (DRAM slots + SSD tier), chunked as chunks.py describes.

Two size classes, each its own ``Store``: values up to ``small_bytes`` take one small slot;
larger ones are cut into ``chunk_bytes`` chunks. The Rust store owns the bytes, the
eviction policy, the SSD tier, leases and pins; this file owns only the object table
(key -> oid, size, class, pinned), which the store cannot know.

Rules kept here:
- put-if-absent: the first committed put of a key wins; a later put returns OK and
  changes nothing (Mooncake's behaviour; the loser's chunks are freed).
- a value never becomes visible before all its chunks are in: the table entry is made
  after they are.
- an object that lost any chunk (evicted, SSD slot corrupt) is dropped whole the first
  time anyone looks (a read, an existence check, the eviction events drained after each
  put); it is reported missing, never partially served.
- a read holds the chunks' leases (Rust refcounts) while copying or while a remote
  reader's transfer runs, so no slot it reads is freed or reused meanwhile.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from .._core import ExistsResponder, HeldKeys, ReservedObject, present_flags
from ..errors import InvalidArgument, StoreFull
from .buffers import gather, scatter, view_at
from .chunks import chunk_key, chunk_keys, evicted_oids, new_oid
from .durable import DurableObjects, recover
from .objects import Lease, ObjectMeta, Reservation, SegmentCounters, SizeClass, clip_sizes
from .status import KeyStatus

__all__ = ["ObjectSegment", "ObjectMeta", "Reservation", "Lease", "SegmentCounters", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 256 << 10
DEFAULT_SMALL_BYTES = 4 << 10


class ObjectSegment:
    def __init__(self, dram_bytes: int, *, ssd_path: str | None = None, ssd_bytes: int = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, small_bytes: int = DEFAULT_SMALL_BYTES,
                 eviction: str = "lru", shared_memory: bool = False) -> None:
        if not (isinstance(chunk_bytes, int) and isinstance(small_bytes, int) and 0 < small_bytes < chunk_bytes):
            raise InvalidArgument(f"need 0 < small_bytes < chunk_bytes, got {small_bytes!r}, {chunk_bytes!r}")
        if not isinstance(dram_bytes, int) or dram_bytes < 2 * chunk_bytes:
            raise InvalidArgument(f"dram_bytes must be at least two chunks ({2 * chunk_bytes}), got {dram_bytes!r}")
        # small values get 1/16 of the memory: they are many but tiny (128 B keys, metadata)
        small_dram = max(16 * small_bytes, dram_bytes // 16)
        # with an SSD tier: 1/16 for small values, 1/16 for the manifests (durable.py)
        small_ssd = ssd_bytes // 16 if ssd_bytes else 0
        large_ssd = ssd_bytes - 2 * small_ssd if ssd_bytes else 0

        def sub(name: str) -> str | None:
            if not ssd_path:
                return None
            p = os.path.join(ssd_path, name)
            os.makedirs(p, exist_ok=True)
            return p

        self.classes = [
            SizeClass(small_bytes, small_dram, sub("small"), small_ssd, eviction, shared_memory),
            SizeClass(chunk_bytes, dram_bytes - small_dram, sub("large"), large_ssd, eviction,
                       shared_memory),
        ]
        self.dram_bytes, self.ssd_bytes = dram_bytes, ssd_bytes
        self._lock = threading.Lock()
        self._objects: dict[str, ObjectMeta] = {}
        self._by_oid: dict[int, str] = {}
        # the table's keys again, in Rust, changed with it under the lock: a node answers a
        # batch_is_exist from the request's msgpack key list (exists_encoded)
        self._held = HeldKeys()
        self._since_reap = 0
        self.counters = SegmentCounters()
        # an SSD tier makes the objects durable: written through, found again after a restart
        self.durable = DurableObjects(ssd_path, small_ssd) if ssd_path and ssd_bytes else None
        if self.durable is not None:
            self.counters.recovered, self.counters.recovery_dropped = recover(self, self.durable)

    # ---- helpers
    def class_of(self, size: int) -> int:
        """The size class an object of ``size`` bytes goes to."""
        return 0 if size <= self.classes[0].chunk_bytes else 1

    def _new_meta(self, size: int, pin: bool) -> ObjectMeta | KeyStatus:
        if not isinstance(size, int) or size < 0:
            return KeyStatus.INVALID
        c = self.class_of(size)
        sc = self.classes[c]
        n = max(1, -(-size // sc.chunk_bytes))
        if n > sc.capacity_chunks:  # would evict everything, itself included: refuse at once
            return KeyStatus.NO_SPACE
        return ObjectMeta(new_oid(), size, c, n, pin)

    def _drop_chunks(self, meta: ObjectMeta) -> None:
        store = self.classes[meta.cls].store
        # last chunk first: freed slots go on a last-in-first-out list, so the next object
        # gets them back in ascending order (its chunks then follow each other in the
        # region, and a remote transfer moves each run as one request: rust/core/src/object_layout.rs)
        for i in reversed(range(meta.nchunks)):
            k = chunk_key(meta.oid, i)
            if meta.pinned:
                try:
                    store.unpin(k)
                except Exception:  # noqa: BLE001 - evicted meanwhile or never pinned
                    pass
            store.remove(k)
        if self.durable is not None:
            self.durable.forget(meta)

    def _forget(self, key: str, meta: ObjectMeta) -> None:
        """Drops a broken/removed object from the table (caller holds the lock)."""
        if self._objects.get(key) is meta:
            del self._objects[key]
            self._by_oid.pop(meta.oid, None)
            self._held.discard(key)

    def _publish(self, key: str, meta: ObjectMeta) -> KeyStatus:
        """Makes a fully written object visible, unless the key won meanwhile. A durable
        segment writes it (chunks, then manifest) to disk first."""
        if self.durable is not None and key not in self._objects:
            st = self.durable.write(key, meta, self.classes[meta.cls].store)
            if st is not KeyStatus.OK:
                self._drop_chunks(meta)
                self.counters.puts_no_space += st is KeyStatus.NO_SPACE
                return st
        self._enter([(key, meta)])
        return KeyStatus.OK

    def _enter(self, written: list[tuple[str, ObjectMeta]]) -> None:
        """Makes fully written objects visible under one lock. Put-if-absent: a key that
        won meanwhile keeps its object, and the loser's chunks are freed."""
        lost: list[ObjectMeta] = []
        with self._lock:
            objects, by_oid = self._objects, self._by_oid
            fresh: dict[str, ObjectMeta] = {}
            for key, meta in written:
                if key in objects or key in fresh:
                    lost.append(meta)
                else:
                    fresh[key] = meta
            self._held.add_many(list(fresh))  # (first: a key that is no str is refused before the table changes)
            objects.update(fresh)
            for key, meta in fresh.items():
                by_oid[meta.oid] = key
            self.counters.puts += len(fresh)
        for meta in lost:
            self._drop_chunks(meta)
        self.counters.puts_existing += len(lost)

    def _maybe_reap(self, writes: int = 1) -> None:
        """After every 64 writes: reads and existence checks find a lost chunk themselves,
        this only keeps the table (and the event log) from carrying the dead for long."""
        self._since_reap += writes
        self.reap_if_due()

    def reap_if_due(self) -> None:
        """``reap_evicted`` when 64 writes were published since the last one (a store
        node calls this after it answered, off the put's path: ``commit_many(reap=False)``)."""
        if self._since_reap >= 64:
            self.reap_evicted()

    def reap_evicted(self) -> int:
        """Drops every object that lost a chunk to eviction (from the stores' events)."""
        self._since_reap = 0
        dropped = 0
        sources = [(sc.store.drain_events_batch().to_bytes(), sc.ssd) for sc in self.classes
                   if sc.store.pending_events()]  # (none, on most calls: a node's every Exists asks)
        if self.durable is not None:
            sources.append((self.durable.events(), True))
        for events, ssd in sources:
            for oid in evicted_oids(events, ssd):
                with self._lock:
                    key = self._by_oid.get(oid)
                    meta = self._objects.get(key) if key is not None else None
                    if key is None or meta is None:
                        continue
                    # a pinned object is whole in DRAM: it loses only its disk copy, rewritten
                    if meta.pinned and self.durable is not None and self.durable.write(
                            key, meta, self.classes[meta.cls].store) is KeyStatus.OK:
                        continue
                    self._forget(key, meta)
                self._drop_chunks(meta)
                dropped += 1
        self.counters.objects_evicted += dropped
        return dropped

    # ---- local writes and reads (memory given by address)
    def put_from(self, key: str, ptrs: list[int], sizes: list[int], pin: bool = False) -> KeyStatus:
        if key in self._objects:
            self.counters.puts_existing += 1
            return KeyStatus.OK
        meta = self._new_meta(sum(sizes), pin)
        if isinstance(meta, KeyStatus):
            if meta is KeyStatus.NO_SPACE:
                self.counters.puts_no_space += 1
            return meta
        sc = self.classes[meta.cls]
        cb, size, n = sc.chunk_bytes, meta.size, meta.nchunks
        if n == 1 and size < cb:  # a small value: one padded slot, nothing to chunk
            pad = np.zeros(cb, dtype=np.uint8)
            gather(ptrs, sizes, pad)
            return self._put_one(key, meta, pad)
        keys = chunk_keys(meta.oid, n)
        full = size // cb
        try:
            if len(ptrs) == 1 and full:
                sc.store.put_many(keys[:full], view_at(ptrs[0], full * cb))
                tail = size - full * cb
                if tail:
                    pad = np.zeros(cb, dtype=np.uint8)
                    pad[:tail] = view_at(ptrs[0] + full * cb, tail)
                    sc.store.put(chunk_key(meta.oid, full), pad)
            else:
                staging = np.zeros(n * cb, dtype=np.uint8)
                gather(ptrs, sizes, staging)
                sc.store.put_many(keys, staging)
            # a value close to the class's size can push out its own first chunks while
            # its last ones go in: check they are all there before publishing it
            run = sc.store.lookup_prefix_run(keys, promote=False)
            whole = len(run) == n
            run.release()
            if not whole:
                raise StoreFull("the value did not fit beside what is leased, pinned or reserved")
            if pin:
                for i in range(n):
                    sc.store.pin(chunk_key(meta.oid, i))
        except StoreFull:
            self._drop_chunks(meta)
            self.counters.puts_no_space += 1
            return KeyStatus.NO_SPACE
        except Exception:  # noqa: BLE001 - a chunk evicted before its pin: no room kept
            self._drop_chunks(meta)
            self.counters.puts_no_space += 1
            return KeyStatus.NO_SPACE
        st = self._publish(key, meta)
        self._maybe_reap()
        return st

    def put_value(self, key: str, value: Any, pin: bool = False) -> KeyStatus:
        """A value given as bytes; one that fits a small slot costs one store call."""
        if key in self._objects:
            self.counters.puts_existing += 1
            return KeyStatus.OK
        if not isinstance(value, (bytes, bytearray)):
            value = memoryview(value).cast("B")
        size = len(value)
        sc0 = self.classes[0]
        if 0 < size <= sc0.chunk_bytes:  # one small slot; the Rust store zeroes the slot's tail
            return self._put_one(key, ObjectMeta(new_oid(), size, 0, 1, pin), value)
        arr = np.frombuffer(value, dtype=np.uint8)
        return self.put_from(key, [arr.ctypes.data], [size], pin) if size else KeyStatus.INVALID

    def _put_one(self, key: str, meta: ObjectMeta, slot: object) -> KeyStatus:
        store = self.classes[meta.cls].store
        try:
            store.put_padded(meta.oid, slot)
            if meta.pinned:
                store.pin(meta.oid)
        except Exception:  # noqa: BLE001 - StoreFull, or evicted before its pin
            self._drop_chunks(meta)
            self.counters.puts_no_space += 1
            return KeyStatus.NO_SPACE
        st = self._publish(key, meta)
        self._maybe_reap()
        return st

    def get_bytes(self, key: str) -> bytes | KeyStatus:
        """The value as bytes (one copy out of the slots), or MISSING."""
        meta = self._objects.get(key)
        if meta is None:
            self.counters.misses += 1
            return KeyStatus.MISSING
        if meta.nchunks == 1:  # one slot: its first `size` bytes, copied out in one Rust call
            data = self.classes[meta.cls].store.get_head(meta.oid, meta.size)
            if data is not None:
                self.counters.hits += 1
                return data
        out = np.empty(meta.size, dtype=np.uint8)
        got = self.get_into(key, [out.ctypes.data], [meta.size])
        return out.tobytes() if got >= 0 else KeyStatus(got)

    def get_into(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        """Bytes read (the object's size), or a negative KeyStatus."""
        meta = self._objects.get(key)
        if meta is None:
            self.counters.misses += 1
            return KeyStatus.MISSING
        if sum(sizes) < meta.size:
            return KeyStatus.INVALID
        sc = self.classes[meta.cls]
        cb, size, n = sc.chunk_bytes, meta.size, meta.nchunks
        keys = chunk_keys(meta.oid, n)
        full = size // cb
        ok = True
        if len(ptrs) == 1:
            if full:
                ok = all(sc.store.get_many_into(keys[:full], view_at(ptrs[0], full * cb)))
            tail = size - full * cb
            if ok and tail:
                blk = sc.store.get(chunk_key(meta.oid, full))
                if blk is None:
                    ok = False
                else:
                    with blk:
                        view_at(ptrs[0] + full * cb, tail)[:] = np.asarray(blk)[:tail]
        else:
            staging = np.empty(n * cb, dtype=np.uint8)
            ok = all(sc.store.get_many_into(keys, staging))
            if ok:
                scatter(staging[:size], ptrs, clip_sizes(sizes, size))
        if not ok:
            self.counters.failed_reads += 1
            with self._lock:
                self._forget(key, meta)
            self._drop_chunks(meta)
            return KeyStatus.MISSING
        self.counters.hits += 1
        return size

    # ---- remote writes and reads (a transfer engine moves the bytes)
    def reserve_many(self, keys: list[str], sizes: list[int], pin: bool = False) -> list[Reservation | KeyStatus]:
        """Per key: reserved slots (offsets in its class store's region), OK if the key is
        already stored (nothing to write), or NO_SPACE / INVALID. One Rust call per size
        class for the whole batch (``Store.reserve_objects``), not one per chunk."""
        out: list[Reservation | KeyStatus] = [KeyStatus.OK] * len(keys)
        by_class: list[list[tuple[int, str, ObjectMeta]]] = [[] for _ in self.classes]
        objects = self._objects
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if key in objects:
                self.counters.puts_existing += 1
                continue
            meta = self._new_meta(size, pin)
            if isinstance(meta, KeyStatus):
                self.counters.puts_no_space += meta is KeyStatus.NO_SPACE
                out[i] = meta
                continue
            by_class[meta.cls].append((i, key, meta))
        self._reserve_slots(by_class, out)
        return out

    def reserve_unbound(self, count: int, size: int) -> list[Reservation]:
        """Slots for ``count`` objects of ``size`` bytes whose keys are not known yet (a
        store node's spare slots: the put that fills them names the keys, and whether to
        pin, before it commits; ``Reservation.key`` is "" until then). As many as fit, up
        to ``count``."""
        meta = self._new_meta(size, False)
        if isinstance(meta, KeyStatus) or count <= 0:
            return []
        items = [(i, "", meta if i == 0 else meta._replace(oid=new_oid())) for i in range(count)]
        by_class: list[list[tuple[int, str, ObjectMeta]]] = [[] for _ in self.classes]
        by_class[meta.cls] = items
        out: list[Reservation | KeyStatus] = [KeyStatus.NO_SPACE] * count
        self._reserve_slots(by_class, out, puts=False)
        return [r for r in out if isinstance(r, Reservation)]

    def _reserve_slots(self, by_class: list[list[tuple[int, str, ObjectMeta]]],
                       out: list[Reservation | KeyStatus], puts: bool = True) -> None:
        """One store call a size class: ``out[i]`` becomes the reservation of each ``(i,
        key, meta)`` whose chunks fit, NO_SPACE for the others (counted as puts refused
        when they are ``puts``)."""
        for cls, items in enumerate(by_class):
            if not items:
                continue
            slots = self.classes[cls].store.reserve_objects([m.oid for _, _, m in items],
                                                            [m.nchunks for _, _, m in items])
            for (i, key, meta), obj in zip(items, slots):
                if obj is None:  # its chunks did not fit: none of its slots kept
                    self.counters.puts_no_space += puts
                    out[i] = KeyStatus.NO_SPACE
                else:
                    out[i] = Reservation(key, meta, obj, obj.offsets)

    def reserve(self, key: str, size: int, pin: bool = False) -> Reservation | KeyStatus:
        """``reserve_many`` of one key."""
        return self.reserve_many([key], [size], pin)[0]

    def commit(self, res: Reservation) -> KeyStatus:
        """Publishes a reservation whose bytes were written: its chunks (pinned if asked,
        one Rust call), then the object."""
        if not res.slots.commit(res.meta.pinned):  # a chunk evicted before its pin: nothing of it kept
            self.counters.puts_no_space += 1
            return KeyStatus.NO_SPACE
        st = self._publish(res.key, res.meta)
        self._maybe_reap()
        return st

    def commit_many(self, reservations: list[Reservation], reap: bool = True) -> list[KeyStatus]:
        """``commit`` of a batch: every object's chunks published (one Rust call), then
        every object made visible under one lock. A durable segment writes each to disk
        first: object by object, as ``commit``. ``reap`` False: the dead are reaped later,
        by ``reap_if_due`` (a store node's, after its answer left)."""
        if self.durable is not None:
            return [self.commit(res) for res in reservations]
        out = [KeyStatus.OK] * len(reservations)
        whole = []
        published = ReservedObject.commit_many([res.slots for res in reservations],
                                               [res.meta.pinned for res in reservations])
        for j, (res, ok) in enumerate(zip(reservations, published)):
            if ok:
                whole.append(res)
            else:  # a chunk evicted before its pin: nothing of it kept
                self.counters.puts_no_space += 1
                out[j] = KeyStatus.NO_SPACE
        self._enter([(res.key, res.meta) for res in whole])
        self._since_reap += len(reservations)
        if reap:
            self.reap_if_due()
        return out

    def abort(self, res: Reservation) -> None:
        res.slots.abort()  # (nothing if committed or aborted already)

    def lease_many(self, keys: list[str]) -> list[Lease | KeyStatus]:
        """Per key: the object's chunks, leased, with their slot offsets (for a remote
        read), or MISSING. One Rust call per size class (``Store.lease_objects``)."""
        out: list[Lease | KeyStatus] = [KeyStatus.MISSING] * len(keys)
        by_class: list[list[tuple[int, str, ObjectMeta]]] = [[] for _ in self.classes]
        objects = self._objects
        for i, key in enumerate(keys):
            meta = objects.get(key)
            if meta is None:
                self.counters.misses += 1
                continue
            by_class[meta.cls].append((i, key, meta))
        for cls, items in enumerate(by_class):
            if not items:
                continue
            runs = self.classes[cls].store.lease_objects([m.oid for _, _, m in items],
                                                         [m.nchunks for _, _, m in items])
            for (i, key, meta), run in zip(items, runs):
                if run is None:  # in the table but a chunk is gone: dropped whole, reported missing
                    self.counters.failed_reads += 1
                    with self._lock:
                        self._forget(key, meta)
                    self._drop_chunks(meta)
                    continue
                self.counters.hits += 1
                out[i] = Lease(meta, run, run.offsets)
        return out

    def lease(self, key: str) -> Lease | KeyStatus:
        """``lease_many`` of one key."""
        return self.lease_many([key])[0]

    # ---- metadata
    def exists(self, key: str) -> bool:
        return key in self._objects

    def exists_many(self, keys: list[str]) -> list[int]:
        """1 for each key held, else 0 (a batch_is_exist of a node; one Rust call for the list)."""
        return present_flags(self._objects, keys if type(keys) is list else list(keys))

    def exists_encoded(self, keys: Any) -> bytes:
        """``exists_many`` of a key list given as its msgpack bytes (a node's ``Exists`` as
        it came off the wire), answered as the msgpack bytes of the 1/0 list, in one Rust
        pass: no str object, Python hash or dict probe a key. InvalidArgument when ``keys``
        is not a msgpack array of str."""
        return self._held.flags_msgpack(keys)

    def exists_responder(self, spin_s: float) -> ExistsResponder:
        """A reader for one plain connection of this segment's node that answers its
        ``Exists`` frames itself, from the same key set as ``exists_encoded``, and only
        while no store has an eviction or removal event waiting for ``reap_evicted``
        (``Store.pending_losses``; rust/core/src/exists_frames.rs)."""
        stores = [sc.store for sc in self.classes] + ([self.durable.store] if self.durable is not None else [])
        return ExistsResponder(self._held, stores, spin_s)

    def size_of(self, key: str) -> int | None:
        meta = self._objects.get(key)
        return None if meta is None else meta.size

    def remove(self, key: str) -> bool:
        with self._lock:
            meta = self._objects.get(key)
            if meta is None:
                return False
            self._forget(key, meta)
        self._drop_chunks(meta)
        self.counters.removes += 1
        return True

    def remove_all(self) -> int:
        with self._lock:
            items = list(self._objects.items())
            self._objects.clear()
            self._by_oid.clear()
            self._held.clear()
        for _, meta in reversed(items):  # (the first object's slots end up on top: _drop_chunks)
            self._drop_chunks(meta)
        self.counters.removes += len(items)
        return len(items)

    def keys(self) -> list[str]:
        return list(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def object_bytes(self) -> int:
        return sum(m.size for m in list(self._objects.values()))

    def flush(self) -> None:
        """Syncs the SSD tiers to the device (a put is in the file already; this makes it
        survive a power loss too). Called at close."""
        for sc in self.classes:
            sc.store.flush()
        if self.durable is not None:
            self.durable.store.flush()

    def check_integrity(self) -> None:
        for sc in self.classes:
            sc.store.check_integrity()
