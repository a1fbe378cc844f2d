"""``mooncake-rs serve --etcd URL --listen HOST:PORT``: the conductor and router of a
deployment across hosts, as a service.

Several may run: each campaigns for ``{prefix}/leader`` (election.py) with its client
address as its name; the leader runs a ``ConductorService`` (service.py) over the
workers in etcd and takes ``RemoteCluster`` clients on ``--listen``; a standby waits and
takes over when the leader's lease lapses. With ``--model DIR`` the leader also serves
the OpenAI-compatible API (docs/http.md) over the same service on ``--host:--port``. A
new leader attaches every worker afresh and each re-announces its store's contents, so
its index never names blocks that are gone. A leader that loses its lease (etcd says so
after an outage, or a partition) stops routing at once and campaigns again: another may
lead by then.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Any

from ..errors import InvalidArgument
from ..serving.config import ServingConfig
from .election import LeaderElection
from ..client.records import cluster_prefix
from .settings import add_etcd_arguments, etcd_client, read_token, split_hostport

__all__ = ["add_service_arguments", "run_service"]

log = logging.getLogger("mooncake_rs.deploy")


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    """``serve``'s options for a deployment across hosts (beside the HTTP front's)."""
    p.add_argument("--listen", default=None, help="with --etcd: HOST:PORT for RemoteCluster clients (HOST: the "
                                                  "address clients reach this host at)")
    p.add_argument("--cluster", default="default", help="with --etcd: the cluster's name in etcd (default: default)")
    p.add_argument("--auth-token-file", default=None, help="with --etcd: the cluster token "
                                                           "(default: $MOONCAKE_AUTH_TOKEN)")
    p.add_argument("--lease-ttl", type=int, default=3, help="with --etcd: the leader lease's TTL in seconds")
    p.add_argument("--multipath", action="store_true",
                   help="fetch a prefix from every prefill instance (worker) holding it at once (DualPath)")
    p.add_argument("--replicate-every", type=float, default=None, metavar="SECONDS",
                   help="copy the conductor's hot prefixes to an idle prefill instance this often "
                        "(hot-block replication; default: never)")
    p.add_argument("--replica-max-bytes", type=float, default=ServingConfig.replica_max_bytes, metavar="BYTES",
                   help="with --replicate-every: bytes of KV one round may copy and have in flight "
                        "(default: %(default).0f)")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds an instance (worker) may go without a heartbeat before it is dropped "
                        "(default: 5 with --etcd, else 10)")
    add_etcd_arguments(p)


def _http_front(service: object, args: argparse.Namespace) -> Any:
    """With ``--model DIR`` (its tokenizer and config.json; no weights needed here), the
    OpenAI-compatible front over the service on ``--host:--port`` while this leads."""
    if not getattr(args, "model", None):
        return None
    from ..http.front import Frontend
    from ..http.server import ServerThread, limits_of

    from ..base.model_config import PRESETS
    from ..models.tiny import front_dir

    api_key = args.api_key or os.environ.get("MOONCAKE_API_KEY") or None
    # a preset name (the workers' --model tiny) gets its byte-level front in a scratch directory
    scratch = tempfile.mkdtemp(prefix="mooncake-front-")
    atexit.register(shutil.rmtree, scratch, True)
    model_dir = front_dir(args.model, scratch, weights=False)
    name = args.served_model_name or (args.model if args.model in PRESETS else None)
    front = Frontend.from_model_dir(service, model_dir, tokenizer_dir=args.tokenizer,
                                    model_name=name, api_key=api_key,
                                    request_timeout_s=args.request_timeout, limits=limits_of(args))
    return ServerThread(front, args.host, args.port, log_level=args.log_level).start()


def run_service(args: argparse.Namespace) -> int:
    """Blocks until SIGTERM / SIGINT."""
    from .service import ConductorService
    from .service_clients import ClientEndpoint

    if not args.listen:
        raise InvalidArgument("serve --etcd needs --listen HOST:PORT (where RemoteCluster clients connect)")
    config = ServingConfig.from_args(args)  # checked before anything starts
    token = read_token(args.auth_token_file)
    prefix = cluster_prefix(args.cluster)
    host, port = split_hostport(args.listen, "--listen")
    client = etcd_client(args)
    stop = threading.Event()
    lost = threading.Event()

    def _stop(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    from ..serving.shm import clean_at_exit, sweep_dead

    clean_at_exit()
    sweep_dead()  # e.g. a leader SIGKILLed on this host
    election = LeaderElection(client, prefix, args.listen, ttl_s=args.lease_ttl, on_lost=lost.set, token=token)
    print(f"mooncake-rs serve: candidate {args.listen} for {prefix}", file=sys.stderr, flush=True)
    while not stop.is_set():
        if not election.campaign(timeout_s=1.0):
            continue
        lost.clear()
        service = ConductorService(client, prefix, token, config=config)
        try:
            endpoint = ClientEndpoint(service, host, port, token)
        except BaseException:
            service.close()
            election.resign()
            raise
        http = _http_front(service, args)
        print(f"mooncake-rs serve: leading {prefix}; clients on {endpoint.address}"
              + (f"; OpenAI API on {http.url}" if http is not None else ""), file=sys.stderr, flush=True)
        while not (stop.is_set() or lost.is_set()):
            stop.wait(0.2)
        if http is not None:
            http.stop()
        endpoint.close()
        service.close()
        if lost.is_set():
            log.error("serve: lost the leadership of %s; campaigning again", prefix)
    election.resign()
    return 0
