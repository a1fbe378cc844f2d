"""The OpenAI-compatible P/D proxy (``serve --upstream prefill:...=... decode:...=...``).

Per request, vLLM's disaggregated protocol:
1. the conductor picks the prefill instance (``interop/pd.py``); it gets the request with
   ``max_tokens=1``, not streamed, and ``kv_transfer_params={"do_remote_decode": true}``:
   it computes the prompt, its connector saves the blocks, and its answer's
   ``kv_transfer_params`` say where they are;
2. the least loaded decode instance gets the client's request unchanged plus those
   ``kv_transfer_params``: its connector loads the blocks, it computes only the prompt's
   last partial block, and its answer (streamed or not) goes back to the client.

Failures are bounded: the prefill call has ``prefill_timeout_s``. A prefill that cannot be
reached, dies or answers 5xx is taken out of routing (a connect failure) and the request
is re-run on the decode instance alone (it computes the whole prompt: the same output,
slower); a decode that cannot be reached is marked down and another one is tried; a
decode stream that breaks ends with an error event. ``X-Mooncake-Prefill`` /
``X-Mooncake-Decode`` name the instances used (``none``: no prefill instance).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import ApiError, bad_request
from ...interop.pd import DecodeChoice, PDRouter
from .proxy import prompt_ids_of
from .forward import UpstreamHttp, is_stream, passthrough, read_body

__all__ = ["create_pd_app", "PREFILL_HEADER", "DECODE_HEADER"]

log = logging.getLogger("mooncake_rs.interop")  # the name it logged under before it moved to http

PREFILL_HEADER = "X-Mooncake-Prefill"
DECODE_HEADER = "X-Mooncake-Decode"
_MAX_BODY = 16 << 20


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill's copy of a request: one token, not streamed, asked to keep its KV."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens", "n")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def create_pd_app(router: PDRouter, tokenizer: Any, *, api_key: str | None = None,
                  request_timeout_s: float | None = None, prefill_timeout_s: float = 60.0,
                  connect_timeout_s: float = 5.0) -> Starlette:
    shared = UpstreamHttp(api_key=api_key, request_timeout_s=request_timeout_s,
                          connect_timeout_s=connect_timeout_s, what="P/D request")
    client, check_auth, error = shared.client, shared.check_auth, shared.error

    async def run_prefill(ids: list[int], body: dict[str, Any], path: str, fwd: dict[str, str],
                          headers: dict[str, str]) -> tuple[dict[str, Any] | None, Response | None]:
        """The prefill step: (kv_transfer_params, None), (None, None) to fall back, or (None, an error)."""
        mt = body.get("max_tokens")
        expected = mt if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else None
        # The cache partitions as the engines fold them: a tenant's salt, a LoRA adapter.
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) and body.get("cache_salt") else None
        model = body.get("model")
        lora = model if isinstance(model, str) and model in router.prefill.lora_adapters else None
        r = router.prefill.route(ids, expected_output_len=expected, cache_salt=salt, lora_name=lora)
        headers[PREFILL_HEADER] = r.name
        try:
            resp = await client().post(r.url + path, json=prefill_body(body), headers=fwd,
                                       timeout=httpx.Timeout(prefill_timeout_s, connect=connect_timeout_s))
        except httpx.TransportError as e:
            router.prefill.finish(r, failed=True)
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                router.prefill.mark_down(r)
            log.warning("prefill %r failed (%s: %s); re-running the request on the decode instance", r.name,
                        type(e).__name__, e)
            return None, None
        if resp.status_code >= 500:
            router.prefill.finish(r, failed=True)
            log.warning("prefill %r answered %d; re-running the request on the decode instance", r.name,
                        resp.status_code)
            return None, None
        if resp.status_code >= 400:  # the request itself is wrong: the decode would refuse it too
            router.prefill.finish(r, failed=True)
            return None, Response(resp.content, status_code=resp.status_code,
                                  headers={**headers, "content-type": "application/json"})
        router.prefill.first_token(r)
        router.prefill.finish(r, 1)
        try:
            params = resp.json().get("kv_transfer_params")
        except ValueError:
            params = None
        return (params if isinstance(params, dict) else None), None

    async def forward(request: Request, path: str, kind: str) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        try:
            check_auth(request)
            raw = await request.body()
            if len(raw) > _MAX_BODY:
                raise ApiError(413, f"the request body is larger than {_MAX_BODY} bytes", code="body_too_large")
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise bad_request(f"the request body is not valid JSON: {e}") from None
            ids = prompt_ids_of(tokenizer, kind, body)
            fwd = {"content-type": "application/json", "x-request-id": rid}
            if "authorization" in request.headers:
                fwd["authorization"] = request.headers["authorization"]
            router.count("pd_requests")
            params, failed = await run_prefill(ids, body, path, fwd, headers)
        except Exception as e:  # noqa: BLE001 - every failure answers in the OpenAI error shape
            return error(e, headers)
        if failed is not None:
            return failed
        decode_body = dict(body)
        if params is None:
            router.count("prefill_fallbacks")
            headers[PREFILL_HEADER] = "none"
            decode_body.pop("kv_transfer_params", None)
        else:
            decode_body["kv_transfer_params"] = params
        tried: list[str] = []
        while True:
            try:
                d = router.pick_decode(exclude=tried)
            except Exception:  # noqa: BLE001 - none left to try: the request fails with 502
                return error(ApiError(502, f"no decode instance could be reached (tried {tried})",
                                      type="upstream_error", code="upstream_unreachable"), headers)
            headers[DECODE_HEADER] = d.name
            try:
                resp = await client().send(client().build_request("POST", d.url + path, json=decode_body,
                                                                  headers=fwd), stream=True)
                break
            except httpx.TransportError as e:
                connect = isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                router.decode_done(d, failed=True, unreachable=connect)
                tried.append(d.name)
                if not connect:
                    return error(ApiError(502, f"decode {d.name!r} failed: {type(e).__name__}: {e}",
                                          type="upstream_error", code="upstream_unreachable"), headers)
        return await relay(resp, d, headers)

    async def relay(resp: httpx.Response, d: DecodeChoice, headers: dict[str, str]) -> Response:
        if not is_stream(resp, headers):
            try:
                data = await read_body(resp)
            except httpx.TransportError as e:
                router.decode_done(d, failed=True)
                return error(ApiError(502, f"decode {d.name!r} broke: {type(e).__name__}: {e}",
                                      type="upstream_error", code="upstream_stream_broken"), headers)
            router.decode_done(d, failed=resp.status_code >= 500)
            return Response(data, status_code=resp.status_code, headers=headers)

        stream = passthrough(resp, f"decode {d.name!r}", failed_from=500,
                             on_end=lambda _chunks, failed: router.decode_done(d, failed=failed))
        return StreamingResponse(stream, status_code=resp.status_code, headers=headers)

    async def models(request: Request) -> Response:
        for name in router.decode_names:
            url = router._decode[name].spec.url
            try:
                resp = await client().get(url + "/v1/models")
            except httpx.TransportError:
                continue
            return Response(resp.content, status_code=resp.status_code,
                            headers={"content-type": resp.headers.get("content-type", "application/json")})
        return error(ApiError(502, "no decode instance answered /v1/models", type="upstream_error",
                              code="upstream_unreachable"), {})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "prefill": router.prefill.names, "decode": router.decode_names})

    return shared.app(forward, models=models, health=health, stats=router.stats)
