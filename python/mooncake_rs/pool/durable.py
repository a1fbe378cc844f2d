"""A segment's objects surviving its process (a node started with ``--ssd-path``).

Nothing here invents a file format: everything goes through the Rust store's SSD tier
(its slot file: one checksummed slot per block, data written before header, every slot
verified by the recovery scan when the store opens, a torn or damaged one dropped).

- **Chunks**: written through to their class's SSD tier before the put is acknowledged
  (``Store.persist``: the DRAM slot's bytes go to the slot file now, and stay in DRAM as
  a cache). The SSD tier then holds every object; its eviction is the pool's eviction.
- **The key table**: one *manifest* per object, a block in a third store that lives on
  SSD only (``Store.put_ssd``), under the object's oid: the key, size, class, chunk count
  and pin. It is written after the chunks and before the object becomes visible, and
  removed with it.
- **Recovery** (the segment opening over an existing ``ssd_path``): each store's open
  scans its slot file and announces the intact blocks; every manifest whose chunks all
  came back is an object again; one that lost a chunk (torn write, flipped bit) is
  dropped whole with what is left of it, and chunks without a manifest (a put killed
  half-way) are freed. So after a crash a key is served with its own bytes or reported
  missing, never partially or with another key's bytes.

Durable against the process dying (SIGKILL, OOM): the bytes are in the file (the page
cache) when a put returns. Against power loss only after the OS wrote them back (no
fsync per put).
"""

from __future__ import annotations

import os
import struct
from typing import Any

from .._core import Store
from .chunks import chunk_key, chunk_keys, oid_of, stored_keys
from .objects import ObjectMeta
from .status import KeyStatus

__all__ = ["DurableObjects", "MANIFEST_BYTES", "MAX_DURABLE_KEY_BYTES", "encode_manifest", "decode_manifest"]

#: a manifest block; with the slot file's 64-byte slot header it fills one 4 KiB page
MANIFEST_BYTES = 4096 - 64
_MAGIC = b"MCRSOBJ1"
# magic, oid (16 bytes LE), size, class, chunks, pinned, key length; then the key
_HEAD = struct.Struct("<8s16sQBI?H")
MAX_DURABLE_KEY_BYTES = MANIFEST_BYTES - _HEAD.size


def encode_manifest(key: str, meta: ObjectMeta) -> bytes | None:
    """The manifest block of ``key`` (None: the key is too long for one)."""
    k = key.encode()
    if len(k) > MAX_DURABLE_KEY_BYTES:
        return None
    head = _HEAD.pack(_MAGIC, meta.oid.to_bytes(16, "little"), meta.size, meta.cls, meta.nchunks, meta.pinned, len(k))
    return head + k + bytes(MANIFEST_BYTES - len(head) - len(k))


def decode_manifest(oid: int, block: bytes) -> tuple[str, ObjectMeta] | None:
    """The key and record a manifest stored under ``oid`` describes, or None if it does
    not describe that oid (the slot checksum guards the bytes; this guards the meaning)."""
    if len(block) != MANIFEST_BYTES:
        return None
    magic, oid_bytes, size, cls, nchunks, pinned, klen = _HEAD.unpack_from(block)
    if magic != _MAGIC or int.from_bytes(oid_bytes, "little") != oid or cls not in (0, 1) or nchunks < 1:
        return None
    if klen > MAX_DURABLE_KEY_BYTES:
        return None
    try:
        key = block[_HEAD.size:_HEAD.size + klen].decode()
    except UnicodeDecodeError:
        return None
    return key, ObjectMeta(oid, size, cls, nchunks, pinned)


class DurableObjects:
    """The manifests' store and the write-through of a segment's chunks."""

    def __init__(self, ssd_path: str, ssd_bytes: int) -> None:
        path = os.path.join(ssd_path, "objects")
        os.makedirs(path, exist_ok=True)
        # manifests live on SSD only (put_ssd; reads with promote=False): DRAM is a token
        self.store = Store(MANIFEST_BYTES, 4 * 4096, ssd_path=path, ssd_bytes=ssd_bytes)

    def write(self, key: str, meta: ObjectMeta, data: Store) -> KeyStatus:
        """Writes the object's chunks (in DRAM now) and then its manifest to disk."""
        rec = encode_manifest(key, meta)
        if rec is None:
            return KeyStatus.INVALID
        if not all(data.persist(chunk_keys(meta.oid, meta.nchunks))):
            return KeyStatus.NO_SPACE
        # False also when a manifest is there already (a pinned object written again)
        if not (self.store.put_ssd(meta.oid, rec) or self.store.contains(meta.oid)):
            return KeyStatus.NO_SPACE
        return KeyStatus.OK

    def forget(self, meta: ObjectMeta) -> None:
        self.store.remove(meta.oid)

    def events(self) -> bytes:
        return self.store.drain_events_batch().to_bytes()

    def recovered(self) -> list[tuple[int, tuple[str, ObjectMeta] | None]]:
        """Every manifest the store's open recovered: (oid, decoded or None if garbled)."""
        out: list[tuple[int, tuple[str, ObjectMeta] | None]] = []
        for oid in stored_keys(self.events()):
            blk = self.store.get(oid, promote=False)
            if blk is None:
                out.append((oid, None))
                continue
            with blk:
                out.append((oid, decode_manifest(oid, bytes(memoryview(blk)))))
        return out


def recover(seg: Any, durable: DurableObjects) -> tuple[int, int]:
    """Rebuilds ``seg``'s object table from what its stores recovered; returns (objects
    back, objects dropped because a chunk or the manifest was lost or damaged). ``seg`` is
    the ObjectSegment being opened (not imported here: segment.py imports this module)."""
    chunks = [set(stored_keys(sc.store.drain_events_batch().to_bytes())) for sc in seg.classes]
    back = dropped = 0
    for oid, entry in durable.recovered():
        if entry is None:
            durable.store.remove(oid)
            dropped += 1
            continue
        key, meta = entry
        sc = seg.classes[meta.cls]
        whole = all(chunk_key(meta.oid, i) in chunks[meta.cls] for i in range(meta.nchunks))
        if whole and key not in seg._objects and meta.pinned:
            whole = _pin_all(sc.store, meta)
        if not whole or key in seg._objects:
            durable.forget(meta)
            for i in range(meta.nchunks):
                sc.store.remove(chunk_key(meta.oid, i))
            dropped += 1
            continue
        seg._held.add(key)
        seg._objects[key] = meta
        seg._by_oid[meta.oid] = key
        back += 1
    # chunks no manifest names (a put killed between its chunks and its manifest)
    for cls, keys in enumerate(chunks):
        for k in keys:
            if oid_of(k) not in seg._by_oid:
                seg.classes[cls].store.remove(k)
    return back, dropped


def _pin_all(store: Store, meta: ObjectMeta) -> bool:
    pinned = 0
    try:
        for i in range(meta.nchunks):
            store.pin(chunk_key(meta.oid, i))
            pinned += 1
    except Exception:  # noqa: BLE001 - no DRAM left for the pins: the object cannot be kept pinned
        for i in range(pinned):
            store.unpin(chunk_key(meta.oid, i))
        return False
    return True
