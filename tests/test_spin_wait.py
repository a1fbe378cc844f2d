"""The bounded poll before a blocking read (net/spin_wait.py, native: SpinWait) and FrameIO
with it: it reports a socket readable when bytes (or the end of the stream) are there or
arrive while it polls, gives up when nothing comes, its read returns what a plain read
returns (bytes, b"" at the end, the socket's receive timeout as BlockingIOError), and
frames read with it are the frames read without it, on a plain socket and on a sealed one
(whose own read-ahead it must not wait on)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from mooncake_rs.errors import InvalidArgument
from mooncake_rs.net.sealed import SealedSocket, session_keys
from mooncake_rs.net.spin_wait import MAX_SPIN_US, SpinWait, spin_us_checked
from mooncake_rs.pool.protocol import Answer, Exists, FrameIO, PutInline, Reply, Request

pytestmark = [pytest.mark.timeout(60)]


def test_readable_at_once_when_bytes_wait():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x")
        assert SpinWait(1e-3).wait(a.fileno()) is True
        assert a.recv(1) == b"x"


def test_gives_up_when_nothing_comes():
    a, b = socket.socketpair()
    with a, b:
        assert SpinWait(1e-4).wait(a.fileno()) is False


def test_sees_bytes_that_arrive_while_it_polls():
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=lambda: (time.sleep(0.01), b.sendall(b"late")))
        t.start()
        # a spin far longer than the writer's delay ends because the bytes came, or gives
        # up early when the writer took this CPU (SHARED_CPU_S); never True without bytes
        spin = SpinWait(10.0)
        deadline = time.monotonic() + 30
        while not spin.wait(a.fileno()):
            assert time.monotonic() < deadline
        t.join()
        assert a.recv(4, socket.MSG_DONTWAIT) == b"late"


def test_the_end_of_the_stream_is_readable():
    a, b = socket.socketpair()
    with a:
        b.close()
        assert SpinWait(10.0).wait(a.fileno()) is True
        assert a.recv(1) == b""


def test_polls_that_give_up_make_the_next_waits_skip_polling():
    """Back-off: each poll that gave up skips the next 1, 3, 7 ... waits (they return
    False at once, without a poll: the caller's blocking read returns as soon as bytes are
    there); once the skips are used up, bytes already there are seen at once."""
    a, b = socket.socketpair()
    with a, b:
        spin = SpinWait(1e-4)
        fd = a.fileno()
        skips = []
        for _ in range(4):
            assert spin.wait(fd) is False  # gave up: nothing came
            skips.append(spin.skip)
            while spin.skip:
                assert spin.wait(fd) is False  # skipped
        assert skips == [1, 3, 7, 15]
        spin.skip = 1
        b.sendall(b"x")
        assert spin.wait(fd) is False and spin.skip == 0  # skipped: the caller's read finds the byte
        assert spin.wait(fd) is True  # readable already
        assert a.recv(1) == b"x"


@pytest.mark.parametrize("spin_s", [0.0, 1e-4, 5.0])
def test_its_read_returns_what_a_plain_read_returns(spin_s):
    """Bytes already there, bytes that come later (read after the poll, or by the blocking
    read after it gave up), at most ``max_bytes`` a read, b"" at the end of the stream, the
    socket's own receive timeout as BlockingIOError (a pool link's "node silent"), and a
    closed socket (descriptor -1) as OSError: never a hang."""
    a, b = socket.socketpair()
    spin = SpinWait(spin_s)
    with a, b:
        b.sendall(b"abcdef")
        assert spin.recv(a.fileno(), 4) == b"abcd"
        assert spin.recv(a.fileno(), 64) == b"ef"
        t = threading.Thread(target=lambda: (time.sleep(0.02), b.sendall(b"late")))
        t.start()
        assert spin.recv(a.fileno(), 64) == b"late"
        t.join()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
        t0 = time.monotonic()
        with pytest.raises(BlockingIOError):
            spin.recv(a.fileno(), 64)
        assert time.monotonic() - t0 < 5 + spin_s
        b.shutdown(socket.SHUT_WR)
        assert spin.recv(a.fileno(), 64) == b""
    with pytest.raises(OSError):
        spin.recv(a.fileno(), 64)  # (closed: fileno() is -1)
    with pytest.raises(OSError):
        spin.wait(a.fileno())
    with pytest.raises(ValueError):
        spin.recv(0, 0)
    with pytest.raises(ValueError):
        SpinWait(-1.0)


def test_spin_bounds_are_checked():
    assert spin_us_checked(0, "x") == 0
    assert spin_us_checked("250", "x") == 250
    for bad in (-1, MAX_SPIN_US + 1, "ten", 1.5, True, None):
        with pytest.raises(InvalidArgument, match="microseconds"):
            spin_us_checked(bad, "x")


def _frames(n: int) -> list:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(PutInline(rid=i, keys=[f"k{i}"], values=[os.urandom(1 + i * 37 % 4096)]))
        else:
            out.append(Exists(rid=i, keys=[f"k{j}" for j in range(i % 50)]))
    return out


def _pair(sealed: bool) -> tuple:
    a, b = socket.socketpair()
    if not sealed:
        return a, b
    k1, k2 = session_keys(b"t" * 32, b"n" * 16, b"m" * 16)
    return SealedSocket(a, k1, k2), SealedSocket(b, k2, k1)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("spin_s", [0.0, 1e-4, 5.0])
def test_frames_read_with_a_spin_are_the_frames_sent(sealed, spin_s):
    """Requests one way, answers the other, sent in bursts (so a read finds several frames
    buffered, in FrameIO or in the sealed socket) and one at a time (so it must wait)."""
    a, b = _pair(sealed)
    client_out, node_in = FrameIO(a, Reply, spin_s=spin_s), FrameIO(b, Request, spin_s=spin_s)
    node_out, client_in = FrameIO(b, Reply), FrameIO(a, Reply, spin_s=spin_s)
    sent = _frames(60)
    got: list = []

    def node() -> None:
        for _ in sent:
            msg = node_in.recv()
            got.append(msg)
            node_out.send(Answer(rid=msg.rid, values=[len(msg.keys)]))

    t = threading.Thread(target=node)
    t.start()
    answers = []
    for burst in (sent[:20], sent[20:]):
        if burst is sent[:20]:
            for m in burst:  # a burst: all sent before any answer is read
                client_out.send(m)
            answers += [client_in.recv() for _ in burst]
        else:
            for m in burst:  # one at a time
                client_out.send(m)
                answers.append(client_in.recv())
    t.join(30)
    assert got == sent
    assert [(r.rid, r.values) for r in answers] == [(m.rid, [len(m.keys)]) for m in sent]
    a.close()
    b.close()


def test_a_bad_spin_is_a_typed_error_where_it_is_set(monkeypatch):
    from mooncake_rs.net.spin_wait import DEFAULT_SPIN_US, spin_us_from_env
    from mooncake_rs.pool.node import StoreNode

    monkeypatch.delenv("MOONCAKE_RS_SPIN_US", raising=False)
    assert spin_us_from_env() == DEFAULT_SPIN_US
    monkeypatch.setenv("MOONCAKE_RS_SPIN_US", "0")
    assert spin_us_from_env() == 0
    monkeypatch.setenv("MOONCAKE_RS_SPIN_US", "fast")
    with pytest.raises(InvalidArgument, match="MOONCAKE_RS_SPIN_US"):
        spin_us_from_env()
    with pytest.raises(InvalidArgument, match="--spin-us"):
        StoreNode(name="n", listen="127.0.0.1:0", dram_bytes=1 << 20, auth_token=None, plaintext=True, spin_us=-1)


class _ChunkedSocket:
    """Hands out a byte stream in the chunks given, one a ``recv`` (never more than asked)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    def recv(self, n: int) -> bytes:
        if not self._chunks:
            return b""
        head = self._chunks[0]
        self._chunks[0] = head[n:]
        if not self._chunks[0]:
            self._chunks.pop(0)
        return head[:n]

    def sendall(self, data: bytes) -> None:
        raise AssertionError("not sent on")

    def fileno(self) -> int:
        return -1


