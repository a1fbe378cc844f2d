"""The indexer behind the Mooncake Conductor Indexer API: events in, prefix hits out.

Publishers register under a *group* ``(model, lora_name, block_size, salt)``: blocks of
different groups never match each other (each group has its own hasher and its own
per-medium block indexes). Within a group each publisher ``(tenant_id, instance_id,
dp_rank)`` is one slot in those indexes, fed by an :class:`.ingest.Ingestor` (and, when
subscribing, a :class:`.subscriber.KVEventSubscriber` thread).

A query answers, for every registered instance of the tenant (or the one asked for), in
tokens (blocks x block_size):

- ``longest_matched``: the longest prefix of the query's full blocks such that every
  block is held by the instance on some medium and some DP rank;
- per medium (``GPU``, ``CPU``, ``DISK``, and any other a publisher named): the same
  over that medium alone (any DP rank);
- ``DP``: per DP rank, over every medium of that rank.

Each is a union over (slot, medium) cells: the block index gives every cell's
contiguous prefix in one ``match_prefix`` call per medium; a union can reach further
than its longest cell (GPU holds block 0 and 2, CPU block 1: 3 blocks), so from there
it probes ``holders`` block by block (cached per medium and depth) until a block is
missing. Exact, and only a few probes in practice.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from .._core import PrefixHasher, Xxh3RollingHasher
from ..errors import InvalidArgument, Overloaded
from ..kv_events.events import EventBatch
from ..kv_events.extra_keys import vllm_block_extras
from .indexer_api import QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest, check_limits
from ..kv_events.ingest import BlockHasher, Ingestor
from ..kv_events.targets import MediumIndex

__all__ = ["Indexer", "GroupKey", "HashName"]

log = logging.getLogger("mooncake_rs.interop")

HashName = Literal["rfc", "mooncake"]

GroupKey = tuple[str, str, int, str]
"""(model, lora_name or "", block_size, salt or "")."""

MemberKey = tuple[str, str, int]
"""(tenant_id, instance_id, dp_rank)."""


@dataclass
class _Member:
    key: MemberKey
    slot: int
    ingestor: Ingestor
    endpoint: str
    replay_endpoint: str | None
    type: str
    subscriber: object | None = None  # a KVEventSubscriber when subscribing


@dataclass
class _Group:
    key: GroupKey
    hasher: BlockHasher
    media: MediumIndex = field(default_factory=MediumIndex)
    members: dict[MemberKey, _Member] = field(default_factory=dict)


@dataclass(frozen=True)
class _Fold:
    """A request's cache salt and LoRA adapter, to fold into its block hashes."""

    cache_salt: str | None = None
    lora_name: str | None = None


def _group_key(model: str, lora_name: str | None, block_size: int, salt: str | None) -> GroupKey:
    return (model, lora_name or "", block_size, salt or "")


