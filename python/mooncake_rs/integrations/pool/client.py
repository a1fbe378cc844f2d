"""A connection to a KV pool (server.py): one request at a time, thread-safe.

Typed errors: the pool's refusals come back as the ``mooncake_rs.errors`` class it named;
a pool that is gone or does not answer within ``timeout_s`` is ``ServiceUnavailable``
(the connection is dropped and made again on the next call).
"""

from __future__ import annotations

import threading
from typing import Any

from ... import errors
from ...net.auth_socket import connect
from ...errors import ServiceUnavailable, Unauthorized
from ...net.framing import Codec, ProtocolError
from . import protocol as p
from .wire import recv_message

__all__ = ["PoolClient"]


class PoolClient:
    def __init__(self, address: str, auth_token: str, timeout_s: float = 5.0) -> None:
        self.address = address
        self._token = auth_token
        self.timeout_s = timeout_s
        self._codec = Codec(p.Reply)
        self._lock = threading.Lock()
        self._sock: Any = None  # a SealedSocket once connected

    def call(self, msg: Any) -> Any:
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = connect(self.address, self._token, timeout_s=self.timeout_s)
                    self._sock.settimeout(self.timeout_s)
                self._sock.sendall(self._codec.encode(msg))
                reply = recv_message(self._sock, self._codec)
            except (Unauthorized, ServiceUnavailable):  # typed already (Unauthorized is an OSError)
                self._drop()
                raise
            except (OSError, ConnectionError, ProtocolError) as e:
                self._drop()
                raise ServiceUnavailable(f"KV pool {self.address}: {type(e).__name__}: {e}") from e
            except BaseException:
                self._drop()
                raise
        if isinstance(reply, p.PoolError):
            cls = getattr(errors, reply.kind, None)
            if not (isinstance(cls, type) and issubclass(cls, errors.MooncakeError)):
                cls = errors.InternalError
            raise cls(f"KV pool {self.address}: {reply.message}")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    # typed shortcuts ------------------------------------------------------------

    def open(self, block_bytes: int, layout: str) -> p.Opened:
        r = self.call(p.Open(block_bytes, layout))
        assert isinstance(r, p.Opened)
        return r

    def lookup(self, keys: bytes, lease_s: float = 0.0) -> p.Found:
        r = self.call(p.Lookup(keys, lease_s))
        assert isinstance(r, p.Found)
        return r

    def release(self, lease: int) -> None:
        if lease:
            self.call(p.Release(lease))

    def reserve(self, keys: bytes, lease_s: float = 30.0) -> p.Reserved:
        r = self.call(p.Reserve(keys, lease_s))
        assert isinstance(r, p.Reserved)
        return r

    def commit(self, reservation: int, ok: list[bool], checksums: list[int] | None = None) -> int:
        r = self.call(p.Commit(reservation, ok, list(checksums or ())))
        assert isinstance(r, p.Committed)
        return r.stored

    def remove(self, keys: bytes, corrupt: bool = True) -> int:
        r = self.call(p.Remove(keys, corrupt))
        assert isinstance(r, p.Removed)
        return r.removed

    def events(self, since: int, limit: int = 65536) -> p.EventBatch:
        r = self.call(p.Events(since, limit))
        assert isinstance(r, p.EventBatch)
        return r

    def stats(self) -> dict[str, int]:
        r = self.call(p.PoolStats())
        assert isinstance(r, p.PoolStatsReply)
        return dict(r.stats)
