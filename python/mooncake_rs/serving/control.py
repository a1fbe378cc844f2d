"""Control links: how protocol messages (protocol.py) travel between the cluster, its
instances and instance peers. KV bytes never travel here.

A link delivers what it receives into a sink queue as ``(source, message)``; the
cluster has one sink (the router's events, tagged with the instance id), an instance
has one (its inbox: messages from the cluster, tagged ``CLUSTER``, and from its peers,
tagged with the peer's instance id). A link that closes (EOF, an error, a frame that
does not decode) posts ``Lost(reason)``: that is how a dead worker, or a dead peer, is
noticed. A reader that gets a bad frame, or a message that link must not carry, logs
why and closes that connection; it never raises into the process.

- ``QueueChannel``: in-process cluster <-> instance (queues; messages passed as objects).
- ``QueuePeer``: in-process instance -> instance.
- ``SocketChannel``: a stream socket (a ``socketpair`` made by the cluster at spawn)
  carrying length-prefixed msgpack frames, for worker processes: the control link and
  the peer links alike. It is net/channel.py's ``FramedChannel`` (the reader thread,
  ``Lost``, the framing) with the heartbeat and the cluster-side methods below.
- deploy/worker_link.py: a remote worker's ``ConductorLinks`` (its instance's channel)
  and ``RelayPeers`` (its peers, reached through the conductor).

Each kind implements a declared protocol, so no caller probes for a method: ``Link``
(what every link is: ``send``, ``counts``, ``alive``, ``close``), ``InstanceChannel``
(an instance's link to its cluster: ``recv``, ``beat``, ``adopt``, ``refuse_pending``)
and ``ControlLink`` (the cluster's end of it: ``to_instance``, ``cluster_counts``,
``last_seen``, ``last_beat``, ``fence``).

Every link counts the messages it sends, by op (``counts``): the hop count of
docs/serving.md is measured with them. A worker's control link also carries ``Beat``
every few seconds (worker.py): its reader only stamps ``last_seen``, which the
cluster's watchdog compares with ``heartbeat_timeout_s``, and keeps the latest one
(``last_beat``: the instance's KV and store use, the cluster's gauges). An in-process
instance's loop beats through ``QueueChannel.beat`` instead (no router trip).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ..net.channel import Counts, FramedChannel, Lost, get_from
from .protocol import Beat, Message, ProtocolError, Stop

__all__ = ["CLUSTER", "Lost", "Detached", "Counts", "Link", "InstanceChannel", "ControlLink", "QueueChannel",
           "QueuePeer", "SocketChannel"]

log = logging.getLogger("mooncake_rs.serving")

#: the source id of messages from the cluster in an instance's inbox
CLUSTER = -1


@dataclass(frozen=True)
class Detached:
    """To a remote worker's instance (deploy/): its conductor's link closed. Unlike a
    lost cluster link in a child process, this is no reason to exit: the worker drops
    what it holds for that conductor and waits for the next one to attach."""

    reason: str


class Link(Protocol):
    """Every link: where a message is sent, what it sent (by op), whether it is open."""

    counts: Counts
    alive: bool

    def send(self, msg: Any) -> None:
        """One message to the other end (dropped once the link is closed)."""

    def close(self) -> None: ...


class InstanceChannel(Link, Protocol):
    """An instance's link to its cluster (or conductor): ``send`` goes to the cluster,
    ``recv`` reads the instance's inbox (the cluster's messages and its peers')."""

    def recv(self, timeout: float | None) -> tuple[int, Any] | None:
        """The next ``(source, message)``; None after ``timeout`` (0: do not wait)."""

    def beat(self, msg: Beat) -> None:
        """The loop's heartbeat (in-process: stamped here; a worker's beat thread sends
        its own, so a socket's is a no-op)."""

    def adopt(self) -> None:
        """The instance took an ``Attach`` (a worker across hosts): its link is the one
        it serves from now on."""

    def refuse_pending(self, msg: Message) -> None:
        """Answers a pending ``Attach`` with ``msg`` and closes that link."""


class ControlLink(Protocol):
    """The cluster's end of an instance's control link."""

    counts: Counts
    alive: bool
    last_seen: float  # time.monotonic() of the instance's last sign of life
    last_beat: Beat | None  # its latest heartbeat (memory use, link counters)
    last_beat_at: float  # time.monotonic() here when that beat's link reading was taken

    @property
    def cluster_counts(self) -> Counts:
        """Messages the cluster sent on it (the same as ``counts`` on a socket, whose
        ends each count their own sends)."""

    def to_instance(self, msg: Message) -> None: ...

    def fence(self) -> None:
        """The instance was declared down: nothing it says from now on is taken."""

    def close(self) -> None: ...


