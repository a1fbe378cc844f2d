"""The block store of one serving instance: a ``mooncake_rs.Store`` behind the few calls
the prefill and decode roles make.

Blocks are keyed by their prefix hash. A slot being filled is a ``WritableBlock``
(``reserve(key)``; its ``offset`` in the arena is what a peer writes to); a held block is
a ``Block`` (a lease: never evicted or moved while held; its offset is
``Store.slot_offset(key)``). Request-scoped data (the partial last block of a prompt) uses
a reservation under a synthetic key that is never committed. The arena is registered with
the instance's transfer engine (``TransferEngine.register(store)``); with
``shared_memory=True`` (worker processes) a peer on this host maps it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core import Block, Store, WritableBlock
from .protocol import StoreRun

__all__ = ["StoreSlots"]

_SCRATCH = 0x5C8A_7C11 << 96  # high bits of the synthetic keys of request-scoped slots


class StoreSlots:
    def __init__(self, block_bytes: int, dram_bytes: int, *, shared_memory: bool, scope: int,
                 ssd_path: str | None = None, ssd_bytes: int = 0) -> None:
        self.store = Store(block_bytes, dram_bytes, ssd_path=ssd_path, ssd_bytes=ssd_bytes,
                           shared_memory=shared_memory)
        self.block_bytes = block_bytes
        self._scope = scope

    # ---- reservations (WritableBlock)
    def reserve(self, key: int) -> WritableBlock:
        return self.store.reserve(key)

    def reserve_scratch(self, request_id: int) -> WritableBlock:
        """A slot for request-scoped data under a synthetic key; never committed (``abort``
        it when done), so it never shows in the store's events."""
        key = _SCRATCH | ((self._scope & 0xFFFF_FFFF) << 64) | (request_id & ((1 << 64) - 1))
        return self.store.reserve(key)

    def commit(self, wb: WritableBlock, *, lease: bool = False) -> Block | None:
        """Publishes ``wb`` (an existing copy of the key wins); with ``lease``, the held block."""
        key = wb.key
        wb.commit()
        return self.store.get(key) if lease else None

    # ---- held blocks (Block)
    def lookup(self, key: int) -> Block | None:
        return self.store.get(key)

    def offset(self, h: Block | WritableBlock) -> int:
        if isinstance(h, WritableBlock):
            return h.offset
        off = self.store.slot_offset(h.key)
        if off is None:
            raise LookupError(f"block {h.key:#x} is not in DRAM")
        return off

    @staticmethod
    def view(h: Any) -> np.ndarray:
        return np.asarray(h)

    def drain_runs(self) -> list[StoreRun]:
        """The store's events since the last call, for the conductor's index, as runs of
        one kind and tier in store order (a block may be stored, evicted and stored again
        within one batch): a demotion stores the block in the SSD tier, a promotion in
        DRAM; an eviction or a removal drops it from the tier it names. The one place
        where store events are translated (``Conductor.apply_store_events`` may take the
        store's events directly later)."""
        runs: list[StoreRun] = []
        kind_tier: tuple[str, str] | None = None
        keys: list[bytes] = []
        for e in self.store.drain_events():
            kind = "stored" if e.kind in ("stored", "promoted", "demoted") else (
                "evicted" if e.kind in ("evicted", "removed") else None)
            if kind is None:
                continue
            if (kind, e.tier) != kind_tier:
                if keys and kind_tier is not None:
                    runs.append(StoreRun(kind_tier[0], kind_tier[1], b"".join(keys)))
                kind_tier, keys = (kind, e.tier), []
            keys.append(e.key.to_bytes(16, "little"))
        if keys and kind_tier is not None:
            runs.append(StoreRun(kind_tier[0], kind_tier[1], b"".join(keys)))
        return runs

    def __len__(self) -> int:
        return self.store.stats().blocks_dram

    @property
    def evictions(self) -> int:
        return self.store.stats().evictions_dram
