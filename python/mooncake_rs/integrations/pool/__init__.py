"""The KV pool service (torch-free): a shared-memory :class:`~mooncake_rs.Store` that
engines we did not write reach through an authenticated control socket (reserve, commit,
look up, lease; protocol.py) and our :class:`~mooncake_rs.TransferEngine` (the bytes).
``mooncake-rs kv-pool`` runs one; ``MooncakeRsConnector`` is its vLLM client."""

from .client import PoolClient
from .follower import PoolFollower
from .membership import PoolRegistration, pool_addresses
from .server import KVPoolServer, PoolConfig

__all__ = ["KVPoolServer", "PoolConfig", "PoolClient", "PoolFollower", "PoolRegistration", "pool_addresses"]
