"""Reading one framed message off a blocking connection (the pool's server and client):
a plain socket or net's SealedSocket (its ``recv`` opens the AES-GCM records that carry
every byte after the handshake)."""

from __future__ import annotations

from typing import Any

from ...net.framing import Codec, read_message

__all__ = ["recv_message"]


def recv_message(sock: Any, codec: Codec) -> Any:
    """One message; ``ConnectionError`` at EOF, ``ProtocolError`` for a bad frame."""
    msg = read_message(sock, codec)
    if msg is None:
        raise ConnectionError("the peer closed the connection")
    return msg
