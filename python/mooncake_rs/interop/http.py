"""The Mooncake Conductor Indexer HTTP API over an :class:`.indexer.Indexer` (ASGI, starlette).

``POST /register``, ``/unregister``, ``/query``, ``/query_by_hash`` with Mooncake's field
names and response shapes; ``GET /health`` and ``GET /stats`` are ours. Bad input is
HTTP 400 ``{"error": "..."}``. Needs the ``indexer`` extra (starlette, uvicorn).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import InvalidArgument, Overloaded
from .indexer import HashName, Indexer
from .indexer_api import QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest, decode_request

__all__ = ["create_app", "serve"]

log = logging.getLogger("mooncake_rs.interop")

_json = msgspec.json.Encoder()


def _reply(obj: object, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


MAX_BODY = 8 << 20
"""Bytes a request body may have (a /query of a million token ids fits)."""


class _TooLarge(Exception):
    pass


async def _body(request: Request) -> bytes:
    """The body, refused past ``MAX_BODY`` whatever Content-Length says (read in chunks,
    so a large upload is never held whole)."""
    claimed = request.headers.get("content-length", "")
    if claimed.isdigit() and int(claimed) > MAX_BODY:
        raise _TooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise _TooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def _endpoint(handler: Callable[[bytes], object]) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            body = await _body(request)
        except _TooLarge:
            return _reply({"error": f"the request body is larger than {MAX_BODY} bytes"}, 413)
        try:
            return _reply(handler(body))
        except InvalidArgument as e:
            return _reply({"error": str(e)}, 400)
        except Overloaded as e:
            return _reply({"error": str(e)}, 429)
        except Exception as e:  # noqa: BLE001 - an answer, never a reset connection
            log.exception("indexer request failed")
            return _reply({"error": f"{type(e).__name__}: {e}"}, 500)

    return run


def create_app(indexer: Indexer) -> Starlette:
    """An ASGI app serving ``indexer``; the app closes it on shutdown."""

    def register(body: bytes) -> object:
        return indexer.register(decode_request(body, RegisterRequest))

    def unregister(body: bytes) -> object:
        return indexer.unregister(decode_request(body, UnregisterRequest))

    def query(body: bytes) -> object:
        return indexer.query(decode_request(body, QueryRequest))

    def query_by_hash(body: bytes) -> object:
        return indexer.query_by_hash(decode_request(body, QueryByHashRequest))

    async def health(_request: Request) -> Response:
        return _reply({"status": "ok"})

    async def stats(_request: Request) -> Response:
        return _reply(indexer.stats())

    # Handlers are sync and short (the block index does the work in Rust), so they run
    # on the event loop; starlette would otherwise hop to a thread per request.
    routes = [
        Route("/register", _endpoint(register), methods=["POST"]),
        Route("/unregister", _endpoint(unregister), methods=["POST"]),
        Route("/query", _endpoint(query), methods=["POST"]),
        Route("/query_by_hash", _endpoint(query_by_hash), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            indexer.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.indexer = indexer
    return app


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"--listen must be HOST:PORT (e.g. 127.0.0.1:8800), got {listen!r}")
    return host.strip("[]"), int(port)


def serve(listen: str, hash: HashName = "rfc", seed: int = 0, map_capacity: int = 1 << 20,
          max_publishers: int = 256) -> None:
    """Run the indexer HTTP server until interrupted (``mooncake-rs indexer``)."""
    import uvicorn

    host, port = parse_listen(listen)
    indexer = Indexer(hash=hash, seed=seed, map_capacity=map_capacity, max_publishers=max_publishers)
    uvicorn.run(create_app(indexer), host=host, port=port, log_level="warning")
