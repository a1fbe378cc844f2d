"""What an instance's role (prefill.py, decode.py) is to its instance (instance.py): the
``Role`` protocol both implement, and the ``RoleContext`` each is made with.

The instance loop calls a role through these eight methods only; a role works with what
its context holds: the instance's engine, store, transport and endpoint, its link up to
the cluster (``up``), its peers, and ``flush`` (store events to the cluster). A role
switch (roles.py) makes a new role over a new context of the same engine, store and
transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .protocol import Endpoint, InstanceSpec, Message

__all__ = ["Role", "RoleContext"]


@dataclass
class RoleContext:
    #: the instance's spec; replaced when a conductor attaches it under a new id
    spec: InstanceSpec
    engine: Any  # engine.Engine
    store: Any  # arena.StoreSlots
    transport: Any  # transport.Transport
    endpoint: Endpoint  # the instance's arena as peers reach it
    up: Callable[[Message], None]  # to the cluster
    peers: Any  # peer id -> control.Link (``get``): a dict, or a remote worker's RelayPeers
    flush: Callable[[], None]  # the store's events to the cluster, now
    kv_events: Any = None  # kv_events.KVEventsOut of a prefill instance that publishes them


class Role(Protocol):
    ctx: RoleContext

    def handle(self, src: int, msg: Message) -> None:
        """A message of this role's requests, from the cluster or a peer (``src``)."""

    def on_outputs(self, outs: list[Any]) -> None:
        """The engine's outputs of one step."""

    def send_pending(self) -> None:
        """Sends what this loop phase gathered (tokens), as few messages as it can."""

    def poll(self) -> None:
        """Advances what is in flight (fetches, hand-offs) without blocking."""

    def busy(self) -> bool:
        """Whether the loop should come back soon although the engine is idle."""

    def tracked(self) -> int:
        """Requests this role still holds state (pages, leases, slots) for."""

    def rids(self) -> list[int]:
        """The requests ``tracked`` counts."""

    def holds(self, rid: int) -> bool: ...
