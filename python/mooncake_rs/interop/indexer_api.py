"""Request bodies of the Mooncake Conductor Indexer HTTP API (field names as on the wire).

Unknown fields are ignored, so newer clients keep working; a missing required field or
a wrong type is an :class:`~mooncake_rs.InvalidArgument` (HTTP 400) naming the field.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from ..errors import InvalidArgument

__all__ = ["RegisterRequest", "UnregisterRequest", "QueryRequest", "QueryByHashRequest", "decode_request",
           "check_limits", "MAX_BLOCK_SIZE", "MAX_DP_RANK", "MAX_QUERY_TOKENS", "MAX_QUERY_HASHES", "MAX_NAME_LEN"]

# Resource limits of a request (issue 26): what one body may make the indexer hold or
# compute. A value past them is a 400 naming the field.
MAX_BLOCK_SIZE = 1 << 20
MAX_DP_RANK = (1 << 16) - 1
MAX_QUERY_TOKENS = 1 << 20
MAX_QUERY_HASHES = 1 << 16
MAX_NAME_LEN = 1024


class RegisterRequest(msgspec.Struct, frozen=True):
    """``POST /register``: a KV event publisher to consume."""

    endpoint: str
    type: str
    modelname: str
    instance_id: str
    block_size: int | None = None
    """The engine's KV block size; absent: learned from its replay buffer (the first
    ``BlockStored`` it still holds), or the registration is refused saying so."""
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
    """Decode a JSON body into ``kind`` and check its limits (:func:`check_limits`);
    :class:`InvalidArgument` says what is wrong."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise InvalidArgument(f"bad {kind.__name__} body: {e}") from None
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"the request body is not valid JSON: {e}") from None
    check_limits(req)
    return req


def _bad(field: str, what: str, v: object) -> InvalidArgument:
    shown = v if not isinstance(v, (list, str)) or len(v) <= 64 else f"<{len(v)} items>"
    return InvalidArgument(f"{field} must be {what}, got {shown!r}")


def check_limits(req: object) -> None:
    """Raises :class:`InvalidArgument` naming the first field of ``req`` past a limit:
    ``block_size`` in 1..MAX_BLOCK_SIZE, ``dp_rank`` in 0..MAX_DP_RANK, at most
    MAX_QUERY_TOKENS ``token_ids`` (each a u32) and MAX_QUERY_HASHES ``seq_hashes``,
    names and endpoints up to MAX_NAME_LEN characters. By field name, whatever the
    request type: a field added to a body later is checked once it is named here."""
    bs = getattr(req, "block_size", None)
    if bs is not None and not 1 <= bs <= MAX_BLOCK_SIZE:
        raise _bad("block_size", f"an integer in 1..{MAX_BLOCK_SIZE}", bs)
    dp = getattr(req, "dp_rank", None)
    if dp is not None and not 0 <= dp <= MAX_DP_RANK:
        raise _bad("dp_rank", f"an integer in 0..{MAX_DP_RANK}", dp)
    toks = getattr(req, "token_ids", None)
    if toks is not None:
        if len(toks) > MAX_QUERY_TOKENS:
            raise _bad("token_ids", f"at most {MAX_QUERY_TOKENS} token ids", toks)
        if toks and not (0 <= min(toks) and max(toks) < 1 << 32):
            bad = next(t for t in toks if not 0 <= t < 1 << 32)
            raise InvalidArgument(f"token_ids must be u32 token ids, got {bad}")
    for name in ("seq_hashes", "block_hash"):
        hashes = getattr(req, name, None)
        if hashes is not None and len(hashes) > MAX_QUERY_HASHES:
            raise _bad(name, f"at most {MAX_QUERY_HASHES} hashes", hashes)
    for name in ("endpoint", "replay_endpoint", "type", "modelname", "model", "instance_id", "tenant_id",
                 "lora_name", "additionalsalt", "cache_salt"):
        v = getattr(req, name, None)
        if isinstance(v, str) and len(v) > MAX_NAME_LEN:
            raise _bad(name, f"at most {MAX_NAME_LEN} characters", v)
