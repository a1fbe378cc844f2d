"""The spare slots a store node holds for one client connection (protocol.py ``Spares``):
slots reserved for the client's next put of objects of one size, so that put writes into
them and names them with a ``Bind`` instead of asking a ``Reserve`` first (remote.py;
docs/store-service.md). One per ``NodeLink``; shared by the client's threads, each spare
taken by one caller."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from .node_down import NodeDown
from .protocol import Commit, Reserve, Spares

__all__ = ["SpareSlots"]

#: one spare: (put id, region, chunk bytes, slot offsets)
Spare = tuple[int, int, int, list[int]]


class _Answer(Protocol):
    def result(self) -> Any: ...


class _Link(Protocol):
    """What of its ``NodeLink`` (links.py) a ``SpareSlots`` uses."""

    def submit(self, make: type, **fields: object) -> _Answer: ...

    def post(self, make: type, **fields: object) -> None: ...


class SpareSlots:
    def __init__(self, link: _Link) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._held: list[Spare] = []
        self.size = 0  # the object size the held spares are for
        self._coming: _Answer | None = None  # the answer to ``ask``, not read yet
        self.last_put_size = 0  # the object size of the last put to the node (0: none, or mixed)

    def note_put(self, totals: list[int]) -> bool:
        """Records a put of objects of ``totals`` bytes to the node; whether they are all of
        one size and the last put's were too (a one-off put holds no spares for nothing).
        Spares held for another size, which this client has moved on from, are given back."""
        size, last = totals[0], self.last_put_size
        self.last_put_size = size if all(n == size for n in totals) else 0
        if self.size not in (0, size) and self.held(self.size):
            self.give_back(self.drop())
        return self.last_put_size != 0 and last == size

    def ask(self, count: int, size: int, engine: str) -> None:
        """Asks the node for ``count`` spare slots of ``size`` bytes (a ``Reserve`` of no
        key), unless an ask is in flight; the answer is read by the next ``take``. A put
        asks after its own writes ended, so the node reserves them between puts, not while
        the put's bytes stream in."""
        with self._lock:
            if self._coming is not None:
                return
            try:
                self._coming = self._link.submit(Reserve, keys=[], sizes=[], engine=engine, commit_on_landing=True,
                                                 spares=count, spare_size=size)
            except NodeDown:
                pass  # (the link broke: the next put finds out)

    def add(self, spares: Spares | None) -> None:
        """Keeps the spare slots a node's answer gave. Those held for another object size,
        which this client will not use, are given back."""
        if spares is None:
            return
        with self._lock:
            stale: list[int] = []
            if spares.size != self.size:
                stale, self._held = [e[0] for e in self._held], []
                self.size = spares.size
            self._held.extend(zip(spares.put_ids, spares.regions, spares.chunk_bytes, spares.offsets))
        if stale:
            self.give_back(stale)

    def take(self, count: int, size: int) -> list[Spare] | None:
        """``count`` spare slots for objects of ``size`` bytes, now this caller's alone;
        None when fewer are held (an ``ask``'s answer is read first: it has usually
        arrived since)."""
        self._collect()
        with self._lock:
            if size != self.size or len(self._held) < count:
                return None
            taken, self._held = self._held[:count], self._held[count:]
            return taken

    def held(self, size: int) -> int:
        """How many spares for objects of ``size`` bytes are held."""
        self._collect()
        with self._lock:
            return len(self._held) if size == self.size else 0

    def drop(self) -> list[int]:
        """Forgets every spare held; their ids (the caller gives them back)."""
        with self._lock:
            ids, self._held = [e[0] for e in self._held], []
            return ids

    def give_back(self, put_ids: list[int]) -> None:
        """Ends reservations nobody writes into (a ``Commit`` with ok false; its answer is
        not waited for)."""
        try:
            self._link.post(Commit, put_ids=put_ids, ok=[False] * len(put_ids))
        except NodeDown:
            pass  # (they went with the connection)

    def _collect(self) -> None:
        """Keeps the spares an ``ask``'s answer gave, once."""
        with self._lock:
            coming, self._coming = self._coming, None
        if coming is not None:
            try:
                self.add(coming.result().spares)
            except NodeDown:
                pass  # (refused or broken: no spares)