def _not_across_hosts(what: str) -> None:
    raise ProtocolError(f"{what}: only a worker across hosts (deploy/) is attached by a conductor")


class QueueChannel:
    """In-process cluster <-> instance: the instance reads ``inbox``; what it sends lands
    in the cluster's event queue tagged with its id."""

    def __init__(self, instance_id: int, events: "queue.SimpleQueue[tuple[int, Any]]") -> None:
        self.instance_id = instance_id
        self.inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._events = events
        self.counts = Counts()  # sent by the instance
        self.cluster_counts = Counts()  # sent by the cluster
        self.last_seen = time.monotonic()
        self.last_beat: Beat | None = None  # the latest heartbeat (the instance's memory use)
        self.last_beat_at = 0.0  # when its link reading was taken (time.monotonic())
        self.fenced = False
        self.alive = True

    # instance side
    def recv(self, timeout: float | None) -> tuple[int, Any] | None:
        if self.fenced:
            return CLUSTER, Stop()
        return get_from(self.inbox, timeout)

    def beat(self, msg: Beat) -> None:
        """The instance loop's heartbeat: stamps ``last_seen`` here, without a trip
        through the router (nothing there needs it; the watchdog reads the stamp)."""
        self.last_beat = msg
        self.last_seen = self.last_beat_at = time.monotonic()

    def send(self, msg: Message) -> None:
        if self.fenced:  # declared down: what it says now would be about requests it lost
            return
        self.counts.add(msg)
        self._events.put((self.instance_id, msg))

    # cluster side
    def fence(self) -> None:
        """The instance was declared down (a crashed or wedged thread): from now on its
        reads return ``Stop`` and its sends are dropped, so a thread that wakes up exits
        at its next read instead of acting on requests the cluster has failed."""
        self.fenced = True

    def adopt(self) -> None:
        _not_across_hosts("adopt")

    def refuse_pending(self, msg: Message) -> None:
        _not_across_hosts("refuse_pending")

    def to_instance(self, msg: Message) -> None:
        self.cluster_counts.add(msg)
        self.inbox.put((CLUSTER, msg))

    def close(self) -> None:
        pass


class QueuePeer:
    """In-process instance -> instance: posts into the peer's inbox under our id."""

    def __init__(self, source_id: int, target: "queue.SimpleQueue[tuple[int, Any]]") -> None:
        self.source_id = source_id
        self._target = target
        self.counts = Counts()
        self.alive = True

    def send(self, msg: Message) -> None:
        self.counts.add(msg)
        self._target.put((self.source_id, msg))

    def close(self) -> None:
        self.alive = False


class SocketChannel(FramedChannel):
    """The serving protocol on a socket link (net/channel.py's ``FramedChannel``): a
    worker's control link and its peer links alike. Its reader takes the instance's
    ``Beat`` itself (``last_beat``, and ``last_seen`` as for any frame) and delivers the
    rest into ``sink``; ``to_instance`` / ``send`` write a frame (the cluster and the
    instance side share the framing); ``recv`` reads the sink (for a worker whose only
    link it is)."""

    log = log

    def __init__(self, sock: Any, source_id: int, sink: Any,
                 allowed: tuple[type, ...], name: str = "", types: Any = None) -> None:
        """As ``FramedChannel``; ``types``: the tagged union the link decodes (default:
        the serving protocol's ``Message``)."""
        self.last_beat: Beat | None = None  # the latest heartbeat received (the instance's memory use)
        self.last_beat_at = 0.0  # when its link reading was taken, on this host's clock (less its age)
        super().__init__(sock, source_id, sink, allowed, Message if types is None else types, name)

    def _taken(self, msg: Any) -> bool:
        if isinstance(msg, Beat):
            self.last_beat_at = self.last_seen - msg.link_age_s
            self.last_beat = msg
            return True
        return False

    to_instance = FramedChannel.send

    @property
    def cluster_counts(self) -> Counts:
        """The cluster's end counts what it sends in ``counts``."""
        return self.counts

    def fence(self) -> None:
        """A worker process is fenced by killing it (members.mark_down); a remote worker
        by closing this link (its conductor's ``on_down``)."""

    def beat(self, msg: Beat) -> None:
        pass  # a worker's beat thread sends its beats on this link (worker.py)

    def adopt(self) -> None:
        _not_across_hosts("adopt")

    def refuse_pending(self, msg: Message) -> None:
        _not_across_hosts("refuse_pending")
