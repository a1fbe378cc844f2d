"""``RemoteCluster``: a running deployment across hosts, from Python, with the embedded
``Cluster``'s request API (``submit`` / ``generate`` / streaming / ``metrics_text``).

    cluster = mooncake_rs.Cluster.connect(etcd="http://10.0.0.1:2379", auth_token=token)
    outs = cluster.generate([[1, 2, 3]], SamplingParams(max_tokens=8))

It finds the leading ``serve`` process in etcd (``{prefix}/leader`` holds its client
address), or takes ``address`` directly, and talks the client protocol
(protocol.py) on a connection authenticated with the cluster token. ``submit``
waits for the service's answer (admitted, or refused: ``Overloaded``,
``InvalidArgument``, ``ServiceUnavailable`` ... as the service raised it), then the
handle streams the tokens. If the connection drops (the leader died), every request on
it fails with ``ServiceUnavailable``; the next ``submit`` looks the leader up again and
reconnects, so requests after a failover go to the new leader. Torch-free.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import errors as _errors
from ..errors import InvalidArgument, MooncakeError, ServiceUnavailable, Unauthorized
from ..net import auth_socket
from ..net.channel import FramedChannel, Lost
from ..net.etcd import EtcdClient
from .generate import GenerateMixin
from .handle import RequestHandle, request_entry
from .protocol import (FROM_SERVICE, Admitted, Answer, CancelSubmitted, ClientMessage, Error, Finished, Query, Submit,
                       Tokens)
from .records import cluster_prefix, decode_leader, leader_key, records_key

__all__ = ["RemoteCluster"]

log = logging.getLogger("mooncake_rs.deploy")


def _error_of(msg: Error) -> MooncakeError:
    cls = getattr(_errors, msg.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, MooncakeError)):
        cls = MooncakeError
    if cls is _errors.Overloaded:
        return _errors.Overloaded(msg.message, reason=msg.reason)
    return cls(msg.message)


class _Pending:
    """A request between ``Submit`` and the service's first answer."""

    def __init__(self, handle: "_RemoteHandle") -> None:
        self.handle = handle
        self.answered = threading.Event()
        self.error: MooncakeError | None = None


class _Connection:
    def __init__(self, address: str, token: str, timeout_s: float) -> None:
        self.address = address
        sock = auth_socket.connect(address, token, timeout_s=timeout_s)
        self._lock = threading.Lock()
        self.pending: dict[int, _Pending] = {}
        self.queries: dict[int, list[Any]] = {}  # qid -> [Event, answer]
        self.alive = True
        self.link = FramedChannel(sock, 0, self, FROM_SERVICE, ClientMessage, name=f"client->{address}")

    def add(self, cid: int, p: _Pending) -> None:
        with self._lock:
            if not self.alive:
                raise ServiceUnavailable(f"the connection to the conductor service at {self.address} is closed")
            self.pending[cid] = p

    # the link's reader thread
    def put(self, item: tuple[int, Any]) -> None:
        _, msg = item
        if isinstance(msg, Tokens):
            p = self.pending.get(msg.cid)
            if p is not None:
                p.answered.set()  # (tokens can overtake Admitted: admission all the same)
                for t in msg.tokens:
                    p.handle._token(t)
        elif isinstance(msg, Admitted):
            p = self.pending.get(msg.cid)
            if p is not None:
                p.handle.prefill_instance, p.handle.decode_instance = msg.prefill, msg.decode
                p.answered.set()
        elif isinstance(msg, Finished):
            p = self._pop(msg.cid)
            if p is not None:
                p.answered.set()
                p.handle._finish(_output(p.handle, msg))
        elif isinstance(msg, Error):
            if msg.qid is not None:
                self._answer(msg.qid, _error_of(msg))
                return
            p = self._pop(msg.cid) if msg.cid is not None else None
            if p is None:
                return
            if not p.answered.is_set():
                p.error = _error_of(msg)
                p.answered.set()
            p.handle._fail(_error_of(msg))
        elif isinstance(msg, Answer):
            self._answer(msg.qid, msg)
        elif isinstance(msg, Lost):
            self._lost(msg.reason)

    def _pop(self, cid: int) -> _Pending | None:
        with self._lock:
            return self.pending.pop(cid, None)

    def _answer(self, qid: int, answer: Any) -> None:
        with self._lock:
            slot = self.queries.get(qid)
        if slot is not None:
            slot[1] = answer
            slot[0].set()

    def _lost(self, reason: str) -> None:
        with self._lock:
            self.alive = False
            pending, self.pending = list(self.pending.values()), {}
            queries = list(self.queries.values())
        err = ServiceUnavailable(f"lost the connection to the conductor service at {self.address} ({reason})")
        for p in pending:
            if not p.answered.is_set():
                p.error = err
                p.answered.set()
            p.handle._fail(err)
        for slot in queries:
            slot[1] = err
            slot[0].set()

    def query(self, qid: int, what: str, timeout_s: float) -> Any:
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            if not self.alive:
                raise ServiceUnavailable(f"the connection to the conductor service at {self.address} is closed")
            self.queries[qid] = slot
        try:
            self.link.send(Query(qid, what))
            if not slot[0].wait(timeout_s):
                raise ServiceUnavailable(f"the conductor service at {self.address} did not answer within "
                                         f"{timeout_s:g}s")
        finally:
            with self._lock:
                self.queries.pop(qid, None)
        if isinstance(slot[1], BaseException):
            raise slot[1]
        return slot[1]


