"""Authenticated TCP connections for the control plane between hosts.

Both ends hold the cluster token (a shared secret, 16 bytes or more). Before either side
sends a control message, a mutual challenge-response proves that the other end holds it
too, without sending the token itself:

    server -> client   MAGIC (4) | version (1) | server nonce (32)
    client -> server   client nonce (32) | HMAC-SHA256(token, "c" | server nonce | client nonce)
    server -> client   HMAC-SHA256(token, "s" | client nonce | server nonce)

Fresh nonces on both sides make a recorded handshake useless to replay; the role bytes
keep one side's proof from being reflected as the other's. A client that fails sees
:class:`~mooncake_rs.errors.Unauthorized` (wrong token) or
:class:`~mooncake_rs.errors.ServiceUnavailable` (nothing listening, timeout); the server
logs the refusal with the peer's address and closes that connection only.

After the handshake both ends derive one key per direction from the token and both
nonces (sealed.py), and the connection is handed over as a :class:`SealedSocket`: every
byte that follows travels in AES-256-GCM records, so a relay that forwarded the
handshake can neither read nor change what follows (docs/deploy.md, threat model).

The listener bounds what unauthenticated peers can hold (listener.py): at most
``max_handshakes`` handshakes at once (the oldest is dropped to admit a new one), each with
a deadline, so a peer that connects and stays silent costs one slot for
``handshake_timeout_s``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable

from ..errors import InvalidArgument, ServiceUnavailable, Unauthorized
from .listener import Listener
from .sealed import SealedSocket, session_keys

__all__ = ["connect", "AuthListener", "MIN_TOKEN_BYTES"]

log = logging.getLogger("mooncake_rs.deploy")  # the name operators of a deployment filter on

MAGIC = b"MCRS"
#: what a plaintext listener (plain_socket.py) sends instead: told apart at once, not after a timeout
PLAIN_MAGIC = b"MCPT"
VERSION = 2  # 2: the stream after the handshake is sealed (sealed.py)
NONCE = 32
MAC = 32
MIN_TOKEN_BYTES = 16
_HELLO = len(MAGIC) + 1 + NONCE


def _token_bytes(token: str | bytes) -> bytes:
    t = token.encode() if isinstance(token, str) else bytes(token)
    if len(t) < MIN_TOKEN_BYTES:
        raise InvalidArgument(f"the cluster token must be at least {MIN_TOKEN_BYTES} bytes, got {len(t)} "
                              "(make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return t


def _mac(token: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, role + a + b, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        buf += chunk
    return bytes(buf)


def connect(address: str, token: str | bytes, timeout_s: float = 5.0) -> SealedSocket:
    """An authenticated, sealed connection to ``HOST:PORT`` (blocking, no timeout set)."""
    tok = _token_bytes(token)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"expected HOST:PORT, got {address!r}")
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as e:
        raise ServiceUnavailable(f"cannot connect to {address}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _recv_exact(sock, len(MAGIC), deadline)
        if hello == PLAIN_MAGIC:
            raise Unauthorized(f"{address} serves plaintext (started with --plaintext); connect without a token "
                               "(plaintext=True) or give the node the cluster token")
        hello += _recv_exact(sock, _HELLO - len(MAGIC), deadline)
        if hello[:4] != MAGIC:
            raise Unauthorized(f"{address} is not a mooncake_rs control endpoint")
        if hello[4] != VERSION:
            raise Unauthorized(f"{address} speaks handshake version {hello[4]}, this build {VERSION}")
        ns = hello[5:]
        nc = secrets.token_bytes(NONCE)
        sock.sendall(nc + _mac(tok, b"c", ns, nc))
        try:
            proof = _recv_exact(sock, MAC, deadline)
        except ConnectionError as e:
            raise Unauthorized(f"{address} refused the cluster token (wrong token?)") from e
        if not hmac.compare_digest(proof, _mac(tok, b"s", nc, ns)):
            raise Unauthorized(f"{address} does not hold the cluster token")
        sock.settimeout(None)
        c2s, s2c = session_keys(tok, ns, nc)
        return SealedSocket(sock, c2s, s2c, peer=address)
    except Unauthorized:  # an OSError (PermissionError) too: re-raised as it is
        sock.close()
        raise
    except (OSError, TimeoutError) as e:
        sock.close()
        raise ServiceUnavailable(f"handshake with {address} failed: {e}") from e
    except BaseException:
        sock.close()
        raise


class AuthListener(Listener):
    """Accepts connections on ``host:port`` (0: any free port; see ``address``) and hands
    each authenticated, sealed socket to ``on_connection(sock, peer)`` on the handshake's
    thread. At most ``max_handshakes`` handshakes at once, each within
    ``handshake_timeout_s`` (``listener.Listener``)."""

    kind = "mooncake-listen"

    def __init__(self, host: str, port: int, token: str | bytes,
                 on_connection: Callable[[SealedSocket, str], None], *,
                 handshake_timeout_s: float = 3.0, max_handshakes: int = 64) -> None:
        self._token = _token_bytes(token)
        self.handshake_timeout_s, self.max_handshakes = handshake_timeout_s, max_handshakes
        super().__init__(host, port, on_connection, timeout_s=handshake_timeout_s, max_pending=max_handshakes)

    def _greet(self, conn: socket.socket, peer: str, deadline: float) -> SealedSocket | None:
        ns = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + bytes([VERSION]) + ns)
        reply = _recv_exact(conn, NONCE + MAC, deadline)
        nc, proof = reply[:NONCE], reply[NONCE:]
        if not hmac.compare_digest(proof, _mac(self._token, b"c", ns, nc)):
            log.warning("control connection from %s refused: wrong cluster token", peer)
            return None
        conn.sendall(_mac(self._token, b"s", nc, ns))
        c2s, s2c = session_keys(self._token, ns, nc)
        return SealedSocket(conn, s2c, c2s, peer=peer)
