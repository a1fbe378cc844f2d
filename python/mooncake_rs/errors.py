"""The exception tree of mooncake_rs.

Every error raised by the library is a :class:`MooncakeError`. The Rust core maps each of
its error categories to one class here (by name), so catching a class catches it from
every part of the library.
"""

from __future__ import annotations

__all__ = [
    "MooncakeError",
    "InvalidArgument",
    "StoreFull",
    "BlockNotFound",
    "StoreIOError",
    "TransferFailed",
    "TransferTimeout",
    "Overloaded",
    "ServiceUnavailable",
    "Unauthorized",
    "InternalError",
    "MalformedEvent",
]


class MooncakeError(Exception):
    """Base class of every mooncake_rs error."""


class InvalidArgument(MooncakeError, ValueError):
    """A malformed or out-of-range argument; nothing was changed."""


class StoreFull(MooncakeError):
    """The store has no slot it may use: every slot is leased or pinned."""


class BlockNotFound(MooncakeError, KeyError):
    """A block that must exist does not."""


class StoreIOError(MooncakeError, OSError):
    """Disk I/O of the SSD tier failed (open, write, flush)."""


class TransferFailed(MooncakeError):
    """A transfer failed: refused by the peer, out of bounds, or the connection was lost."""


class TransferTimeout(TransferFailed, TimeoutError):
    """A transfer did not finish within its deadline."""


class Overloaded(MooncakeError):
    """The conductor rejected a request because an SLO cannot be met (HTTP 429).

    ``reason`` says which SLO; ``estimates`` carries the estimates behind the decision
    when the conductor provides them.
    """

    def __init__(self, message: str = "", reason: str | None = None, estimates: object = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.estimates = estimates


class ServiceUnavailable(MooncakeError, ConnectionError):
    """A service the deployment depends on (etcd, a remote conductor) cannot be reached or
    refused the call; what was running keeps its last known state."""


class Unauthorized(MooncakeError, PermissionError):
    """The peer does not hold the cluster token (or this side does not hold the peer's):
    the connection was refused before any message was exchanged."""


class InternalError(MooncakeError):
    """An internal invariant was broken: a bug in mooncake_rs. Please report it."""


class MalformedEvent(InvalidArgument):
    """A KV event message (ZMQ frames or msgpack payload) that cannot be decoded.

    Raised by :mod:`mooncake_rs.kv_events` for a truncated or malformed frame; the message
    says which frame or field is wrong.
    """
