"""The control plane's authenticated TCP handshake: both sides prove they hold the cluster
token; a wrong token, garbage, silence or a flood of half-open connections is refused or
dropped by the listener without stopping it serving the honest peers."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from mooncake_rs.net.auth_socket import AuthListener, connect
from mooncake_rs.errors import InvalidArgument, ServiceUnavailable, Unauthorized

TOKEN = "k" * 32


class Echo:
    """An AuthListener whose connections echo one line back."""

    def __init__(self, token: str = TOKEN, **kw: object) -> None:
        self.peers: list[str] = []
        self.listener = AuthListener("127.0.0.1", 0, token, self._serve, **kw)  # type: ignore[arg-type]

    def _serve(self, sock: socket.socket, peer: str) -> None:
        self.peers.append(peer)
        with sock:
            data = sock.recv(100)
            sock.sendall(data)

    def __enter__(self) -> "Echo":
        return self

    def __exit__(self, *exc: object) -> None:
        self.listener.close()


def roundtrip(address: str, token: str = TOKEN) -> bytes:
    with connect(address, token, timeout_s=5) as s:
        s.sendall(b"ping")
        return s.recv(100)


def test_both_sides_holding_the_token_talk() -> None:
    with Echo() as e:
        assert roundtrip(e.listener.address) == b"ping"
        assert len(e.peers) == 1 and e.listener.refused == 0


def test_a_wrong_token_is_refused_on_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    with Echo() as e, caplog.at_level(logging.WARNING, "mooncake_rs.deploy"):
        with pytest.raises(Unauthorized, match="refused the cluster token"):
            connect(e.listener.address, "x" * 32, timeout_s=5)
        assert wait(lambda: e.listener.refused == 1)
        assert "wrong cluster token" in caplog.text and not e.peers
        assert roundtrip(e.listener.address) == b"ping"  # still serving


def test_a_client_refuses_a_server_without_the_token() -> None:
    """A server that answers the challenge with a made-up proof (it does not know the
    token) is refused by the client: the authentication is mutual."""
    srv = socket.create_server(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % srv.getsockname()[1]

    def impostor() -> None:
        c, _ = srv.accept()
        with c:
            c.sendall(b"MCRS\x02" + b"\0" * 32)
            c.recv(64)
            c.sendall(b"\1" * 32)
            time.sleep(0.5)

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(Unauthorized, match="does not hold the cluster token"):
        connect(addr, TOKEN, timeout_s=5)
    t.join(timeout=5)
    srv.close()


def test_garbage_and_silence_cost_a_bounded_slot() -> None:
    with Echo(handshake_timeout_s=0.5, max_handshakes=4) as e:
        host, port = e.listener.address.split(":")
        junk = socket.create_connection((host, int(port)))
        junk.recv(37)
        junk.sendall(b"\xff" * 64)  # the right length, a wrong proof
        silent = [socket.create_connection((host, int(port))) for _ in range(6)]  # more than max_handshakes
        assert roundtrip(e.listener.address) == b"ping"  # evicts the oldest silent one to get in
        assert wait(lambda: e.listener.evicted >= 3 and e.listener.refused >= 1)
        assert wait(lambda: e.listener.refused >= 1 + 6 - e.listener.evicted, timeout_s=5)  # the rest time out
        for s in silent + [junk]:
            s.close()
        assert roundtrip(e.listener.address) == b"ping"


def test_bad_arguments_and_nothing_listening() -> None:
    with pytest.raises(InvalidArgument, match="at least 16 bytes"):
        connect("127.0.0.1:1", "short")
    with pytest.raises(InvalidArgument, match="HOST:PORT"):
        connect("nohost", TOKEN)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ServiceUnavailable, match="cannot connect"):
        connect(f"127.0.0.1:{port}", TOKEN, timeout_s=1)
    with pytest.raises(InvalidArgument, match="at least 16 bytes"):
        AuthListener("127.0.0.1", 0, b"short", lambda s, p: None)


def wait(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def test_the_session_after_the_handshake_is_sealed() -> None:
    """Frames larger than a record (1 MiB) cross whole; every byte on the wire after the
    handshake is ciphertext; a flipped byte breaks the session with ``Unauthorized``."""
    got: list[bytes] = []
    wire = bytearray()
    done = threading.Event()

    def serve(sock, peer) -> None:  # type: ignore[no-untyped-def]
        with sock:
            want, buf = 3 << 20, b""
            while len(buf) < want:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
            got.append(buf)
            sock.sendall(b"ok")
        done.set()

    with AuthListener("127.0.0.1", 0, TOKEN, serve) as listener:
        payload = bytes(range(256)) * (3 << 12)  # 3 MiB, recognisable
        with connect(listener.address, TOKEN, timeout_s=5) as s:
            s._sock = _Spy(s._sock, wire)  # type: ignore[assignment]
            s.sendall(payload)
            assert s.recv(2) == b"ok"
        assert done.wait(5) and got == [payload]
        assert len(wire) == len(payload) + 3 * (4 + 16)  # three records of 1 MiB
        assert bytes(range(64)) not in wire

    # a relay's flipped byte: the receiver refuses the record, typed
    from mooncake_rs.net.sealed import SealedSocket

    from mooncake_rs._core import RecordSealer

    a, b = socket.socketpair()
    key = b"k" * 32
    right = SealedSocket(b, b"x" * 32, key)
    record = bytearray(RecordSealer(key).seal(b"tokens"))
    record[-1] ^= 1
    a.sendall(bytes(record))
    with pytest.raises(Unauthorized, match="integrity"):
        right.recv(100)
    a.close()
    b.close()
    # the same record unchanged opens
    a, b = socket.socketpair()
    a.sendall(RecordSealer(key).seal(b"tokens"))
    assert SealedSocket(b, b"x" * 32, key).recv(100) == b"tokens"
    a.close()
    b.close()


class _Spy:
    """A socket whose writes are also kept (what a wire tap sees)."""

    def __init__(self, sock: socket.socket, wire: bytearray) -> None:
        self._sock, self._wire = sock, wire

    def sendall(self, data: bytes) -> None:
        self._wire.extend(data)
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_a_read_timeout_mid_record_keeps_the_sealed_stream_in_step() -> None:
    """The reader reads ahead; a timeout that cuts a record in two keeps what came, so the
    next read returns the whole record and the ones behind it (several records in one
    ``recv`` too)."""
    from mooncake_rs.net.sealed import SealedSocket

    a, b = socket.socketpair()
    k1, k2 = b"k" * 32, b"j" * 32
    tx = SealedSocket(a, k1, k2)
    rx = SealedSocket(b, k2, k1)
    raw = socket.socket(fileno=a.detach())  # the same stream, to cut a record's bytes
    try:
        from mooncake_rs._core import RecordSealer

        sealer = RecordSealer(k1)
        first = sealer.seal(b"first record " * 100)
        raw.sendall(first[:len(first) // 2])
        b.settimeout(0.2)
        with pytest.raises(socket.timeout):
            rx.recv(1 << 16)
        raw.sendall(first[len(first) // 2:] + sealer.seal(b"second") + sealer.seal(b"third"))
        got = b""
        while len(got) < len(b"first record " * 100) + len(b"secondthird"):
            got += rx.recv(1 << 16)
        assert got == b"first record " * 100 + b"secondthird"
    finally:
        raw.close()
        rx.close()
        del tx
