"""The device KV cache: a pool of pages, and the byte layout of a store block.

Pages: per layer, one K and one V tensor of shape ``[num_pages, page_size, kv_heads,
head_dim]`` (the NHD layout FlashInfer accepts). All layers live in one allocation
``[layers, 2, num_pages, page_size, kv_heads, head_dim]``. A sequence owns a list of page
ids (its block table); token ``t`` of the sequence lives in page ``table[t // page_size]``
at row ``t % page_size``.

Store blocks: a store block holds the KV of ``block_size`` tokens (a multiple of the page
size) for every layer, laid out as described by :class:`BlockLayout`. The save/load
methods copy between pages and such a byte buffer (a store slot). The layout types are
torch-free (:mod:`.layout`) so a client can size blocks without importing torch.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InvalidArgument
from ..base.model_config import ModelConfig
from ..base.layout import BlockLayout
from .weights import torch_dtype

__all__ = ["KVCache", "as_byte_tensor"]


def as_byte_tensor(buf: Any, *, writable: bool) -> torch.Tensor:
    """A 1-D uint8 CPU tensor sharing memory with ``buf`` (no copy).

    ``buf``: a contiguous CPU torch tensor, a numpy array, or any object with the buffer
    protocol (memoryview, bytearray, a store slot view).
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise InvalidArgument("a tensor buffer must be a contiguous CPU tensor")
        return buf.reshape(-1).view(torch.uint8)
    try:
        arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"buffer must support the buffer protocol: {e}") from None
    if not arr.flags.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous")
    arr = arr.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise InvalidArgument("buffer is read-only; saving KV needs a writable buffer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only sources are only read
        return torch.from_numpy(arr)


class KVCache:
    """Device page pool for K and V of every layer, with a free-page allocator."""

    def __init__(self, cfg: ModelConfig, *, num_pages: int, page_size: int, dtype: str,
                 device: str | torch.device) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise InvalidArgument("num_pages and page_size must be positive")
        self.cfg = cfg
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.data = torch.zeros(cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=self.dtype, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pops low ids first

    # ---- pages
    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise InvalidArgument(f"cannot allocate {n} pages, {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out[::-1]

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))

    def k(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new K/V rows ``[T, kv_heads, head_dim]`` at flat slots ``page * page_size + row``."""
        h, d = self.cfg.num_kv_heads, self.cfg.head_dim
        self.data[layer, 0].view(-1, h, d).index_copy_(0, slots, k)
        self.data[layer, 1].view(-1, h, d).index_copy_(0, slots, v)

    # ---- blocks <-> bytes
    def _block_view(self, layout: BlockLayout, buf: torch.Tensor, layer: int | None, num_tokens: int,
                    ) -> tuple[torch.Tensor, slice]:
        """The typed view of ``buf`` for ``layer`` (or all layers) and the layer slice."""
        dt = self.dtype
        if torch_dtype(layout.dtype) != dt:
            raise InvalidArgument(f"block layout dtype {layout.dtype} differs from the cache's {dt}")
        h, d, b = self.cfg.num_kv_heads, self.cfg.head_dim, layout.block_size
        if layer is None:
            if buf.numel() != layout.block_nbytes:
                raise InvalidArgument(f"buffer holds {buf.numel()} bytes, a block needs {layout.block_nbytes}")
            view = buf.view(dt).view(layout.num_layers, 2, b, h, d)
            return view[:, :, :num_tokens], slice(None)
        span = layout.layer_span(layer)
        if buf.numel() == layout.block_nbytes:
            buf = buf[span.offset:span.end]
        elif buf.numel() != layout.layer_nbytes:
            raise InvalidArgument(f"buffer holds {buf.numel()} bytes; expected a whole block "
                                  f"({layout.block_nbytes}) or one layer ({layout.layer_nbytes})")
        view = buf.view(dt).view(1, 2, b, h, d)
        return view[:, :, :num_tokens], slice(layer, layer + 1)

    def _block_pages(self, layout: BlockLayout, pages: Sequence[int], num_tokens: int) -> torch.Tensor:
        if layout.block_size % self.page_size:
            raise InvalidArgument(f"block_size {layout.block_size} is not a multiple of page_size {self.page_size}")
        if not 0 < num_tokens <= layout.block_size:
            raise InvalidArgument(f"num_tokens {num_tokens} out of range 1..{layout.block_size}")
        need = self.pages_for(num_tokens)
        if len(pages) < need:
            raise InvalidArgument(f"block of {num_tokens} tokens needs {need} pages, got {len(pages)}")
        return torch.tensor(list(pages[:need]), dtype=torch.long, device=self.device)

    def save_block(self, layout: BlockLayout, pages: Sequence[int], num_tokens: int, buf: Any,
                   layer: int | None = None) -> None:
        """Copies the KV of ``num_tokens`` tokens held in ``pages`` into ``buf`` (bytes of a block)."""
        idx = self._block_pages(layout, pages, num_tokens)
        dst, ls = self._block_view(layout, as_byte_tensor(buf, writable=True), layer, num_tokens)
        src = self.data[ls].index_select(2, idx)  # [L, 2, npages, page, h, d]
        src = src.reshape(src.shape[0], 2, -1, *src.shape[-2:])[:, :, :num_tokens]
        dst.copy_(src)

    def save_blocks(self, layout: BlockLayout, pages: Sequence[int], num_blocks: int, buf: Any,
                    layer: int | None = None) -> None:
        """Copies ``num_blocks`` full blocks held in ``pages`` (``pages_for(block_size)`` pages
        a block, in order) into ``buf``: ``num_blocks`` whole blocks back to back, or with
        ``layer`` that layer's bytes of each block back to back. One gather and one copy for
        all of them, where :meth:`save_block` is a call (and a gather) per block."""
        b = layout.block_size
        if b % self.page_size:
            raise InvalidArgument(f"block_size {b} is not a multiple of page_size {self.page_size}")
        per = b // self.page_size
        if num_blocks < 1 or len(pages) != num_blocks * per:
            raise InvalidArgument(f"{num_blocks} blocks need {num_blocks * per} pages, got {len(pages)}")
        dt = self.dtype
        if torch_dtype(layout.dtype) != dt:
            raise InvalidArgument(f"block layout dtype {layout.dtype} differs from the cache's {dt}")
        h, d = self.cfg.num_kv_heads, self.cfg.head_dim
        nl = layout.num_layers if layer is None else 1
        per_bytes = layout.block_nbytes if layer is None else layout.layer_nbytes
        out = as_byte_tensor(buf, writable=True)
        if out.numel() != num_blocks * per_bytes:
            raise InvalidArgument(f"buffer holds {out.numel()} bytes; {num_blocks} blocks need {num_blocks * per_bytes}")
        if self.device.type == "cpu":
            self._save_blocks_cpu(pages, num_blocks, per, out, 0 if layer is None else layer, nl)
            return
        ls = slice(None) if layer is None else slice(layer, layer + 1)
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        src = self.data[ls].index_select(2, idx).view(nl, 2, num_blocks, b, h, d)
        # Put the blocks in the buffer's order ([blocks, layers, K/V, tokens, heads, dim]) on
        # the device, then make one contiguous copy into the buffer: copying into a permuted
        # view of host memory instead stages the bytes on the host and permutes them there
        # (1.3 GB/s on an H200 against 55 GB/s for the contiguous copy).
        staged = src.permute(2, 0, 1, 3, 4, 5).contiguous()
        out.view(dt).view(staged.shape).copy_(staged)

    def _save_blocks_cpu(self, pages: Sequence[int], num_blocks: int, per: int, out: torch.Tensor, first_layer: int,
                         nl: int) -> None:
        """save_blocks on CPU: every (layer, K/V, page) of the blocks is one contiguous run
        of the cache, so the whole save is one ``copy_segments`` call (Rust, GIL released,
        one pass) instead of a gather into a temporary and a permuted copy."""
        from .._core import copy_segments

        page_bytes = self.page_size * self.cfg.num_kv_heads * self.cfg.head_dim * self.data.element_size()
        planes = self._planes(first_layer, nl, page_bytes)  # byte offset of each (layer, K/V) plane
        pg = np.asarray(pages, dtype=np.uint64) * np.uint64(page_bytes)
        src = (pg.reshape(num_blocks, 1, per) + planes).ravel()  # [block, layer, K/V, page], the buffer's order
        copy_segments(self._cache_bytes(), src, out.numpy(), self._runs(src.size, page_bytes), page_bytes)

    def _planes(self, first_layer: int, nl: int, page_bytes: int) -> np.ndarray:
        key = (first_layer, nl)
        cache = self.__dict__.setdefault("_plane_cache", {})
        if key not in cache:
            idx = np.arange(2 * first_layer, 2 * (first_layer + nl), dtype=np.uint64)
            cache[key] = (idx * np.uint64(self.data.shape[2] * page_bytes)).reshape(1, 2 * nl, 1)
        return cache[key]

    def _runs(self, n: int, page_bytes: int) -> np.ndarray:
        """Offsets of ``n`` back-to-back runs of ``page_bytes`` (a view of one cached array)."""
        runs = getattr(self, "_runs_cache", None)
        if runs is None or len(runs) < n:
            runs = self._runs_cache = np.arange(max(n, 1024), dtype=np.uint64) * np.uint64(page_bytes)
        return runs[:n]

    def _cache_bytes(self) -> np.ndarray:
        """The (contiguous, CPU) cache as a flat uint8 array sharing its memory."""
        if getattr(self, "_bytes", None) is None:
            self._bytes = self.data.view(-1).view(torch.uint8).numpy()
        return self._bytes

    def load_block(self, layout: BlockLayout, pages: Sequence[int], num_tokens: int, buf: Any,
                   layer: int | None = None) -> None:
        """Copies the KV of ``num_tokens`` tokens from ``buf`` (bytes of a block) into ``pages``."""
        idx = self._block_pages(layout, pages, num_tokens)
        src, ls = self._block_view(layout, as_byte_tensor(buf, writable=False), layer, num_tokens)
        p = self.page_size
        npg = idx.numel()
        full = npg * p
        if num_tokens != full:  # pad the last page with what it holds now
            cur = self.data[ls].index_select(2, idx).reshape(src.shape[0], 2, full, *src.shape[-2:])
            cur[:, :, :num_tokens] = src.to(self.device)
            src = cur
        src = src.to(self.device).reshape(src.shape[0], 2, npg, p, *src.shape[-2:])
        target = self.data[ls]
        target.index_copy_(2, idx, src)
