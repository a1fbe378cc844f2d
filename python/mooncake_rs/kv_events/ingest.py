"""Applying one engine instance's KV events to a target index.

For ``BlockStored`` we recompute our chained hashes from its ``token_ids``, starting
from our hash of its ``parent_block_hash`` (translated through the instance's
:class:`~.hashmap.EngineHashMap`), insert them, and remember engine hash -> ours.
``BlockRemoved`` translates back and removes; ``AllBlocksCleared`` drops the instance.
Events the index cannot use are counted, not raised: a publisher that is out of step
with us must not stop ingestion (``stats()`` shows them).

The work is done in Rust (``_core.EventIngestor``): :meth:`Ingestor.apply_payload` takes
a ZMQ message's msgpack payload and decodes, hashes, maps and indexes it in one call,
with no Python object per event or block (what :class:`.subscriber.KVEventSubscriber`
uses); :meth:`Ingestor.apply` takes already decoded events. Python only decides, the
first time an instance names a medium, which index and tier it goes to (the target's
``key_of`` and ``sink``). A target without ``sink`` / ``all_indexes`` (a user's own
:class:`~.targets.Target`) or a hasher other than ``PrefixHasher`` /
``Xxh3RollingHasher`` is served by the pure-Python :class:`.ingest_ref.ReferenceIngestor`,
with the same behaviour.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from .._core import EngineHashMap, EventIngestor, PrefixHasher, Xxh3RollingHasher
from ..errors import InvalidArgument
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent, decode_payload
from .hashmap import DictEngineHashMap
from .ingest_ref import ReferenceIngestor, block_extras
from .ingest_types import BlockHasher, IngestStats, InstanceFeed
from .targets import Target

__all__ = ["BlockHasher", "Ingestor", "IngestStats"]

log = logging.getLogger("mooncake_rs.kv_events")


class Ingestor(InstanceFeed):
    """Feeds one instance (``slot``) of ``target`` from that instance's event stream."""

    def __init__(
        self, target: Target, slot: int, hasher: BlockHasher, map_capacity: int = 1 << 20, reference: bool = False
    ) -> None:
        """``reference=True``: apply events with the pure-Python reference path (for
        tests and benchmarks; slower, same behaviour)."""
        super().__init__(target, slot, hasher)
        self._fast: EventIngestor | None = None
        self._ref: ReferenceIngestor | None = None
        self._size_warned = False
        sink = getattr(target, "sink", None)
        all_indexes = getattr(target, "all_indexes", None)
        if not reference and isinstance(hasher, (PrefixHasher, Xxh3RollingHasher)) and callable(sink) and callable(all_indexes):
            self._fast = EventIngestor(slot, hasher, map_capacity, all_indexes())
        else:
            self._ref = ReferenceIngestor(target, slot, hasher, map_capacity)

    @property
    def fast(self) -> bool:
        """Whether events are applied in Rust (else by the Python reference)."""
        return self._fast is not None

    @property
    def map(self) -> EngineHashMap | DictEngineHashMap:
        """The engine hash -> our hash map of this instance."""
        if self._fast is not None:
            return self._fast.map
        assert self._ref is not None
        return self._ref.map

    def _register(self, name: str) -> None:
        """A medium this instance names for the first time: its key, index and tier."""
        assert self._fast is not None
        key = self.target.key_of(name)
        index, tier = self.target.sink(key)  # type: ignore[attr-defined]
        self._fast.add_medium(name, key, index, tier)

    def apply_payload(self, payload: bytes | memoryview) -> None:
        """Decode and apply one message's msgpack payload (an event batch).

        Raises :class:`~mooncake_rs.MalformedEvent` for a payload that does not decode
        (nothing applied) or a ``BlockStored`` whose token ids are not u32s (the events
        before it stay applied).
        """
        fast = self._fast
        if fast is None:
            assert self._ref is not None
            self._ref.apply(decode_payload(payload, raw_tokens=True))
            return
        step = fast.apply_payload(payload)
        while step is not None:
            event, name = step
            self._register(name)
            step = fast.apply_payload(payload, event)

    def apply(self, batch: EventBatch) -> None:
        """Apply one decoded batch's events in order.

        Raises :class:`~mooncake_rs.MalformedEvent` at a ``BlockStored`` whose token ids
        are not u32s (the events before it stay applied; the subscriber logs, counts and
        moves on).
        """
        if self._fast is None:
            assert self._ref is not None
            self._ref.apply(batch)
            return
        self._fast.count_batch(batch.unknown)
        for ev in batch.events:
            self.apply_event(ev)

    def apply_event(self, ev: KVEvent) -> None:
        fast = self._fast
        if fast is None:
            assert self._ref is not None
            self._ref.apply_event(ev)
            return
        if isinstance(ev, BlockStored):
            tokens: Any = ev.token_ids
            raw = type(tokens) is msgspec.Raw
            extras = block_extras(ev)
            args = (ev.block_hashes, ev.parent_block_hash, tokens, ev.block_size, ev.medium, raw, extras)
            while (name := fast.stored(*args, ev.group_idx, ev.kv_cache_spec_kind)) is not None:
                self._register(name)
        elif isinstance(ev, BlockRemoved):
            while (name := fast.removed(ev.block_hashes, ev.medium, ev.group_idx)) is not None:
                self._register(name)
        elif isinstance(ev, AllBlocksCleared):
            fast.cleared()
        else:  # pragma: no cover - the decoder yields only the three types
            fast.count_batch(1, 0)

    def groups(self) -> list[tuple[int, bool]]:
        """The KV cache groups this instance's events named: ``(group_idx, full attention)``."""
        if self._fast is None:
            assert self._ref is not None
            return self._ref.groups()
        return self._fast.groups()

    def check_block_size(self, payload: bytes | memoryview) -> None:
        """Say once, with both sizes, that this instance's blocks are not ours (its events
        count as ``mismatched`` and are ignored): ``payload`` is a recent message, read to
        find the engine's size. Cheap after the first warning; callers call it per poll."""
        if self._size_warned or self.stats().mismatched == 0:
            return
        self._size_warned = True
        try:
            sizes = sorted({ev.block_size for ev in decode_payload(payload).events
                            if isinstance(ev, BlockStored) and ev.block_size and ev.block_size != self.block_size})
        except InvalidArgument:
            sizes = []
        theirs = ", ".join(map(str, sizes)) or "another size (token counts not a multiple of ours)"
        log.warning("KV events of instance slot %d: the engine caches blocks of %s tokens, we hash blocks of %d: "
                    "its blocks are ignored; give the engine's block size (--block-size %s)", self.slot, theirs,
                    self.block_size, sizes[0] if sizes else "N")

    def reset(self, reason: str) -> None:
        """Events were lost: forget everything this instance holds, rebuild from new events."""
        if self._fast is None:
            assert self._ref is not None
            self._ref.reset(reason)
            return
        log.warning("KV events of instance slot %d: %s; dropping its %d index entries", self.slot, reason, len(self.map))
        self.target.clear(self.slot)
        self._fast.reset_map()

    def stats(self) -> IngestStats:
        if self._fast is None:
            assert self._ref is not None
            return self._ref.stats()
        return IngestStats(**self._fast.stats())
