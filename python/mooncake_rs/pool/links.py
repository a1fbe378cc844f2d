"""A client's connection to one store node: the authenticated control socket and the
transfer engine's peer for the node's segment.

The socket is pipelined: any number of requests may be in flight, from any threads. Each
carries an id (``rid``); whichever waiting thread is reading the socket hands each answer
to the request that has its id (the node answers in the order it read, but nothing here
relies on it). No reader thread: a lone caller reads its own answer, as a plain
request/response would (a hand-over to a reader thread cost ~20 us of CPU per round
trip). So a batch can ask several nodes at once and go on with its transfers while a
``Release`` is still on the wire, and threads that share a client do not queue behind
each other's round trips.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
from typing import Any

from .._core import TransferEngine
from ..net import auth_socket, plain_socket
from ..errors import InvalidArgument, MooncakeError
from .members import StoreNodeRecord
from .node_down import NodeDown
from .spare_slots import SpareSlots
from .protocol import Failure, FrameIO, Reply

__all__ = ["NodeLink", "NodeDown", "Pending"]

log = logging.getLogger("mooncake_rs.pool")


class Pending:
    """The answer to one request. Its ``result()`` reads the link itself when no other
    thread is reading it (no hand-over to a reader thread: a lone caller's round trip
    costs what a plain request/response does), else waits for the reader to pass the
    answer on, or to leave the reading to it."""

    __slots__ = ("_link", "_rid", "done", "_reply", "_error")

    def __init__(self, link: "NodeLink", rid: int) -> None:
        self._link, self._rid = link, rid
        self.done = False
        self._reply: Any = None
        self._error: NodeDown | None = None

    def _set(self, reply: Any = None, error: NodeDown | None = None) -> None:
        """Called with the link's condition held."""
        self._reply, self._error, self.done = reply, error, True

    @property
    def link(self) -> "NodeLink":
        return self._link

    def result(self) -> Any:
        """The answer; NodeDown if the link broke, timed out or the node refused."""
        link = self._link
        link._await(self)
        if self._error is not None:
            raise self._error
        reply = self._reply
        if isinstance(reply, Failure):
            raise NodeDown(f"store node {link.record.name} refused: {reply.kind}: {reply.message}")
        return reply


