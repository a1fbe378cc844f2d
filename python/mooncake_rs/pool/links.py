"""A client's connection to one store node: the authenticated control socket and the
transfer engine's peer for the node's segment.

The socket is pipelined: any number of requests may be in flight, from any threads. Each
carries an id (``rid``); one reader thread per link hands each answer to the request that
has its id (the node answers in the order it read, but nothing here relies on it). So a
batch can ask several nodes at once and go on with its transfers while a ``Release`` is
still on the wire, and threads that share a client do not queue behind each other's
round trips.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import Any

from .._core import TransferEngine
from ..deploy import auth_socket
from ..errors import InvalidArgument, MooncakeError
from .members import StoreNodeRecord
from .protocol import Failure, FrameIO, Reply

__all__ = ["NodeLink", "NodeDown", "Pending"]

log = logging.getLogger("mooncake_rs.pool")


class NodeDown(Exception):
    """The node could not be asked (unreachable, closed, timed out, malformed answer)."""


class Pending:
    """The answer to one request, once the link's reader has it."""

    __slots__ = ("_link", "_rid", "_done", "_reply", "_error")

    def __init__(self, link: "NodeLink", rid: int) -> None:
        self._link, self._rid = link, rid
        self._done = threading.Event()
        self._reply: Any = None
        self._error: NodeDown | None = None

    def _set(self, reply: Any = None, error: NodeDown | None = None) -> None:
        self._reply, self._error = reply, error
        self._done.set()

    @property
    def link(self) -> "NodeLink":
        return self._link

    def result(self) -> Any:
        """The answer; NodeDown if the link broke, timed out or the node refused."""
        link = self._link
        if not self._done.wait(link.timeout_s):
            link._fail(f"no answer to request {self._rid} within {link.timeout_s} s")
        if self._error is not None:
            raise self._error
        reply = self._reply
        if isinstance(reply, Failure):
            raise NodeDown(f"store node {link.record.name} refused: {reply.kind}: {reply.message}")
        return reply


class NodeLink:
    def __init__(self, record: StoreNodeRecord, token: str | bytes, te: TransferEngine, timeout_s: float) -> None:
        self.record = record
        self.timeout_s = timeout_s
        try:
            self.sock = auth_socket.connect(record.control, token, timeout_s=timeout_s)
            # the reader blocks until an answer or the close; waits are bounded by Pending.result
            self.sock.settimeout(None)
            self.peer = te.connect(f"store-{record.name}", record.transfer)
        except (MooncakeError, OSError) as e:
            raise NodeDown(f"store node {record.name} at {record.control}: {e}") from e
        self.io = FrameIO(self.sock, Reply)
        self._lock = threading.Lock()  # the table of requests in flight, and the order of sends
        self._waiting: dict[int, Pending] = {}
        self._rids = itertools.count(1)
        self.broken = False
        self._reader = threading.Thread(target=self._read, name=f"mooncake-pool-link-{record.name}", daemon=True)
        self._reader.start()

    def submit(self, make: type, **fields: object) -> Pending:
        """Sends ``make(rid=..., **fields)`` now; the answer comes with ``.result()``."""
        return self._send(make, True, fields)  # type: ignore[return-value]

    def post(self, make: type, **fields: object) -> None:
        """Sends a request whose answer nobody waits for (its reader drops it)."""
        self._send(make, False, fields)

    def call(self, make: type, **fields: object) -> Any:
        """Sends ``make(rid=..., **fields)`` and returns the answer."""
        return self.submit(make, **fields).result()

    def _send(self, make: type, wait: bool, fields: dict[str, object]) -> Pending | None:
        with self._lock:
            if self.broken:
                raise NodeDown(f"store node {self.record.name}: link closed")
            rid = next(self._rids)
            pending = Pending(self, rid) if wait else None
            if pending is not None:
                self._waiting[rid] = pending
            try:
                # under the lock: frames leave whole and in rid order
                self.io.send(make(rid=rid, **fields))
            except (OSError, InvalidArgument) as e:
                failed = f"{type(e).__name__}: {e}"
            else:
                return pending
        self._fail(failed)
        raise NodeDown(f"store node {self.record.name}: {failed}")

    def _read(self) -> None:
        why = "link closed"
        try:
            while True:
                reply = self.io.recv()
                with self._lock:
                    pending = self._waiting.pop(getattr(reply, "rid", -1), None)
                if pending is not None:
                    pending._set(reply)
                elif isinstance(reply, Failure):  # a posted request the node refused
                    log.warning("store node %s refused request %s: %s: %s", self.record.name, reply.rid, reply.kind,
                                reply.message)
        except (OSError, EOFError, socket.timeout, InvalidArgument) as e:
            why = f"{type(e).__name__}: {e}"
        self._fail(why)

    def _fail(self, why: str) -> None:
        """Breaks the link: every request in flight ends with NodeDown."""
        with self._lock:
            self.broken = True
            waiting, self._waiting = self._waiting, {}
        for p in waiting.values():
            p._set(error=NodeDown(f"store node {self.record.name}: {why}"))
        self._shut()

    def _shut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        self._fail("link closed")