def test_frames_read_whole_split_or_several_a_read_are_the_frames_sent():
    """A read that brings exactly one frame is decoded straight from it (the usual small
    round trip); one that brings part of a frame, or several, goes through the buffer: the
    messages are the frames sent, in order, whatever the cut points; then the end."""
    import random

    import msgspec

    rng = random.Random(21)
    enc = msgspec.msgpack.Encoder()
    for trial in range(60):
        sent = _frames(rng.randint(1, 12))
        frames = [len(b).to_bytes(4, "big") + b for b in map(enc.encode, sent)]
        stream = b"".join(frames)
        if trial % 3 == 0:  # one frame a read: every read takes the direct decode
            chunks = frames
        else:  # random cuts: partial headers, partial bodies, several frames in one read
            cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, min(20, len(stream) - 1))))
            chunks = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)])]
        io = FrameIO(_ChunkedSocket(chunks), Request)
        assert [io.recv() for _ in sent] == sent
        with pytest.raises(EOFError):
            io.recv()


def test_a_malformed_or_oversized_frame_read_whole_is_refused():
    body = b"\x93\x01\x02\x03"  # msgpack of a list: not a message of the union
    io = FrameIO(_ChunkedSocket([len(body).to_bytes(4, "big") + body]), Request)
    with pytest.raises(InvalidArgument, match="malformed pool message"):
        io.recv()
    io = FrameIO(_ChunkedSocket([(1 << 30).to_bytes(4, "big") + b"x" * 8]), Request)
    with pytest.raises(InvalidArgument, match="exceeds the limit"):
        io.recv()
