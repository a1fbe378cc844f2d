"""The client endpoint of a conductor service: ``RemoteCluster`` connections
(client/protocol.py) on an authenticated listener.

Each connection has a reader (the link's thread: submits and cancels) and a writer
thread with a queue: the router thread hands a request's tokens to the connection's
queue and never blocks on a slow client's socket. A connection that closes cancels
the requests it submitted (nobody is left to read them).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any

from .. import errors as _errors
from ..net.channel import FramedChannel, Lost
from ..net.framing import Codec
from ..client.handle import RequestHandle
from ..net.auth_socket import AuthListener
from ..client.protocol import (CLIENT_PROTOCOL_VERSION, TO_SERVICE, Admitted, Answer, CancelSubmitted, ClientMessage,
                              Error, Finished, Query, Submit, Tokens)
from ..net.sealed import SealedSocket

__all__ = ["ClientEndpoint", "error_message"]

log = logging.getLogger("mooncake_rs.deploy")

_CLOSE = object()


def error_message(cid: int | None, e: BaseException, qid: int | None = None) -> Error:
    """An exception as the client protocol carries it (its class name from errors.py)."""
    kind = type(e).__name__ if isinstance(e, _errors.MooncakeError) else "MooncakeError"
    return Error(cid, kind, str(e), getattr(e, "reason", None), qid)


class _Forward(RequestHandle):
    """The service's handle of a remote client's request: what the router gives it goes
    to the client's queue (the router thread never writes to a socket)."""

    def __init__(self, rid: int, prompt: list[int], on_cancel: Any, conn: "_Connection", cid: int) -> None:
        super().__init__(rid, prompt, on_cancel)
        self._conn, self._cid = conn, cid

    def _token(self, tok: int) -> None:
        self._conn.post(Tokens(self._cid, [tok]))

    def _finish(self, output: Any) -> None:
        super()._finish(output)
        self._conn._forget(self._cid)
        self._conn.post(Finished(self._cid, output.finish_reason, dataclasses.asdict(output.metrics)))

    def _fail(self, error: BaseException) -> None:
        super()._fail(error)
        self._conn._forget(self._cid)
        self._conn.post(error_message(self._cid, error))


class _Connection:
    def __init__(self, service: Any, sock: SealedSocket, peer: str, on_close: Any) -> None:
        self.service, self.peer = service, peer
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._codec = Codec(ClientMessage)
        self._sock = sock
        self._handles: dict[int, RequestHandle] = {}  # cid -> the service's handle
        self._lock = threading.Lock()
        self._on_close = on_close
        self._writer = threading.Thread(target=self._write, name=f"mooncake-client-out-{peer}", daemon=True)
        self._writer.start()
        self._link = FramedChannel(sock, 0, self, TO_SERVICE, ClientMessage, name=f"service<-client@{peer}")

    # ---- out (any thread; the writer sends)
    def post(self, msg: Any) -> None:
        self._out.put(msg)

    def _write(self) -> None:
        while True:
            msg = self._out.get()
            if msg is _CLOSE:
                return
            try:
                self._sock.sendall(self._codec.encode(msg))
            except OSError:
                return  # the reader sees the socket close and cleans up

    # ---- in (the link's reader thread calls ``put``, as for any sink)
    def put(self, item: tuple[int, Any]) -> None:
        _, msg = item
        if isinstance(msg, Submit):
            self._submit(msg)
        elif isinstance(msg, CancelSubmitted):
            with self._lock:
                h = self._handles.get(msg.cid)
            if h is not None:
                h.cancel()
        elif isinstance(msg, Query):
            self._query(msg)
        elif isinstance(msg, Lost):
            self._closed(msg.reason)

    def _submit(self, msg: Submit) -> None:
        cid = msg.cid
        if msg.version != CLIENT_PROTOCOL_VERSION:
            self.post(Error(cid, "InvalidArgument", f"client protocol version {msg.version}, the service speaks "
                                                    f"{CLIENT_PROTOCOL_VERSION}"))
            return

        try:
            h = self.service.submit_forwarded(msg.prompt, msg.params, msg.timeout_s,
                                              lambda rid, toks, cancel: _Forward(rid, toks, cancel, self, cid))
        except Exception as e:  # noqa: BLE001 - every refusal goes back typed
            self.post(error_message(cid, e))
            return
        with self._lock:
            if not h.done:  # (one that ended already was forgotten before it was known)
                self._handles[cid] = h
        # The router may post the request's first tokens (or its failure) before this:
        # the client takes those as admission too (client/remote.py)
        self.post(Admitted(cid, h.request_id, h.prefill_instance, h.decode_instance))

    def _forget(self, cid: int) -> None:
        with self._lock:
            self._handles.pop(cid, None)

    def _query(self, msg: Query) -> None:
        try:
            if msg.what == "metrics":
                self.post(Answer(msg.qid, text=self.service.metrics_text()))
            elif msg.what == "instances":
                self.post(Answer(msg.qid, instances=self.service.instances()))
            elif msg.what == "stats":  # asks every worker: off the reader thread
                threading.Thread(target=self._stats, args=(msg.qid,), daemon=True).start()
            else:
                raise _errors.InvalidArgument(f"unknown query {msg.what!r} (metrics, instances, stats)")
        except Exception as e:  # noqa: BLE001
            self.post(error_message(None, e, msg.qid))

    def _stats(self, qid: int) -> None:
        try:
            self.post(Answer(qid, stats=self.service.instance_stats()))
        except Exception as e:  # noqa: BLE001
            self.post(error_message(None, e, qid))

    def _closed(self, reason: str) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            h.cancel()
        self._out.put(_CLOSE)
        self._on_close(self)

    def close(self) -> None:
        self._link.close()


class ClientEndpoint:
    """Listens on ``host:port`` for ``RemoteCluster`` clients of ``service``."""

    def __init__(self, service: Any, host: str, port: int, token: str) -> None:
        self.service = service
        self._conns: set[_Connection] = set()
        self._lock = threading.Lock()
        self._listener = AuthListener(host, port, token, self._accept)
        self.address = self._listener.address

    def _accept(self, sock: SealedSocket, peer: str) -> None:
        conn = _Connection(self.service, sock, peer, self._gone)
        with self._lock:
            self._conns.add(conn)

    def _gone(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            c.close()
