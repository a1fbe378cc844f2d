"""The client protocol of a conductor service (``mooncake-rs serve --etcd``): how a
``RemoteCluster`` submits requests and gets their tokens back.

Same framing as the serving protocol (net/framing.py: a 4-byte length, then msgpack;
``Codec`` with this module's union): one frozen ``msgspec.Struct`` per op, decoded
strictly, never pickled. The connection is authenticated first with the cluster token
(net/auth_socket.py). A client numbers its own requests (``cid``); the service answers each
``Submit`` with ``Admitted`` or ``Error`` (a rejection is an ``Error`` of kind
``Overloaded``), then ``Tokens`` as they come and ``Finished`` or ``Error`` at the end.
``Error.kind`` names an exception class of ``mooncake_rs.errors``, re-raised as such on
the client.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from ..base.params import SamplingParams

__all__ = ["Submit", "CancelSubmitted", "Query", "Admitted", "Tokens", "Finished", "Error", "Answer",
           "ClientMessage", "TO_SERVICE", "FROM_SERVICE", "CLIENT_PROTOCOL_VERSION"]

CLIENT_PROTOCOL_VERSION = 1


class _C(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    pass


class Submit(_C, frozen=True, tag="submit"):
    cid: int
    prompt: list[int]
    params: SamplingParams
    timeout_s: Union[float, None] = None
    version: int = CLIENT_PROTOCOL_VERSION


class CancelSubmitted(_C, frozen=True, tag="cancel"):
    cid: int


class Query(_C, frozen=True, tag="query"):
    """``what``: ``"metrics"`` (Prometheus text), ``"instances"`` (id -> name) or
    ``"stats"`` (each worker's ``instance_stats``)."""

    qid: int
    what: str


class Admitted(_C, frozen=True, tag="admitted"):
    cid: int
    rid: int
    prefill: int
    decode: int


class Tokens(_C, frozen=True, tag="tokens"):
    cid: int
    tokens: list[int]


class Finished(_C, frozen=True, tag="finished"):
    cid: int
    finish_reason: str
    metrics: dict[str, Any]  # RequestMetrics' fields


class Error(_C, frozen=True, tag="error"):
    """``cid`` None: about the connection or a query. ``reason``: an ``Overloaded``'s."""

    cid: Union[int, None]
    kind: str
    message: str
    reason: Union[str, None] = None
    qid: Union[int, None] = None


class Answer(_C, frozen=True, tag="answer"):
    qid: int
    text: str = ""
    instances: dict[int, str] = {}
    stats: dict[int, dict[str, float]] = {}


ClientMessage = Union[Submit, CancelSubmitted, Query, Admitted, Tokens, Finished, Error, Answer]
TO_SERVICE: tuple[type, ...] = (Submit, CancelSubmitted, Query)
FROM_SERVICE: tuple[type, ...] = (Admitted, Tokens, Finished, Error, Answer)
