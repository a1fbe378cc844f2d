"""A plaintext store node answers ``Exists`` frames in its native reader (pool/node.py,
rust/core/src/exists_frames.rs) without the Python handler: the answers must be the bytes
the handler would have sent, in request order among other requests, and never stale while
an eviction waits to be taken into the node's key set. The client reads a 1/0 answer
natively too (``exists_flags``): the same message msgspec's decoder makes of it."""

from __future__ import annotations

import os
import random
import socket
import time

import msgspec
import pytest

from mooncake_rs._core import exists_flags
from mooncake_rs.net.plain_socket import connect_plain
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import (INLINE_MAX, Answer, Exists, ExistsKeys, Failure, FlagsAnswer, FrameIO, PutInline,
                                       Reply, Sizes, Value)

pytestmark = [pytest.mark.timeout(120)]

ENC = msgspec.msgpack.Encoder()


@pytest.fixture
def node():
    with StoreNode(name="x", listen="127.0.0.1:0", dram_bytes=32 << 20, auth_token=None, plaintext=True,
                   chunk_bytes=64 << 10, transports=("tcp",)) as n:
        yield n


@pytest.fixture
def handled(node, monkeypatch):
    """The request types that reached the node's Python handler, in order."""
    seen: list[type] = []
    handle = node._handle

    def counting(msg, conn):
        seen.append(type(msg))
        return handle(msg, conn)

    monkeypatch.setattr(node, "_handle", counting)
    return seen


def frame(msg_or_body: object) -> bytes:
    body = msg_or_body if isinstance(msg_or_body, bytes) else ENC.encode(msg_or_body)
    return len(body).to_bytes(4, "big") + body


def read_frame(sock: socket.socket) -> bytes:
    """One whole answer frame, length prefix included."""
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "the node closed the connection"
            out += chunk
        return out

    hdr = exactly(4)
    return hdr + exactly(int.from_bytes(hdr, "big"))


def handler_answer(rid: int, keys: list[str], held: set[str]) -> bytes:
    """What the Python handler writes for an ``Exists`` (a ``FlagsAnswer``), from msgspec."""
    return frame(FlagsAnswer(rid, msgspec.Raw(ENC.encode([int(k in held) for k in keys]))))


def put_inline(sock: socket.socket, rid: int, keys: list[str], value: bytes) -> list[int]:
    sock.sendall(frame(PutInline(rid, keys, [value] * len(keys), False)))
    rep = msgspec.msgpack.decode(read_frame(sock)[4:], type=Reply)
    assert rep.rid == rid
    return rep.values


def test_native_answers_are_the_handlers_bytes_for_every_rid_and_key_form(node, handled):
    rng = random.Random(3)
    held = {f"h{i}" for i in range(200)} | {"é" * 20, "k" * 40, "long" * 100}
    with connect_plain(node.address) as sock:
        for i, batch in enumerate([sorted(held)[j:j + 50] for j in range(0, len(held), 50)]):
            assert put_inline(sock, 10 + i, batch, b"v") == [0] * len(batch)
        handled.clear()
        pool = sorted(held) + [f"no{i}" for i in range(100)] + ["ü" * 33, "x" * 300]
        rids = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
        for rid, n in zip(rids, [0, 1, 15, 16, 17, 100, 300, 2, 3, 4, 5, 1000]):
            keys = rng.choices(pool, k=n)
            sock.sendall(frame(Exists(rid, keys)))
            assert read_frame(sock) == handler_answer(rid, keys, held)
        assert handled == [], "an Exists laid out as msgspec writes it reached the Python handler"

        # laid out otherwise (rid before op), or past one read: the handler answers, the same
        body = msgspec.msgpack.encode({"rid": 7, "op": "exists", "keys": ["h1", "no1"]})
        sock.sendall(frame(body))
        assert read_frame(sock) == handler_answer(7, ["h1", "no1"], held)
        many = rng.choices(pool, k=40_000)  # (~300 KB: more than one read of the native reader)
        sock.sendall(frame(Exists(8, many)))
        assert read_frame(sock) == handler_answer(8, many, held)
        assert handled == [ExistsKeys, ExistsKeys]


def test_pipelined_requests_are_answered_in_order_across_both_readers(node, handled):
    with connect_plain(node.address) as sock:
        assert put_inline(sock, 1, ["a", "b"], b"v" * 100) == [0, 0]
        big = PutInline(5, ["big"], [b"z" * INLINE_MAX], False)
        stream = b"".join([frame(Exists(2, ["a", "c"])), frame(Sizes(3, ["a", "c"])), frame(Exists(4, ["b"])),
                           frame(big), frame(Exists(6, ["big", "a"]))])
        cut = len(stream) - len(frame(Exists(6, ["big", "a"]))) - 100  # (inside the big put)
        sock.sendall(stream[:cut])
        time.sleep(0.05)  # (the node reads the first part alone)
        sock.sendall(stream[cut:])
        answers = [msgspec.msgpack.decode(read_frame(sock)[4:], type=Reply) for _ in range(5)]
        assert [a.rid for a in answers] == [2, 3, 4, 5, 6]
        assert [a.values for a in answers] == [[1, 0], [100, -704], [1], [0], [1, 1]]
        # the first Exists was answered natively; the rest came behind other requests
        assert handled[:3] == [PutInline, Sizes, ExistsKeys]


