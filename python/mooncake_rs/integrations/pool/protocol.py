"""The KV pool's control protocol: one frozen msgspec message per op, msgpack frames.

Framing is net/framing.py's (a 4-byte big-endian length, then the msgpack body;
:class:`~mooncake_rs.net.framing.Codec` with this module's tagged union), so the
decoder builds only the types named here (no pickle, unknown fields refused). Block keys
(128-bit hashes) travel as ``bytes`` of 16-byte little-endian keys.

Every request gets exactly one reply: the op's own, or :class:`PoolError` (kind, message).
Data never goes over this socket: a client moves block bytes with its
:class:`~mooncake_rs.TransferEngine` into or out of the pool's registered arena (shm on one
host, TCP across hosts), at the slot offsets a ``Reserved`` / ``Found`` reply names.
"""

from __future__ import annotations

from typing import Union

import msgspec

__all__ = [
    "POOL_PROTOCOL_VERSION", "Open", "Opened", "Lookup", "Found", "Release", "Reserve", "Reserved", "Commit",
    "Committed", "Remove", "Removed", "Events", "EventBatch", "PoolStats", "PoolStatsReply", "PoolError",
    "Request", "Reply",
]

POOL_PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


class Open(_Msg, frozen=True, tag="open"):
    """A client names the block size and layout it will use; the first one sizes the pool."""

    block_bytes: int
    layout: str
    version: int = POOL_PROTOCOL_VERSION


class Opened(_Msg, frozen=True, tag="opened"):
    engine_name: str
    engine_address: str
    region: int
    block_bytes: int
    slots: int
    layout: str
    slot_stride: int = 0
    shm_name: str = ""  # the arena's segment: a client on the same host maps it and copies directly
    host_id: str = ""  # the pool host's boot id: a client maps ``shm_name`` only when its own is equal


class Lookup(_Msg, frozen=True, tag="lookup"):
    """The longest leading run of ``keys`` the pool holds; leased for ``lease_s`` when > 0."""

    keys: bytes
    lease_s: float = 0.0


class Found(_Msg, frozen=True, tag="found"):
    count: int
    offsets: list[int]
    checksums: list[int]
    lease: int  # 0: nothing leased


class Release(_Msg, frozen=True, tag="release"):
    lease: int


class Reserve(_Msg, frozen=True, tag="reserve"):
    """Slots to write ``keys`` into; a key already held or with no free slot gets -1."""

    keys: bytes
    lease_s: float = 30.0


class Reserved(_Msg, frozen=True, tag="reserved"):
    reservation: int
    offsets: list[int]
    present: int  # keys skipped because the pool holds them
    full: int  # keys skipped because every slot is leased, pinned or reserved


class Commit(_Msg, frozen=True, tag="commit"):
    """Publish the written slots of a reservation (``ok[i]``), abort the others.
    ``checksums[i]``: the CRC-32 of block ``i`` as the client wrote it (taken in its copy
    pass); empty: the pool takes them from the slots."""

    reservation: int
    ok: list[bool]
    checksums: list[int] = []


class Committed(_Msg, frozen=True, tag="committed"):
    stored: int


class Remove(_Msg, frozen=True, tag="remove"):
    """Drop keys (a client found them corrupt: their checksum did not match)."""

    keys: bytes
    corrupt: bool = True


class Removed(_Msg, frozen=True, tag="removed"):
    removed: int


class Events(_Msg, frozen=True, tag="events"):
    """The pool's store events from sequence number ``since`` on."""

    since: int
    limit: int = 65536


class EventBatch(_Msg, frozen=True, tag="event_batch"):
    start: int  # sequence number of the first event here (> since: older ones were dropped)
    next: int
    kinds: list[str]
    keys: bytes
    tiers: list[str]


class PoolStats(_Msg, frozen=True, tag="pool_stats"):
    pass


class PoolStatsReply(_Msg, frozen=True, tag="pool_stats_reply"):
    stats: dict[str, int]


class PoolError(_Msg, frozen=True, tag="pool_error"):
    kind: str  # a mooncake_rs.errors class name
    message: str


Request = Union[Open, Lookup, Release, Reserve, Commit, Remove, Events, PoolStats]
Reply = Union[Opened, Found, Reserved, Committed, Removed, EventBatch, PoolStatsReply, PoolError]
