"""``FramedChannel``: one end of a stream socket carrying framed messages (framing.py),
with a reader thread that delivers what it receives into a sink.

The reader puts ``(source_id, message)`` into the sink for every message of the types
the link may carry (``allowed``); when the link closes (EOF, a socket error, a bad frame,
a message of a type it must not carry) it logs why for a bad frame, shuts the socket
down and posts ``Lost(reason)``: that is how a dead peer is noticed. It never raises
into the process. ``send`` writes one frame under a lock (several threads may send).

Serving's control link (serving/control.py ``SocketChannel``) is this channel with a
heartbeat the reader takes itself; a ``RemoteCluster`` (client/remote.py) and the
conductor service's client endpoint use it as it is, with the client protocol's union.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from .framing import Codec, ProtocolError, op_of, read_message

__all__ = ["Lost", "Counts", "FramedChannel", "get_from"]


@dataclass(frozen=True)
class Lost:
    """Posted by a link that closed: EOF, a socket error or a bad frame (``reason``)."""

    reason: str


class Counts:
    """Messages sent on one link, by op (thread-safe: a link may send from two threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: collections.Counter[str] = collections.Counter()

    def add(self, msg: Any) -> None:
        op = op_of(msg)
        with self._lock:
            self._c[op] += 1

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self._c)


def get_from(q: Any, timeout: float | None) -> Any:
    """The next item of ``q``: waits up to ``timeout`` (None: forever, 0: not at all)."""
    try:
        return q.get(timeout=timeout) if timeout != 0 else q.get_nowait()
    except queue.Empty:
        return None


class FramedChannel:
    """One end of a socket link; a reader thread delivers ``(source_id, msg)`` into
    ``sink`` for every message of the types in ``allowed``."""

    #: where a bad frame is logged (a subclass logs under its own layer's name)
    log = logging.getLogger("mooncake_rs.net")

    def __init__(self, sock: Any, source_id: int, sink: Any, allowed: tuple[type, ...], types: Any,
                 name: str = "") -> None:
        """``sock``: a socket, or what stands for one (``net.sealed.SealedSocket``:
        ``sendall``, ``recv``, ``shutdown``, ``close``). ``sink``: anything with
        ``put((source_id, msg))``. ``types``: the tagged union the link decodes."""
        self.sock = sock
        self.source_id = source_id
        self.name = name or f"link-{source_id}"
        self._allowed = allowed
        self._sink = sink
        self._types = types
        self._send_lock = threading.Lock()
        self._enc = Codec(types)
        self.counts = Counts()
        self.alive = True
        #: time.monotonic() of the last frame received (any op): the peer's liveness
        self.last_seen = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"mooncake-ctl-{self.name}", daemon=True)
        self._reader.start()

    def _taken(self, msg: Any) -> bool:
        """Whether the reader itself takes ``msg`` (not delivered to the sink): none here."""
        return False

    def _read(self) -> None:
        codec = Codec(self._types)
        reason = "closed"
        while True:
            try:
                msg = read_message(self.sock, codec)
            except ProtocolError as e:
                reason = f"bad frame: {e}"
                self.log.warning("%s: %s; closing the connection", self.name, reason)
                break
            except OSError as e:
                reason = f"{type(e).__name__}: {e}"
                break
            if msg is None:
                break
            self.last_seen = time.monotonic()
            if self._taken(msg):
                continue
            if not isinstance(msg, self._allowed):
                reason = f"bad frame: a {op_of(msg)} message is not expected on this link"
                self.log.warning("%s: %s; closing the connection", self.name, reason)
                break
            self._sink.put((self.source_id, msg))
        self.alive = False
        self._shutdown()
        self._sink.put((self.source_id, Lost(reason)))

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send(self, msg: Any) -> None:
        """One message of the link's union."""
        with self._send_lock:  # one writer at a time per socket (and per encoder)
            frame = self._enc.encode(msg)
            self.counts.add(msg)
            try:
                self.sock.sendall(frame)
            except OSError:
                pass  # the reader notices the closed socket and reports it

    def recv(self, timeout: float | None) -> tuple[int, Any] | None:
        """The sink's next item (for a link whose sink is a queue read by its owner)."""
        return get_from(self._sink, timeout)

    def close(self) -> None:
        self._shutdown()
        self.sock.close()
