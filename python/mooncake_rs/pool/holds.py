"""What one client connection holds on a store node: reservations (slots its transfer
engine writes, then commits) and leases (slots it reads, then releases), and, on a node
with a lease deadline (``--lease-ttl``), the transfer grants that let that client's
engine, and only it, reach exactly those slots.

Why grants: the bytes move one-sided, over the transfer engine, without the node's
control thread. When a hung client's hold ends on the node's clock, freeing its slots
is safe only if the engine itself refuses that client's late reads and writes of them;
else a read that comes late would return the bytes of whichever object took the slots
next, and a late write would corrupt it. So the node's regions are registered
``restricted`` and every hold grants its slot runs to the client's engine name; when
the hold ends (commit, release, expiry or the connection's close) its grants are
revoked first, and an expired hold's slots are given back only ``GRACE_S`` later (a
request the engine checked just before the revoke finishes its slice copy in well under
that).

A hold's deadline is renewed by use: any request on the connection moves every hold of
that connection to ``ttl_s`` from now. A client that stops talking (hung, stopped, its
connection still open) loses them ``ttl_s`` after its last request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Union

from .._core import Region, TransferEngine
from .objects import Lease, Reservation

__all__ = ["ConnHolds", "GRACE_S", "slot_runs"]

log = logging.getLogger("mooncake_rs.pool")

#: how long an expired hold's slots stay unused after its grants were revoked
GRACE_S = 1.0

#: how many outcomes of landed groups a connection keeps for its client's Commit
OUTCOMES_KEPT = 4096

Held = Union[Reservation, Lease]


def slot_runs(offsets: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of consecutive slots: one grant covers each run, so
    a client request spanning consecutive chunks (object_layout.rs) falls inside one grant."""
    runs: list[tuple[int, int]] = []
    for off in offsets:
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + chunk_bytes)
        else:
            runs.append((off, chunk_bytes))
    return runs


