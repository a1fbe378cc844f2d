"""Decoding of the KV event wire format that vLLM and SGLang publish over ZMQ.

A message is three frames: ``[topic, sequence number (u64 big-endian), msgpack payload]``.
The payload is an event batch, shipped in two forms by different engine versions:

- positional: ``[ts, [event, ...], data_parallel_rank]`` (the rank may be missing; what
  vLLM 0.32 sends, with map events inside);
- a map: ``{"ts": ..., "events": [...], "data_parallel_rank": ...}``.

Each event is tagged with its type and is itself positional (``["BlockStored", hashes,
parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
kv_cache_spec_kind, ...]``)
or a map with a ``"type"`` field. Trailing positional fields and unknown map keys are
ignored, so newer engines that append fields still decode. Engine block hashes arrive as
integers (u64, or i64 from older versions) or as bytes; they are opaque to us and kept
as sent (see :mod:`.hashmap`).

The fast path decodes a whole batch with one typed msgspec decoder (C code, no Python
per event; one decoder per shape, tried in turn); a batch that mixes forms or carries an event type we do not know falls back
to decoding event by event, skipping unknown types (counted in ``Batch.unknown``).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from ..errors import MalformedEvent

__all__ = [
    "EngineHash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "EventBatch",
    "EventMessage",
    "decode_payload",
    "decode_message",
    "decode_seq",
    "REPLAY_END",
    "MAX_ENGINE_HASH_BYTES",
]

MAX_ENGINE_HASH_BYTES = 64
"""The longest engine hash accepted as bytes (a SHA-256 digest is 32): the indexer keeps
each one whole in its map, so a longer one is a malformed event, not memory held."""

EngineHash = Union[int, Annotated[bytes, msgspec.Meta(max_length=MAX_ENGINE_HASH_BYTES)]]
"""An engine's own block hash: opaque, compared as sent."""

# The public types are the map form; the positional form is a subclass of each (same
# fields, same tag), so ``isinstance(event, BlockStored)`` holds for both.


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", frozen=True, gc=False):
    """Consecutive full blocks were stored; ``token_ids`` holds all of their tokens."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", frozen=True, gc=False):
    """Blocks were evicted from ``medium`` (``None``: the engine's default, its GPU)."""

    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True, gc=False):
    """The engine dropped every cached block (a cache reset or a restart)."""


class _BlockStoredPos(BlockStored, array_like=True, frozen=True, tag="BlockStored"):
    pass


class _BlockRemovedPos(BlockRemoved, array_like=True, frozen=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedPos(AllBlocksCleared, array_like=True, frozen=True, tag="AllBlocksCleared"):
    pass


class _BlockStoredRawPos(BlockStored, array_like=True, frozen=True, tag="BlockStored"):
    # For ingestion: the tokens stay msgpack bytes, decoded in Rust (``msgpack_tokens``)
    # without ever becoming Python ints, the largest cost of decoding in Python.
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # type: ignore[assignment]


class _BlockStoredRawMap(BlockStored, frozen=True, tag="BlockStored"):
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # type: ignore[assignment]


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One published batch: its events in order, the engine's DP rank if it says."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    unknown: int = 0
    """Events of a type this decoder does not know (skipped)."""


class EventMessage(msgspec.Struct, frozen=True, gc=False):
    """A decoded three-frame message."""

    topic: bytes
    seq: int
    batch: EventBatch


class _BatchPos(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_BlockStoredPos, _BlockRemovedPos, _AllBlocksClearedPos]]
    data_parallel_rank: int | None = None


