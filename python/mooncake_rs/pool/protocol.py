"""The control messages between a pool client and a store node.

A frame is a 4-byte big-endian length, then one msgpack-encoded message of the union
below (one ``msgspec.Struct`` per op, decoded strictly, never pickled). The connection is
authenticated first with the cluster token (net/auth_socket.py). Requests carry an id
(``rid``) that the answer repeats; a client may have many requests in flight on one
connection (links.py matches answers to requests by id); the node answers each in turn.
Bytes never travel here: they move over the transfer engine, into slots a ``Reserve``
answered or out of slots a ``Lookup`` leased.

Reservations and leases belong to the connection that made them: when it closes (the
client ended or died), the node aborts its reservations and releases its leases; on a
node with a lease deadline (holds.py) also when the connection stays silent that long.
"""

from __future__ import annotations

import socket
import struct
import typing
from typing import Any, Protocol, Union

import msgspec

from .._core import exists_flags
from ..errors import InvalidArgument
from ..net.spin_wait import SpinWait

__all__ = ["INLINE_MAX", "SPARE_BYTES_MAX", "Reserve", "Bind", "Spares", "Bound", "Commit", "PutInline", "Lookup",
           "GetValue", "Release", "Exists", "Sizes", "Remove", "RemoveAll", "Stats", "Value", "ExistsKeys", "Reserved",
           "Leased", "Answer", "FlagsAnswer", "Failure", "Request", "NodeRequest", "Reply", "FrameIO", "MAX_FRAME"]

MAX_FRAME = 64 << 20
#: values up to this size travel inside control messages (PutInline, Lookup.inline_max)
INLINE_MAX = 4096
#: the most bytes of spare slots (``Spares``) a node holds for one connection
SPARE_BYTES_MAX = 256 << 20
_HDR = struct.Struct(">I")


