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
#: what one ``recv`` of the wire asks for at least
_READ_AHEAD = 64 << 10


def session_keys(token: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """``(client -> server, server -> client)`` keys of one session. Distinct from the
    handshake's proofs (another label), so what the handshake showed on the wire reveals
    nothing about them."""
    def key(direction: bytes) -> bytes:
        return hmac.new(token, b"mooncake_rs control session v2 " + direction + server_nonce + client_nonce,
                        hashlib.sha256).digest()
    return key(b"c2s"), key(b"s2c")


class SealedSocket:
    """An authenticated socket whose stream is sealed. Any thread may ``sendall`` (one at
    a time, in order: the sequence numbers must match the bytes on the wire); one thread
    reads."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, peer: str = "") -> None:
        self._sock = sock
        self._sealer = RecordSealer(send_key)
        self._opener = RecordOpener(recv_key)
        self._send_lock = threading.Lock()
        self._buf = b""  # plaintext of the record being read, from _pos on
        self._pos = 0
        self._raw = b""  # wire bytes read ahead, from _raw_pos on
        self._raw_pos = 0
        self.peer = peer

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._send_lock:
            for start in range(0, len(view), _CHUNK):
                self._sock.sendall(self._sealer.seal(bytes(view[start:start + _CHUNK])))

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not yet handed out (plaintext, or wire bytes read
        ahead): while any, a ``recv`` may return without the socket becoming readable."""
        return len(self._buf) - self._pos + len(self._raw) - self._raw_pos

    def recv(self, n: int) -> bytes:
        """Up to ``n`` bytes of plaintext; b"" once the peer closed. A record that fails
        its check raises ``Unauthorized`` (an OSError: readers treat it as a lost link)."""
        while self._pos >= len(self._buf):  # (an empty record carries nothing: read on)
            if not self._fill():
                return b""
        out = self._buf[self._pos:self._pos + n]
        self._pos += len(out)
        return out

    def _need(self, n: int) -> bool:
        """At least ``n`` wire bytes buffered (False at the stream's end). Reads ahead: one
        ``recv`` brings a small record's header and body, not one call each. Nothing is
        consumed here, so a timeout in the middle of a record leaves the stream in step."""
        have = len(self._raw) - self._raw_pos
        if have >= n:
            return True
        parts = [self._raw[self._raw_pos:]] if have else []
        try:
            while have < n:
                chunk = self._sock.recv(max(n - have, _READ_AHEAD))
                if not chunk:
                    return False
                parts.append(chunk)
                have += len(chunk)
        finally:
            self._raw, self._raw_pos = b"".join(parts), 0
        return True

    def _fill(self) -> bool:
        if not self._need(_HEADER):
            return False
        at = self._raw_pos
        header = self._raw[at:at + _HEADER]
        try:
            body_len = RecordOpener.body_length(header)
            if not self._need(_HEADER + body_len):
                return False
            at = self._raw_pos  # (_need may have moved the buffer)
            body = self._raw[at + _HEADER:at + _HEADER + body_len]
            self._raw_pos = at + _HEADER + body_len  # consumed only when whole
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
