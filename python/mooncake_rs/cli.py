"""The ``mooncake-rs`` command (also ``python -m mooncake_rs``)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence

from .errors import MooncakeError

# What each extra brings that a command imports (pyproject.toml's optional dependencies).
_EXTRAS = {
    "torch": ("torch", "safetensors"),
    "http": ("starlette", "uvicorn", "tokenizers", "jinja2"),
    "upstream": ("msgspec", "zmq", "starlette", "uvicorn", "httpx", "tokenizers", "jinja2"),
    "plot": ("matplotlib",),
}


def _missing_extras(command: str, *extras: str) -> int | None:
    """None when every module of ``extras`` is importable; otherwise prints one line that
    says what to install and returns the exit status 2 (checked before any work starts)."""
    missing = [m for e in extras for m in _EXTRAS[e] if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    print(f"mooncake-rs {command} needs pip install \"mooncake-rs[{','.join(extras)}]\" "
          f"(not installed: {', '.join(dict.fromkeys(missing))})", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    if args.index_only:
        from . import demo

        demo.run(
            instances=args.instances,
            conversations=args.conversations or 200,
            turns=args.turns or 5,
            block_size=args.block_size,
            seed=args.seed,
            progress=not args.no_progress,
        )
        return 0
    if importlib.util.find_spec("torch") is None:
        print("mooncake-rs demo: the cluster demo needs torch (pip install \"mooncake-rs[torch]\"); "
              "`mooncake-rs demo --index-only` runs without it", file=sys.stderr)
        return 2
    from .serving import demo as serving_demo

    serving_demo.run(
        conversations=args.conversations or 32,
        turns=args.turns or 5,
        seed=args.seed,
        processes=args.processes,
        progress=not args.no_progress,
        compare=not args.no_compare,
    )
    return 0


def _replay(args: argparse.Namespace) -> int:
    if args.plot and (rc := _missing_extras("replay --plot", "plot")):
        return rc  # before the run, not after it
    from .sim.cli import replay

    return replay(args)


def _trace(args: argparse.Namespace) -> int:
    from .sim import generate_trace, save_trace

    trace = generate_trace(args.requests, rate=args.rate, kind=args.kind, seed=args.seed)
    save_trace(trace, args.out)
    print(f"mooncake-rs: wrote {len(trace)} requests ({args.kind}, {args.rate:g}/s) to {args.out}", file=sys.stderr)
    return 0


def _make_model(args: argparse.Namespace) -> int:
    if rc := _missing_extras("make-model", "torch", "http"):
        return rc
    from .models.tiny import write_model_dir

    path = write_model_dir(args.dir, seed=args.seed, max_position_embeddings=args.max_position_embeddings)
    print(f"mooncake-rs: wrote a tiny random-weight Llama (tokenizer, chat template) to {path}", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Every mode of ``serve`` is chosen here, and only here: ``--etcd`` the conductor of a
    deployment across hosts (with ``--model``, its OpenAI front too); ``--upstream`` a
    router over engines we did not write (with ``prefill:``/``decode:`` roles, the P/D
    proxy); otherwise an embedded cluster of ``--model``."""
    if getattr(args, "rest", None) is not None:  # the http extra is missing: its options are not known
        return _missing_extras("serve", "http") or 2
    if args.etcd:
        if args.model and (rc := _missing_extras("serve --etcd --model", "http")):
            return rc
        from .deploy.serve import run_service

        return run_service(args)
    if args.upstream:
        if rc := _missing_extras("serve --upstream", "upstream"):
            return rc
        from .interop.pd import is_role_spec

        if any(is_role_spec(s) for s in args.upstream):
            from .http.upstream.pd_serve import serve_pd

            return serve_pd(args)
        from .http.upstream.serve import serve_upstreams

        return serve_upstreams(args)
    if rc := _missing_extras("serve", "torch", "http"):
        return rc
    from .http.server import serve

    return serve(args)


def _worker(args: argparse.Namespace) -> int:
    if rc := _missing_extras("worker", "torch"):
        return rc
    from .deploy.worker import run_worker

    return run_worker(args)


def _store(args: argparse.Namespace) -> int:
    from .pool.serve_node import run_store

    return run_store(args)


def _indexer(args: argparse.Namespace) -> int:
    try:
        from .interop.http import serve
    except ImportError as e:
        print(f"mooncake-rs indexer needs the indexer extra (pip install \"mooncake-rs[indexer]\"): {e}",
              file=sys.stderr)
        return 2
    serve(args.listen, hash=args.hash, seed=args.seed, map_capacity=args.map_capacity,
          max_publishers=args.max_publishers)
    return 0