def _bound_io(sock: Any, timeout_s: float) -> None:
    """Bounds each read and write on ``sock`` to ``timeout_s`` (a node silent this long
    with a request in flight is down) with the kernel's own socket timeouts on a
    blocking socket: Python's ``settimeout`` would make every ``recv`` and ``sendall`` a
    ``poll`` and then the call, two system calls where one does (a small-key round trip
    is one send and one receive). A read that times out raises ``BlockingIOError``."""
    sock.settimeout(None)
    sec = max(int(timeout_s), 0)
    usec = max(int((timeout_s - sec) * 1e6), 0 if sec else 1000)  # never 0 s 0 us: that means "no limit"
    tv = struct.pack("ll", sec, usec)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class NodeLink:
    def __init__(self, record: StoreNodeRecord, token: str | bytes | None, te: TransferEngine,
                 timeout_s: float, spin_s: float = 0.0) -> None:
        """``token`` None: a plaintext node (net/plain_socket.py). ``spin_s``: how long a
        reader polls for the answer before it sleeps in ``recv`` (net/spin_wait.py)."""
        self.record = record
        self.timeout_s = timeout_s
        try:
            self.sock = (plain_socket.connect_plain(record.control, timeout_s=timeout_s) if token is None
                         else auth_socket.connect(record.control, token, timeout_s=timeout_s))
            _bound_io(self.sock, timeout_s)
            self.peer = te.connect(f"store-{record.name}", record.transfer)
        except (MooncakeError, OSError) as e:
            raise NodeDown(f"store node {record.name} at {record.control}: {e}") from e
        self.io = FrameIO(self.sock, Reply, spin_s=spin_s)
        self._send_lock = threading.Lock()  # frames leave whole
        # the table of requests in flight, and who reads. Taken as the plain lock where
        # nobody waits or is woken (a Condition's own ``with`` is Python code, several
        # microseconds a small-key call); ``_cond`` on the same lock for waiting
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._sleepers = 0  # threads in _cond.wait: a lone caller never notifies
        self._waiting: dict[int, Pending] = {}
        self._reading = False
        self._rids = itertools.count(1)
        self.broken = False
        # whether this engine's writes into the node's regions were last seen to go over
        # TCP, where the node sees them land (remote.py: a put then asks the node to publish
        # its objects as they land, Reserve.commit_on_landing). Known at once for a peer
        # reached over TCP alone; a same-host peer's (shm) regions may still route over TCP
        # (a node that shares no memory): False until a put has shown it
        self.writes_land = self.peer.transport == "tcp"
        # the spare slots the node holds for this connection (remote.py's puts into them)
        self.spares = SpareSlots(self)

    def submit(self, make: type, **fields: object) -> Pending:
        """Sends ``make(rid=..., **fields)`` now; the answer comes with ``.result()``."""
        return self._send(make, True, fields)  # type: ignore[return-value]

    def post(self, make: type, **fields: object) -> None:
        """Sends a request whose answer nobody waits for (the next reader drops it)."""
        self._send(make, False, fields)

    def call(self, make: type, **fields: object) -> Any:
        """Sends ``make(rid=..., **fields)`` and returns the answer. A caller that finds
        nobody reading and nothing in flight takes the reading at once and reads its own
        answer without a ``Pending`` in the table (what one small-key call pays for:
        two lock passes, not five); otherwise as ``submit(...).result()``."""
        with self._lock:
            if self.broken:
                raise NodeDown(f"store node {self.record.name}: link closed")
            if self._reading or self._waiting:
                lone = False
            else:
                lone = self._reading = True
                rid = next(self._rids)
        if not lone:
            return self.submit(make, **fields).result()
        try:
            self._send_frame(rid, make, fields)
            reply = self._recv_reply()
            while reply.rid != rid:  # (another thread's answer, or a posted request's: passed on)
                self._hand_over(reply)
                reply = self._recv_reply()
        finally:
            self._stop_reading()
        if reply.__class__ is Failure:
            raise NodeDown(f"store node {self.record.name} refused: {reply.kind}: {reply.message}")
        return reply

    def _recv_reply(self) -> Any:
        """The next answer off the link. A read that fails or times out breaks the link
        (``_fail``: every request in flight ends with NodeDown) and raises NodeDown."""
        try:
            return self.io.recv()
        except BlockingIOError:  # the socket's receive timeout (_bound_io)
            why, cause = f"the node sent nothing for {self.timeout_s} s with requests in flight", None
        except (OSError, EOFError, socket.timeout, InvalidArgument) as e:
            why, cause = f"{type(e).__name__}: {e}", e
        self._fail(why)
        raise NodeDown(f"store node {self.record.name}: {why}") from cause

    def _stop_reading(self) -> None:
        with self._lock:
            self._reading = False
            if self._sleepers:
                self._cond.notify_all()

    def _hand_over(self, reply: Any) -> None:
        """An answer read by the reading thread: to its waiter (the sleepers are woken: one
        of them may be it), or dropped (the answer to a posted request)."""
        with self._lock:
            waiter = self._waiting.pop(getattr(reply, "rid", -1), None)
            if waiter is not None:
                waiter._set(reply)
                if self._sleepers:
                    self._cond.notify_all()
        if waiter is None and isinstance(reply, Failure):  # a posted request the node refused
            log.warning("store node %s refused request %s: %s: %s", self.record.name, reply.rid, reply.kind,
                        reply.message)

    def _send(self, make: type, wait: bool, fields: dict[str, object]) -> Pending | None:
        with self._lock:
            if self.broken:
                raise NodeDown(f"store node {self.record.name}: link closed")
            rid = next(self._rids)
            pending = Pending(self, rid) if wait else None
            if pending is not None:
                self._waiting[rid] = pending
        self._send_frame(rid, make, fields)
        return pending

    def _send_frame(self, rid: int, make: type, fields: dict[str, object]) -> None:
        """Sends request ``rid`` whole. A send that fails breaks the link (``_fail``: every
        request in flight ends with NodeDown) and raises NodeDown."""
        try:
            with self._send_lock:
                self.io.send(make(rid=rid, **fields))
        except (OSError, InvalidArgument) as e:
            failed = f"{type(e).__name__}: {e}"
            self._fail(failed)
            raise NodeDown(f"store node {self.record.name}: {failed}") from e

    def _await(self, pending: Pending) -> None:
        """Until ``pending`` is answered (or the link fails): reads the socket while no
        other thread does, passing on each answer to the request with its id."""
        with self._lock:  # the usual case: answered already, or nobody reads: read ourselves
            if pending.done:
                return
            mine = not self._reading
            if mine:
                self._reading = True
        if mine:
            self._read_then_hand_over(pending)
            if pending.done:
                return
        end = time.monotonic() + self.timeout_s
        while True:
            with self._cond:
                while not pending.done and self._reading:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._sleepers += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._sleepers -= 1
                if pending.done:
                    return
                if self._reading:  # another thread reads, and our answer did not come in time
                    stuck = True
                else:
                    self._reading, stuck = True, False
            if stuck:
                self._fail(f"no answer to request {pending._rid} within {self.timeout_s} s")
                return
            self._read_then_hand_over(pending)

    def _read_then_hand_over(self, pending: Pending) -> None:
        """Reads (this thread holds ``_reading``) until ``pending`` is answered, then lets
        a waiting thread take over the reading."""
        try:
            self._read_until(pending)
        finally:
            self._stop_reading()

    def _read_until(self, pending: Pending) -> None:
        while not pending.done:
            try:
                reply = self._recv_reply()
            except NodeDown:  # (the link is broken: ``pending`` ended with it)
                return
            self._hand_over(reply)

    def _fail(self, why: str) -> None:
        """Breaks the link: every request in flight ends with NodeDown."""
        with self._cond:
            self.broken = True
            waiting, self._waiting = self._waiting, {}
            for p in waiting.values():
                p._set(error=NodeDown(f"store node {self.record.name}: {why}"))
            self._cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        self._fail("link closed")