class _BatchMap(msgspec.Struct, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


class _RawBatchPos(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawBatchMap(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchRawPos(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_BlockStoredRawPos, _BlockRemovedPos, _AllBlocksClearedPos]]
    data_parallel_rank: int | None = None


class _BatchRawMap(msgspec.Struct, gc=False):
    ts: float
    events: list[Union[_BlockStoredRawMap, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


# What vLLM 0.32 really sends: a positional batch whose events are maps.
class _BatchPosOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


class _BatchRawPosOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_BlockStoredRawMap, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


_dec_raw_tokens_pos = msgspec.msgpack.Decoder(_BatchRawPos)
_dec_raw_tokens_map = msgspec.msgpack.Decoder(_BatchRawMap)
_dec_raw_tokens_pos_of_maps = msgspec.msgpack.Decoder(_BatchRawPosOfMaps)
_dec_pos = msgspec.msgpack.Decoder(_BatchPos)
_dec_pos_of_maps = msgspec.msgpack.Decoder(_BatchPosOfMaps)
_dec_map = msgspec.msgpack.Decoder(_BatchMap)
_dec_raw_pos = msgspec.msgpack.Decoder(_RawBatchPos)
_dec_raw_map = msgspec.msgpack.Decoder(_RawBatchMap)
_dec_event_pos = msgspec.msgpack.Decoder(Union[_BlockStoredPos, _BlockRemovedPos, _AllBlocksClearedPos])
_dec_event_map = msgspec.msgpack.Decoder(Union[BlockStored, BlockRemoved, AllBlocksCleared])
_dec_event_raw_pos = msgspec.msgpack.Decoder(Union[_BlockStoredRawPos, _BlockRemovedPos, _AllBlocksClearedPos])
_dec_event_raw_map = msgspec.msgpack.Decoder(Union[_BlockStoredRawMap, BlockRemoved, AllBlocksCleared])
_dec_any = msgspec.msgpack.Decoder()


def _is_array(data: bytes | memoryview) -> bool | None:
    """True for a msgpack array, False for a map, None for anything else (by its first byte)."""
    if len(data) == 0:
        return None
    b = data[0]
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return True
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return False
    return None


def _tag_of(raw: msgspec.Raw) -> object:
    """The type tag of an undecodable event, to tell an unknown type from a broken one."""
    try:
        obj = _dec_any.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, list) and obj:
        return obj[0]
    if isinstance(obj, dict):
        return obj.get("type")
    return None


def _decode_slow(payload: bytes | memoryview, array: bool, raw_tokens: bool) -> EventBatch:
    """Event by event: mixed forms, unknown event types (``token_ids`` left raw as on the
    fast path when ``raw_tokens``)."""
    try:
        raw = (_dec_raw_pos if array else _dec_raw_map).decode(payload)
    except msgspec.DecodeError as e:
        raise MalformedEvent(f"KV event payload is not an event batch: {e}") from None
    events: list[KVEvent] = []
    unknown = 0
    dec_pos, dec_map = (_dec_event_raw_pos, _dec_event_raw_map) if raw_tokens else (_dec_event_pos, _dec_event_map)
    for i, ev in enumerate(raw.events):
        form = _is_array(memoryview(ev))
        try:
            if form is None:
                raise msgspec.ValidationError("an event must be an array or a map")
            events.append((dec_pos if form else dec_map).decode(ev))
        except msgspec.DecodeError as e:
            tag = _tag_of(ev)
            if isinstance(tag, str) and tag not in _KNOWN_TAGS:
                unknown += 1
                continue
            raise MalformedEvent(f"KV event {i} of the batch is malformed: {e}") from None
    return EventBatch(raw.ts, events, raw.data_parallel_rank, unknown)


def decode_payload(payload: bytes | memoryview, raw_tokens: bool = False) -> EventBatch:
    """Decode one msgpack event batch (either form). Raises :class:`MalformedEvent`.

    ``raw_tokens=True`` (what ingestion uses) may leave a ``BlockStored``'s
    ``token_ids`` as the undecoded msgpack array (a ``msgspec.Raw``), which
    :class:`~mooncake_rs.kv_events.Ingestor` decodes in Rust.
    """
    array = _is_array(payload)
    if array is None:
        raise MalformedEvent(
            "KV event payload must be a msgpack array [ts, events, dp_rank] or a map "
            f"{{ts, events, data_parallel_rank}}; got {len(payload)} bytes starting "
            f"{bytes(payload[:8])!r}"
        )
    b: Any
    decoders: tuple[Any, ...]
    # Typed decoders, one per shape, most likely first: a positional batch of map events
    # (vLLM 0.32), of positional events (older vLLM, SGLang), a map batch of map events.
    if array:
        decoders = ((_dec_raw_tokens_pos_of_maps, _dec_raw_tokens_pos) if raw_tokens else (_dec_pos_of_maps, _dec_pos))
    else:
        decoders = (_dec_raw_tokens_map,) if raw_tokens else (_dec_map,)
    for dec in decoders:
        try:
            b = dec.decode(payload)
            break
        except msgspec.ValidationError:
            continue
        except msgspec.DecodeError as e:  # truncated or not msgpack at all
            raise MalformedEvent(f"KV event payload is not valid msgpack: {e}") from None
    else:
        return _decode_slow(payload, array, raw_tokens)
    return EventBatch(b.ts, b.events, b.data_parallel_rank)  # type: ignore[arg-type]


REPLAY_END = (1 << 64) - 1
"""The sequence frame that ends a replay: -1 as 8 signed big-endian bytes."""


def decode_seq(frame: bytes | memoryview) -> int:
    """A sequence-number frame: 8 bytes, big-endian, unsigned (:data:`REPLAY_END` ends a replay)."""
    if len(frame) != 8:
        raise MalformedEvent(f"a KV event sequence frame must be 8 bytes (u64 big-endian), got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes] | list[memoryview] | list[Any], raw_tokens: bool = False) -> EventMessage:
    """Decode ``[topic, seq, payload]``. Raises :class:`MalformedEvent` naming the bad frame."""
    if len(frames) != 3:
        raise MalformedEvent(
            f"a KV event message has 3 frames [topic, seq (8 bytes BE), msgpack payload]; got {len(frames)}"
        )
    topic, seq, payload = frames
    return EventMessage(bytes(topic), decode_seq(seq), decode_payload(payload, raw_tokens))