def _output(handle: "_RemoteHandle", msg: Finished) -> Any:
    from ..base.outputs import RequestOutput
    from ..base.metrics import RequestMetrics

    fields = set(RequestMetrics.__dataclass_fields__)
    metrics = RequestMetrics(**{k: v for k, v in msg.metrics.items() if k in fields})
    return RequestOutput(str(handle.request_id), handle.prompt_token_ids, list(handle.tokens), msg.finish_reason, [],
                         metrics.reused_tokens, 0, metrics)


class _RemoteHandle(RequestHandle):
    """Keeps the tokens it was given (the output's ``token_ids``, whether or not the
    caller iterated the handle)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.tokens: list[int] = []

    def _token(self, tok: int) -> None:
        self.tokens.append(tok)
        super()._token(tok)


class RemoteCluster(GenerateMixin):
    """A client of a running deployment (``mooncake-rs serve --etcd``). Give ``etcd``
    (the leader is looked up there, under ``cluster``'s prefix) or ``address`` (a
    ``serve`` process's ``--listen``); ``auth_token`` is the cluster token."""

    def __init__(self, address: str | None = None, *, etcd: "str | EtcdClient | None" = None, auth_token: str,
                 cluster: str = "default", connect_timeout_s: float = 10.0) -> None:
        if (address is None) == (etcd is None):
            raise InvalidArgument("give either etcd= (find the leading serve process there) or address=HOST:PORT")
        if not isinstance(auth_token, str) or len(auth_token) < 16:
            raise InvalidArgument("auth_token must be the cluster token (a string of at least 16 characters)")
        self._address, self._token = address, auth_token
        self._etcd = EtcdClient(etcd) if isinstance(etcd, str) else etcd
        self._prefix = cluster_prefix(cluster)
        self._connect_timeout_s = connect_timeout_s
        self._ids = itertools.count(1)
        self._conn: _Connection | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._connection()  # fail now, not at the first request, if nothing answers

    def _leader(self) -> str:
        if self._address is not None:
            return self._address
        assert self._etcd is not None
        key = leader_key(self._prefix)
        kv = self._etcd.get(key)
        if kv is None:
            raise ServiceUnavailable(f"no serve process leads {self._prefix} (is `mooncake-rs serve --etcd` running?)")
        try:
            return decode_leader(kv.value, records_key(self._token), key, kv.lease)
        except InvalidArgument as e:  # an etcd writer's record: never connect to it
            log.error("%s; waiting for a signed one", e)
            raise ServiceUnavailable(str(e)) from e

    def _connection(self) -> _Connection:
        """The live connection, or a new one to the current leader (tried until
        ``connect_timeout_s``: a failover takes the lease TTL)."""
        with self._lock:
            if self._closed:
                raise InvalidArgument("the remote cluster is closed")
            if self._conn is not None and self._conn.alive:
                return self._conn
            deadline = time.monotonic() + self._connect_timeout_s
            while True:
                try:
                    self._conn = _Connection(self._leader(), self._token, timeout_s=5.0)
                    return self._conn
                except Unauthorized:
                    raise
                except ServiceUnavailable as e:
                    if time.monotonic() > deadline:
                        raise ServiceUnavailable(f"cannot reach the conductor service: {e}") from e
                    time.sleep(0.2)

    @property
    def address(self) -> str | None:
        """The service this client talks to now (None before it connected)."""
        c = self._conn
        return c.address if c is not None else None

    def submit(self, prompt: Sequence[int], params: Any = None, *, timeout_s: float | None = None) -> RequestHandle:
        """As ``Cluster.submit``: admits one request (raises what the service raised:
        ``Overloaded``, ``InvalidArgument``, ``ServiceUnavailable``) and returns its handle."""
        toks, params, wait = request_entry(prompt, params, timeout_s)
        conn = self._connection()
        cid = next(self._ids)
        handle = _RemoteHandle(cid, toks, lambda rid, err, outcome: self._cancel(conn, rid))
        p = _Pending(handle)
        conn.add(cid, p)
        conn.link.send(Submit(cid, toks, params, wait))
        if not p.answered.wait(self._connect_timeout_s + 30.0):
            handle.cancel()
            raise ServiceUnavailable(f"the conductor service at {conn.address} did not answer a submit")
        if p.error is not None:
            raise p.error
        return handle

    @staticmethod
    def _cancel(conn: _Connection, cid: int) -> None:
        conn._pop(cid)
        conn.link.send(CancelSubmitted(cid))

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """The service's Prometheus exposition (totals, instance gauges)."""
        ans = self._connection().query(next(self._ids), "metrics", timeout_s)
        return str(ans.text)

    def instances(self, timeout_s: float = 10.0) -> dict[int, str]:
        """The service's live workers: id -> name."""
        ans = self._connection().query(next(self._ids), "instances", timeout_s)
        return dict(ans.instances)

    def instance_stats(self, timeout_s: float = 30.0) -> dict[int, dict[str, float]]:
        """Per live worker, as ``Cluster.instance_stats``: bytes its transfer engine moved
        (``copied_bytes``), seconds with a transfer in flight (``copy_busy_s``), blocks..."""
        ans = self._connection().query(next(self._ids), "stats", timeout_s)
        return {int(k): dict(v) for k, v in ans.stats.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.link.close()

    def __enter__(self) -> "RemoteCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
