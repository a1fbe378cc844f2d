"""Reading one framed message off a blocking connection (the pool's server and client):
a plain socket or the deploy layer's SealedSocket (its ``recv`` opens the AES-GCM records
that carry every byte after the handshake)."""

from __future__ import annotations

from typing import Any

from ...serving.protocol import HEADER_BYTES, Codec

__all__ = ["recv_message", "recv_exact"]


def recv_exact(sock: Any, n: int) -> bytes:
    parts = []
    got = 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_message(sock: Any, codec: Codec) -> Any:
    """One message; ``ConnectionError`` at EOF, ``ProtocolError`` for a bad frame."""
    n = codec.body_length(recv_exact(sock, HEADER_BYTES))
    return codec.decode_body(recv_exact(sock, n))
