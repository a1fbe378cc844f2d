"""``mooncake-rs serve --upstream prefill:NAME=URL,events=... --upstream decode:NAME=URL``:
the P/D proxy (pd_app.py) run by uvicorn. Reached from serve_upstream.py when an
``--upstream`` names a role."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..errors import InvalidArgument

__all__ = ["serve_pd"]


def serve_pd(args: argparse.Namespace) -> int:
    """Blocks until Ctrl-C / SIGTERM."""
    from .pd import PDRouter, is_role_spec

    plain = [s for s in args.upstream if not is_role_spec(s)]
    if plain:
        raise InvalidArgument(f"--upstream {plain[0]!r} has no role: with P/D every upstream is prefill:NAME=URL,... "
                              "or decode:NAME=URL")
    if not args.tokenizer or not os.path.isdir(args.tokenizer):
        raise InvalidArgument("--upstream with roles needs --tokenizer DIR (the upstreams' tokenizer.json and "
                              "tokenizer_config.json): prompts are tokenized to hash their blocks")
    try:
        import uvicorn

        from ..text import Tokenizer
        from .pd_app import create_pd_app
    except ImportError as e:
        print(f"mooncake-rs serve --upstream needs the upstream extra (pip install \"mooncake-rs[upstream]\"): {e}",
              file=sys.stderr)
        return 2
    tok = Tokenizer.from_dir(args.tokenizer)
    api_key = args.api_key or os.environ.get("MOONCAKE_API_KEY") or None
    policy = "local_cache_aware" if args.policy == "mooncake" else args.policy
    with PDRouter(args.upstream, block_size=args.block_size, seed=args.seed, policy=policy,
                  rejection=args.rejection, ttft_slo_s=args.ttft_slo) as router:
        print(f"mooncake-rs: P/D over prefill {router.prefill.names} and decode {router.decode_names} on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            sock.close()
            raise InvalidArgument(f"cannot listen on {args.host}:{args.port}: {e}; pick another --port") from None
        config = uvicorn.Config(create_pd_app(router, tok, api_key=api_key, request_timeout_s=args.request_timeout),
                                log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            sock.close()
    return 0
