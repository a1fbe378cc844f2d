"""KV-cache events in the wire format vLLM and SGLang publish over ZMQ, in and out.

The bottom of everything that speaks KV events: our own instances publish through it
(``serving/kv_events.py``, ``Cluster(kv_events=...)``), and the indexer and the upstream
router of :mod:`mooncake_rs.interop` ingest engines' events through it. It imports only
``_core`` and ``errors``, so both can use it without reaching each other.

- :mod:`.events`: decoding of the wire format (both payload forms) into typed events.
- :mod:`.encode`: the same format out (our publishers, tests, benchmarks).
- :mod:`.publisher`: ``EventPublisher``, a PUB socket and a replay ROUTER on one thread.
- :mod:`.subscriber`: the ZMQ SUB client with gap detection and replay (needs ``pyzmq``).
- :mod:`.hashmap`: per-instance engine hash -> our hash, bounded (Rust; a dict reference).
- :mod:`.targets`: where events land (one block index per medium, or a conductor's index).
- :mod:`.ingest`: applying one instance's events (hash recomputation from token ids), a
  whole message per Rust call; :mod:`.ingest_ref` is the pure-Python reference.
- :mod:`.extra_keys`: vLLM's per-block extra keys (LoRA, salt, multimodal), to hash a
  prompt as the ingest hashes the engine's blocks.

See docs/interop.md. Importing this package does not import pyzmq; the subscriber and
the publisher do.
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
    "KVEventSubscriber",
]


def __getattr__(name: str) -> object:
    if name == "KVEventSubscriber":  # imports pyzmq
        from .subscriber import KVEventSubscriber

        return KVEventSubscriber
    raise AttributeError(f"module 'mooncake_rs.kv_events' has no attribute {name!r}")
