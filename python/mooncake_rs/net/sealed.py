"""A sealed session on an authenticated socket: after the handshake of auth_socket.py,
every byte either way travels in AES-256-GCM records (``_core.RecordSealer`` /
``RecordOpener``, rust/core/src/seal.rs) under keys bound to that handshake.

Why: the handshake proves that both ends hold the cluster token, but by itself binds
nothing that follows. A relay placed in etcd (as the leader, or as a worker's control
address) could forward a real handshake and then read every prompt and rewrite every
token. The keys here are derived from the token *and* both fresh nonces, one per
direction, and never sent: a relay without the token sees only ciphertext, and any byte
it changes, drops, replays or reorders fails the next record's tag, which closes the
connection (the peer sees the link lost; nothing forged is ever delivered).

``SealedSocket`` offers what the control links use of a socket (``sendall``, ``recv``,
``shutdown``, ``close``, ``settimeout`` ...), so the framing above it (serving/control.py)
is unchanged: a frame written with one ``sendall`` goes out as one record (or several of
at most 1 MiB), and ``recv`` hands back the plaintext of the records in order.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
from typing import Any

from .._core import RecordOpener, RecordSealer
from ..errors import Unauthorized

__all__ = ["SealedSocket", "session_keys"]

log = logging.getLogger("mooncake_rs.deploy")  # the name operators of a deployment filter on

#: plaintext per record (the core's bound is 1 MiB)
_CHUNK = 1 << 20
_HEADER = 4


def session_keys(token: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """``(client -> server, server -> client)`` keys of one session. Distinct from the
    handshake's proofs (another label), so what the handshake showed on the wire reveals
    nothing about them."""
    def key(direction: bytes) -> bytes:
        return hmac.new(token, b"mooncake_rs control session v2 " + direction + server_nonce + client_nonce,
                        hashlib.sha256).digest()
    return key(b"c2s"), key(b"s2c")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class SealedSocket:
    """An authenticated socket whose stream is sealed. Any thread may ``sendall`` (one at
    a time, in order: the sequence numbers must match the bytes on the wire); one thread
    reads."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, peer: str = "") -> None:
        self._sock = sock
        self._sealer = RecordSealer(send_key)
        self._opener = RecordOpener(recv_key)
        self._send_lock = threading.Lock()
        self._buf = b""
        self._pos = 0
        self.peer = peer

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._send_lock:
            for start in range(0, len(view), _CHUNK):
                self._sock.sendall(self._sealer.seal(bytes(view[start:start + _CHUNK])))

    def recv(self, n: int) -> bytes:
        """Up to ``n`` bytes of plaintext; b"" once the peer closed. A record that fails
        its check raises ``Unauthorized`` (an OSError: readers treat it as a lost link)."""
        while self._pos >= len(self._buf):  # (an empty record carries nothing: read on)
            if not self._fill():
                return b""
        out = self._buf[self._pos:self._pos + n]
        self._pos += len(out)
        return out

    def _fill(self) -> bool:
        header = _recv_exact(self._sock, _HEADER)
        if header is None:
            return False
        try:
            body_len = RecordOpener.body_length(header)
            body = _recv_exact(self._sock, body_len)
            if body is None:
                return False
            self._buf, self._pos = self._opener.open(header, body), 0
        except Unauthorized as e:
            log.warning("sealed session with %s broken: %s; closing it", self.peer or "a peer", e)
            raise
        return True

    # ---- the rest is the socket's
    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def __enter__(self) -> "SealedSocket":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # getpeername, setsockopt ...
        return getattr(self._sock, name)
