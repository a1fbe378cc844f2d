"""A small etcd v3 client over etcd's JSON gateway (``/v3/...``), standard library only.

Why this client: the deployment needs only leases (grant, keep-alive, revoke), puts and
ranges, one transaction shape (create-if-absent, for registration and leader election)
and prefix watches. etcd 3.4 (Debian's ``etcd-server``, what tests and CI run) serves all
of them as JSON over HTTP on its client port, so no gRPC stack and no third-party etcd
package is needed (the Python ``etcd3`` package pins old protobuf/grpcio and is not
maintained). Keys and values are bytes; the gateway wants them base64-encoded.

etcd's own access control is supported: ``user``/``password`` (``/v3/auth/authenticate``
gives a token sent with every call, fetched again when etcd says it expired) and TLS
(``https://``, with ``ca_file`` to trust etcd's certificate and ``cert_file``/``key_file``
for client-certificate authentication). Enable them wherever etcd is reachable by others:
without them anyone who can reach etcd can write to it (docs/deploy.md, threat model).

Every call has a deadline (``timeout_s``); an unreachable or failing etcd raises
:class:`~mooncake_rs.errors.ServiceUnavailable`, never hangs. A watch is a long-lived
streaming response read by the caller's thread; :meth:`Watch.close` (from any thread)
ends it, and a watch whose connection drops ends with ``ServiceUnavailable`` so the
caller can resync (see ``membership.py``).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, ServiceUnavailable

__all__ = ["EtcdClient", "KeyValue", "WatchEvent", "Watch", "prefix_end"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(_unb64(raw.get("key")), _unb64(raw.get("value")), int(raw.get("mod_revision", 0)),
                    int(raw.get("lease", 0)))


class EtcdClient:
    """One etcd endpoint, ``http://HOST:PORT`` or ``https://HOST:PORT``. Thread-safe: each
    call opens its own connection (calls are rare: registration, keep-alives, elections).

    ``user``/``password``: etcd's authentication (``etcdctl auth enable``). ``ca_file``:
    the CA that signed etcd's certificate (default: the system's); ``cert_file`` and
    ``key_file``: this client's certificate (etcd's ``--client-cert-auth``)."""

    def __init__(self, url: str, timeout_s: float = 2.0, *, user: str | None = None, password: str | None = None,
                 ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None) -> None:
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise InvalidArgument(f"etcd URL {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s!r}")
        if (user is None) != (password is None):
            raise InvalidArgument("etcd authentication needs both user and password")
        if (cert_file is None) != (key_file is None):
            raise InvalidArgument("a client certificate needs both cert_file and key_file")
        self._tls: ssl.SSLContext | None = None
        if u.scheme == "https":
            try:
                self._tls = ssl.create_default_context(cafile=ca_file)
                if cert_file is not None:
                    self._tls.load_cert_chain(cert_file, key_file)
            except (OSError, ssl.SSLError) as e:
                raise InvalidArgument(f"etcd TLS files: {e}") from e
        elif ca_file or cert_file:
            raise InvalidArgument(f"TLS files given for a plain-HTTP etcd URL {url!r}: use https://")
        self.url = f"{u.scheme}://{u.hostname}:{u.port or 2379}"
        self._host, self._port = u.hostname, u.port or 2379
        self.timeout_s = float(timeout_s)
        self._user, self._password = user, password
        self._auth_token: str | None = None
        self._auth_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EtcdClient({self.url!r})"

    # ---- transport
    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._tls is not None:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._tls)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._user is not None:
            h["Authorization"] = self._token()
        return h

    def _token(self, stale: str | None = None) -> str:
        """etcd's auth token for this user (fetched once, again when ``stale`` expired)."""
        with self._auth_lock:
            if self._auth_token is None or self._auth_token == stale:
                out = self._post("/v3/auth/authenticate", {"name": self._user, "password": self._password},
                                 {"Content-Type": "application/json"})
                token = out.get("token")
                if not token:
                    raise ServiceUnavailable(f"etcd at {self.url} gave no auth token for user {self._user!r}")
                self._auth_token = str(token)
            return self._auth_token

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = self._headers()
        try:
            return self._post(path, body, headers)
        except ServiceUnavailable as e:
            if self._user is None or "token" not in str(e):
                raise
            # the auth token expired (etcd's simple tokens live minutes): once more with a new one
            headers["Authorization"] = self._token(stale=headers.get("Authorization"))
            return self._post(path, body, headers)

    def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        conn = self._connection(self.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise ServiceUnavailable(f"etcd at {self.url} unreachable ({path}): {e}") from e
        finally:
            conn.close()
        try:
            out = json.loads(data) if data else {}
        except ValueError as e:
            raise ServiceUnavailable(f"etcd at {self.url} answered {path} with non-JSON ({resp.status})") from e
        if resp.status != 200 or "error" in out:
            raise ServiceUnavailable(f"etcd at {self.url} refused {path}: {out.get('message') or out.get('error') or resp.status}")
        return out

    # ---- keys
    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Stores ``value``; returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/v3/kv/put", body)["header"]["revision"])

    def get(self, key: bytes) -> KeyValue | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the revision they were read at (watch from
        ``revision + 1`` to miss nothing)."""
        out = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(kv) for kv in out.get("kvs", [])], int(out["header"]["revision"])

    def delete(self, key: bytes) -> bool:
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Puts ``key`` only if it does not exist (one transaction); True if it did not."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        out = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": put}],
        })
        return bool(out.get("succeeded", False))

    def replace(self, key: bytes, value: bytes, mod_revision: int) -> bool:
        """Puts ``key`` only if it was last modified at ``mod_revision`` (one
        transaction: nobody changed it since it was read); True if it was."""
        out = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
        })
        return bool(out.get("succeeded", False))

    # ---- leases
    def lease_grant(self, ttl_s: int) -> int:
        if ttl_s < 1:
            raise InvalidArgument(f"a lease TTL is whole seconds >= 1, got {ttl_s!r}")
        return int(self._call("/v3/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Refreshes ``lease``; returns its TTL, 0 if it is gone (expired or revoked)."""
        out = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(out.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """Revokes ``lease`` and deletes its keys; a lease already gone is fine."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)})
        except ServiceUnavailable as e:
            if "not found" not in str(e):
                raise

    # ---- watches
    def watch_prefix(self, prefix: bytes, start_revision: int) -> "Watch":
        return Watch(self, prefix, start_revision)


class Watch:
    """A prefix watch: iterate for batches of events; ``close()`` ends it from any thread.

    The iterator ends normally after ``close()``; a dropped connection, a compacted start
    revision or a cancel by etcd raise ``ServiceUnavailable`` (the caller resyncs)."""

    def __init__(self, client: EtcdClient, prefix: bytes, start_revision: int) -> None:
        self._closed = threading.Event()
        headers = client._headers()
        self._conn = client._connection(client.timeout_s)
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        try:
            self._conn.request("POST", "/v3/watch", json.dumps(body), headers)
            self._resp = self._conn.getresponse()
            # the stream is read with no timeout: events come when they come; close() and
            # the caller's health check end it (membership.py)
            assert self._conn.sock is not None
            self._conn.sock.settimeout(None)
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise ServiceUnavailable(f"etcd at {client.url} unreachable (watch): {e}") from e
        if self._resp.status != 200:
            self._conn.close()
            raise ServiceUnavailable(f"etcd at {client.url} refused the watch ({self._resp.status})")
        self._url = client.url

    def close(self) -> None:
        """Ends the watch from any thread: the socket is shut down, which wakes the reader;
        the reading thread closes the connection itself (closing it here would race the
        reader inside http.client)."""
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __iter__(self) -> Iterator[list[WatchEvent]]:
        try:
            yield from self._events()
        finally:
            self._conn.close()

    def _events(self) -> Iterator[list[WatchEvent]]:
        while not self._closed.is_set():
            try:
                line = self._resp.readline()
            except (OSError, ValueError, AttributeError, http.client.HTTPException) as e:
                if self._closed.is_set():
                    return
                raise ServiceUnavailable(f"etcd watch at {self._url} lost: {e}") from e
            if not line:
                if self._closed.is_set():
                    return
                raise ServiceUnavailable(f"etcd watch at {self._url} closed by the server")
            try:
                msg = json.loads(line)
            except ValueError as e:
                raise ServiceUnavailable(f"etcd watch at {self._url} sent a malformed line") from e
            res = msg.get("result", {})
            if "error" in msg or res.get("canceled") or int(res.get("compact_revision", 0) or 0):
                raise ServiceUnavailable(f"etcd watch at {self._url} cancelled: {msg.get('error') or res.get('cancel_reason') or 'compacted'}")
            events = [WatchEvent("delete" if ev.get("type") == "DELETE" else "put", _unb64(ev["kv"].get("key")),
                                 _unb64(ev["kv"].get("value")), int(ev["kv"].get("mod_revision", 0)),
                                 int(ev["kv"].get("lease", 0)))
                      for ev in res.get("events", [])]
            if events:
                yield events
