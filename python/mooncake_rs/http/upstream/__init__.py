"""The HTTP side of ``serve --upstream``: OpenAI-compatible proxies over engines we did not
write, routed by :mod:`mooncake_rs.interop` (which holds the routing: ``UpstreamRouter``,
the P/D planning, the engines' KV events into the conductor's index).

- :mod:`.proxy`: the KV-aware proxy's ASGI app (``create_proxy_app``); :mod:`.serve` runs it.
- :mod:`.pd_app`: the P/D proxy's ASGI app (``create_pd_app``); :mod:`.pd_serve` runs it.
- :mod:`.forward`: what both apps do the same way (client, API key, errors, passthrough).
- :mod:`.listen`: the listening socket and uvicorn, the tokenizer and key both load first.

Needs the ``upstream`` extra (httpx, starlette, uvicorn). See docs/interop.md.
"""
