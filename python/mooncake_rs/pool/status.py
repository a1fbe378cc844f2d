"""Per-key outcomes of the pool's batch calls, and the integer codes Mooncake Store uses
for them (the compat facade returns those codes; vLLM, SGLang and LMCache parse them).

Single-key calls of :class:`~mooncake_rs.pool.DistributedStore` raise typed exceptions
instead; batch calls return one :class:`KeyStatus` (or a byte count) per key, because one
missing key must not hide the others' results.
"""

from __future__ import annotations

import enum

__all__ = ["KeyStatus", "MOONCAKE_CODES", "code_of"]


class KeyStatus(enum.IntEnum):
    """What happened to one key. Negative values are Mooncake Store's own codes, so a
    status *is* the integer an integration expects."""

    OK = 0
    #: no room: every slot is pinned, leased or reserved, or the value exceeds a segment
    NO_SPACE = -200
    INVALID = -600
    #: the key is not in the pool (never put, removed, evicted, or its only holder is gone)
    MISSING = -704
    #: moving the bytes failed (a node died mid-transfer, a timeout)
    TRANSFER_FAILED = -800
    #: a node could not be asked (unreachable, refused, malformed answer)
    RPC_FAILED = -900


MOONCAKE_CODES = {s.name: int(s) for s in KeyStatus}


def code_of(status: "KeyStatus | int") -> int:
    return int(status)
