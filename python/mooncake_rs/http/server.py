"""Running the front: ``mooncake-rs serve`` and :class:`ServerThread` (tests, benchmarks).

``serve`` starts an embedded :class:`mooncake_rs.Cluster` of the model directory (the
same defaults as ``Cluster``), builds the :class:`Frontend` over it and runs uvicorn
until interrupted; the cluster is closed on the way out.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from typing import Any

from .._core import ConductorConfig
from ..errors import InvalidArgument, MooncakeError

__all__ = ["ServerThread", "add_serve_arguments", "serve"]

log = logging.getLogger("mooncake_rs.http")


class ServerThread:
    """The app over ``front`` served by uvicorn on a thread of this process, on a socket
    bound here (``port=0``: a free port; ``url`` says which). ``start()`` waits until it
    accepts connections, ``stop()`` shuts it down (also the context manager's exit).
    The cluster behind ``front`` is the caller's to close."""

    def __init__(self, front: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 app: Any = None) -> None:
        from .app import create_app
        from .guard import DrainingServer, make_config

        self.front = front
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without, uvloop's transports leave Nagle on, and a
        # response's separate header and body writes wait for the client's delayed ACK (~40 ms).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        # ``app``: another ASGI app to serve instead of ``create_app(front)`` (the upstream proxy)
        config = make_config(app if app is not None else create_app(front), front, log_level=log_level,
                             access_log=False, lifespan="on")
        self.server = DrainingServer(config, front)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="mooncake-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        step = 0.02
        waited = 0.0
        while not self.server.started:
            if not self._thread.is_alive() or waited > timeout_s:
                raise MooncakeError(f"the HTTP server did not start on {self.url}")
            threading.Event().wait(step)
            waited += step
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json, "
                        "tokenizer_config.json with the chat template; `mooncake-rs make-model DIR` makes a tiny "
                        "one) or a preset name (tiny: random weights, a byte-level tokenizer); required unless "
                        "--upstream is given")
    p.add_argument("--upstream", action="append", default=[], metavar="NAME=URL,events=tcp://HOST:PORT[,replay=..]",
                   help="route over external OpenAI-compatible engines instead of serving a model: one per "
                        "engine, its KV events endpoint (vLLM's ZMQ format) and optional replay endpoint; "
                        "needs --tokenizer (docs/interop.md)")
    p.add_argument("--tokenizer", default=None, help="directory of tokenizer.json / tokenizer_config.json "
                                                     "(default: --model)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOONCAKE_API_KEY, else none)")
    p.add_argument("--etcd", default=None, help="run the conductor of a deployment across hosts over the workers "
                                                "registered in this etcd (http://HOST:PORT; needs --listen; "
                                                "docs/deploy.md) instead of an embedded cluster")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances (default 2)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens (default: 16 for a cluster served here; with --upstream, "
                        "what the engines report)")
    p.add_argument("--processes", action="store_true", help="one worker process per instance")
    defaults = ConductorConfig()  # the conductor's defaults, written once in the core
    p.add_argument("--policy", default=defaults.policy)
    p.add_argument("--rejection", default=defaults.rejection, help="conductor admission: none, early, predictive")
    p.add_argument("--no-prefix-reuse", action="store_true", help="compute every prompt (no KV reuse; baselines)")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="seconds")
    p.add_argument("--dram-bytes", type=int, default=64 << 20, help="store DRAM per instance")
    p.add_argument("--ssd-path", default=None)
    p.add_argument("--dtype", default=None, help="engine dtype (float32, bfloat16, float16)")
    p.add_argument("--device", default=None, help="engine device (cpu, cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=None, help="seconds a request may run (default: none)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request may take to send its body (default 30)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most; more are answered 503 (default: from the descriptor limit)")


def serve(args: argparse.Namespace) -> int:
    """``mooncake-rs serve --model``: blocks until Ctrl-C / SIGTERM. ``--model`` is a model
    directory or a preset name (``tiny``: a random-weight model with a byte-level
    tokenizer, as ``worker --model tiny`` takes)."""
    if args.model is None:
        raise InvalidArgument("--model is required: a Hugging Face model directory or a preset name such as tiny "
                              "(or --upstream NAME=URL,events=... to route over external engines)")
    import tempfile

    from ..base.model_config import PRESETS
    from ..models.tiny import front_dir
    from ..serving import Cluster
    from ..serving.config import ServingConfig
    from .app import create_app
    from .front import Frontend
    from .guard import DrainingServer, make_config

    api_key = args.api_key or os.environ.get("MOONCAKE_API_KEY") or None
    with tempfile.TemporaryDirectory(prefix="mooncake-front-") as scratch:
        # Checked first: a directory without config.json, weights or a tokenizer fails
        # in a second with one line, not after the cluster starts.
        model_dir = front_dir(args.model, scratch)
        from ..text import Tokenizer

        Tokenizer.from_dir(args.tokenizer or model_dir)
        cluster = Cluster.from_config(args.model, ServingConfig.from_args(args))
        server = None
        try:
            if args.rejection != "none":
                # admission by SLO needs the prefill model of this host, not a default: fit it
                # on the real engine first (the online calibration refines it under load)
                cluster.calibrate(repeats=1)
            name = args.served_model_name or (args.model if args.model in PRESETS else None)
            front = Frontend.from_model_dir(cluster, model_dir, tokenizer_dir=args.tokenizer,
                                            model_name=name, api_key=api_key,
                                            request_timeout_s=args.request_timeout, limits=limits_of(args))
            print(f"mooncake-rs: serving {front.model_name!r} on http://{args.host}:{args.port} "
                  f"({args.prefill} prefill + {args.decode} decode instances)", file=sys.stderr, flush=True)
            # SIGTERM / SIGINT: running requests end (streams with an error event and [DONE]),
            # connections close, then the cluster below; the signal is not re-raised
            server = DrainingServer(make_config(create_app(front), front, host=args.host, port=args.port,
                                                log_level=args.log_level, access_log=False), front)
            server.run()
        finally:
            cluster.close()
    if server is not None and server.stopped_by is not None:
        print(f"mooncake-rs: stopped by signal {server.stopped_by}; requests drained, cluster closed",
              file=sys.stderr, flush=True)
    return 0


def limits_of(args: argparse.Namespace) -> "Any":
    """The front's :class:`FrontLimits` from ``serve``'s arguments."""
    from .limits import FrontLimits

    return FrontLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                       max_connections=args.max_connections)
