"""Request bodies of the Mooncake Conductor Indexer HTTP API (field names as on the wire).

Unknown fields are ignored, so newer clients keep working; a missing required field or
a wrong type is an :class:`~mooncake_rs.InvalidArgument` (HTTP 400) naming the field.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from ..errors import InvalidArgument

__all__ = ["RegisterRequest", "UnregisterRequest", "QueryRequest", "QueryByHashRequest", "decode_request"]


class RegisterRequest(msgspec.Struct, frozen=True):
    """``POST /register``: a KV event publisher to consume."""

    endpoint: str
    type: str
    modelname: str
    instance_id: str
    block_size: int
    dp_rank: int = 0
    replay_endpoint: str | None = None
    lora_name: str | None = None
    tenant_id: str = "default"
    additionalsalt: str | None = None


class UnregisterRequest(msgspec.Struct, frozen=True):
    """``POST /unregister``: removes the publisher ``(instance_id, tenant_id, dp_rank)``."""

    instance_id: str
    tenant_id: str = "default"
    dp_rank: int | None = None
    """``None``: every DP rank of the instance."""
    type: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    block_size: int | None = None


class QueryRequest(msgspec.Struct, frozen=True):
    """``POST /query``: prefix hits of ``token_ids`` (full blocks only)."""

    model: str
    block_size: int
    token_ids: list[int]
    lora_name: str | None = None
    lora_id: int | None = None
    tenant_id: str = "default"
    instance_id: str | None = None
    cache_salt: str | None = None


class QueryByHashRequest(msgspec.Struct, frozen=True):
    """``POST /query_by_hash``: prefix hits of precomputed rolling sequence hashes."""

    model: str
    block_size: int
    seq_hashes: list[int] | None = None
    block_hash: list[int] | None = None
    """The name earlier drafts used for ``seq_hashes``."""
    lora_name: str | None = None
    lora_id: int | None = None
    tenant_id: str = "default"
    instance_id: str | None = None
    cache_salt: str | None = None


T = TypeVar("T")


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into ``kind``; :class:`InvalidArgument` says what is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise InvalidArgument(f"bad {kind.__name__} body: {e}") from None
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"the request body is not valid JSON: {e}") from None
