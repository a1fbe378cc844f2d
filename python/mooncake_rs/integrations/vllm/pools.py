"""The pools a scheduler-side connector knows of: their store events feed one
:class:`~mooncake_rs.BlockIndex` (which pool holds the longest prefix of a prompt), and the
local pool's events become vLLM KV events for the blocks this instance saved.

Followed: the local pool, ``peers`` from the settings, and pools named by P/D requests. Events are pulled
(``Events(since)``) at most every ``poll_s`` from the scheduler's own loop (take_events),
so there is no thread; a pool that does not answer is skipped until the next poll, and a
follower that fell behind the pool's event log (``start > since``) rebuilds that pool's
index entries from what the log still has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..._core import BlockHashes, BlockIndex
from ...errors import MooncakeError
from ..pool.client import PoolClient
from .config import ConnectorSettings

__all__ = ["PoolFollower"]

log = logging.getLogger("mooncake_rs.vllm")

MEDIUM = "CPU"  # how vLLM's own events name an offload tier in host memory


class PoolFollower:
    def __init__(self, settings: ConnectorSettings, client: Callable[[str], PoolClient], poll_s: float = 0.2) -> None:
        self.settings = settings
        self._client = client
        self.poll_s = poll_s
        self.index = BlockIndex()
        self._ids: dict[str, int] = {}
        self._next: dict[str, int] = {}
        self._last_poll = 0.0
        self._expected: dict[int, dict[str, Any]] = {}  # key -> vLLM event fields (blocks we save)
        self._published: dict[int, Any] = {}  # key -> vLLM hash announced as stored
        self._out: list[Any] = []
        self.follow(settings.pool)
        for p in settings.peers:
            self.follow(p)

    def follow(self, address: str) -> None:
        if address not in self._ids:
            self._ids[address] = len(self._ids)
            self._next[address] = 0

    def expect(self, key: int, fields: dict[str, Any] | None) -> None:
        if fields is not None:
            self._expected[key] = fields

    def best_pool(self, keys: BlockHashes) -> tuple[str, int] | None:
        """The followed pool holding the longest leading run of ``keys`` (by its events)."""
        self.poll()
        best = self.index.best_prefix(keys)
        if best is None:
            return None
        names = {v: k for k, v in self._ids.items()}
        return names[best[0]], best[1]

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        for address in list(self._ids):
            try:
                self._pull(address)
            except MooncakeError as e:
                log.debug("MooncakeRsConnector: events of pool %s: %s", address, e)

    def _pull(self, address: str) -> None:
        client = self._client(address)
        inst = self._ids[address]
        while True:
            batch = client.events(self._next[address])
            if batch.start > self._next[address]:
                # We missed events: forget what we thought this pool held, then replay the log.
                self.index.remove_instance(inst)
            keys = BlockHashes(batch.keys)
            stored = [k for k, kind in zip(keys, batch.kinds) if kind in ("stored", "promoted")]
            gone = [k for k, kind in zip(keys, batch.kinds) if kind in ("evicted", "removed")]
            if stored:
                self.index.insert(inst, stored, "dram")
            if gone:
                self.index.remove(inst, gone)
            if inst == 0:
                self._to_vllm(stored, gone)
            self._next[address] = batch.next
            if batch.next == batch.start:
                return

    def _to_vllm(self, stored: list[int], gone: list[int]) -> None:
        try:
            from vllm.distributed.kv_events import BlockRemoved, BlockStored
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        except ImportError:  # a follower outside vLLM (tests, tools) publishes nothing
            return
        for k in stored:
            f = self._expected.pop(k, None)
            if f is None:
                continue
            lora = f["lora"]
            h = maybe_convert_block_hash(f["hash"])
            self._published[k] = h
            self._out.append(BlockStored(
                block_hashes=[h], parent_block_hash=maybe_convert_block_hash(f["parent"]) if f["parent"] else None,
                token_ids=list(f["tokens"]), block_size=len(f["tokens"]),
                lora_id=lora.adapter_id if lora else None, medium=MEDIUM, lora_name=lora.name if lora else None))
        removed = [self._published.pop(k) for k in gone if k in self._published]
        if removed:
            self._out.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))

    def take_vllm_events(self, block_size: int) -> list[Any]:
        self.poll()
        out, self._out = self._out, []
        return out

    def close(self) -> None:
        pass
