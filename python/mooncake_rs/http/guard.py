"""What keeps the HTTP front serving under stress: a cap on open connections, a
deadline for a request's headers (slowloris), and a shutdown that drains streams.

uvicorn closes idle keep-alive connections but has no deadline for a request's headers
and no cap on connections (its ``limit_concurrency`` answers 503 only once a request's
headers are in, so slow connections still hold every descriptor). ``GuardedH11Protocol``
adds both: a connection past ``max_connections`` is answered 503 and closed at once, and
one that has not sent a complete request head within ``header_timeout_s`` of opening
(or of its previous response) is closed. The body's deadline is the app's (app.py).

``DrainingServer``: on shutdown (SIGTERM / SIGINT, or ``ServerThread.stop``) the front
first ends every running request (``Frontend.drain``: a stream gets an error event and
``[DONE]``), then uvicorn closes the connections; and the signal is not re-raised at
the end, so ``serve`` closes its cluster before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any, Generator

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import FrontLimits

__all__ = ["GuardedH11Protocol", "DrainingServer", "make_config"]

log = logging.getLogger("mooncake_rs.http")


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error": {"message": "too many open connections; retry shortly", "type": "service_unavailable", '
              b'"param": null, "code": "too_many_connections"}}')


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a request-head deadline (the
    limits come from ``config.guard``, a :class:`FrontLimits`)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._limits: FrontLimits = getattr(config, "guard", None) or FrontLimits()
        self._max_connections = self._limits.connections
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            transport.write(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
            transport.close()
            return
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_deadline, self.cycle)

    def _head_deadline(self, cycle_then: Any) -> None:
        # no new request (cycle) started since the deadline was armed: the head never came
        self._head_timer = None
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains the front before closing connections and does not
    re-raise the signal that stopped it (the caller closes what it owns, then exits)."""

    def __init__(self, config: uvicorn.Config, front: Any) -> None:
        super().__init__(config)
        self.front = front
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
            self.stopped_by = self._captured_signals[0] if self._captured_signals else None
            self._captured_signals.clear()  # handled: serve() exits normally after its cleanup

    async def shutdown(self, sockets: Any = None) -> None:
        drain = getattr(self.front, "drain", None)
        if drain is not None:
            n = drain("the server is shutting down")
            limit = getattr(getattr(self.front, "limits", None), "drain_timeout_s", 5.0)
            if n:
                log.warning("shutting down: ended %d running requests", n)
            waited = 0.0
            while getattr(self.front, "active_requests", 0) and waited < limit:
                await asyncio.sleep(0.05)
                waited += 0.05
        await super().shutdown(sockets)


def make_config(app: Any, front: Any, **kw: Any) -> uvicorn.Config:
    """A uvicorn config that serves ``app`` with the guarded protocol and ``front``'s limits."""
    limits: FrontLimits = getattr(front, "limits", None) or FrontLimits()
    config = uvicorn.Config(app, http=GuardedH11Protocol, timeout_graceful_shutdown=math.ceil(limits.drain_timeout_s) + 2,
                            **kw)
    config.guard = limits  # type: ignore[attr-defined]
    return config
