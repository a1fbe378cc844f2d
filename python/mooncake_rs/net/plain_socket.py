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

import socket
import time
from collections.abc import Callable

from ..errors import InvalidArgument, ServiceUnavailable, Unauthorized
from .auth_socket import MAGIC, PLAIN_MAGIC
from .listener import Listener

__all__ = ["connect_plain", "PlainListener", "PLAIN_MAGIC"]



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


class PlainListener(Listener):
    """Accepts connections on ``host:port`` (0: any free port; see ``address``), sends the
    plaintext hello and hands each socket to ``on_connection(sock, peer)`` on a thread of
    its own. The same interface as ``auth_socket.AuthListener`` without the token, and the
    same bound on connections still in their first exchange (``listener.Listener``)."""

    kind = "mooncake-plain"

    def __init__(self, host: str, port: int, on_connection: Callable[[socket.socket, str], None]) -> None:
        super().__init__(host, port, on_connection)

    def _greet(self, conn: socket.socket, peer: str, deadline: float) -> socket.socket:
        conn.sendall(PLAIN_MAGIC)
        return conn
