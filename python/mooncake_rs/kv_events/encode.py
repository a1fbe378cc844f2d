"""Encoding of KV event batches in the engines' wire format (both forms).

Used by our own stand-in publishers (tests, benchmarks) and to publish our stores'
events so other indexers can index our instances (serving/kv_events.py). The positional
form matches engines that declare their structs ``array_like``; the map form matches the
others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["encode_event", "encode_batch", "encode_message"]

Form = Literal["positional", "map"]

_enc = msgspec.msgpack.Encoder()


def encode_event(event: KVEvent, form: Form = "positional") -> object:
    """The msgpack-ready object of one event (a list or a dict)."""
    if isinstance(event, BlockStored):
        fields: dict[str, object] = {
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        optional = {
            "extra_keys": event.extra_keys,
            "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind,
        }
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": list(event.block_hashes), "medium": event.medium}
        optional = {"group_idx": event.group_idx}
        tag = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields, optional, tag = {}, {}, "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV event: {type(event).__name__}")
    # Trailing optional fields are left out when unset, as engines do (omit_defaults).
    if form == "map":
        out: dict[str, object] = {"type": tag, **fields}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out
    seq: list[object] = [tag, *fields.values()]
    tail = list(optional.values())
    while tail and tail[-1] is None:
        tail.pop()
    return seq + tail


def encode_batch(
    events: Sequence[KVEvent], ts: float = 0.0, dp_rank: int | None = None, form: Form = "positional"
) -> bytes:
    """The msgpack payload of one batch."""
    evs = [encode_event(e, form) for e in events]
    if form == "map":
        obj: object = {"ts": ts, "events": evs}
        if dp_rank is not None:
            obj["data_parallel_rank"] = dp_rank  # type: ignore[index]
    else:
        obj = [ts, evs] if dp_rank is None else [ts, evs, dp_rank]
    return _enc.encode(obj)


def encode_message(seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    """The three frames ``[topic, seq (8 bytes BE), payload]``."""
    return [topic, seq.to_bytes(8, "big"), payload]
