"""What the deployment's processes (``worker``, ``serve --etcd``) read the same way: the
cluster token, a HOST:PORT to listen on, how to reach etcd (its own authentication and
TLS). The cluster's key prefix in etcd is client/records.py's ``cluster_prefix`` (a
``RemoteCluster`` reads it too)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument

__all__ = ["read_token", "split_hostport", "add_etcd_arguments", "etcd_client"]


def read_token(path: str | None) -> str:
    """The cluster token: the file's contents (stripped), else ``$MOONCAKE_AUTH_TOKEN``.
    At least 16 characters; never taken from the command line, where other local users
    could read it."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise InvalidArgument(f"cannot read the auth token file {path!r}: {e}") from e
    else:
        token = os.environ.get("MOONCAKE_AUTH_TOKEN", "").strip()
    if len(token) < 16:
        raise InvalidArgument("a cluster token of at least 16 characters is required: --auth-token-file FILE "
                              "(or $MOONCAKE_AUTH_TOKEN); every worker and serve process of the cluster holds the same")
    return token


def split_hostport(address: str, what: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"{what} must be HOST:PORT, got {address!r}")
    if host in ("0.0.0.0", "::", "[::]"):
        raise InvalidArgument(f"{what} needs the address its peers reach this host at, not {host}")
    return host.strip("[]"), int(port)


def add_etcd_arguments(p: argparse.ArgumentParser) -> None:
    """etcd's own access control, for ``worker`` and ``serve --etcd`` alike."""
    p.add_argument("--etcd-user", default=None, help="etcd user (etcd's authentication); its password from "
                                                     "--etcd-password-file or $MOONCAKE_ETCD_PASSWORD")
    p.add_argument("--etcd-password-file", default=None, help="a file holding the etcd user's password")
    p.add_argument("--etcd-ca", default=None, help="with an https:// etcd URL: the CA file of etcd's certificate")
    p.add_argument("--etcd-cert", default=None, help="with https://: this client's certificate (client-cert auth)")
    p.add_argument("--etcd-key", default=None, help="with https://: the key of --etcd-cert")


def etcd_client(args: argparse.Namespace) -> Any:
    """The ``EtcdClient`` the command line describes."""
    from ..net.etcd import EtcdClient

    user = getattr(args, "etcd_user", None)
    password = None
    if user:
        path = getattr(args, "etcd_password_file", None)
        try:
            password = Path(path).read_text().strip() if path else os.environ.get("MOONCAKE_ETCD_PASSWORD")
        except OSError as e:
            raise InvalidArgument(f"cannot read the etcd password file {path!r}: {e}") from e
        if not password:
            raise InvalidArgument("--etcd-user needs a password: --etcd-password-file FILE or $MOONCAKE_ETCD_PASSWORD")
    return EtcdClient(args.etcd, user=user or None, password=password, ca_file=getattr(args, "etcd_ca", None),
                      cert_file=getattr(args, "etcd_cert", None), key_file=getattr(args, "etcd_key", None))