def _kv_pool(args: argparse.Namespace) -> int:
    from .integrations.pool.cli import run_pool

    return run_pool(args)


def _version(args: argparse.Namespace) -> int:
    from . import __version__

    print(__version__)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mooncake-rs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the embedded cluster demo (2 prefill + 1 decode, tiny model, CPU)")
    demo.add_argument("--index-only", action="store_true",
                      help="the hashing and block-index routing demo instead (no torch needed)")
    demo.add_argument("--processes", action="store_true", help="one worker process per instance")
    demo.add_argument("--no-compare", action="store_true", help="skip the run without prefix reuse")
    demo.add_argument("--instances", type=int, default=4, help="--index-only: instances")
    demo.add_argument("--conversations", type=int, default=None, help="default: 32 (cluster), 200 (index-only)")
    demo.add_argument("--turns", type=int, default=None, help="default: 5 (cluster), 5 (index-only)")
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    demo.set_defaults(func=_demo)

    from .sim.cli import add_replay_arguments

    replay = sub.add_parser("replay", help="replay a Mooncake-format trace on a simulated cluster")
    add_replay_arguments(replay)
    replay.set_defaults(func=_replay)

    trace = sub.add_parser("trace", help="write a generated Mooncake-format trace (JSON lines) for replay")
    trace.add_argument("out", help="the .jsonl file to write")
    trace.add_argument("--requests", type=int, default=1000, help="requests (default 1000)")
    trace.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (default 4)")
    trace.add_argument("--kind", choices=("chat", "agentic"), default="chat",
                       help="chat: conversations over shared system prompts and documents; agentic: tool loops")
    trace.add_argument("--seed", type=int, default=0)
    trace.set_defaults(func=_trace)

    make_model = sub.add_parser("make-model", help="write a tiny random-weight Llama directory (config.json, "
                                                   "safetensors, tokenizer, chat template) for serve and worker")
    make_model.add_argument("dir", help="the directory to write (created if missing)")
    make_model.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    make_model.add_argument("--max-position-embeddings", type=int, default=4096)
    make_model.set_defaults(func=_make_model)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server over an embedded cluster")
    try:
        from .http.server import add_serve_arguments
    except ImportError:  # the http extra is missing: the subcommand says so when run
        serve.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        add_serve_arguments(serve)
    from .deploy.serve import add_service_arguments

    add_service_arguments(serve)
    serve.set_defaults(func=_serve)
    worker = sub.add_parser("worker", help="one prefill or decode instance of a deployment across hosts "
                                           "(registers in etcd; docs/deploy.md)")
    from .deploy.worker import add_worker_arguments

    add_worker_arguments(worker)
    worker.set_defaults(func=_worker)
    store = sub.add_parser("store", help="a store node of the cluster-wide KV pool (Mooncake-Store compatible "
                                         "clients: mooncake_rs.compat)")
    from .pool.serve_node import add_store_arguments

    add_store_arguments(store)
    store.set_defaults(func=_store)
    indexer = sub.add_parser("indexer", help="the Mooncake Conductor Indexer HTTP API: KV events in, prefix hits out")
    indexer.add_argument("--listen", default="127.0.0.1:8800", help="HOST:PORT to serve on (default 127.0.0.1:8800)")
    indexer.add_argument("--hash", choices=["rfc", "mooncake"], default="rfc",
                         help="block hash: the RFC's rolling XXH3-64 (default; /query_by_hash interop) or ours")
    indexer.add_argument("--seed", type=int, default=0, help="hash seed S (default 0)")
    indexer.add_argument("--map-capacity", type=int, default=1 << 20,
                         help="engine-hash map entries kept per publisher (default 1048576)")
    indexer.add_argument("--max-publishers", type=int, default=256,
                         help="publishers registered at once (a thread and a socket each; default 256)")
    indexer.set_defaults(func=_indexer)

    kv_pool = sub.add_parser("kv-pool", help="a KV pool service for external engines (the vLLM connector "
                                             "MooncakeRsConnector saves and loads KV through it)")
    from .integrations.pool.cli import add_pool_arguments

    add_pool_arguments(kv_pool)
    kv_pool.set_defaults(func=_kv_pool)

    version = sub.add_parser("version", help="print the version")
    version.set_defaults(func=_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except MooncakeError as e:
        print(f"mooncake-rs: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
