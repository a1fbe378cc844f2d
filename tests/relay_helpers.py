"""A man-in-the-middle for tests: a TCP relay on 127.0.0.1 that forwards to a target,
keeps every byte it saw, and (``tamper=True``) rewrites what the server sends after the
handshake the way an attacker would: each length-prefixed frame that decodes as the
client protocol's ``Tokens`` gets its tokens replaced by 7s; one that does not decode (a
sealed record) gets a byte flipped. It holds no token: it only forwards the handshake.
"""

from __future__ import annotations

import socket
import struct
import threading

import msgspec

from mooncake_rs.client.protocol import ClientMessage, Tokens

__all__ = ["Relay"]

#: what the server sends during the handshake: its hello (magic, version, nonce), then,
#: after the client's answer, its proof
HELLO, PROOF = 4 + 1 + 32, 32
_HDR = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class Relay:
    def __init__(self, target: str, *, tamper: bool = False) -> None:
        self.target, self.tamper = target, tamper
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._srv.getsockname()[1]
        self.connections = 0
        self.upstream = bytearray()  # client -> server, everything
        self.rewritten = 0  # Tokens frames rewritten
        self.flipped = 0  # undecodable frames (records) tampered with
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.settimeout(None)
            except OSError:
                c.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [c, s]
            threading.Thread(target=self._up, args=(c, s), daemon=True).start()
            threading.Thread(target=self._down, args=(s, c), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.upstream += data
                dst.sendall(data)
        except OSError:
            pass
        self._close(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        dec = msgspec.msgpack.Decoder(ClientMessage)
        enc = msgspec.msgpack.Encoder()
        try:
            for n in (HELLO, PROOF):
                hs = _recv_exact(src, n)
                if hs is None:
                    return
                dst.sendall(hs)
            while True:
                hdr = _recv_exact(src, 4)
                if hdr is None:
                    return
                body = _recv_exact(src, _HDR.unpack(hdr)[0])
                if body is None:
                    return
                if self.tamper:
                    try:
                        msg = dec.decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
                        msg = None
                    if isinstance(msg, Tokens):
                        body = enc.encode(Tokens(msg.cid, [7] * len(msg.tokens)))
                        hdr = _HDR.pack(len(body))
                        self.rewritten += 1
                    elif msg is None and body:
                        body = body[:-1] + bytes([body[-1] ^ 1])
                        self.flipped += 1
                dst.sendall(hdr + body)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._srv.close()
        with self._lock:
            socks = list(self._socks)
        self._close(*socks)
        for s in socks:
            s.close()
