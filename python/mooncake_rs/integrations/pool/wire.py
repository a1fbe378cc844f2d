"""Reading one framed message off a blocking socket (the pool's server and client)."""

from __future__ import annotations

import socket
from typing import Any

from ...serving.protocol import HEADER_BYTES, Codec

__all__ = ["recv_message", "recv_exact"]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def recv_message(sock: socket.socket, codec: Codec) -> Any:
    """One message; ``ConnectionError`` at EOF, ``ProtocolError`` for a bad frame."""
    n = codec.body_length(recv_exact(sock, HEADER_BYTES))
    return codec.decode_body(recv_exact(sock, n))
