"""Hot-prefix replication in the serving cluster: the conductor's replica hints acted on.

The conductor proposes (``Conductor.replication_hints``, docs/conductor.md
"Replication") to copy a prefix that many requests reuse and whose every holder is
busy — its queue is long, or its NIC out is backed up by KV streams, so fetching from it
is slow — from the holder that could serve it soonest to an idle prefill instance.
This module carries that out, with the same messages a request's prefix fetch uses:

1. ``Replicator.round`` (the router thread, every ``replicate_every_s`` or on
   ``Cluster.replicate_hot_prefixes``) takes the hints and, for each one that fits in
   ``replica_max_bytes`` together with the copies still in flight, sends the holder
   ``Export`` under a replication id (negative: never a request's): it pins the
   prefix's blocks and answers ``Exported`` with their arena offsets;
2. the router hands that to the target as ``Replicate``; ``ReplicaCopies`` (the
   target instance) reads the blocks into its store with a ``MultiFetch`` (the store's
   events then tell the conductor's index the target holds them) and answers
   ``Fetched``, whether the copy came in or not;
3. the router sends the holder ``Unpin``, and the bytes leave the in-flight count.

A holder or target that goes down drops its copies (the holder's pins go with it).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable

from .._core import BlockHashes
from .multisource import FetchSource, MultiFetch
from .protocol import Exported, Export, Failed, Fetch, Fetched, Message, Replicate, Unpin, pack_keys

__all__ = ["Replicator", "ReplicaCopies"]

log = logging.getLogger("mooncake_rs.serving")

#: replication ids count down from here (request ids are >= 0, transport tags are local)
_FIRST_ID = -(1 << 40)


@dataclass
class _Copy:
    holder: int
    target: int
    keys: bytes
    nbytes: float
    exported: bool = False


class Replicator:
    """The cluster's side (router thread only). ``send(instance, message)`` reaches an
    instance; ``block_bytes``: KV bytes of one block; ``max_bytes``: the cap of one
    round and of the copies in flight."""

    def __init__(self, send: Callable[[int, Message], None], block_bytes: Callable[[], float], max_bytes: float) -> None:
        self._send = send
        self._block_bytes = block_bytes
        self.max_bytes = float(max_bytes)
        self._ids = itertools.count(_FIRST_ID, -1)
        self.copies: dict[int, _Copy] = {}
        self.started = self.done = 0
        self.copied_bytes = 0.0

    def in_flight_bytes(self) -> float:
        return sum(c.nbytes for c in self.copies.values())

    def round(self, conductor: Any, now: float) -> int:
        """Acts on the conductor's hints at ``now`` (its clock); returns how many copies
        it started. A hint whose prefix is already on its way to that target, or that
        does not fit in the cap with what is in flight, waits for a later round."""
        if conductor is None:
            return 0
        budget = self.max_bytes - self.in_flight_bytes()
        on_way = {(c.target, c.keys[-16:]) for c in self.copies.values()}
        started = 0
        for h in conductor.replication_hints(now):
            keys = pack_keys(list(h.blocks))
            nbytes = len(h.blocks) * self._block_bytes()
            if (h.to_instance, keys[-16:]) in on_way or nbytes > budget:
                continue
            rid = next(self._ids)
            self.copies[rid] = _Copy(h.from_instance, h.to_instance, keys, nbytes)
            budget -= nbytes
            on_way.add((h.to_instance, keys[-16:]))
            self._send(h.from_instance, Export(rid, keys))
            started += 1
        self.started += started
        return started

    def owns(self, rid: Any) -> bool:
        return isinstance(rid, int) and rid in self.copies

    def on_message(self, src: int, msg: Exported | Fetched | Failed) -> None:
        """``Exported`` from the holder, ``Fetched`` / ``Failed`` from the target, for a
        copy this replicator :meth:`owns`."""
        rid = msg.rid
        if rid is None:  # a Failed of no request: never a copy's (owns(None) is False)
            return
        c = self.copies[rid]
        if isinstance(msg, Exported) and src == c.holder and not c.exported:
            n = len(msg.offsets)
            if n == 0:  # the holder no longer has it
                self._end(rid, copied=False)
                return
            c.exported = True
            keys = c.keys[:16 * n]
            self._send(c.target, Replicate(rid, Fetch(c.holder, msg.arena, list(msg.offsets), keys)))
        elif isinstance(msg, Fetched) and src == c.target:
            self._end(rid, copied=True)
        else:  # a Failed from either end
            self._end(rid, copied=False)

    def _end(self, rid: int, copied: bool) -> None:
        c = self.copies.pop(rid)
        self._send(c.holder, Unpin(rid))
        if copied:
            self.done += 1
            self.copied_bytes += c.nbytes

    def instance_down(self, inst: int) -> None:
        for rid, c in list(self.copies.items()):
            if inst in (c.holder, c.target):
                self.copies.pop(rid)
                if c.holder != inst:
                    self._send(c.holder, Unpin(rid))


class ReplicaCopies:
    """The target instance's side: each ``Replicate`` read into the store, driven from
    the instance loop (``poll``), then ``Fetched`` to the cluster."""

    def __init__(self, transport: Any, store: Any, up: Callable[[Message], None]) -> None:
        self.transport, self.store, self.up = transport, store, up
        self._live: dict[int, MultiFetch] = {}

    def start(self, msg: Replicate) -> None:
        f = msg.fetch
        mf = MultiFetch(self.transport, self.store, BlockHashes(f.keys).tolist(),
                        [FetchSource(f.holder, f.arena.as_dict(), f.offsets)])
        self._live[msg.rid] = mf
        mf.start()

    def poll(self) -> None:
        for rid, mf in list(self._live.items()):
            if not mf.poll():
                continue
            del self._live[rid]
            res = mf.finish()
            for b in res.blocks:  # committed to the store (or not, on an error): the copy holds nothing
                b.release()
            if res.error is not None:
                log.info("replica %d: the copy failed (%s)", rid, res.error)
            self.up(Fetched(rid))

    def drop_all(self) -> None:
        for mf in self._live.values():
            mf.abort()
        self._live.clear()
