"""The ASGI app (Starlette): routes, auth, request ids, JSON and server-sent events.

Everything model-specific is in :class:`Frontend`; this file only maps HTTP to it. A
client that goes away is noticed by waiting on the ASGI ``http.disconnect`` message
next to the work: the work is then cancelled and the request's generation closed, so the
cluster frees the request's state at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .errors import ApiError, bad_request, from_exception
from .front import Frontend
from .generation import Generation
from .protocol import GenerateRequest, parse_chat, parse_completion
from .responses import SSE_DONE, Shapes, sse

__all__ = ["create_app"]

log = logging.getLogger("mooncake_rs.http")

REQUEST_ID = "x-request-id"
_MAX_BODY = 16 << 20  # bytes of JSON a request may send


class _Disconnected(Exception):
    pass


async def _until_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
    """Runs ``work``; if the client disconnects first, cancels it and raises _Disconnected."""
    async def watch() -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        raise _Disconnected()
    return task.result()


class _EventStream(StreamingResponse):
    """``text/event-stream`` of ``frames``; ``gen`` is closed whatever ends the stream
    (the end, an error, the client going away)."""

    def __init__(self, frames: AsyncIterator[bytes], gen: Generation, front: Frontend, headers: dict[str, str]) -> None:
        super().__init__(frames, status_code=200, headers={"Cache-Control": "no-cache", **headers},
                         media_type="text/event-stream")
        self.frames, self.gen, self.front = frames, gen, front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for frame in self.frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        self.front.metrics.stream_delta(1)
        try:
            await _until_disconnect(pump(), receive)
        except _Disconnected:
            self.front.metrics.count("disconnects")
        finally:
            self.front.metrics.stream_delta(-1)
            self.gen.close()
            await self.frames.aclose()  # type: ignore[attr-defined]


async def _stream_frames(gen: Generation, shapes: Shapes, req: GenerateRequest, front: Frontend) -> AsyncIterator[bytes]:
    first = True
    try:
        async for d in gen.deltas():
            if d.text or d.finish_reason is not None or first:  # an empty first chunk marks the first token
                yield sse(shapes.chunk(d.text, d.finish_reason, first=first, include_usage=req.include_usage))
                first = False
    except Exception as e:  # noqa: BLE001 - a failure after the headers went out: an error event
        err = from_exception(e)
        log.warning("stream of %s failed: %s", shapes.id, err.message)
        yield sse(err.body())
    else:
        if gen.stop_string is not None:
            front.metrics.count("stop_strings")
        if req.include_usage:
            yield sse(shapes.usage_chunk(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
    front.metrics.count("prompt_tokens", gen.prompt_tokens)
    front.metrics.count("completion_tokens", gen.completion_tokens)
    yield SSE_DONE


async def _collect(gen: Generation) -> str:
    parts = []
    async for d in gen.deltas():
        parts.append(d.text)
    return "".join(parts)


def create_app(front: Frontend) -> Starlette:
    """The OpenAI-compatible app over ``front``."""

    def endpoint(route: str, fn: Callable[[Request, dict[str, str]], Awaitable[Response]], *,
                 auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
            headers = {"X-Request-Id": rid}
            try:
                if auth:
                    front.check_auth(request.headers.get("authorization"))
                resp = await fn(request, headers)
            except Exception as e:  # noqa: BLE001 - every failure answers in the OpenAI error shape
                err = from_exception(e)
                if err.status >= 500 and not isinstance(e, ApiError):
                    log.exception("%s failed", route)
                resp = JSONResponse(err.body(), status_code=err.status, headers={**headers, **err.headers})
            front.metrics.response(route, resp.status_code)
            return resp
        return handler

    async def body_of(request: Request) -> Any:
        # read at most _MAX_BODY bytes, whatever Content-Length claims
        too_big = ApiError(413, f"the request body is larger than {_MAX_BODY} bytes; send a shorter prompt",
                           code="body_too_large")
        claimed = request.headers.get("content-length", "")
        if claimed.isdigit() and int(claimed) > _MAX_BODY:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > _MAX_BODY:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    async def generate(request: Request, headers: dict[str, str], req: GenerateRequest) -> Response:
        gen = front.start(req)
        shapes = Shapes(req.kind, uuid.uuid4().hex, front.model_name, gen.created)
        if req.stream:
            return _EventStream(_stream_frames(gen, shapes, req, front), gen, front, headers)
        try:
            text = await _until_disconnect(_collect(gen), request.receive)
        except _Disconnected:
            front.metrics.count("disconnects")
            return Response(status_code=499, headers=headers)  # nobody reads it; counted as 499
        finally:
            gen.close()
        front.metrics.count("prompt_tokens", gen.prompt_tokens)
        front.metrics.count("completion_tokens", gen.completion_tokens)
        if gen.stop_string is not None:
            front.metrics.count("stop_strings")
        return JSONResponse(shapes.full(text, gen.finish_reason, gen.prompt_tokens, gen.completion_tokens,
                                        gen.cached_tokens),
                            headers=headers)

    async def completions(request: Request, headers: dict[str, str]) -> Response:
        return await generate(request, headers, parse_completion(await body_of(request)))

    async def chat(request: Request, headers: dict[str, str]) -> Response:
        return await generate(request, headers, parse_chat(await body_of(request)))

    async def models(request: Request, headers: dict[str, str]) -> Response:
        return JSONResponse(front.models(), headers=headers)

    async def health(request: Request, headers: dict[str, str]) -> Response:
        ready, why = front.serving_state()
        return JSONResponse({"status": "ok" if ready else "unavailable", "detail": why},
                            status_code=200 if ready else 503, headers=headers)

    async def metrics(request: Request, headers: dict[str, str]) -> Response:
        return PlainTextResponse(front.metrics_text(), headers=headers,
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/v1/completions", endpoint("/v1/completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("/v1/chat/completions", chat), methods=["POST"]),
        Route("/v1/models", endpoint("/v1/models", models), methods=["GET"]),
        Route("/health", endpoint("/health", health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("/metrics", metrics, auth=False), methods=["GET"]),
    ]
    return Starlette(routes=routes)
