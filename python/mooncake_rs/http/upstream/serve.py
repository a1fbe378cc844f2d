"""``mooncake-rs serve --upstream ...``: the KV-aware proxy over external engines, run by uvicorn."""

from __future__ import annotations

import argparse
import os
import sys

from ...errors import InvalidArgument
from .listen import run_app, upstream_basics

__all__ = ["serve_upstreams"]


def serve_upstreams(args: argparse.Namespace) -> int:
    """Blocks until Ctrl-C / SIGTERM. Upstreams without roles (``cli._serve`` sends those
    with ``prefill:``/``decode:`` roles to ``pd_serve.py``)."""
    from ...interop.upstream import UpstreamRouter, parse_upstream

    specs = [parse_upstream(s) for s in args.upstream]
    if args.model is not None:
        raise InvalidArgument("--model and --upstream exclude each other: --upstream routes over external "
                              "engines (give their tokenizer with --tokenizer), --model serves a model here")
    if not args.tokenizer:
        raise InvalidArgument("--upstream needs --tokenizer DIR (tokenizer.json / tokenizer_config.json of the "
                              "upstreams' model): prompts are tokenized to hash their blocks")
    if not os.path.isdir(args.tokenizer):
        raise InvalidArgument(f"--tokenizer {args.tokenizer!r} is not a directory")
    missing = [s.name for s in specs if not s.events]
    if missing:
        print(f"mooncake-rs: upstreams {missing} have no events=: routed by load only", file=sys.stderr)
    basics = upstream_basics(args)
    if basics is None:
        return 2
    tok, api_key, policy = basics
    from .proxy import create_proxy_app
    with UpstreamRouter(specs, block_size=args.block_size, seed=args.seed, policy=policy,
                        rejection=args.rejection, ttft_slo_s=args.ttft_slo) as router:
        print(f"mooncake-rs: routing over {len(specs)} upstreams ({', '.join(router.names)}) on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        app = create_proxy_app(router, tok, api_key=api_key, request_timeout_s=args.request_timeout)
        run_app(app, args.host, args.port, args.log_level)
    return 0
