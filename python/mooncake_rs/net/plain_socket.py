"""Plaintext TCP control connections, for deployments that chose no cluster token (a
trusted network, as Mooncake Store's own TCP transport assumes).

Nothing here authenticates or protects anything: it exists so that a pool can run
like for like with a plaintext store, and it is only ever used when the operator asked
for it by name (``mooncake-rs store --plaintext``, ``DistributedStore.connect(...,
plaintext=True)``). Both ends exchange a four-byte hello first, so a plaintext client
that reaches a node holding a token (or the other way round) fails at once with a
message that says which side to change, instead of hanging on frames it cannot read:

    server -> client   PLAIN_MAGIC (4)        (a token-holding listener sends auth_socket.MAGIC)
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from ..errors import InvalidArgument, ServiceUnavailable, Unauthorized
from .auth_socket import MAGIC, PLAIN_MAGIC

__all__ = ["connect_plain", "PlainListener", "PLAIN_MAGIC"]

log = logging.getLogger("mooncake_rs.deploy")


def connect_plain(address: str, timeout_s: float = 5.0) -> socket.socket:
    """A plaintext connection to ``HOST:PORT`` of a ``PlainListener`` (blocking, no
    timeout set). ``Unauthorized`` when the endpoint holds a cluster token instead."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"expected HOST:PORT, got {address!r}")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as e:
        raise ServiceUnavailable(f"cannot connect to {address}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = b""
        deadline = time.monotonic() + timeout_s
        while len(hello) < len(PLAIN_MAGIC):
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(len(PLAIN_MAGIC) - len(hello))
            if not chunk:
                raise ServiceUnavailable(f"{address} closed the connection before its hello")
            hello += chunk
        if hello == MAGIC:
            raise Unauthorized(f"{address} requires the cluster token; connect with auth_token "
                               "(or start the node with --plaintext)")
        if hello != PLAIN_MAGIC:
            raise Unauthorized(f"{address} is not a mooncake_rs plaintext control endpoint")
        sock.settimeout(None)
        return sock
    except (Unauthorized, ServiceUnavailable):
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise ServiceUnavailable(f"hello from {address} failed: {e}") from e


class PlainListener:
    """Accepts connections on ``host:port`` (0: any free port; see ``address``), sends the
    plaintext hello and hands each socket to ``on_connection(sock, peer)`` on a thread of
    its own. The same interface as ``auth_socket.AuthListener`` without the token."""

    def __init__(self, host: str, port: int, on_connection: Callable[[socket.socket, str], None]) -> None:
        self._on_connection = on_connection
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise InvalidArgument(f"cannot listen on {host}:{port}: {e}") from e
        h, p = self._sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self.refused = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"mooncake-plain-{p}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            if self._closed:
                conn.close()
                return
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(target=self._start, args=(conn, peer), name="mooncake-plain-conn", daemon=True).start()

    def _start(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(PLAIN_MAGIC)
        except OSError as e:
            log.warning("plaintext control connection from %s dropped: %s", peer, e)
            conn.close()
            return
        self._on_connection(conn, peer)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2)

    def __enter__(self) -> "PlainListener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
