"""Interop with engines we did not write: vLLM / SGLang KV events in, the Mooncake indexer API.

- :mod:`.events`: decoding of the ZMQ wire format (both payload forms) into typed events.
- :mod:`.encode`: the same format out (stand-in publishers, tests, benchmarks).
- :mod:`.hashmap`: per-instance engine hash -> our hash, bounded (Rust; a dict reference).
- :mod:`.targets`: where events land (one block index per medium, or a conductor's index).
- :mod:`.ingest`: applying one instance's events (hash recomputation from token ids), a
  whole message per Rust call; :mod:`.ingest_ref` is the pure-Python reference.
- :mod:`.subscriber`: the ZMQ SUB client with gap detection and replay (needs ``pyzmq``).
- :mod:`.upstream`: ``UpstreamRouter``, external OpenAI engines routed by our conductor on their events.
- :mod:`.proxy`, :mod:`.serve_upstream`: the ``serve --upstream`` app (needs ``httpx``, starlette, uvicorn).
- :mod:`.standin`: a stand-in engine publishing vLLM-format events (tests, demos; needs torch).

See docs/interop.md. This package imports neither pyzmq nor the HTTP stack until a
subscriber or the indexer server is used.
"""

from __future__ import annotations

from .encode import encode_batch, encode_event, encode_message
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventMessage,
    KVEvent,
    decode_message,
    decode_payload,
)
from .hashmap import EngineHashMap
from .ingest import Ingestor, IngestStats
from .targets import MediumIndex, TierTarget, canonical_medium
from .upstream import UpstreamRouter, UpstreamSpec, parse_upstream

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventMessage",
    "KVEvent",
    "decode_message",
    "decode_payload",
    "encode_batch",
    "encode_event",
    "encode_message",
    "EngineHashMap",
    "Ingestor",
    "IngestStats",
    "MediumIndex",
    "TierTarget",
    "canonical_medium",
    "UpstreamRouter",
    "UpstreamSpec",
    "parse_upstream",
    "KVEventSubscriber",
]


def __getattr__(name: str) -> object:
    if name == "KVEventSubscriber":  # imports pyzmq
        from .subscriber import KVEventSubscriber

        return KVEventSubscriber
    raise AttributeError(f"module 'mooncake_rs.interop' has no attribute {name!r}")
