"""Serving an ASGI app of ``serve --upstream`` (the KV-aware proxy and the P/D proxy) on
its own listening socket, run by uvicorn until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from ...errors import InvalidArgument

__all__ = ["run_app", "upstream_basics"]


def upstream_basics(args: argparse.Namespace) -> tuple[Any, str | None, str] | None:
    """What both ``serve --upstream`` modes load first: the upstreams' tokenizer, the API
    key (``--api-key`` or ``MOONCAKE_API_KEY``) and the routing policy (``mooncake`` routes as
    ``local_cache_aware``: no fetches between engines). None, after one line on stderr,
    when the ``upstream`` extra is missing."""
    try:
        import httpx  # noqa: F401 - checked here: a missing extra fails in one line
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        from ...text import Tokenizer
    except ImportError as e:
        print(f"mooncake-rs serve --upstream needs the upstream extra (pip install \"mooncake-rs[upstream]\"): {e}",
              file=sys.stderr)
        return None
    api_key = args.api_key or os.environ.get("MOONCAKE_API_KEY") or None
    policy = "local_cache_aware" if args.policy == "mooncake" else args.policy
    return Tokenizer.from_dir(args.tokenizer), api_key, policy


def run_app(app: Any, host: str, port: int, log_level: str) -> None:
    """Blocks until stopped. Our own socket, for TCP_NODELAY (see ``ServerThread``): every
    answer is a header write then a body write, which Nagle would hold for a delayed ACK."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidArgument(f"cannot listen on {host}:{port}: {e}; pick another --port") from None
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
