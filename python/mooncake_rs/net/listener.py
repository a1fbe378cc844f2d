"""The accept loop shared by the control-plane listeners: a TCP server socket, a thread per
new connection for its first exchange (the token handshake of ``auth_socket.AuthListener``,
the plaintext hello of ``plain_socket.PlainListener``), then the connection handed to
``on_connection(conn, peer)`` on that thread.

What a peer can hold before its first exchange is done is bounded here, the same way for
both kinds: at most ``max_pending`` exchanges at once (the oldest is shut down to admit a
new one, counted in ``evicted``), each with a deadline of ``timeout_s``, so a peer that
connects and stays silent costs one slot for that long. A subclass says only what its
first exchange is (:meth:`Listener._greet`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument

__all__ = ["Listener"]

log = logging.getLogger("mooncake_rs.deploy")  # the name operators of a deployment filter on


class Listener:
    """Accepts connections on ``host:port`` (0: any free port; see ``address``), runs
    :meth:`_greet` on a thread each and hands what it returns to ``on_connection``."""

    #: the accept thread's name, ``{kind}-{port}``, and the exchange threads' ``{kind}-conn``
    kind = "mooncake-listen"

    def __init__(self, host: str, port: int, on_connection: Callable[[Any, str], None], *,
                 timeout_s: float = 3.0, max_pending: int = 64) -> None:
        if max_pending < 1 or not timeout_s > 0:
            raise InvalidArgument("max_pending (max_handshakes) >= 1 and timeout_s (handshake_timeout_s) > 0 "
                                  "are required")
        self._on_connection = on_connection
        self._timeout_s, self._max_pending = timeout_s, max_pending
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise InvalidArgument(f"cannot listen on {host}:{port}: {e}") from e
        h, p = self._sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self._pending: dict[socket.socket, float] = {}  # first exchanges in progress -> start time
        self._lock = threading.Lock()
        self._closed = False
        #: refused first exchanges (wrong token, garbage, timeout) and exchanges evicted for room
        self.refused = 0
        self.evicted = 0
        self._thread = threading.Thread(target=self._accept, name=f"{self.kind}-{p}", daemon=True)
        self._thread.start()

    def _greet(self, conn: socket.socket, peer: str, deadline: float) -> Any:
        """The first exchange on a new connection: what to hand to ``on_connection``, or
        ``None`` to refuse it (counted in ``refused``; log why). Raising ``OSError``,
        ``TimeoutError`` or ``ConnectionError`` refuses it too."""
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._pending) >= self._max_pending:
                    oldest = min(self._pending, key=self._pending.__getitem__)
                    self._pending.pop(oldest)
                    self.evicted += 1
                    try:
                        oldest.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self._pending[conn] = time.monotonic()
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(target=self._start, args=(conn, peer), name=f"{self.kind}-conn", daemon=True).start()

    def _start(self, conn: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        handed: Any = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._timeout_s)
            handed = self._greet(conn, peer, deadline)
        except (OSError, TimeoutError, ConnectionError) as e:
            log.warning("control connection from %s dropped during its first exchange: %s", peer, e)
        with self._lock:
            still = self._pending.pop(conn, None) is not None  # not evicted, not closed meanwhile
            if handed is None:
                self.refused += 1
        if handed is None or not still:
            conn.close()
            return
        conn.settimeout(None)
        self._on_connection(handed, peer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
        try:
            # shutdown wakes the accept() blocked in the listener thread; close alone does not
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        finally:
            for c in pending:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=2)

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
