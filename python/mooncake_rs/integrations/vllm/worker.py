"""The worker side of ``MooncakeRsConnector``: moves blocks between vLLM's KV tensors and
KV pools with our transfer engine, layer by layer.

- ``register_kv_caches``: learns the layout (layout.py) and registers each KV storage with
  a :class:`~mooncake_rs.TransferEngine` of this process (no listener: it only initiates).
- Two paths for the bytes. A pool on this host (same boot id, ``shm`` transport on) has
  its arena mapped here (pool/shared_arena.py): a layer's blocks move in one
  ``copy_segments`` call (Rust, GIL released) with each block's CRC-32 folded into the
  copy, on this thread: on a CPU host the copy costs the same cores wherever it runs, and
  one pass beats the engine's hand-off to copy threads. A pool on another host: one
  ``submit_spans`` batch per layer through the transfer engine (TCP), asynchronous.
- Loads: ``start_load_kv`` copies (or submits) every layer's planned blocks (pool slot ->
  vLLM block); ``wait_for_layer_load`` waits for that layer's batch only. After the last
  layer each block's CRC-32 (the copy's, or one pass over the loaded bytes) is compared
  with the pool's; a block that failed to copy or to check is reported by
  ``get_block_ids_with_load_errors`` (vLLM recomputes it and every block after it) and
  removed from its pool.
- Saves: ``begin_step`` (the metadata is bound before the forward) reserves pool slots for
  the step's finished blocks (one call); ``save_kv_layer`` copies (or submits) that layer's
  writes, taking the blocks' checksums on the way; ``wait_for_save`` waits for the
  submitted ones and commits the slots whose every write landed, with their checksums (one
  call). A full pool gives no slot: that block is skipped and counted, serving goes on.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._core import TransferEngine, copy_segments
from ...errors import MooncakeError
from ..pool.client import PoolClient
from ..pool.shared_arena import SharedArena
from .config import ConnectorSettings
from .layout import KVLayout, learn_layout, storage_bytes, worker_counters
from .metadata import LoadSpec, MooncakeRsConnectorMetadata

__all__ = ["ConnectorWorker"]

log = logging.getLogger("mooncake_rs.vllm")

# A layer's load at least this large is written into vLLM's blocks with streaming
# (non-temporal) stores: it does not fit a core's L2 (2 MiB on current x86 servers), so
# the forward would read most of it from farther away anyway, and the ordinary stores'
# read of every destination line first doubles the memory traffic of a copy into cold
# blocks (BENCHMARKS.md, issue 23). Smaller loads stay in cache for the forward.
STREAM_LOADS_FROM_BYTES = 2 << 20


@dataclass
class _Pool:
    client: PoolClient
    region: int
    peer: Any
    arena: SharedArena | None = None  # mapped here: copy directly


@dataclass
class _Load:
    spec: LoadSpec
    pool: _Pool
    failed: set[int] = field(default_factory=set)  # indices into spec.block_ids
    crcs: np.ndarray | None = None  # uint32 a block, continued layer by layer as they are copied


@dataclass
class _Save:
    block_ids: list[int]
    offsets: list[int]  # -1: no slot (held already, or the pool is full)
    reservation: int
    ok: list[bool]
    which: list[int]  # indices of the blocks with a slot
    crcs: np.ndarray  # uint32 for each of ``which``, continued layer by layer
    layers_done: int = 0  # layers saved in pool order; the checksums are whole only at the last


class ConnectorWorker:
    def __init__(self, settings: ConnectorSettings, num_blocks: int) -> None:
        self.settings = settings
        self.num_blocks = num_blocks
        self.engine = TransferEngine(f"vllm-kv-{uuid.uuid4().hex[:12]}", listen="", auth_token=settings.auth_token)
        self.layout: KVLayout | None = None
        self._regions: dict[int, Any] = {}  # storage ptr -> Region
        self._views: dict[int, memoryview] = {}  # storage ptr -> bytes of that storage
        self._pools: dict[str, _Pool] = {}
        self._loads: list[_Load] = []
        self._load_batches: dict[str, list[tuple[Any, _Load, int]]] = {}  # layer -> (batch, load, segments a block)
        self._saves: list[_Save] = []
        self._save_batches: list[tuple[Any, _Save, list[int], int]] = []  # (batch, save, its block indices, per)
        self._errors: set[int] = set()
        self.counters = worker_counters()

    # --- setup --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layout = learn_layout(kv_caches, self.num_blocks)
        for layer in self.layout.layers:
            if layer.storage_ptr in self._regions:
                continue
            raw = storage_bytes(layer)
            self._views[layer.storage_ptr] = memoryview(raw).cast("B")
            self._regions[layer.storage_ptr] = self.engine.register(raw)
        log.info("MooncakeRsConnector: %d layers, %d-byte pool blocks (%d segments of %d bytes a layer)",
                 len(self.layout.layers), self.layout.block_bytes, len(self.layout.layers[0].outer),
                 self.layout.layers[0].segment_bytes)
        self._pool(self.settings.pool)  # fail at start, not at the first request, if the pool is wrong

    def _pool(self, address: str) -> _Pool:
        pool = self._pools.get(address)
        if pool is None:
            assert self.layout is not None
            client = PoolClient(address, self.settings.auth_token, timeout_s=self.settings.timeout_s)
            opened = client.open(self.layout.block_bytes, self.layout.fingerprint)
            peer = self.engine.connect(opened.engine_name, opened.engine_address)
            arena = None
            if self.settings.direct_copies:
                arena = SharedArena.open(opened.shm_name, opened.host_id, opened.slots * opened.slot_stride)
            pool = self._pools[address] = _Pool(client, opened.region, peer, arena)
        return pool

    # --- loads --------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeRsConnectorMetadata) -> None:
        self._finish_loads()  # a previous step's, if vLLM skipped the waits
        assert self.layout is not None
        for spec in meta.loads:
            try:
                pool = self._pool(spec.pool)
            except MooncakeError as e:
                log.warning("MooncakeRsConnector: cannot reach pool %s for %s: %s; recomputing its %d blocks",
                            spec.pool, spec.req_id, e, len(spec.block_ids))
                self._fail_blocks(spec.block_ids)
                continue
            crcs = np.zeros(len(spec.block_ids), np.uint32) if self.settings.verify_checksums else None
            self._loads.append(_Load(spec, pool, crcs=crcs))
        for layer in self.layout.layers if self._loads else ():
            region = self._regions[layer.storage_ptr]
            per = len(layer.outer)
            for load in self._loads:
                local, remote = layer.spans(load.spec.block_ids, load.spec.offsets)
                arena = load.pool.arena
                if arena is not None:
                    streaming = local.size * layer.segment_bytes >= STREAM_LOADS_FROM_BYTES
                    try:  # pool slot -> vLLM block, checksummed in the same pass
                        copy_segments(arena.view, remote, self._views[layer.storage_ptr], local,
                                      layer.segment_bytes, load.crcs, per, streaming)
                    except MooncakeError as e:  # an offset outside the arena: a pool we cannot trust
                        log.warning("MooncakeRsConnector: load of %s from %s failed: %s", load.spec.req_id,
                                    load.spec.pool, e)
                        load.failed.update(range(len(load.spec.block_ids)))
                    continue
                batch = self.engine.submit_spans("read", region, local, load.pool.peer, load.pool.region, remote,
                                                 layer.segment_bytes, timeout_s=self.settings.timeout_s)
                self._load_batches.setdefault(layer.name, []).append((batch, load, per))

    def begin_step(self, meta: MooncakeRsConnectorMetadata) -> None:
        """Bound before the forward of every step (start_load_kv may run after it)."""
        if meta.saves and self.settings.saves:
            self._reserve(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for batch, load, per in self._load_batches.pop(layer_name, ()):
            for i, status in enumerate(batch.wait()):
                if not status.ok:
                    load.failed.add(i // per)

    def _finish_loads(self) -> None:
        """Wait for every layer still in flight, check checksums, record the failures."""
        if not self._loads:
            return
        for name in list(self._load_batches):
            self.wait_for_layer_load(name)
        assert self.layout is not None
        self._checksum_engine_loads()
        for load in self._loads:
            spec = load.spec
            bad_keys = []
            for j, bid in enumerate(spec.block_ids):
                if j not in load.failed and load.crcs is not None and spec.checksums[j] >= 0:
                    if int(load.crcs[j]) != spec.checksums[j]:
                        self.counters["blocks_corrupt"] += 1
                        bad_keys.append(spec.keys[16 * j:16 * j + 16])
                        load.failed.add(j)
                if j in load.failed:
                    self._errors.add(bid)
                    self.counters["blocks_load_failed"] += 1
                else:
                    self.counters["blocks_loaded"] += 1
                    self.counters["bytes_loaded"] += self.layout.block_bytes
            if bad_keys:
                log.warning("MooncakeRsConnector: %d blocks of %s failed their checksum; removed from pool %s and "
                            "recomputed", len(bad_keys), spec.req_id, spec.pool)
                try:
                    load.pool.client.remove(b"".join(bad_keys), corrupt=True)
                except MooncakeError as e:
                    log.warning("MooncakeRsConnector: could not remove corrupt blocks from %s: %s", spec.pool, e)
        self._loads = []

    def _checksum_engine_loads(self) -> None:
        """CRC-32s of the blocks the transfer engine loaded (direct copies took theirs while
        copying): one pass over the loaded bytes, layer after layer in pool order."""
        assert self.layout is not None
        loads = [ld for ld in self._loads if ld.pool.arena is None and ld.crcs is not None]
        for layer in self.layout.layers if loads else ():
            for load in loads:
                local, _ = layer.spans(load.spec.block_ids, load.spec.offsets)
                copy_segments(self._views[layer.storage_ptr], local, None, local, layer.segment_bytes, load.crcs,
                              len(layer.outer))

    def _fail_blocks(self, block_ids: list[int]) -> None:
        self._errors.update(block_ids)
        self.counters["blocks_load_failed"] += len(block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    # --- saves --------------------------------------------------------------------

    def _reserve(self, meta: MooncakeRsConnectorMetadata) -> None:
        block_ids = [b for s in meta.saves for b in s.block_ids]
        keys = b"".join(s.keys for s in meta.saves)
        try:
            pool = self._pool(self.settings.pool)
            r = pool.client.reserve(keys, lease_s=max(30.0, self.settings.timeout_s))
        except MooncakeError as e:
            log.warning("MooncakeRsConnector: pool %s refused a save of %d blocks: %s", self.settings.pool,
                        len(block_ids), e)
            self.counters["saves_failed"] += len(block_ids)
            return
        self.counters["saves_skipped_full"] += r.full
        self.counters["saves_skipped_present"] += r.present
        which = [j for j, slot in enumerate(r.offsets) if slot >= 0]
        self._saves.append(_Save(block_ids, list(r.offsets), r.reservation, [off >= 0 for off in r.offsets], which,
                                 np.zeros(len(which), np.uint32)))

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._saves:
            return
        assert self.layout is not None
        try:
            index, layer = self.layout.layer(layer_name)
        except KeyError:
            return
        pool = self._pools[self.settings.pool]
        view = self._views[layer.storage_ptr]
        per = len(layer.outer)
        for save in self._saves:
            which = save.which
            if not which:
                continue
            local, remote = layer.spans([save.block_ids[j] for j in which], [save.offsets[j] for j in which])
            # the checksums stay whole only while layers come in pool order (vLLM's order)
            crcs = save.crcs if save.layers_done == index else None
            if crcs is not None:
                save.layers_done += 1
            if pool.arena is not None:
                try:  # vLLM block -> reserved slot, checksummed in the same pass; streaming
                    # stores: the slot is read by a later request, not by this forward
                    copy_segments(view, local, pool.arena.view, remote, layer.segment_bytes, crcs, per, True)
                except MooncakeError as e:
                    log.warning("MooncakeRsConnector: save into %s failed: %s", self.settings.pool, e)
                    for j in which:
                        save.ok[j] = False
                continue
            batch = self.engine.submit_spans("write", self._regions[layer.storage_ptr], local, pool.peer, pool.region,
                                             remote, layer.segment_bytes, timeout_s=self.settings.timeout_s)
            self._save_batches.append((batch, save, which, per))
            if crcs is not None:  # the source's checksums: a write that goes wrong on the way is caught at load
                copy_segments(view, local, None, local, layer.segment_bytes, crcs, per)

    def wait_for_save(self) -> None:
        self._finish_loads()
        if not self._saves:
            return
        for batch, save, which, per in self._save_batches:
            for i, status in enumerate(batch.wait()):
                if not status.ok:
                    save.ok[which[i // per]] = False
        self._save_batches = []
        assert self.layout is not None
        pool = self._pools[self.settings.pool]
        whole = len(self.layout.layers)
        for save in self._saves:
            sums: list[int] | None = None
            if save.which and save.layers_done == whole:
                sums = [0] * len(save.offsets)
                for j, crc in zip(save.which, save.crcs.tolist()):
                    sums[j] = crc
            try:
                stored = pool.client.commit(save.reservation, save.ok, sums)
            except MooncakeError as e:
                log.warning("MooncakeRsConnector: commit to pool %s failed: %s", self.settings.pool, e)
                self.counters["saves_failed"] += sum(save.ok)
                continue
            self.counters["blocks_saved"] += stored
            self.counters["bytes_saved"] += stored * self.layout.block_bytes
            self.counters["saves_failed"] += sum(1 for off, ok in zip(save.offsets, save.ok) if off >= 0 and not ok)
        self._saves = []

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.client.close()
            if pool.arena is not None:
                pool.arena.close()
        self.engine.close()

