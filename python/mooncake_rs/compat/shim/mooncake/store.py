"""``mooncake.store``: forwards to mooncake_rs.compat.mooncake_store."""

from mooncake_rs.compat.mooncake_store import *  # noqa: F401,F403
from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore, ReplicateConfig  # noqa: F401
