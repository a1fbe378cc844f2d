"""What the deployment's processes (``worker``, ``serve --etcd``) and clients read the
same way: the cluster's key prefix in etcd, the cluster token, a HOST:PORT to listen on."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidArgument

__all__ = ["cluster_prefix", "read_token", "split_hostport"]


def cluster_prefix(cluster: str) -> str:
    """The etcd key prefix of a named cluster."""
    if not cluster or "/" in cluster:
        raise InvalidArgument(f"a cluster name is non-empty and has no '/', got {cluster!r}")
    return f"/mooncake/{cluster}"


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
