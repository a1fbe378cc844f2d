"""The HTTP front's limits under stress (no web stack imported: the CLI builds these).

See guard.py for how the server enforces them and app.py for the body deadline.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["FrontLimits", "default_max_connections"]


def default_max_connections() -> int:
    """Open connections allowed: the descriptor limit less room for the cluster's own
    sockets and files (at least 32, at most 16384)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 16384
    return max(32, min(16384, soft - max(64, soft // 8)))


@dataclass(frozen=True)
class FrontLimits:
    """``header_timeout_s``: a connection's request head must be complete this long after
    it opened (or after its previous response); ``body_timeout_s``: the whole body this
    long after the head; ``max_connections``: open connections (None: from the
    descriptor limit, :func:`default_max_connections`); ``drain_timeout_s``: how long a
    shutdown waits for streams to end after their requests were ended."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "drain_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {v!r}")
        m = self.max_connections
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InvalidArgument(f"max_connections must be an int >= 1 or None, got {m!r}")

    @property
    def connections(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()
