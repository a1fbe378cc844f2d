"""What ``MooncakeDistributedStore.setup`` is given, read the way Mooncake's integrations
write it: positional arguments, a dict, or the JSON file named by ``MOONCAKE_CONFIG_PATH``
(keys ``local_hostname``, ``metadata_server``, ``global_segment_size``,
``local_buffer_size``, ``protocol``, ``device_name``, ``master_server_address``; sizes as
ints or strings such as ``"4GB"``).

Which pool it opens:
- ``metadata_server`` or ``master_server_address`` an ``etcd://HOST:PORT`` URL: the
  deployment of ``mooncake-rs store`` nodes registered there (cluster token from
  ``MOONCAKE_AUTH_TOKEN`` or the file named by ``MOONCAKE_AUTH_TOKEN_FILE``; cluster name
  ``MOONCAKE_CLUSTER``, default ``default``, as the nodes' ``--cluster``; transports
  ``MOONCAKE_RS_TRANSPORTS``, default ``tcp,shm``: ``tcp`` alone sends every byte over
  TCP even to a node on this host; ``MOONCAKE_RS_TCP_CONNECTIONS``: TCP connections per
  node, each sealed and opened on its own thread at both ends (unset: without a token 2
  where the process may use two cores, else 1; with one half the cores, 1 to 4);
  ``MOONCAKE_RS_PLAINTEXT=1``: the nodes run ``--plaintext``, no token, nothing sealed;
  ``MOONCAKE_RS_SPIN_US``: microseconds a call polls for a node's answer before it sleeps,
  default 100, 0 off: net/spin_wait.py);
- anything else (``P2PHANDSHAKE``, an HTTP metadata URL, a master address): an embedded
  pool of ``global_segment_size`` bytes in this process, no etcd, no network.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..net.spin_wait import spin_us_from_env

__all__ = ["SetupConfig", "parse_size", "etcd_url_of", "auth_token_from_env", "pool_prefix", "transports_from_env",
           "tcp_connections_from_env", "plaintext_from_env", "spin_us_from_env"]

_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def parse_size(value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"a size is an int or a string such as '4GB', got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?b?)\s*", str(value).lower())
    if not m:
        raise InvalidArgument(f"a size is an int or a string such as '4GB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2) if m.group(2) != "k" else "kb"])


@dataclass
class SetupConfig:
    local_hostname: str = "localhost"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 16 << 20
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    master_server_address: str = "127.0.0.1:50051"
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SetupConfig":
        c = cls()
        for k, v in d.items():
            if k in ("global_segment_size", "local_buffer_size"):
                setattr(c, k, parse_size(v))
            elif k == "rdma_devices":
                c.device_name = str(v)
            elif k == "master_server_addr":
                c.master_server_address = str(v)
            elif hasattr(c, k):
                setattr(c, k, v)
        return c

    @classmethod
    def from_file(cls, path: str) -> "SetupConfig":
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"cannot read the Mooncake config {path!r}: {e}") from e
        if not isinstance(data, dict):
            raise InvalidArgument(f"the Mooncake config {path!r} must hold a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls) -> "SetupConfig | None":
        path = os.environ.get("MOONCAKE_CONFIG_PATH")
        return cls.from_file(path) if path else None


def etcd_url_of(cfg: SetupConfig) -> str | None:
    """``http://HOST:PORT`` of the deployment's etcd, or None (embedded)."""
    for v in (cfg.metadata_server, cfg.master_server_address):
        if isinstance(v, str) and v.startswith("etcd://"):
            return "http://" + v[len("etcd://"):].rstrip("/")
    return None


def auth_token_from_env() -> str | None:
    tok = os.environ.get("MOONCAKE_AUTH_TOKEN")
    if tok:
        return tok.strip()
    path = os.environ.get("MOONCAKE_AUTH_TOKEN_FILE")
    if path:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            raise InvalidArgument(f"cannot read MOONCAKE_AUTH_TOKEN_FILE {path!r}: {e}") from e
    return None


def pool_prefix() -> str:
    """The etcd prefix of the cluster named by ``MOONCAKE_CLUSTER`` (the nodes' --cluster)."""
    from ..client.records import cluster_prefix

    return cluster_prefix(os.environ.get("MOONCAKE_CLUSTER", "default"))


def transports_from_env() -> tuple[str, ...]:
    raw = os.environ.get("MOONCAKE_RS_TRANSPORTS", "tcp,shm")
    names = tuple(t.strip() for t in raw.split(",") if t.strip())
    if not names or any(t not in ("tcp", "shm") for t in names):
        raise InvalidArgument(f"MOONCAKE_RS_TRANSPORTS lists tcp and/or shm, got {raw!r}")
    return names


def plaintext_from_env() -> bool:
    """``MOONCAKE_RS_PLAINTEXT=1``: the deployment's nodes run ``--plaintext`` (no token)."""
    raw = os.environ.get("MOONCAKE_RS_PLAINTEXT", "0").strip().lower()
    if raw not in ("0", "1", "false", "true", "no", "yes", ""):
        raise InvalidArgument(f"MOONCAKE_RS_PLAINTEXT is 1 (nodes started with --plaintext) or 0, got {raw!r}")
    return raw in ("1", "true", "yes")


def tcp_connections_from_env() -> int | None:
    """None when unset: the transfer engine's rule (DistributedStore.connect)."""
    raw = os.environ.get("MOONCAKE_RS_TCP_CONNECTIONS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise InvalidArgument(f"MOONCAKE_RS_TCP_CONNECTIONS is a count of connections per node, 1 to 64, got {raw!r}")
    return int(raw)
