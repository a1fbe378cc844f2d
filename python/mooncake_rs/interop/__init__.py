"""Interop with engines we did not write: the Mooncake indexer API, and routing over
external OpenAI engines on their KV events.

The events themselves (wire format, publisher, subscriber, ingest) are the package below,
:mod:`mooncake_rs.kv_events`.

- :mod:`.indexer`, :mod:`.indexer_api`, :mod:`.http`: the Mooncake Conductor Indexer API.
- :mod:`.engine_info`: an external engine's block size and LoRA adapters.
- :mod:`.upstream`: ``UpstreamRouter``, external OpenAI engines routed by our conductor on their events.
- :mod:`.pd`: ``PDRouter``, the same with prefill/decode roles.

The proxies that serve this routing over HTTP (``serve --upstream``) are
:mod:`mooncake_rs.http.upstream`, a layer above: this package imports nothing of ``http``.

See docs/interop.md. This package imports neither pyzmq nor the HTTP stack until a
subscriber or a server is used.
"""

from __future__ import annotations

from .upstream import UpstreamRouter, UpstreamSpec, parse_upstream

__all__ = ["UpstreamRouter", "UpstreamSpec", "parse_upstream"]
