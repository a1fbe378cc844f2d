"""What both ``serve --upstream`` apps (the KV-aware proxy, ``proxy.py``; the P/D proxy,
``pd_app.py``) do the same way around the engines they forward to: one httpx client,
made in the server's event loop on first use (a client is bound to its loop), the API
key check, failures answered in the OpenAI error shape, and a streamed answer passed
through as it comes (``passthrough``)."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ApiError, from_exception

__all__ = ["UpstreamHttp", "is_stream", "read_body", "passthrough"]

log = logging.getLogger("mooncake_rs.interop")  # the name it logged under before it moved to http


class UpstreamHttp:
    """``what`` names the app's requests in the log of an unexpected failure."""

    def __init__(self, *, api_key: str | None, request_timeout_s: float | None, connect_timeout_s: float,
                 what: str) -> None:
        self.api_key = api_key
        self.timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self.what = what
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        return self._client

    async def aclose(self) -> None:
        """At the app's shutdown (its lifespan): the client goes with the loop it was made in."""
        c, self._client = self._client, None
        if c is not None:
            await c.aclose()

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization") or ""
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>' (the key the "
                                "server was started with, --api-key)", code="invalid_api_key")

    def app(self, forward: Callable[[Request, str, str], Awaitable[Response]], *,
            models: Callable[[Request], Awaitable[Response]], health: Callable[[Request], Awaitable[Response]],
            stats: Callable[[], dict[str, Any]]) -> Starlette:
        """A proxy's OpenAI routes: completions and chat through ``forward(request, path,
        kind)``, ``/v1/models``, ``/health``, ``/stats`` (``stats()`` as JSON); the client
        closed at the app's shutdown."""

        async def completions(request: Request) -> Response:
            return await forward(request, "/v1/completions", "completion")

        async def chat(request: Request) -> Response:
            return await forward(request, "/v1/chat/completions", "chat")

        async def stats_route(request: Request) -> Response:
            return JSONResponse(stats())

        @contextlib.asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            try:
                yield
            finally:
                await self.aclose()

        return Starlette(routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats_route, methods=["GET"]),
        ], lifespan=lifespan)

    def error(self, e: BaseException, headers: dict[str, str]) -> JSONResponse:
        err = from_exception(e)
        if err.status >= 500 and not isinstance(e, ApiError):
            log.exception("%s failed", self.what)
        return JSONResponse(err.body(), status_code=err.status, headers={**headers, **err.headers})


#: the engine's answer headers a proxy passes on to its client
_PASS_HEADERS = ("content-type", "cache-control")


def is_stream(resp: httpx.Response, headers: dict[str, str]) -> bool:
    """Copies the engine's ``content-type`` and ``cache-control`` into ``headers`` (the
    client's answer); whether the engine answers with an event stream."""
    for h in _PASS_HEADERS:
        if h in resp.headers:
            headers[h] = resp.headers[h]
    return resp.headers.get("content-type", "").startswith("text/event-stream")


async def read_body(resp: httpx.Response) -> bytes:
    """An answer that is not a stream, whole; ``resp`` is closed either way (the
    ``httpx.TransportError`` of one that broke is the caller's to answer)."""
    try:
        return await resp.aread()
    finally:
        await resp.aclose()


async def passthrough(resp: httpx.Response, source: str, *, failed_from: int,
                      on_end: Callable[[int, bool], None],
                      on_first: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """An engine's event stream, chunk for chunk as it comes (``StreamingResponse``'s
    body). ``on_first()`` before each chunk while no ``data:`` line has passed (the first
    token); a stream that breaks ends with one ``data:`` event in the OpenAI error shape
    naming ``source``. ``on_end(data_chunks, failed)`` once, however it ends: the
    ``data:`` lines passed and whether it failed (it broke, or the engine answered with
    a status of ``failed_from`` or more)."""
    chunks = 0
    failed = True
    try:
        async for chunk in resp.aiter_raw():
            if chunks == 0 and on_first is not None:
                on_first()
            chunks += chunk.count(b"data:")
            yield chunk
        failed = resp.status_code >= failed_from
    except httpx.TransportError as e:
        log.warning("the stream from %s broke: %s", source, e)
        broke = ApiError(502, f"the stream from {source} broke: {type(e).__name__}: {e}",
                         type="upstream_error", code="upstream_stream_broken")
        yield b"data: " + json.dumps(broke.body()).encode() + b"\n\n"
    finally:
        # First, before any await: a client that went away cancels this generator, and
        # an await here could be cancelled again before the caller's slot is freed.
        on_end(chunks, failed)
        await resp.aclose()
