"""``mooncake-rs kv-pool``: run one KV pool service until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ...errors import InvalidArgument

__all__ = ["add_pool_arguments", "run_pool"]


def add_pool_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:7600", help="control socket HOST:PORT (default 127.0.0.1:7600)")
    p.add_argument("--data-listen", default="127.0.0.1:0",
                   help="the transfer engine's HOST:PORT (TCP for other hosts; same-host clients map the arena)")
    p.add_argument("--memory", default="1G", help="DRAM arena size, e.g. 512M, 4G (default 1G)")
    p.add_argument("--auth-token-file", default=None,
                   help="a file holding the cluster token (else MOONCAKE_AUTH_TOKEN); 16 bytes or more")
    p.add_argument("--name", default="", help="the pool's name (its transfer engine's, its etcd key's); default "
                                              "kvpool-<random>")
    p.add_argument("--eviction", default="lru", help="eviction policy of the store (default lru)")
    p.add_argument("--etcd", default=None, help="register in this etcd (the deployment's) so connectors on every "
                                                "host follow this pool")
    p.add_argument("--etcd-prefix", default="/mooncake", help="the deployment's key prefix (default /mooncake)")
    p.add_argument("--advertise", default=None, help="the control address other hosts reach (default: --listen)")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise InvalidArgument(f"--memory {text!r}: expected bytes or a size like 512M, 4G") from None


def run_pool(args: argparse.Namespace) -> int:
    from .server import KVPoolServer, PoolConfig

    token = os.environ.get("MOONCAKE_AUTH_TOKEN")
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read().strip()
    if not token:
        raise InvalidArgument("the KV pool needs a token: --auth-token-file FILE or MOONCAKE_AUTH_TOKEN")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with KVPoolServer(PoolConfig(auth_token=token, dram_bytes=_size(args.memory), listen=args.listen,
                                 data_listen=args.data_listen, name=args.name, eviction=args.eviction)) as pool:
        reg = None
        if args.etcd:
            from .membership import PoolRegistration

            reg = PoolRegistration(args.etcd, pool.engine.name, args.advertise or pool.address, prefix=args.etcd_prefix)
        print(f"mooncake-rs: KV pool on {pool.address} (data {pool.engine.address})", file=sys.stderr, flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            if reg is not None:
                reg.close()
    return 0
