"""Control messages between the cluster and its instances.

Messages are small dicts (``{"op": ..., ...}``; KV bytes never travel here). In-process,
a channel is a pair of queues; with ``processes=True`` it is a local stream socket
(a ``socketpair`` shared with the worker at spawn) carrying length-prefixed pickles.
The cluster's side posts every message it receives, tagged with the instance id, into
one event queue; a closed socket posts ``{"op": "dead"}`` (how a dead worker is noticed).
A worker also sends ``{"op": "beat"}`` every few seconds (see worker.py): the reader
thread only stamps ``last_seen`` for it, which the cluster's watchdog compares with
``heartbeat_timeout_s`` (how a hung worker is noticed).
"""

from __future__ import annotations

import pickle
import queue
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["QueueChannel", "SocketChannel", "send_frame", "recv_frame"]

_HDR = struct.Struct("!I")
_MAX_FRAME = 256 * 1024 * 1024

Msg = dict[str, Any]


def send_frame(sock: socket.socket, msg: Msg) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HDR.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> Msg | None:
    """The next message, or None when the peer closed the connection."""
    hdr = _recv_exact(sock, _HDR.size)
    if hdr is None:
        return None
    (n,) = _HDR.unpack(hdr)
    if n > _MAX_FRAME:
        raise ConnectionError(f"control frame of {n} bytes exceeds the limit")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    msg = pickle.loads(body)
    if not isinstance(msg, dict) or "op" not in msg:
        raise ConnectionError("malformed control message")
    return msg


def _get(q: "queue.Queue[Msg]", timeout: float | None) -> Msg | None:
    """The next message of ``q``: waits up to ``timeout`` (None: forever, 0: not at all)."""
    try:
        return q.get(timeout=timeout) if timeout != 0 else q.get_nowait()
    except queue.Empty:
        return None


class QueueChannel:
    """In-process: the instance reads ``inbox``; what it sends lands in the cluster's queue."""

    def __init__(self, instance_id: int, events: "queue.Queue[tuple[int, Msg]]") -> None:
        self.instance_id = instance_id
        self.inbox: queue.Queue[Msg] = queue.Queue()
        self._events = events

    # instance side
    def recv(self, timeout: float | None) -> Msg | None:
        return _get(self.inbox, timeout)

    def send(self, msg: Msg) -> None:
        self._events.put((self.instance_id, msg))

    # cluster side
    def to_instance(self, msg: Msg) -> None:
        self.inbox.put(msg)

    def close(self) -> None:
        pass


class SocketChannel:
    """One end of the control socket; a reader thread feeds ``deliver`` with messages."""

    def __init__(self, sock: socket.socket, instance_id: int, events: "queue.Queue[tuple[int, Msg]] | None" = None) -> None:
        self.sock = sock
        self.instance_id = instance_id
        self._send_lock = threading.Lock()
        self.inbox: queue.Queue[Msg] = queue.Queue()
        self._events = events
        #: time.monotonic() of the last frame received (any op): the peer's liveness
        self.last_seen = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"mooncake-ctl-{instance_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = recv_frame(self.sock)
            except (OSError, ConnectionError, pickle.UnpicklingError, EOFError):
                msg = None
            if msg is None:
                msg = {"op": "dead"}
            else:
                self.last_seen = time.monotonic()
                if msg["op"] == "beat":
                    continue
            if self._events is not None:
                self._events.put((self.instance_id, msg))
            else:
                self.inbox.put(msg)
            if msg["op"] == "dead":
                return

    def _send(self, msg: Msg) -> None:
        with self._send_lock:
            try:
                send_frame(self.sock, msg)
            except OSError:
                pass  # the reader notices the closed socket and reports it

    # worker side (inbox) and cluster side (events) share the framing
    def recv(self, timeout: float | None) -> Msg | None:
        return _get(self.inbox, timeout)

    def send(self, msg: Msg) -> None:
        self._send(msg)

    def to_instance(self, msg: Msg) -> None:
        self._send(msg)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
