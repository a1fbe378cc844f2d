"""A client's connection to one store node: the authenticated control socket (one request
at a time) and the transfer engine's peer for the node's segment."""

from __future__ import annotations

import itertools
import socket
import threading
from typing import Any

from .._core import TransferEngine
from ..net import auth_socket
from ..errors import InvalidArgument, MooncakeError
from .members import StoreNodeRecord
from .protocol import Failure, FrameIO, Reply

__all__ = ["NodeLink", "NodeDown"]


class NodeDown(Exception):
    """The node could not be asked (unreachable, closed, timed out, malformed answer)."""


class NodeLink:
    def __init__(self, record: StoreNodeRecord, token: str | bytes, te: TransferEngine, timeout_s: float) -> None:
        self.record = record
        try:
            self.sock = auth_socket.connect(record.control, token, timeout_s=timeout_s)
            self.sock.settimeout(timeout_s)
            self.peer = te.connect(f"store-{record.name}", record.transfer)
        except (MooncakeError, OSError) as e:
            raise NodeDown(f"store node {record.name} at {record.control}: {e}") from e
        self.io = FrameIO(self.sock, Reply)
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self.broken = False

    def call(self, make: type, **fields: object) -> Any:
        """Sends ``make(rid=..., **fields)`` and returns the answer."""
        with self._lock:
            if self.broken:
                raise NodeDown(f"store node {self.record.name}: link closed")
            rid = next(self._rids)
            try:
                self.io.send(make(rid=rid, **fields))
                reply = self.io.recv()
            except (OSError, EOFError, socket.timeout, InvalidArgument) as e:
                self.close()
                raise NodeDown(f"store node {self.record.name}: {type(e).__name__}: {e}") from e
        if getattr(reply, "rid", None) != rid:
            self.close()
            raise NodeDown(f"store node {self.record.name} answered request {getattr(reply, 'rid', None)}, not {rid}")
        if isinstance(reply, Failure):
            raise NodeDown(f"store node {self.record.name} refused: {reply.kind}: {reply.message}")
        return reply

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass
