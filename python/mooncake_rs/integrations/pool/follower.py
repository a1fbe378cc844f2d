"""Which pool holds what: the store events of every followed pool feed one
:class:`~mooncake_rs.BlockIndex` (instance = pool), so a client can ask which pool holds
the longest prefix of a prompt without asking each.

Followed: the client's local pool, given ``peers``, any pool :meth:`follow` names (a P/D
request's), and with ``etcd`` every pool registered there (membership.py), looked up every
``discover_s``. Events are pulled (``Events(since)``) at most every ``poll_s`` from the
caller's own loop, so there is no thread; a pool that does not answer is skipped until the
next poll; when a pool's log dropped events this follower had not read (``start > since``),
that pool's entries are rebuilt from what the log still has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..._core import BlockHashes, BlockIndex
from ...errors import MooncakeError
from .client import PoolClient
from .membership import DEFAULT_PREFIX, pool_addresses

__all__ = ["PoolFollower"]

log = logging.getLogger("mooncake_rs.pool")

LocalEvents = Callable[[list[int], list[int]], None]


class PoolFollower:
    def __init__(self, local: str, client: Callable[[str], PoolClient], *, peers: tuple[str, ...] = (),
                 etcd: str | None = None, etcd_prefix: str = DEFAULT_PREFIX, poll_s: float = 0.2,
                 discover_s: float = 5.0, on_local_events: LocalEvents | None = None) -> None:
        self._client = client
        self.local = local
        self.etcd, self.etcd_prefix = etcd, etcd_prefix
        self.poll_s, self.discover_s = poll_s, discover_s
        self.on_local_events = on_local_events
        self.index = BlockIndex()
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next: dict[str, int] = {}
        self._last_poll = 0.0
        self._last_discover = float("-inf")
        self.follow(local)
        for p in peers:
            self.follow(p)

    @property
    def pools(self) -> list[str]:
        return list(self._ids)

    def follow(self, address: str) -> None:
        if address not in self._ids:
            i = len(self._ids)
            self._ids[address], self._names[i] = i, address
            self._next[address] = 0

    def best_pool(self, keys: BlockHashes) -> tuple[str, int] | None:
        """The followed pool holding the longest leading run of ``keys`` (by its events)."""
        self.poll()
        best = self.index.best_prefix(keys)
        return None if best is None else (self._names[best[0]], best[1])

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        if self.etcd and (force or now - self._last_discover >= self.discover_s):
            self._last_discover = now
            try:
                for address in pool_addresses(self.etcd, self.etcd_prefix):
                    self.follow(address)
            except MooncakeError as e:
                log.info("pool follower: etcd %s: %s", self.etcd, e)
        for address in list(self._ids):
            try:
                self._pull(address)
            except MooncakeError as e:
                log.debug("pool follower: events of %s: %s", address, e)

    def _pull(self, address: str) -> None:
        client = self._client(address)
        inst = self._ids[address]
        while True:
            batch = client.events(self._next[address])
            if batch.start > self._next[address]:
                self.index.remove_instance(inst)  # we missed some: start over from the log
            keys = BlockHashes(batch.keys)
            stored = [k for k, kind in zip(keys, batch.kinds) if kind in ("stored", "promoted")]
            gone = [k for k, kind in zip(keys, batch.kinds) if kind in ("evicted", "removed")]
            if stored:
                self.index.insert(inst, stored, "dram")
            if gone:
                self.index.remove(inst, gone)
            if address == self.local and self.on_local_events is not None and (stored or gone):
                self.on_local_events(stored, gone)
            self._next[address] = batch.next
            if batch.next == batch.start:
                return
