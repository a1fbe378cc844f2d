"""What one block of a vLLM KV cache is, in bytes, learned from the tensors themselves.

vLLM hands the worker one tensor per attention layer. Their shapes differ by backend
(CPU: ``[num_blocks, 2, ...]`` in its "LBHNC" layout; GPU flash attention:
``[2, num_blocks, block, heads, dim]``; MLA: ``[num_blocks, block, width]``), so nothing
here assumes one: a layer's block dimension is the one whose size is the cache's block
count, and a block of that layer is every index of the dimensions before it (e.g. K and
V) times the dense bytes after it. Each such piece is one contiguous *segment* of the
tensor's storage: a block of a layer is ``len(outer)`` segments of ``segment_bytes``.

A pool block is every layer's segments of one block, layer after layer (the layout of
docs/design.md "Block layout": one contiguous byte range per layer), so a layer can be
written and read on its own.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InvalidArgument

__all__ = ["LayerLayout", "KVLayout", "learn_layout", "storage_bytes", "worker_counters"]


@dataclass(frozen=True)
class LayerLayout:
    name: str
    storage_ptr: int  # data pointer of the tensor's storage (the registered region)
    storage_bytes: int
    base: int  # byte offset of element 0 of the tensor inside its storage
    block_stride: int  # bytes between two blocks
    outer: tuple[int, ...]  # byte offset of each segment of block 0 (relative to base)
    segment_bytes: int
    pool_offset: int  # where this layer's bytes start inside a pool block

    @property
    def block_bytes(self) -> int:
        return len(self.outer) * self.segment_bytes

    def segments(self, block_id: int) -> list[int]:
        """Storage byte offsets of block ``block_id``'s segments, in pool order."""
        start = self.base + block_id * self.block_stride
        return [start + o for o in self.outer]

    def spans(self, block_ids: Sequence[int], slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(storage offsets, pool arena offsets) of every segment of these blocks of this
        layer, block by block: the two offset lists of one ``submit_spans`` call."""
        ids = np.asarray(block_ids, dtype=np.uint64)[:, None]
        local = (self.base + ids * np.uint64(self.block_stride) + np.asarray(self.outer, dtype=np.uint64)[None, :])
        seg = np.arange(len(self.outer), dtype=np.uint64) * np.uint64(self.segment_bytes) + np.uint64(self.pool_offset)
        remote = np.asarray(slots, dtype=np.uint64)[:, None] + seg[None, :]
        return np.ascontiguousarray(local.ravel()), np.ascontiguousarray(remote.ravel())


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerLayout, ...]
    num_blocks: int
    block_bytes: int
    fingerprint: str  # dtype, shapes and strides: two pools' blocks mix only when equal

    def layer(self, name: str) -> tuple[int, LayerLayout]:
        for i, layer in enumerate(self.layers):
            if layer.name == name:
                return i, layer
        raise KeyError(name)


def _dense_inner(shape: tuple[int, ...], stride: tuple[int, ...], d: int) -> bool:
    expect = 1
    for size, st in zip(reversed(shape[d + 1:]), reversed(stride[d + 1:])):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


def learn_layout(kv_caches: dict[str, Any], num_blocks: int) -> KVLayout:
    """The layout of ``kv_caches`` (layer name -> tensor, in model order) for a cache of
    ``num_blocks`` blocks. ``InvalidArgument`` when a tensor has no dimension of that size
    or its per-block bytes are not dense after it (the connector cannot move such a block
    as segments)."""
    if not kv_caches:
        raise InvalidArgument("vLLM registered no KV cache tensors")
    layers = []
    pool_offset = 0
    parts = []
    for name, t in kv_caches.items():
        if t.device.type != "cpu":
            # The copy paths read and write the tensors' memory as host memory (a mapped
            # pool, or the transfer engine's registered regions); device memory there
            # would be undefined behaviour, not a slow path.
            raise InvalidArgument(f"KV tensor {name} is on {t.device}: MooncakeRsConnector moves host (CPU) "
                                  "KV caches only; run vLLM's CPU backend, or use a GPU-capable connector")
        shape, stride = tuple(t.shape), tuple(t.stride())
        dims = [d for d, s in enumerate(shape) if s == num_blocks]
        if not dims:
            raise InvalidArgument(f"KV tensor {name} of shape {list(shape)} has no dimension of the cache's "
                                  f"{num_blocks} blocks")
        # With several candidates, the block dimension is the outermost one whose inner
        # bytes are dense (a block count equal to a head count would be a coincidence).
        d = next((d for d in dims if _dense_inner(shape, stride, d)), None)
        if d is None:
            raise InvalidArgument(f"KV tensor {name}: shape {list(shape)}, strides {list(stride)}: the bytes of one "
                                  "block are not dense after its block dimension")
        es = t.element_size()
        inner = math.prod(shape[d + 1:]) * es
        outer = tuple(sum(i * st * es for i, st in zip(idx, stride[:d]))
                      for idx in itertools.product(*(range(s) for s in shape[:d])))
        storage = t.untyped_storage()
        base = t.data_ptr() - storage.data_ptr()
        layer = LayerLayout(name, storage.data_ptr(), storage.nbytes(), base, stride[d] * es, outer or (0,), inner,
                            pool_offset)
        _check_inside(layer, num_blocks)
        layers.append(layer)
        pool_offset += layer.block_bytes
        parts.append(f"{t.dtype}:{list(shape)}:{list(stride)}")
    # the block count is part of the shape, not of the block: keep it out of what pools compare
    fingerprint = ";".join(p.replace(str(num_blocks), "N", 1) for p in parts)
    return KVLayout(tuple(layers), num_blocks, pool_offset, fingerprint)


def _check_inside(layer: LayerLayout, num_blocks: int) -> None:
    last = layer.base + (num_blocks - 1) * layer.block_stride + max(layer.outer) + layer.segment_bytes
    if min(layer.outer) + layer.base < 0 or last > layer.storage_bytes:
        raise InvalidArgument(f"KV tensor {layer.name}: its blocks reach outside its storage")


def storage_bytes(layer: LayerLayout) -> Any:
    """The bytes of ``layer``'s storage as a writable ctypes buffer (``memoryview(...)``
    of it is the byte view). vLLM's tensors, kept for the worker's life, own the memory;
    the connector only borrows it (both worker kinds register it as it is)."""
    return (ctypes.c_char * layer.storage_bytes).from_address(layer.storage_ptr)


def worker_counters() -> dict[str, int]:
    """The connector worker's counters (the same names whichever store it uses)."""
    return dict.fromkeys(("blocks_loaded", "blocks_load_failed", "blocks_corrupt", "blocks_saved",
                          "saves_skipped_full", "saves_skipped_present", "saves_failed", "bytes_loaded",
                          "bytes_saved"), 0)
