"""A remote worker's control side: the links conductors open to it, as one channel for
its ``Instance`` (the same ``recv`` / ``send`` a child worker's socket channel offers).

A conductor service (``serve``) connects to the worker's control address (an
authenticated socket, auth_socket.py) and sends ``Attach`` first. Only one conductor
is served at a time, the one whose ``Attach`` the instance took last: a new leader's
link replaces an old one (after a failover the old leader may still be connected for a
while: it is cut off once the new one attaches). The worker has no links to its peers:
a peer message goes to the conductor as ``Relay(peer, msg)`` and comes back the same
way (``peers``), so membership changes never touch the worker.

Messages of a link that is no longer current (or not yet adopted) are dropped at
``recv``: a stale ``Expect`` from a replaced conductor must not be taken for the new
one's, whose request ids start over. When the current link closes, the instance gets
``Detached`` and drops the requests it held (instance.py); the worker keeps running.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any, Iterator

from ..serving.control import CLUSTER, Counts, Detached, Lost, SocketChannel
from ..serving.protocol import TO_REMOTE, Attach, Message, Relay
from ..net.sealed import SealedSocket

__all__ = ["ConductorLinks", "RelayPeers"]

log = logging.getLogger("mooncake_rs.deploy")

#: the ``epoch`` of items the worker itself posts (a stop on SIGTERM): always delivered
LOCAL = 0


class _LinkSink:
    """What a link's reader puts into the worker's inbox: tagged with the link's epoch,
    a ``Relay`` unwrapped to its source peer, a closed link as ``Detached``."""

    def __init__(self, epoch: int, inbox: "queue.SimpleQueue[tuple[int, int, Any]]") -> None:
        self.epoch, self.inbox = epoch, inbox

    def put(self, item: tuple[int, Any]) -> None:
        _, msg = item
        if isinstance(msg, Relay):
            self.inbox.put((self.epoch, msg.peer, msg.msg))
        elif isinstance(msg, Lost):
            self.inbox.put((self.epoch, CLUSTER, Detached(msg.reason)))
        else:
            self.inbox.put((self.epoch, CLUSTER, msg))


class ConductorLinks:
    def __init__(self, name: str) -> None:
        self.name = name
        self.inbox: queue.SimpleQueue[tuple[int, int, Any]] = queue.SimpleQueue()
        self.counts = Counts()  # sent to the conductor (relayed peer messages too)
        self.peers = RelayPeers(self)
        self._lock = threading.Lock()
        self._epochs = itertools.count(LOCAL + 1)
        self._links: dict[int, SocketChannel] = {}
        self._current: int | None = None  # the epoch whose Attach the instance took
        self._pending: int | None = None  # a link that connected and has not been adopted yet
        self._closed = False

    # ---- the listener's side (AuthListener's on_connection, on its handshake thread)
    def accept(self, sock: SealedSocket, peer: str) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            epoch = next(self._epochs)
            stale, self._pending = self._pending, epoch
            link = SocketChannel(sock, CLUSTER, _LinkSink(epoch, self.inbox), TO_REMOTE,
                                 name=f"{self.name}<-conductor@{peer}")
            self._links[epoch] = link
        log.info("worker %s: a conductor connected from %s", self.name, peer)
        if stale is not None:  # connected, never attached: a newer one wins
            self._drop(stale)

    def _drop(self, epoch: int) -> None:
        with self._lock:
            link = self._links.pop(epoch, None)
        if link is not None:
            link.close()

    # ---- the instance's side
    def recv(self, timeout: float | None) -> tuple[int, Any] | None:
        while True:
            try:
                epoch, src, msg = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
            except queue.Empty:
                return None
            if epoch == LOCAL:
                return src, msg
            with self._lock:
                current = epoch == self._current
                pending = epoch == self._pending
                if current and isinstance(msg, Detached):
                    self._current = None
                    self._links.pop(epoch, None)
            if current or (pending and isinstance(msg, Attach)):
                return src, msg
            # else: a replaced link's leftovers (or a pending link that skipped Attach)

    def adopt(self) -> None:
        """The instance took the pending link's ``Attach``: it is the conductor now, and
        the link it replaces is closed."""
        with self._lock:
            old, self._current, self._pending = self._current, self._pending, None
        if old is not None and old != self._current:
            log.warning("worker %s: a new conductor attached; closing the link to the previous one", self.name)
            self._drop(old)

    def refuse_pending(self, msg: Message) -> None:
        """Answers the pending link's ``Attach`` with ``msg`` (``InitFailed``) and closes
        it; the current conductor, if any, stays."""
        with self._lock:
            epoch, self._pending = self._pending, None
            link = self._links.get(epoch) if epoch is not None else None
        if link is not None:
            log.warning("worker %s: refused an Attach: %r", self.name, msg)
            link.send(msg)
            self._drop(epoch)  # type: ignore[arg-type]

    def beat(self, msg: Any) -> None:
        pass  # the worker's beat thread sends its beats on this channel (deploy/worker.py)

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def attached(self) -> bool:
        return self._current is not None

    def send(self, msg: Message) -> None:
        """To the current conductor; dropped while none is attached (what the instance
        says then is about requests nobody waits for any more)."""
        with self._lock:
            link = self._links.get(self._current) if self._current is not None else None
        if link is not None:
            self.counts.add(msg)
            link.send(msg)

    def post_local(self, msg: Any) -> None:
        """A message of the worker's own (``Stop`` on SIGTERM), delivered whatever link."""
        self.inbox.put((LOCAL, CLUSTER, msg))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            self._current = self._pending = None
        for link in links:
            link.close()


class _RelayPeer:
    """A peer as the instance's roles see it (``send``, ``counts``): its messages go to the
    conductor wrapped in ``Relay``."""

    def __init__(self, peer: int, links: ConductorLinks) -> None:
        self.peer, self._links = peer, links
        self.counts = Counts()
        self.alive = True

    def send(self, msg: Message) -> None:
        self.counts.add(msg)
        self._links.send(Relay(self.peer, msg))  # type: ignore[arg-type]

    def close(self) -> None:
        self.alive = False


class RelayPeers:
    """The instance's peer table (``peers.get(id)``): every id is reachable through the
    conductor, which drops a message to an instance it no longer has (and fails that
    request itself)."""

    def __init__(self, links: ConductorLinks) -> None:
        self._links = links
        self._peers: dict[int, _RelayPeer] = {}

    def get(self, peer: int, default: Any = None) -> _RelayPeer:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _RelayPeer(peer, self._links)
        return p

    def __getitem__(self, peer: int) -> _RelayPeer:
        return self.get(peer)

    def values(self) -> list[_RelayPeer]:
        return list(self._peers.values())

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._peers))

    def __len__(self) -> int:
        return len(self._peers)