def test_an_exists_waiting_behind_an_eviction_is_answered_after_it(node):
    """Puts that evict leave events for the handler to take into the key set; an ``Exists``
    that comes before anything took them must not report the evicted keys held."""
    seg = node.segment
    with connect_plain(node.address) as sock:
        keys = []
        rid = 100
        for i in range(1200):  # (a value a 64 KiB chunk, 512 in 32 MiB: the oldest are evicted)
            key = f"e{i}"
            rid += 1
            sock.sendall(frame(PutInline(rid, [key], [bytes([i % 256]) * INLINE_MAX], False)))
            rep = msgspec.msgpack.decode(read_frame(sock)[4:], type=Reply)
            assert rep.values == [0]
            keys.append(key)
            if any(sc.store.pending_losses() for sc in seg.classes):
                break
        assert any(sc.store.pending_losses() for sc in seg.classes), "no eviction: raise the put count"
        sock.sendall(frame(Exists(999, keys)))
        got = msgspec.msgpack.decode(read_frame(sock)[4:], type=Reply)
        seg.reap_evicted()
        assert got.values == seg.exists_many(keys)
        assert 0 in got.values, "nothing was evicted"
        for k, flag in zip(keys, got.values):  # a key reported held is read back whole
            assert (seg.size_of(k) == INLINE_MAX) == bool(flag)


def test_a_bad_key_list_gets_the_handlers_refusal_and_the_link_stays(node):
    with connect_plain(node.address) as sock:
        sock.sendall(frame(msgspec.msgpack.encode({"op": "exists", "rid": 9, "keys": ["a", 2]})))
        refused = msgspec.msgpack.decode(read_frame(sock)[4:], type=Reply)
        assert (refused.rid, refused.kind) == (9, "InvalidArgument")
        assert "key 1 of the list is not a msgpack str" in refused.message
        sock.sendall(frame(Exists(10, ["a"])))
        assert read_frame(sock) == handler_answer(10, ["a"], set())


def test_a_flags_answer_reads_as_the_decoder_reads_it():
    """The client reads a node's 1/0 answer natively (``exists_flags``); the reference is
    msgspec's decoder of the reply union. Anything but one whole flags answer is left to it."""
    rng = random.Random(11)
    dec = msgspec.msgpack.Decoder(Reply)
    for rid in (0, 1, 127, 128, 65_536, 2**32, 2**64 - 1):
        for n in (0, 1, 15, 16, 100, 70_000):
            flags = [rng.randint(0, 1) for _ in range(n)]
            whole = frame(FlagsAnswer(rid, msgspec.Raw(ENC.encode(flags))))
            got = exists_flags(whole)
            assert got == (rid, flags)
            assert Answer(*got) == dec.decode(whole[4:])
            assert exists_flags(whole[:-1]) is None and exists_flags(whole + whole) is None
    others = [FlagsAnswer(1, msgspec.Raw(ENC.encode([0, 2]))), FlagsAnswer(1, msgspec.Raw(ENC.encode([1, -1]))),
              Answer(1, [1, 0]), Answer(1, [], {"keys": 3}), Failure(1, "InvalidArgument", "no"),
              Value(1, 0, 3, b"abc"), Value(1, 0)]
    for msg in others:
        assert exists_flags(frame(msg)) is None, msg
    for raw in (b"", b"\x00\x00\x00", b"\x00\x00\x00\x00", b"\x00\x00\x00\x01\x90", b"\xff\xff\xff\xff\x83"):
        assert exists_flags(raw) is None


class _SocketSubclass(socket.socket):
    """A socket class of its own (as ``ssl.SSLSocket`` is): its descriptor may carry
    records of another layer, not pool frames."""


def test_only_a_plain_blocking_socket_is_read_natively():
    a, b = socket.socketpair()
    try:
        assert FrameIO(a, Reply).plain_blocking
        sub = _SocketSubclass(family=b.family, type=b.type, fileno=os.dup(b.fileno()))
        with sub:
            assert not FrameIO(sub, Reply).plain_blocking
        a.settimeout(1.0)  # (non-blocking underneath: its reads wait in Python)
        assert not FrameIO(a, Reply).plain_blocking
    finally:
        a.close()
        b.close()
