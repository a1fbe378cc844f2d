"""The OpenAI-compatible proxy over external engines (``mooncake-rs serve --upstream ...``).

Per request: tokenize the prompt (the upstreams' tokenizer, ``--tokenizer``) to hash its
blocks, let :class:`~mooncake_rs.interop.upstream.UpstreamRouter` pick the upstream, forward the request body
unchanged (httpx, async) and pass the answer back as it comes: ``text/event-stream``
chunk by chunk, anything else whole. The chosen upstream is named in the
``X-Mooncake-Upstream`` response header. Errors are in the OpenAI shape: a refused
request is 429 with ``Retry-After`` (as the HTTP front), an upstream that cannot be
reached is 502, bad input is 400. An upstream's own error answer is passed through.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...errors import InvalidArgument
from ..errors import ApiError, bad_request
from ...interop.upstream import Route, UpstreamRouter
from .forward import UpstreamHttp, is_stream, passthrough, read_body

__all__ = ["create_proxy_app", "prompt_ids_of"]


_MAX_BODY = 16 << 20
UPSTREAM_HEADER = "X-Mooncake-Upstream"


def prompt_ids_of(tokenizer: Any, kind: str, body: Any) -> list[int]:
    """The token ids the upstream will see for this request body (what we hash)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
        try:
            return list(tokenizer.encode_chat(messages, add_generation_prompt=bool(body.get("add_generation_prompt",
                                                                                            True))))
        except (InvalidArgument, TypeError, ValueError, KeyError) as e:
            raise bad_request(f"'messages' cannot be rendered with the chat template: {e}", "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # ["text"] or [[ids]]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise bad_request("'prompt' must be a string, a list of token ids, or a list of one of those "
                      "(one prompt per request through the router)", "prompt")


def _usage_tokens(body: bytes) -> int | None:
    try:
        usage = json.loads(body).get("usage") or {}
        return int(usage["completion_tokens"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def create_proxy_app(router: UpstreamRouter, tokenizer: Any, *, api_key: str | None = None,
                     request_timeout_s: float | None = None, connect_timeout_s: float = 5.0) -> Starlette:
    """The ASGI app routing ``/v1/completions`` and ``/v1/chat/completions`` over ``router``'s upstreams."""
    shared = UpstreamHttp(api_key=api_key, request_timeout_s=request_timeout_s,
                          connect_timeout_s=connect_timeout_s, what="proxied request")
    client, check_auth, error = shared.client, shared.check_auth, shared.error

    async def body_of(request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > _MAX_BODY:
                raise ApiError(413, f"the request body is larger than {_MAX_BODY} bytes; send a shorter prompt",
                               code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def unreachable(r: Route, e: Exception) -> ApiError:
        return ApiError(502, f"upstream {r.name!r} ({r.url}) cannot be reached: {type(e).__name__}: {e}; "
                             "check that it is running, or retry (another upstream may be picked)",
                        type="upstream_error", code="upstream_unreachable")

    async def forward(request: Request, path: str, kind: str) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        try:
            check_auth(request)
            raw = await body_of(request)
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise bad_request(f"the request body is not valid JSON: {e}") from None
            ids = prompt_ids_of(tokenizer, kind, body)
            mt = body.get("max_tokens")
            # the conductor's estimate of the output; the upstream judges max_tokens itself
            expected = (min(mt, router.conductor.config.max_output_len)
                        if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else None)
            salt = body.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
            model = body.get("model")
            lora = model if isinstance(model, str) and model in router.lora_adapters else None
            r = router.route(ids, expected_output_len=expected, cache_salt=salt, lora_name=lora)
        except Exception as e:  # noqa: BLE001 - every failure answers in the OpenAI error shape
            return error(e, headers)
        out_headers = {"content-type": "application/json", "x-request-id": rid}
        if "authorization" in request.headers:
            out_headers["authorization"] = request.headers["authorization"]
        while True:
            headers[UPSTREAM_HEADER] = r.name
            try:
                resp = await client().send(client().build_request("POST", r.url + path, content=raw,
                                                                  headers=out_headers), stream=True)
                break
            except httpx.TransportError as e:
                router.finish(r, failed=True)
                # Nothing reached the engine when it cannot even connect: safe to send
                # elsewhere. Any other transport error may have been half-served: no retry.
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) and router.mark_down(r):
                    try:
                        r = router.route(ids, expected_output_len=expected, cache_salt=salt, lora_name=lora)
                        continue
                    except Exception as e2:  # noqa: BLE001
                        return error(e2, headers)
                return error(unreachable(r, e), headers)
            except BaseException:
                router.finish(r, failed=True)
                raise
        if not is_stream(resp, headers):
            try:
                data = await read_body(resp)
            except httpx.TransportError as e:
                router.finish(r, failed=True)
                return error(unreachable(r, e), headers)
            ok = resp.status_code < 400
            if ok:
                router.first_token(r)
            router.finish(r, _usage_tokens(data), failed=not ok)
            return Response(data, status_code=resp.status_code, headers=headers)

        # data chunks less the [DONE] line: about one a token (a usage chunk aside)
        stream = passthrough(resp, f"upstream {r.name!r} ({r.url})", failed_from=400,
                             on_first=lambda: router.first_token(r),
                             on_end=lambda chunks, failed: router.finish(r, max(0, chunks - 1), failed=failed))
        return StreamingResponse(stream, status_code=resp.status_code, headers=headers)

    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except ApiError as e:
            return error(e, {})
        last: Exception | None = None
        for name in router.names:
            url = router._up(name).spec.url
            try:
                resp = await client().get(url + "/v1/models", headers={k: v for k, v in request.headers.items()
                                                                      if k == "authorization"})
            except httpx.TransportError as e:
                last = e
                continue
            return Response(resp.content, status_code=resp.status_code,
                            headers={"content-type": resp.headers.get("content-type", "application/json")})
        return error(ApiError(502, f"no upstream answered /v1/models ({last})", type="upstream_error",
                              code="upstream_unreachable"), {})

    async def health(request: Request) -> Response:
        st = router.stats()
        up = [n for n, v in st.items() if not v["down"]]
        return JSONResponse({"status": "ok" if up else "unavailable", "upstreams": router.names,
                             "down": [n for n in router.names if n not in up]}, status_code=200 if up else 503)

    return shared.app(forward, models=models, health=health, stats=router.stats)
