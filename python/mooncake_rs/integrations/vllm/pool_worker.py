"""The worker side of ``MooncakeRsConnector`` on the cluster-wide pool (``store: "pool"``):
the same hooks as worker.py, with blocks put into and read from a ``DistributedStore``
(pool_store.py) instead of a host's KV pool.

- ``register_kv_caches``: learns the layout (layout.py) and registers each KV storage,
  and the blocks' checksum array, with the pool (read and written in place).
- Loads: ``start_load_kv`` reads every planned block of the step into its vLLM block in
  one ``batch_get_into`` (each layer's segments and the checksum as pieces) before the
  forward; then each block's CRC-32 is taken over the loaded bytes (Rust, one pass a
  layer) and compared with the one saved with it. A block missing (evicted since the
  scheduler looked), of another size, or failing its checksum is reported by
  ``get_block_ids_with_load_errors`` (vLLM recomputes it) and, when corrupt, removed.
  ``wait_for_layer_load`` has nothing left to wait for.
- Saves: ``begin_step`` notes the step's finished blocks; ``wait_for_save`` (after the
  forward wrote every layer) takes each block's CRC-32 and puts the blocks in one
  ``batch_put_from``. A full pool (``NO_SPACE``) skips that block and counts it; serving
  goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._core import copy_segments
from ...errors import MooncakeError
from ...pool.status import KeyStatus
from .config import ConnectorSettings
from .layout import KVLayout, learn_layout, storage_bytes, worker_counters
from .metadata import MooncakeRsConnectorMetadata
from .pool_store import TRAILER_BYTES, PoolBlocks, block_keys, pieces_of

__all__ = ["PoolConnectorWorker"]

log = logging.getLogger("mooncake_rs.vllm")


@dataclass
class _PoolSave:
    block_ids: list[int]
    keys: list[int]


class PoolConnectorWorker:
    def __init__(self, settings: ConnectorSettings, num_blocks: int, blocks: PoolBlocks | None = None) -> None:
        self.settings = settings
        self.num_blocks = num_blocks
        self.blocks = blocks if blocks is not None else PoolBlocks.open(settings)
        self.layout: KVLayout | None = None
        self._views: dict[int, memoryview] = {}  # storage ptr -> bytes of that storage
        # the CRC-32 of each vLLM block as last saved or loaded: the value's last piece
        self._crc = np.zeros(num_blocks, np.uint32)
        self._saves: list[_PoolSave] = []
        self._errors: set[int] = set()
        self.counters = worker_counters()

    # --- setup --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layout = learn_layout(kv_caches, self.num_blocks)
        for layer in self.layout.layers:
            if layer.storage_ptr in self._views:
                continue
            raw = storage_bytes(layer)
            self._views[layer.storage_ptr] = memoryview(raw).cast("B")
            self.blocks.register(layer.storage_ptr, layer.storage_bytes)
        self.blocks.register(self._crc.ctypes.data, self._crc.nbytes)
        log.info("MooncakeRsConnector on the pool (%s): %d layers, %d-byte blocks", self.blocks.namespace,
                 len(self.layout.layers), self.layout.block_bytes)

    def _pieces(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        assert self.layout is not None
        base = self._crc.ctypes.data
        ptrs, sizes = [], []
        for b in block_ids:
            p, s = pieces_of(self.layout.layers, b, base + TRAILER_BYTES * b)
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    def _checksums(self, block_ids: list[int]) -> np.ndarray:
        """CRC-32 of each block's bytes in pool order (layer after layer), as saved."""
        assert self.layout is not None
        crcs = np.zeros(len(block_ids), np.uint32)
        for layer in self.layout.layers:
            local, _ = layer.spans(block_ids, [0] * len(block_ids))
            copy_segments(self._views[layer.storage_ptr], local, None, local, layer.segment_bytes, crcs,
                          len(layer.outer))
        return crcs

    # --- loads --------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeRsConnectorMetadata) -> None:
        assert self.layout is not None
        want = self.layout.block_bytes + TRAILER_BYTES
        for spec in meta.loads:
            ids = list(spec.block_ids)
            keys = block_keys(spec.keys)
            ptrs, sizes = self._pieces(ids)
            try:
                got = self.blocks.get(keys, ptrs, sizes)
            except MooncakeError as e:
                log.warning("MooncakeRsConnector: pool read for %s failed: %s; recomputing its %d blocks",
                            spec.req_id, e, len(ids))
                got = [int(KeyStatus.RPC_FAILED)] * len(ids)
            failed = {j for j, n in enumerate(got) if n != want}
            bad_keys = []
            if self.settings.verify_checksums:
                crcs = self._checksums(ids)
                for j, b in enumerate(ids):
                    if j not in failed and int(crcs[j]) != int(self._crc[b]):
                        failed.add(j)
                        bad_keys.append(keys[j])
                        self.counters["blocks_corrupt"] += 1
            for j, b in enumerate(ids):
                if j in failed:
                    self._errors.add(b)
                    self.counters["blocks_load_failed"] += 1
                else:
                    self.counters["blocks_loaded"] += 1
                    self.counters["bytes_loaded"] += self.layout.block_bytes
            if bad_keys:
                log.warning("MooncakeRsConnector: %d blocks of %s failed their checksum; removed from the pool and "
                            "recomputed", len(bad_keys), spec.req_id)
                try:
                    self.blocks.remove(bad_keys)
                except MooncakeError as e:
                    log.warning("MooncakeRsConnector: could not remove corrupt blocks: %s", e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Every load of the step was read before the forward (start_load_kv)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # --- saves --------------------------------------------------------------------

    def begin_step(self, meta: MooncakeRsConnectorMetadata) -> None:
        if meta.saves and self.settings.saves:
            for s in meta.saves:
                self._saves.append(_PoolSave(list(s.block_ids), block_keys(s.keys)))

    def save_kv_layer(self, layer_name: str) -> None:
        """Blocks are put whole once the forward has written every layer (wait_for_save)."""

    def wait_for_save(self) -> None:
        if not self._saves:
            return
        assert self.layout is not None
        ids = [b for s in self._saves for b in s.block_ids]
        keys = [k for s in self._saves for k in s.keys]
        self._saves = []
        self._crc[ids] = self._checksums(ids)
        ptrs, sizes = self._pieces(ids)
        try:
            statuses = self.blocks.put(keys, ptrs, sizes)
        except MooncakeError as e:
            log.warning("MooncakeRsConnector: pool write of %d blocks failed: %s", len(ids), e)
            self.counters["saves_failed"] += len(ids)
            return
        for st in statuses:
            if st == KeyStatus.OK:
                self.counters["blocks_saved"] += 1
                self.counters["bytes_saved"] += self.layout.block_bytes
            elif st == KeyStatus.NO_SPACE:
                self.counters["saves_skipped_full"] += 1
            else:
                self.counters["saves_failed"] += 1

    def shutdown(self) -> None:
        self.blocks.close()