class _M(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    pass


class Reserve(_M, frozen=True, tag="reserve", omit_defaults=True):
    """Slots for each key (``sizes[i]`` bytes); ``pin``: never evicted. ``engine``: the
    client's transfer engine name (a node with a lease deadline grants the slots to it).
    ``commit_on_landing``: the client's writes reach the node over TCP, so the node may
    publish each object when its last byte lands, before that write is answered, and the
    client sends no ``Commit`` for it (the node says whether it will in ``Reserved``).
    Defaults are left off the wire, so a client that asks nothing new talks to older
    nodes as before."""

    rid: int
    keys: list[str]
    sizes: list[int]
    pin: bool = False
    engine: str = ""
    commit_on_landing: bool = False
    #: also reserve this many spare slots of ``spare_size`` bytes each for the client's
    #: next put (``Reserved.spares``; with ``commit_on_landing`` only; all or none). A
    #: Reserve of no key asks for spares alone
    spares: int = 0
    spare_size: int = 0


class Bind(_M, frozen=True, tag="bind", omit_defaults=True):
    """A put into spare slots the connection holds (``Spares``): spare ``put_ids[i]``
    becomes object ``keys[i]`` (of exactly the spare's size). The client sends it and its
    writes into those slots together, without waiting for the answer: the node publishes
    the objects when their last byte has landed over TCP and it knows their keys, whichever
    comes last (``Bound``). All or nothing: a put id that is not an unbound spare of this
    connection (expired with its holds, or never given) refuses the whole Bind, changing
    nothing. The next put's spares are asked after this put's bytes landed, by a
    ``Reserve`` of no key: the node reserves them between puts, not while bytes stream in."""

    rid: int
    put_ids: list[int]
    keys: list[str]
    pin: bool = False


class Spares(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Spare slots held for a client's next put, each for one object of ``size`` bytes:
    spare ``put_ids[i]`` is written at ``offsets[i]`` of region ``regions[i]``,
    ``chunk_bytes[i]`` a chunk, and named by a ``Bind``. They are the connection's
    reservations: they end with its holds (holds.py), and a client that will not use them
    gives them back with a ``Commit`` (ok false) of their ids."""

    size: int
    put_ids: list[int]
    regions: list[int]
    chunk_bytes: list[int]
    offsets: list[list[int]]


class Commit(_M, frozen=True, tag="commit"):
    """Publishes the reservations whose transfer succeeded (``ok[i]``), aborts the others."""

    rid: int
    put_ids: list[int]
    ok: list[bool]


class PutInline(_M, frozen=True, tag="put_inline"):
    """Small values (at most ``INLINE_MAX`` bytes each) carried in the message itself: one
    round trip instead of reserve + transfer + commit."""

    rid: int
    keys: list[str]
    values: list[bytes]
    pin: bool = False


class Lookup(_M, frozen=True, tag="lookup"):
    """``inline_max``: objects up to this size come back in ``Leased.data`` (no lease);
    ``lease_large`` False: larger ones are only sized (status OK, lease id 0, no data)."""

    rid: int
    keys: list[str]
    inline_max: int = 0
    lease_large: bool = True
    engine: str = ""


class GetValue(_M, frozen=True, tag="get_value"):
    """One key's value, answered by ``Value``: what one small ``get`` asks for. A
    ``Lookup`` of one key is answered with ``Leased``'s eight lists; building, encoding
    and decoding them cost the two ends ~1.2 us more (BENCHMARKS.md, "k24v"), about a
    thirteenth of a small get's round trip."""

    rid: int
    key: str


class Release(_M, frozen=True, tag="release"):
    rid: int
    lease_ids: list[int]


class Exists(_M, frozen=True, tag="exists"):
    rid: int
    keys: list[str]


class ExistsKeys(Exists, frozen=True, tag="exists"):
    """``Exists`` as a store node decodes it: the key list left as its msgpack bytes,
    answered in one Rust pass over them (``ObjectSegment.exists_encoded``) instead of
    decoded into a str object a key and looked up in the node's dict."""

    keys: msgspec.Raw  # type: ignore[assignment]


class Sizes(_M, frozen=True, tag="sizes"):
    rid: int
    keys: list[str]


class Remove(_M, frozen=True, tag="remove"):
    rid: int
    keys: list[str]


class RemoveAll(_M, frozen=True, tag="remove_all"):
    rid: int


class Stats(_M, frozen=True, tag="stats"):
    rid: int


class Reserved(_M, frozen=True, tag="reserved", omit_defaults=True):
    """Per key: a KeyStatus (OK with ``put_ids[i]`` > 0: write into ``offsets[i]`` of
    region ``regions[i]``, ``chunk_bytes[i]`` per chunk; OK with put id 0: already held).
    ``commit_on_landing``: the node publishes each of these objects (of at least one
    byte) when its last byte lands over TCP; a write that landed but could not be
    published fails, and the client's ``Commit`` of it (ok false) gets the reason."""

    rid: int
    statuses: list[int]
    put_ids: list[int]
    regions: list[int]
    chunk_bytes: list[int]
    offsets: list[list[int]]
    commit_on_landing: bool = False
    #: the spare slots the Reserve asked for (as many as fit; None: none)
    spares: Spares | None = None


class Bound(_M, frozen=True, tag="bound", omit_defaults=True):
    """The answer to ``Bind``. ``published`` True: every byte had landed when the keys
    arrived, so the node published the objects itself; ``statuses`` are their outcomes.
    False: the write that lands their last byte publishes them before it is answered
    (as ``Reserved.commit_on_landing``), so a client whose writes all succeeded is done,
    and one whose writes did not sends a ``Commit`` of them."""

    rid: int
    published: bool = False
    statuses: list[int] = []


class Leased(_M, frozen=True, tag="leased"):
    """Per key: a KeyStatus; when OK, the leased chunks' ``offsets`` in ``regions[i]``."""

    rid: int
    statuses: list[int]
    lease_ids: list[int]
    sizes: list[int]
    regions: list[int]
    chunk_bytes: list[int]
    offsets: list[list[int]]
    data: list[bytes] = []


class Value(_M, frozen=True, tag="value"):
    """The answer to ``GetValue``: ``status`` a KeyStatus; when OK, ``size`` and, for a
    value of at most ``INLINE_MAX`` bytes, ``data`` (a larger one is only sized: the
    client reads it by ``Lookup``)."""

    rid: int
    status: int
    size: int = 0
    data: bytes = b""


class Answer(_M, frozen=True, tag="answer"):
    rid: int
    values: list[int] = []
    metrics: dict[str, int] = {}


class FlagsAnswer(_M, frozen=True, tag="answer"):
    """An ``Answer`` whose list a node holds as msgpack already (``ExistsKeys``'s 1/0
    list): written as it is; the client decodes it as an ``Answer``."""

    rid: int
    values: msgspec.Raw


class Failure(_M, frozen=True, tag="failure"):
    rid: int
    kind: str
    message: str


Request = Union[Reserve, Bind, Commit, PutInline, Lookup, GetValue, Release, Exists, Sizes, Remove, RemoveAll, Stats]
#: what a store node decodes: ``Request`` with ``Exists`` read as ``ExistsKeys``
NodeRequest = Union[Reserve, Bind, Commit, PutInline, Lookup, GetValue, Release, ExistsKeys, Sizes, Remove, RemoveAll,
                    Stats]
Reply = Union[Reserved, Bound, Leased, Value, Answer, Failure]


class StreamSocket(Protocol):
    """What FrameIO needs of a socket (a plain one, or deploy's SealedSocket)."""

    def sendall(self, data: bytes | bytearray | memoryview) -> Any: ...

    def recv(self, n: int) -> bytes: ...

    def fileno(self) -> int: ...


class FrameIO:
    """Reads and writes frames of one union on a blocking socket. Reads are buffered: a
    small frame's header and body (and any frames behind them) come in one ``recv``, not
    one for the header and one for the body (a small-key round trip is two frames).

    ``spin_s`` > 0: a read that finds nothing buffered polls the socket that long before
    it sleeps in ``recv`` (net/spin_wait.py: the answer to a small call usually lands
    within it, and nobody has to wake a sleeping thread on another CPU)."""

    #: what one ``recv`` asks for at least
    READ_AHEAD = 64 << 10

    def __init__(self, sock: StreamSocket, types: object, spin_s: float = 0.0) -> None:
        self.sock = sock
        self._spin = SpinWait(spin_s) if spin_s > 0 else None
        self._sock_buffers = hasattr(sock, "buffered")  # (asked once: a plain socket has no such attribute)
        # a plain blocking socket's poll and read are one native call (a sealed socket's
        # reads decrypt in its own layer: it is only polled; a socket with a Python-level
        # timeout is non-blocking underneath, and its reads must go through Python's wait;
        # a subclass such as ssl.SSLSocket would carry records, not frames, on its descriptor)
        self.plain_blocking = type(sock) is socket.socket and sock.gettimeout() is None
        self._spin_recv = self._spin is not None and self.plain_blocking
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(types)
        self._reads_answers = Answer in typing.get_args(types)
        self._frame = bytearray()  # the frame being sent (send)
        self._buf = b""  # bytes read and not yet handed out, from _pos on
        self._pos = 0

    def send(self, msg: object) -> None:
        """Writes ``msg`` as one frame. The frame is built in place in one reused buffer
        (its header written over the first 4 bytes): a 100-key ``Exists`` cost 0.90 us as
        a fresh body, then a header, then their join; 0.53 us here. Callers send from one
        thread at a time (a link's send lock; a node's one thread a connection)."""
        frame = self._frame
        try:
            self._enc.encode_into(msg, frame, _HDR.size)
            _HDR.pack_into(frame, 0, len(frame) - _HDR.size)
            self.sock.sendall(frame)
        except BaseException:
            # (a traceback kept by the caller may hold a view of the buffer, and a buffer
            # with a view cannot be resized: the next send takes a fresh one)
            self._frame = bytearray()
            raise

    def recv(self) -> Any:
        """The next message (one of the union's types); EOFError when the peer closed, InvalidArgument if malformed."""
        if self._pos == len(self._buf):  # nothing buffered: the usual case of a round trip
            return self._recv_fresh()
        return self._recv_buffered()

    @property
    def drained(self) -> bool:
        """Nothing read and not yet handed out (the next read goes to the socket)."""
        return self._pos == len(self._buf)

    def recv_from(self, data: bytes) -> Any:
        """``recv`` whose read was done by another reader of this socket (pool/node.py's
        responder): the next message from ``data`` and, when it ends inside a frame, from
        the socket; only when ``drained``."""
        if not self.drained:
            raise RuntimeError("bytes read elsewhere came while unread bytes are buffered")
        return self._take(data)

    def _recv_fresh(self) -> Any:
        """``recv`` with nothing buffered: one wait and one read."""
        if self._spin_recv:
            data = self._spin.recv(self.sock.fileno(), self.READ_AHEAD)  # type: ignore[union-attr]
        else:
            if self._spin is not None:
                self._wait()
            data = self.sock.recv(self.READ_AHEAD)
        return self._take(data)

    def _take(self, data: bytes) -> Any:
        """The next message from a fresh read: a read that brings exactly one whole frame
        (a small answer or request) is decoded straight from it, anything else goes
        through the buffer."""
        if not data:
            raise EOFError("connection closed")
        if len(data) > _HDR.size and _HDR.unpack_from(data)[0] == len(data) - _HDR.size:
            self._buf, self._pos = b"", 0
            if self._reads_answers:  # (a 1/0 answer, a batch_is_exist's, read natively)
                flags = exists_flags(data)
                if flags is not None:
                    return Answer(*flags)
            return self._decode(memoryview(data)[_HDR.size:])
        self._buf, self._pos = data, 0
        return self._recv_buffered()

    def _recv_buffered(self) -> Any:
        if len(self._buf) - self._pos < _HDR.size:
            self._fill(_HDR.size)
        (n,) = _HDR.unpack_from(self._buf, self._pos)
        if n > MAX_FRAME:
            raise InvalidArgument(f"a pool frame of {n} bytes exceeds the limit ({MAX_FRAME})")
        if len(self._buf) - self._pos < _HDR.size + n:
            self._fill(_HDR.size + n)
        start = self._pos + _HDR.size
        self._pos = start + n
        return self._decode(memoryview(self._buf)[start:start + n])

    def _decode(self, body: memoryview) -> Any:
        """One frame's body as a message of the union; InvalidArgument if malformed."""
        try:
            return self._dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise InvalidArgument(f"malformed pool message: {e}") from None

    def _wait(self) -> None:
        """The poll before a read (``_spin`` set); none when a sealed socket holds a
        record's plaintext already: nothing to wait for."""
        if not (self._sock_buffers and self.sock.buffered):  # type: ignore[attr-defined]
            self._spin.wait(self.sock.fileno())  # type: ignore[union-attr]

    def _fill(self, need: int) -> None:
        """Until at least ``need`` unread bytes are buffered."""
        have = len(self._buf) - self._pos
        if have >= need:
            return
        parts = [self._buf[self._pos:]] if have else []
        if self._spin is not None:
            self._wait()
        try:
            while have < need:
                chunk = self.sock.recv(max(need - have, self.READ_AHEAD))
                if not chunk:
                    raise EOFError("connection closed")
                parts.append(chunk)
                have += len(chunk)
        finally:  # (a timeout keeps what came: the stream stays in step)
            self._buf, self._pos = b"".join(parts), 0
