"""Framing: msgpack messages on a stream socket, one frame each.

A frame is a 4-byte big-endian body length, then the msgpack body of one message of a
tagged union of ``msgspec.Struct`` types (the serving protocol's, the client protocol's,
the pool's: each link says which union it carries). A frame longer than the codec's
``max_frame`` is refused before its body is read.

Decoding never runs code from the peer (no pickle): the decoder builds only the union's
types, with their declared field types. Whatever is wrong with a frame (too long,
truncated, not msgpack, an unknown op, a field of the wrong type) raises
``ProtocolError``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from ..errors import MooncakeError

__all__ = ["MAX_FRAME", "HEADER_BYTES", "ProtocolError", "Codec", "op_of", "read_message"]

#: the longest frame a reader accepts by default (a 4,096-token prompt is ~20 KB; store
#: event batches of a large arena a few MB)
MAX_FRAME = 16 << 20
_HDR = struct.Struct("!I")
HEADER_BYTES = _HDR.size


class ProtocolError(MooncakeError):
    """A control frame that is not a valid message of this protocol (oversized,
    truncated, not msgpack, unknown op, wrong field types, wrong version)."""


_OPS: dict[type, str] = {}


def op_of(msg: Any) -> str:
    """The op tag of a message (a counter key; the class name for other objects)."""
    t = type(msg)
    op = _OPS.get(t)
    if op is None:
        tag = t.__struct_config__.tag if isinstance(msg, msgspec.Struct) else None
        op = _OPS[t] = tag if isinstance(tag, str) else t.__name__
    return op


class Codec:
    """Frames the messages of one tagged union for one link. Not shared between threads
    (one per reader, one per sender under its lock)."""

    def __init__(self, types: Any, max_frame: int = MAX_FRAME) -> None:
        """``types``: the tagged union this link carries."""
        self.max_frame = max_frame
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(types)

    def encode(self, msg: Any) -> bytes:
        body = self._enc.encode(msg)
        if len(body) > self.max_frame:
            raise ProtocolError(f"a {op_of(msg)} message of {len(body)} bytes exceeds the frame limit "
                                f"({self.max_frame})")
        return _HDR.pack(len(body)) + body

    def body_length(self, header: bytes) -> int:
        """The body length a frame header announces; ``ProtocolError`` past the limit."""
        if len(header) != _HDR.size:
            raise ProtocolError(f"truncated frame header ({len(header)} of {_HDR.size} bytes)")
        (n,) = _HDR.unpack(header)
        if n > self.max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds the limit ({self.max_frame})")
        return n

    def decode_body(self, body: bytes) -> Any:
        try:
            return self._dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"malformed control message: {e}") from None
        except (ValueError, TypeError, OverflowError, RecursionError, UnicodeDecodeError) as e:
            raise ProtocolError(f"malformed control message: {type(e).__name__}: {e}") from None

    def decode(self, frame: bytes) -> Any:
        """One whole frame (header + body) -> its message."""
        n = self.body_length(bytes(frame[:_HDR.size]))
        body = frame[_HDR.size:]
        if len(body) != n:
            raise ProtocolError(f"frame announces {n} body bytes, has {len(body)}")
        return self.decode_body(bytes(body))


def _recv_exact(sock: Any, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_message(sock: Any, codec: Codec) -> Any:
    """The next message on ``sock`` (a socket, or what stands for one: ``recv``); None
    when the peer closed it (also mid-frame: a peer that dies while writing). Raises
    ``ProtocolError`` for a bad frame."""
    hdr = _recv_exact(sock, HEADER_BYTES)
    if hdr is None:
        return None
    n = codec.body_length(hdr)
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return codec.decode_body(body)
