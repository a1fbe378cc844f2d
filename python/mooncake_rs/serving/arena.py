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

from collections.abc import Iterable
from typing import Any

import numpy as np

from .._core import Block, BlockHashes, Store, WritableBlock
from ..errors import MooncakeError

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
        """Publishes ``wb``; with ``lease``, the held block. ``commit()`` hands back the
        published slot already leased, so there is no second lookup by key; only when the
        key was stored meanwhile (that copy wins, this slot is freed) is it looked up."""
        key = wb.key
        block = wb.commit()
        if not lease:
            if block is not None:
                block.release()
            return None
        return block if block is not None else self.store.get(key)

    # ---- held blocks (Block)
    def lookup(self, key: int) -> Block | None:
        return self.store.get(key)

    def hold_or_reserve(self, keys: Iterable[int]) -> list[Block | WritableBlock]:
        """Where a fetch lands, key by key: the block (leased) if this store holds it,
        else a fresh reservation to copy into. Stops at the first key a full store cannot
        reserve: the blocks after it are left to compute."""
        out: list[Block | WritableBlock] = []
        for k in keys:
            s: Block | WritableBlock | None = self.store.get(k)
            if s is None:
                try:
                    s = self.store.reserve(k)
                except MooncakeError:
                    break
            out.append(s)
        return out

    def lookup_prefix(self, keys: BlockHashes) -> list[Block]:
        """Leased blocks of the longest leading run of ``keys`` this store holds (one call
        into the store; an SSD-only block is promoted so every block has an offset)."""
        return self.store.lookup_prefix(keys)

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

    def drain_events(self) -> bytes:
        """The store's events since the last call, in the store's own wire form
        (``mooncake_rs.StoreEvents.to_bytes()``), empty when there were none. The conductor
        applies them as they are (``Conductor.apply_store_events``): no translation here."""
        batch = self.store.drain_events_batch()
        return batch.to_bytes() if len(batch) else b""

    def __len__(self) -> int:
        return self.store.stats().blocks_dram

    @property
    def evictions(self) -> int:
        return self.store.stats().evictions_dram
