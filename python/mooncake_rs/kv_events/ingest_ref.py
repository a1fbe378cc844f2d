"""The pure-Python reference of :class:`.ingest.Ingestor`: one instance's decoded KV
events applied to a target index, event by event, with a ``dict`` engine-hash map.

:class:`.ingest.Ingestor` applies whole payloads in Rust (``_core.EventIngestor``);
this is the simple version it is tested against (``tests/test_interop_fastpath.py``),
and what it uses for a target or a hasher the Rust path does not know.

For ``BlockStored`` we recompute our chained hashes from its ``token_ids``, starting
from our hash of its ``parent_block_hash`` (translated through the instance's
:class:`.hashmap.DictEngineHashMap`) and folding in each block's ``extra_keys`` entry
(its msgpack bytes: a salt, a LoRA name, multimodal ids), insert them, and remember
engine hash -> ours.
``BlockRemoved`` translates back and removes; ``AllBlocksCleared`` drops the instance.
Events the index cannot use are counted, not raised: a publisher that is out of step
with us must not stop ingestion (``stats()`` shows them).

KV cache groups (hybrid models: one per attention kind): only full-attention groups
(``kv_cache_spec_kind`` ``"full_attention"``, or not said; ``group_idx`` nil is group
0) decide, and a block is held when every one of them seen so far holds it; events of
other groups are counted (``other_groups``) and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec

from .._core import msgpack_tokens
from ..errors import InvalidArgument, MalformedEvent
from .extra_keys import encode_extra_keys
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from .hashmap import MAX_GROUPS, MEDIA_BITS, DictEngineHashMap
from .ingest_types import BlockHasher, IngestStats, InstanceFeed
from .targets import Target, canonical_medium

__all__ = ["ReferenceIngestor", "block_extras"]

log = logging.getLogger("mooncake_rs.kv_events")

FULL_ATTENTION = "full_attention"
"""vLLM's ``kv_cache_spec_kind`` of full-attention groups, the ones that decide whether an
instance holds a block (a group that does not say its kind counts as one)."""


def block_extras(ev: BlockStored) -> list[bytes | None]:
    """The ``extra_keys`` entries of ``ev`` as the bytes our hashers fold in (one per
    block; empty when it has none): each re-encoded with msgspec, which gives back the
    bytes vLLM sent (both write msgpack in its shortest form)."""
    keys = ev.extra_keys
    if not keys:
        return []
    return [encode_extra_keys(e) for e in keys]


class ReferenceIngestor(InstanceFeed):
    """Feeds one instance (``slot``) of ``target`` from that instance's event stream."""

    def __init__(self, target: Target, slot: int, hasher: BlockHasher, map_capacity: int = 1 << 20) -> None:
        super().__init__(target, slot, hasher)
        self.map = DictEngineHashMap(map_capacity)
        self._stats = IngestStats()
        # medium -> (bit, target key); bit masks of media sharing a key.
        self._media: dict[str | None, tuple[int, str]] = {}
        self._bits: list[tuple[str, str]] = []  # bit index -> (medium, key)
        self._same_key: dict[str, int] = {}
        # KV cache groups: group_idx (nil: 0) -> [number in the map, full attention]
        self._groups: dict[int, list[Any]] = {}
        self._deciding = 0  # mask of the numbers of the groups that decide holding

    def _group(self, idx: int | None, kind: str | None) -> int | None:
        """The map number of an event's group, learning it (and its kind, when a
        ``BlockStored`` says it); ``None`` when the group does not decide."""
        idx = 0 if idx is None else idx
        g = self._groups.get(idx)
        if g is None:
            if len(self._groups) >= MAX_GROUPS:
                return None
            g = self._groups[idx] = [len(self._groups), True]
            self._deciding |= 1 << g[0]
        if kind is not None:
            g[1] = kind == FULL_ATTENTION
            if g[1]:
                self._deciding |= 1 << g[0]
            else:
                self._deciding &= ~(1 << g[0])
        return g[0] if g[1] else None

    def groups(self) -> list[tuple[int, bool]]:
        """The KV cache groups seen so far: ``(group_idx, full attention)``."""
        return [(idx, g[1]) for idx, g in self._groups.items()]

    def _medium(self, medium: str | None) -> tuple[int, str] | None:
        got = self._media.get(medium)
        if got is not None:
            return got
        name = canonical_medium(medium)
        for b, (m, key) in enumerate(self._bits):
            if m == name:
                self._media[medium] = (1 << b, key)
                return self._media[medium]
        if len(self._bits) >= MEDIA_BITS:
            return None
        key = self.target.key_of(name)
        bit = 1 << len(self._bits)
        self._bits.append((name, key))
        self._same_key[key] = self._same_key.get(key, 0) | bit
        self._media[medium] = (bit, key)
        return self._media[medium]

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch's events in order.

        Raises :class:`MalformedEvent` at a ``BlockStored`` whose token ids are not u32s
        (the events before it stay applied; the subscriber logs, counts and moves on).
        """
        st = self._stats
        st.batches += 1
        st.unknown_events += batch.unknown
        for ev in batch.events:
            self.apply_event(ev)

    def apply_event(self, ev: KVEvent) -> None:
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._removed(ev)
        elif isinstance(ev, AllBlocksCleared):
            self._stats.cleared += 1
            self._drop()
        else:  # pragma: no cover - the decoder yields only the three types
            self._stats.unknown_events += 1

    def _stored(self, ev: BlockStored) -> None:
        st = self._stats
        engine = ev.block_hashes
        n = len(engine)
        if n == 0:
            return
        group = self._group(ev.group_idx, ev.kv_cache_spec_kind)
        if group is None:
            st.other_groups += 1
            return
        bs = self.block_size
        tokens: Any = ev.token_ids
        if type(tokens) is msgspec.Raw:  # left undecoded by decode_payload(raw_tokens=True)
            try:
                tokens = memoryview(msgpack_tokens(tokens)).cast("I")
            except InvalidArgument as e:
                raise MalformedEvent(f"BlockStored token_ids: {e}") from None
        extras = block_extras(ev)
        if (ev.block_size and ev.block_size != bs) or len(tokens) != n * bs or len(extras) > n:
            st.mismatched += 1
            return
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = self.map.ours(ev.parent_block_hash, group)
            if parent is None:
                st.orphans += 1
                return
        med = self._medium(ev.medium)
        if med is None:
            st.media_overflow += 1
            return
        bit, key = med
        try:
            ours = self.hasher.hash(tokens, parent, extras) if any(e is not None for e in extras) else self.hasher.hash(tokens, parent)
        except InvalidArgument as e:  # token ids outside u32
            raise MalformedEvent(f"BlockStored token_ids: {e}") from None
        replaced = self.map.store(engine, ours, bit, group)
        if replaced:
            self._remove_masks(replaced)
        if self._deciding != 1 << group:  # several deciding groups: insert what each holds
            same, deciding = self._same_key[key], self._deciding
            ours = [o for o in ours if self.map.held(o, same, deciding)]
        self.target.insert(self.slot, ours, key)
        st.stored_blocks += n
        if len(self.map) > self.map.capacity:
            gone = self.map.evict_overflow()
            st.evicted = self.map.evicted
            self._remove_masks(gone)

    def _removed(self, ev: BlockRemoved) -> None:
        group = self._group(ev.group_idx, None)
        if group is None:
            self._stats.other_groups += 1
            return
        med = self._medium(ev.medium)
        if med is None:
            self._stats.media_overflow += 1
            return
        bit, key = med
        out, unknown = self.map.remove(ev.block_hashes, bit, self._same_key[key], group, self._deciding)
        self._stats.unknown_removed += unknown
        if out:
            self.target.remove(self.slot, out, key)
            self._stats.removed_blocks += len(out)

    def _remove_masks(self, entries: Iterable[tuple[int, int]]) -> None:
        """Remove these (our hash, media mask) blocks, entries just replaced or evicted,
        from every key their media use, unless the map still holds them there."""
        per_key: dict[str, list[int]] = {}
        for ours, mask in entries:
            keys = {self._bits[b][1] for b in range(len(self._bits)) if mask >> b & 1}
            for k in keys:
                if not self.map.held(ours, self._same_key[k], self._deciding):
                    per_key.setdefault(k, []).append(ours)
        # in the order the keys were first named, as the Rust path does
        for k in dict.fromkeys(key for _, key in self._bits):
            if k in per_key:
                self.target.remove(self.slot, per_key[k], k)

    def _drop(self) -> None:
        self.target.clear(self.slot)
        self.map.clear()

    def reset(self, reason: str) -> None:
        """Events were lost: forget everything this instance holds, rebuild from new events."""
        self._stats.resets += 1
        log.warning("KV events of instance slot %d: %s; dropping its %d index entries", self.slot, reason, len(self.map))
        self._drop()

    def stats(self) -> IngestStats:
        self._stats.evicted = self.map.evicted
        return IngestStats(**vars(self._stats))
