"""``mooncake-rs serve --upstream prefill:NAME=URL,events=... --upstream decode:NAME=URL``:
the P/D proxy (pd_app.py) run by uvicorn. ``cli._serve`` sends ``serve`` here when an
``--upstream`` names a role."""

from __future__ import annotations

import argparse
import os
import sys

from ...errors import InvalidArgument
from .listen import run_app, upstream_basics

__all__ = ["serve_pd"]


def serve_pd(args: argparse.Namespace) -> int:
    """Blocks until Ctrl-C / SIGTERM."""
    from ...interop.pd import PDRouter, is_role_spec

    plain = [s for s in args.upstream if not is_role_spec(s)]
    if plain:
        raise InvalidArgument(f"--upstream {plain[0]!r} has no role: with P/D every upstream is prefill:NAME=URL,... "
                              "or decode:NAME=URL")
    if not args.tokenizer or not os.path.isdir(args.tokenizer):
        raise InvalidArgument("--upstream with roles needs --tokenizer DIR (the upstreams' tokenizer.json and "
                              "tokenizer_config.json): prompts are tokenized to hash their blocks")
    basics = upstream_basics(args)
    if basics is None:
        return 2
    tok, api_key, policy = basics
    from .pd_app import create_pd_app
    with PDRouter(args.upstream, block_size=args.block_size, seed=args.seed, policy=policy,
                  rejection=args.rejection, ttft_slo_s=args.ttft_slo) as router:
        print(f"mooncake-rs: P/D over prefill {router.prefill.names} and decode {router.decode_names} on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        app = create_pd_app(router, tok, api_key=api_key, request_timeout_s=args.request_timeout)
        run_app(app, args.host, args.port, args.log_level)
    return 0
