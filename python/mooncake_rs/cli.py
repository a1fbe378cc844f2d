"""The ``mooncake-rs`` command (also ``python -m mooncake_rs``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import MooncakeError


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    demo.run(
        instances=args.instances,
        conversations=args.conversations,
        turns=args.turns,
        block_size=args.block_size,
        seed=args.seed,
        progress=not args.no_progress,
    )
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .sim.cli import replay

    return replay(args)


def _version(args: argparse.Namespace) -> int:
    from . import __version__

    print(__version__)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mooncake-rs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the embedded demo")
    demo.add_argument("--instances", type=int, default=4)
    demo.add_argument("--conversations", type=int, default=200)
    demo.add_argument("--turns", type=int, default=5)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    demo.set_defaults(func=_demo)

    from .sim.cli import add_replay_arguments

    replay = sub.add_parser("replay", help="replay a Mooncake-format trace on a simulated cluster")
    add_replay_arguments(replay)
    replay.set_defaults(func=_replay)

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