class ConnHolds:
    """The holds of one connection. ``te`` / ``ttl_s`` None / 0: holds end only with the
    connection (no grants, no deadline)."""

    def __init__(self, te: TransferEngine | None, ttl_s: float, free: Callable[[Held], None],
                 ended: Callable[[list[int]], object] | None = None) -> None:
        self._te = te if ttl_s > 0 else None
        self.ttl_s = ttl_s
        self._free = free  # (held) -> None: aborts a reservation / releases a lease
        # (reservation ids) -> _: told of the reservations that leave this connection
        # (taken by a Commit or a landing, expired, or the connection closed), so nothing
        # waits for their bytes any more; one call a batch
        self._ended = ended
        # reservation id -> its status when its group landed and was not all published, kept
        # for the client's Commit of it (node.py ``_landed``); bounded, dropped with the connection
        self._outcomes: dict[int, int] = {}
        # reservation ids of the spare slots not yet named by a Bind (node.py ``_spares``)
        self._spares: set[int] = set()
        self._lock = threading.Lock()  # the serving thread and the node's reaper
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self._grants: dict[int, list[tuple[Region, int]]] = {}  # hold id -> (region, grant id)
        self._expired: list[tuple[float, Held]] = []  # (free at, hold): grants revoked, slots not yet given back
        self.engine = ""  # the client's transfer engine name, from its requests
        self.last_use = time.monotonic()
        self.expired_holds = 0

    @property
    def granting(self) -> bool:
        return self._te is not None

    def touch(self) -> None:
        self.last_use = time.monotonic()

    def hold(self, hid: int, held: Held, region: Region, chunk_bytes: int, write: bool) -> None:
        """Records a reservation (``write``) or a lease under id ``hid``, granting its slots
        to the client's engine when the node has a deadline (``hold_many`` of one)."""
        self.hold_many([(hid, held, region, chunk_bytes)], write)

    def hold_many(self, holds: Sequence[tuple[int, Held, Region, int]], write: bool, spare: bool = False) -> None:
        """Records a batch of reservations (``write``) or leases ``(id, held, region,
        chunk_bytes)`` under one lock (a node's request of 32 objects took the lock 32
        times), granting their slots to the client's engine when the node has a deadline;
        all or none: when a grant fails, the batch's grants are revoked and nothing is
        recorded. ``spare``: reservations of spare slots, unbound until ``bind_spares``."""
        grants: dict[int, list[tuple[Region, int]]] = {}
        if self._te is not None:
            try:
                for hid, held, region, chunk_bytes in holds:
                    mine = grants.setdefault(hid, [])
                    for off, n in slot_runs(held.offsets, chunk_bytes):
                        mine.append((region, self._te.grant(region, self.engine, off, n, write=write)))
            except Exception:
                for mine in grants.values():
                    for r, gid in mine:
                        self._te.revoke(r, self.engine, gid)
                raise
        with self._lock:
            table = self.reservations if write else self.leases
            for hid, held, _, _ in holds:
                table[hid] = held  # type: ignore[assignment]
            if spare:
                self._spares.update(hid for hid, _, _, _ in holds)
            if grants:
                self._grants.update(grants)

    def take_reservations(self, pids: list[int]) -> list[Reservation | None]:
        """Takes a batch of reservations out (None for an unknown or expired id) under one
        lock, and revokes their slots' grants."""
        with self._lock:
            pop = self.reservations.pop
            taken = [pop(pid, None) for pid in pids]
            if self._spares:
                self._spares.difference_update(pids)
            if self._grants:
                gpop = self._grants.pop
                grants = [g for pid, res in zip(pids, taken) if res is not None for g in gpop(pid, [])]
            else:
                grants = []
        if self._ended is not None:
            self._ended(pids)
        for region, gid in grants:
            try:
                self._te.revoke(region, self.engine, gid)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - the engine closed: nothing reaches the slots any more
                log.debug("revoke of grant %s failed: %s", gid, e)
        return taken

    def bind_spares(self, pids: list[int]) -> list[Reservation] | None:
        """The spare reservations ``pids``, which stay held and are no longer spare (a Bind
        names their keys); None, changing nothing, unless every one is an unbound spare of
        this connection (given, not expired, not bound or given back already)."""
        with self._lock:
            spares = self._spares
            if len(set(pids)) != len(pids) or not all(pid in spares for pid in pids):
                return None
            spares.difference_update(pids)
            return [self.reservations[pid] for pid in pids]

    @property
    def spare_count(self) -> int:
        return len(self._spares)

    @property
    def spare_bytes(self) -> int:
        """The bytes of the objects the spare slots are for."""
        with self._lock:
            return sum(self.reservations[pid].meta.size for pid in self._spares)

    def note_outcomes(self, statuses: dict[int, int]) -> None:
        """The reservations of a group that landed, not all of them published (node.py
        ``_landed``): the client's Commit of each gets its status (``take_outcome``)."""
        with self._lock:
            for pid, st in statuses.items():
                if len(self._outcomes) >= OUTCOMES_KEPT:  # a client that never asks: oldest first out
                    self._outcomes.pop(next(iter(self._outcomes)))
                self._outcomes[pid] = st

    def take_outcome(self, pid: int) -> int | None:
        with self._lock:
            return self._outcomes.pop(pid, None) if self._outcomes else None

    def take_reservation(self, pid: int) -> Reservation | None:
        return self.take_reservations([pid])[0]

    def take_lease(self, lid: int) -> Lease | None:
        with self._lock:
            lease = self.leases.pop(lid, None)
        if lease is not None:
            self._revoke(lid)
        return lease

    def _revoke(self, hid: int) -> None:
        with self._lock:
            grants = self._grants.pop(hid, [])
        for region, gid in grants:
            try:
                self._te.revoke(region, self.engine, gid)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - the engine closed: nothing reaches the slots any more
                log.debug("revoke of grant %s failed: %s", gid, e)

    def expire(self, now: float) -> int:
        """The node's reaper: ends every hold of a connection silent for ``ttl_s`` (grants
        revoked now, slots given back ``GRACE_S`` later) and gives back those whose grace
        passed. Returns how many holds ended now."""
        ended: list[tuple[int, Held]] = []
        with self._lock:
            if self.ttl_s > 0 and now - self.last_use > self.ttl_s and (self.reservations or self.leases):
                ended = [*self.reservations.items(), *self.leases.items()]
                self.reservations, self.leases = {}, {}
                self._spares = set()
            due = [h for t, h in self._expired if t <= now]
            self._expired = [(t, h) for t, h in self._expired if t > now]
        for hid, held in ended:
            self._revoke(hid)
        self._tell_ended(ended)
        if ended:
            with self._lock:
                self._expired.extend((now + GRACE_S, held) for _, held in ended)
            self.expired_holds += len(ended)
            log.warning("store node: a client (engine %r) silent for %.1f s lost %d holds", self.engine,
                        now - self.last_use, len(ended))
        for held in due:
            self._free(held)
        return len(ended)

    def close(self) -> None:
        """The connection ended: every hold is revoked and given back at once."""
        with self._lock:
            held: list[tuple[int, Held]] = [*self.reservations.items(), *self.leases.items()]
            self.reservations, self.leases = {}, {}
            self._spares = set()
            late = [h for _, h in self._expired]
            self._expired = []
            self._outcomes = {}
        for hid, h in held:
            self._revoke(hid)
        self._tell_ended(held)
        for h in [h for _, h in held] + late:
            self._free(h)

    def _tell_ended(self, ended: list[tuple[int, Held]]) -> None:
        if self._ended is not None and ended:
            self._ended([hid for hid, held in ended if isinstance(held, Reservation)])