class Indexer:
    """Registration, ingestion and queries; thread-safe (HTTP handlers, subscriber threads).

    ``hash="rfc"`` (default) keys blocks by the RFC's rolling XXH3-64 with ``seed``, so
    ``/query_by_hash`` takes the hashes other routers compute; ``"mooncake"`` uses our
    128-bit :class:`~mooncake_rs.PrefixHasher`. ``subscribe=False`` registers publishers
    without connecting to them (feed them with :meth:`ingest`).
    """

    def __init__(
        self,
        hash: HashName = "rfc",
        seed: int = 0,
        subscribe: bool = True,
        map_capacity: int = 1 << 20,
        replay_timeout_s: float = 2.0,
        max_publishers: int = 256,
    ) -> None:
        if not isinstance(max_publishers, int) or max_publishers < 1:
            raise InvalidArgument(f"max_publishers must be an int >= 1, got {max_publishers!r}")
        if hash not in ("rfc", "mooncake"):
            raise InvalidArgument(f"hash must be 'rfc' or 'mooncake', got {hash!r}")
        if not 0 <= seed < 1 << 64:
            raise InvalidArgument(f"seed must be a u64, got {seed}")
        self.hash_name = hash
        self.seed = seed
        self.subscribe = subscribe
        self.map_capacity = map_capacity
        self.replay_timeout_s = replay_timeout_s
        # each publisher is a subscriber thread and a socket: at most this many at once
        self.max_publishers = max_publishers
        self._groups: dict[GroupKey, _Group] = {}
        self._slots = itertools.count(1)
        # Guards the group/member tables only; never held across a socket call or a
        # block-index call (queries take a snapshot of the members first).
        self._lock = threading.Lock()

    def _hasher(self, block_size: int) -> BlockHasher:
        if self.hash_name == "rfc":
            return Xxh3RollingHasher(block_size, self.seed)
        return PrefixHasher(block_size, self.seed)

    # --- registration ------------------------------------------------------------

    @staticmethod
    def _learn_block_size(req: RegisterRequest) -> int:
        """A registration without ``block_size``: the engine's, from its replay buffer."""
        from .engine_info import block_size_from_replay

        size = block_size_from_replay(req.replay_endpoint) if req.replay_endpoint else None
        if size is None:
            raise InvalidArgument(
                f"block_size is missing and could not be learned from {req.instance_id!r}'s events "
                f"({'no replay_endpoint given' if not req.replay_endpoint else 'nothing in its replay buffer yet'}): "
                "pass the engine's block size (vLLM: its --block-size; 128 on CPU by default)")
        log.info("publisher %s: block size %d learned from its replay buffer", req.instance_id, size)
        return size

    def register(self, req: RegisterRequest) -> dict[str, object]:
        if req.block_size is None:
            req = msgspec.structs.replace(req, block_size=self._learn_block_size(req))
        assert req.block_size is not None
        if req.block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {req.block_size}")
        if req.dp_rank < 0:
            raise InvalidArgument(f"dp_rank must be >= 0, got {req.dp_rank}")
        if not req.instance_id:
            raise InvalidArgument("instance_id must not be empty")
        gk = _group_key(req.modelname, req.lora_name, req.block_size, req.additionalsalt)
        mk: MemberKey = (req.tenant_id, req.instance_id, req.dp_rank)
        check_limits(req)  # (also when called directly, not through the HTTP API)
        with self._lock:
            group = self._groups.get(gk)
            if group is None or mk not in group.members:  # a re-registration replaces, adds none
                self._check_room()
            if group is None:
                group = self._groups[gk] = _Group(gk, self._hasher(req.block_size))
            old = group.members.pop(mk, None)
            slot = next(self._slots)
            member = _Member(mk, slot, Ingestor(group.media, slot, group.hasher, self.map_capacity),
                             req.endpoint, req.replay_endpoint, req.type)
            group.members[mk] = member
        if old is not None:  # re-registration replaces the old subscription
            self._retire(group, old)
        if self.subscribe:
            from ..kv_events.subscriber import KVEventSubscriber

            try:
                sub = KVEventSubscriber(req.endpoint, member.ingestor, req.replay_endpoint,
                                        replay_timeout_s=self.replay_timeout_s)
            except InvalidArgument:
                with self._lock:
                    group.members.pop(mk, None)
                raise
            member.subscriber = sub
            sub.start()
        log.info("registered %s publisher %s for %s|%s|%d (group %s)", req.type, req.endpoint, *mk, gk)
        return {"status": "registered successfully", "instance_id": req.instance_id}

    def _check_room(self) -> None:
        """Under the lock: refuses a new publisher past ``max_publishers`` (Overloaded)."""
        n = sum(len(g.members) for g in self._groups.values())
        if n >= self.max_publishers:
            raise Overloaded(f"{n} publishers are registered, the most this indexer takes ({self.max_publishers}); "
                             "unregister some or start it with a larger --max-publishers", reason="publishers")

    def _retire(self, group: _Group, member: _Member) -> None:
        sub = member.subscriber
        if sub is not None:
            sub.stop()  # type: ignore[attr-defined]
        group.media.clear(member.slot)

    def unregister(self, req: UnregisterRequest) -> dict[str, object]:
        removed: list[tuple[_Group, _Member]] = []
        with self._lock:
            for group in self._groups.values():
                for mk in list(group.members):
                    tenant, inst, dp = mk
                    if tenant == req.tenant_id and inst == req.instance_id and req.dp_rank in (None, dp):
                        removed.append((group, group.members.pop(mk)))
        for group, member in removed:
            self._retire(group, member)
        return {
            "status": "unregistered successfully" if removed else "no such instance",
            "removed_instances": [f"{m.key[1]}|{m.key[0]}|{m.key[2]}" for _, m in removed],
        }

    def close(self) -> None:
        with self._lock:
            all_members = [(g, m) for g in self._groups.values() for m in g.members.values()]
            for g in self._groups.values():
                g.members.clear()
        for g, m in all_members:
            self._retire(g, m)

    # --- ingestion without sockets -------------------------------------------------

    def ingest(self, tenant_id: str, instance_id: str, dp_rank: int, batch: EventBatch) -> None:
        """Apply a decoded batch to a registered publisher (tests, embedding, benchmarks)."""
        self._member(tenant_id, instance_id, dp_rank).ingestor.apply(batch)

    def _member(self, tenant_id: str, instance_id: str, dp_rank: int) -> _Member:
        mk = (tenant_id, instance_id, dp_rank)
        with self._lock:
            for g in self._groups.values():
                m = g.members.get(mk)
                if m is not None:
                    return m
        raise InvalidArgument(f"no publisher registered as {instance_id}|{tenant_id}|{dp_rank}")

    def stats(self) -> dict[str, object]:
        """Per publisher ``instance|tenant|dp``: ingestion and subscriber counters."""
        with self._lock:
            members = [m for g in self._groups.values() for m in g.members.values()]
        out: dict[str, object] = {}
        for m in members:
            entry: dict[str, object] = dict(vars(m.ingestor.stats()))
            if m.subscriber is not None:
                entry.update(vars(m.subscriber.stats))  # type: ignore[attr-defined]
            out[f"{m.key[1]}|{m.key[0]}|{m.key[2]}"] = entry
        return out

    # --- queries -------------------------------------------------------------------

    def query(self, req: QueryRequest) -> dict[str, dict[str, dict[str, object]]]:
        group, members, fold = self._select(req.model, req.lora_name, req.lora_id, req.block_size, req.cache_salt,
                                            req.tenant_id, req.instance_id)
        if group is None:
            return {req.tenant_id: {}}
        try:
            if fold.cache_salt is None and fold.lora_name is None:
                hashes = group.hasher.hash(req.token_ids)
            else:
                extras = vllm_block_extras(len(req.token_ids) // req.block_size, cache_salt=fold.cache_salt,
                                           lora_name=fold.lora_name)
                hashes = group.hasher.hash(req.token_ids, extras=extras)
        except InvalidArgument as e:
            raise InvalidArgument(f"token_ids: {e}") from None
        return {req.tenant_id: self._answer(group, members, hashes)}

    def query_by_hash(self, req: QueryByHashRequest) -> dict[str, dict[str, dict[str, object]]]:
        hashes = req.seq_hashes if req.seq_hashes is not None else req.block_hash
        if hashes is None:
            raise InvalidArgument("query_by_hash needs seq_hashes (or the older block_hash)")
        limit = 1 << (64 if self.hash_name == "rfc" else 128)
        for i, h in enumerate(hashes):
            if not 0 <= h < limit:
                raise InvalidArgument(f"seq_hashes[{i}] = {h} is not a {'u64' if limit == 1 << 64 else 'u128'}")
        # The caller's hashes already carry whatever it folded in; salt and adapter only
        # choose the group here.
        group, members, _fold = self._select(req.model, req.lora_name, req.lora_id, req.block_size, req.cache_salt,
                                             req.tenant_id, req.instance_id)
        if group is None:
            return {req.tenant_id: {}}
        return {req.tenant_id: self._answer(group, members, hashes)}

    def _select(
        self, model: str, lora_name: str | None, lora_id: int | None, block_size: int, salt: str | None,
        tenant_id: str, instance_id: str | None,
    ) -> tuple[_Group | None, list[_Member], _Fold]:
        """The group a query reads, and what its hashes must fold in.

        A publisher registered with that LoRA name / salt (``additionalsalt``) is its own
        group, as in Mooncake's API. Otherwise the query reads the group registered without
        them, and the request's salt and adapter are folded into its hashes as the engine
        folds them into its own (vLLM: a per-request ``cache_salt``, one engine serving
        many adapters), so salted or adapted blocks never answer a plain query, nor the
        reverse."""
        if lora_id is not None:
            raise InvalidArgument("lora_id is deprecated and not supported: pass lora_name")
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        candidates = [(_group_key(model, lora_name, block_size, salt), _Fold())]
        if salt:
            candidates.append((_group_key(model, lora_name, block_size, None), _Fold(cache_salt=salt)))
        if lora_name:
            candidates.append((_group_key(model, None, block_size, salt), _Fold(lora_name=lora_name)))
        if salt and lora_name:
            candidates.append((_group_key(model, None, block_size, None), _Fold(salt, lora_name)))
        with self._lock:
            for gk, fold in candidates:
                group = self._groups.get(gk)
                if group is not None:
                    members = [m for m in group.members.values()
                               if m.key[0] == tenant_id and (instance_id is None or m.key[1] == instance_id)]
                    return group, members, fold
        return None, [], _Fold()

    def _answer(self, group: _Group, members: list[_Member], hashes: list[int]) -> dict[str, dict[str, object]]:
        bs = group.key[2]
        n = len(hashes)
        media = list(group.media.indexes.items())  # a snapshot: a subscriber may add a medium
        names = [m for m, _ in media]
        # Contiguous prefix of every (slot, medium) cell, one index call per medium.
        prefix: list[dict[int, int]] = [idx.match_prefix(hashes) if n else {} for _, idx in media]
        held_cache: dict[tuple[int, int], set[int]] = {}

        def held(mi: int, depth: int) -> set[int]:
            got = held_cache.get((mi, depth))
            if got is None:
                if depth == 0:
                    got = set(prefix[mi])
                else:
                    got = {inst for inst, _tier in media[mi][1].holders(hashes[depth])}
                held_cache[(mi, depth)] = got
            return got

        # Slots with any entry in each medium: a cell outside it holds nothing there.
        present = [set(idx.instances()) for _, idx in media]

        def union(cells: Iterable[tuple[int, int]]) -> int:
            """Longest prefix where every block is held by one of the (slot, medium index) cells."""
            live = [(slot, mi, prefix[mi].get(slot, 0)) for slot, mi in cells if slot in present[mi]]
            if len(live) <= 1:  # one cell's contiguous prefix is exact (the common case)
                return live[0][2] if live else 0
            depth = max(p for _, _, p in live)
            while depth < n:
                # A cell whose contiguous prefix is ``depth`` is known to lack block ``depth``;
                # only the shorter ones can still hold it (out of order).
                maybe = [(slot, mi) for slot, mi, p in live if p < depth]
                if not maybe or not any(slot in held(mi, depth) for slot, mi in maybe):
                    break
                depth += 1
            return depth

        by_instance: dict[str, list[_Member]] = {}
        for m in members:
            by_instance.setdefault(m.key[1], []).append(m)
        out: dict[str, dict[str, object]] = {}
        all_media = range(len(media))
        for inst, ms in sorted(by_instance.items()):
            slots = [m.slot for m in ms]
            entry: dict[str, object] = {
                "longest_matched": bs * union((s, mi) for s in slots for mi in all_media)
            }
            for mi, name in enumerate(names):  # GPU, CPU, DISK, then any other medium seen
                entry[name] = bs * union((s, mi) for s in slots)
            entry["DP"] = {str(m.key[2]): bs * union((m.slot, mi) for mi in all_media)
                           for m in sorted(ms, key=lambda m: m.key[2])}
            out[inst] = entry
        return out
