"""``mooncake-rs store``: run one store node until SIGTERM/SIGINT.

    mooncake-rs store --etcd http://10.0.0.1:2379 --listen 10.0.0.5:7100 --dram-bytes 64GB \\
        [--ssd-path /nvme/pool --ssd-bytes 1TB] [--auth-token-file /etc/mooncake/token]

Prints one line ``store node NAME ready control=... transfer=... metrics=...`` when it
serves, then logs. The token (``--auth-token-file`` or ``$MOONCAKE_AUTH_TOKEN``) is the
cluster's: clients and nodes must hold the same.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading

from ..client.records import cluster_prefix
from ..deploy.settings import read_token
from ..errors import InvalidArgument
from ..net.spin_wait import DEFAULT_SPIN_US, spin_us_from_env

__all__ = ["add_store_arguments", "run_store", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"a byte count such as 1073741824, 512MB or 64GB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte count is >= 0, got {text!r}")
    return value


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", required=True, help="etcd's client URL, http://HOST:PORT")
    p.add_argument("--listen", required=True, help="HOST:PORT of the pool control listener (clients reach it there)")
    p.add_argument("--dram-bytes", required=True, type=parse_bytes, help="DRAM this node contributes (e.g. 64GB)")
    p.add_argument("--ssd-path", default=None, help="directory of the SSD tier")
    p.add_argument("--ssd-bytes", type=parse_bytes, default=0, help="size of the SSD tier")
    p.add_argument("--auth-token-file", default=None, help="the cluster token (else $MOONCAKE_AUTH_TOKEN)")
    p.add_argument("--name", default=None, help="this node's name in etcd (default: HOSTNAME-PORT)")
    p.add_argument("--cluster", default="default", help="the cluster's name in etcd (default: default)")
    p.add_argument("--transfer", default=None, help="HOST:PORT of the transfer engine (default: the --listen host, "
                                                    "any port)")
    p.add_argument("--metrics", default=None, help="HOST:PORT of /metrics (default: the --listen host, any port)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=None, help="slot size of large values (default 256KB)")
    p.add_argument("--ttl", type=int, default=3, help="seconds of the etcd lease (a crashed node leaves after it)")
    p.add_argument("--tcp-only", action="store_true", help="never offer the segment over shared memory")
    p.add_argument("--lease-ttl", type=float, default=0.0,
                   help="seconds after a client's last request when its reservations and leases end even with its "
                        "connection open (a hung client); its late reads and writes of those slots are refused. "
                        "0 (default): they end with the connection. Turns off the shm path for this node's slots")
    p.add_argument("--spin-us", type=int, default=None,
                   help="microseconds a connection's thread polls for the client's next request before it sleeps "
                        f"(default $MOONCAKE_RS_SPIN_US, else {DEFAULT_SPIN_US}; 0: off). Saves waking a thread on "
                        "another CPU per small call, at up to that much CPU after each request")
    p.add_argument("--plaintext", action="store_true",
                   help="no cluster token: control and data travel unauthenticated and unsealed, like Mooncake "
                        "Store's TCP (only on a network where every host is trusted; clients connect with "
                        "plaintext=True / MOONCAKE_RS_PLAINTEXT=1)")


def run_store(args: argparse.Namespace) -> int:
    from .node import StoreNode
    from .segment import DEFAULT_CHUNK_BYTES

    if (args.ssd_path is None) != (args.ssd_bytes == 0):
        raise InvalidArgument("--ssd-path and --ssd-bytes go together")
    if args.plaintext and args.auth_token_file:  # ($MOONCAKE_AUTH_TOKEN is not read with --plaintext)
        raise InvalidArgument("--plaintext runs without a cluster token: drop --auth-token-file or --plaintext")
    token = None if args.plaintext else read_token(args.auth_token_file)
    port = args.listen.rpartition(":")[2]
    name = args.name or f"{socket.gethostname()}-{port}"
    node = StoreNode(name=name, listen=args.listen, dram_bytes=args.dram_bytes, auth_token=token,
                     ssd_path=args.ssd_path, ssd_bytes=args.ssd_bytes, transfer_listen=args.transfer,
                     metrics_listen=args.metrics, etcd=args.etcd, prefix=cluster_prefix(args.cluster),
                     ttl_s=args.ttl, chunk_bytes=args.chunk_bytes or DEFAULT_CHUNK_BYTES,
                     transports=("tcp",) if args.tcp_only else ("tcp", "shm"), plaintext=args.plaintext,
                     lease_ttl_s=args.lease_ttl, spin_us=spin_us_from_env() if args.spin_us is None else args.spin_us)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"store node {name} ready control={node.address} transfer={node.te.address} "
          f"metrics={node.metrics_address}", flush=True)
    try:
        stop.wait()
    finally:
        node.close()
    return 0
