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

from .._core import PageGather
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
        self._save_layout: tuple[BlockLayout, int] | None = None  # the layout save_blocks last checked
        self._num_layers = cfg.num_layers
        # On CPU, save_blocks is one Rust call over the cache's bytes (kept here with its
        # shape: planes = each layer's K then V, of num_pages pages each).
        self._gather: PageGather | None = None
        if self.device.type == "cpu":
            page_bytes = page_size * cfg.num_kv_heads * cfg.head_dim * self.data.element_size()
            self._gather = PageGather(self.data.view(-1).view(torch.uint8).numpy(), 2 * cfg.num_layers, num_pages,
                                      page_bytes)

    @property
    def page_gather(self) -> PageGather | None:
        """The Rust gather over the cache's bytes on CPU (``None`` on CUDA): what the
        engine's one-call saves (``batch_save.cpu_saver``) gather with."""
        return self._gather

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
        ``layer`` that layer's bytes of each block back to back. One call for all of them,
        where :meth:`save_block` is a call (and a gather) per block."""
        known = self._save_layout  # the layout checked last time: skip the call (the common case)
        per = known[1] if known is not None and known[0] is layout else self._pages_per_block(layout)
        if num_blocks < 1 or len(pages) != num_blocks * per:
            raise InvalidArgument(f"{num_blocks} blocks need {num_blocks * per} pages, got {len(pages)}")
        nl = self._num_layers
        if layer is not None and not 0 <= layer < nl:
            raise InvalidArgument(f"layer {layer} out of range 0..{nl - 1}")
        gather = self._gather
        if gather is not None:
            # CPU: one Rust call walks (block, layer, K/V, page) and copies each run of the
            # cache straight into the buffer (a CPU tensor or any writable buffer), which
            # it checks (size, writable, contiguous)
            if layer is None:
                gather.save(pages, per, 0, 2 * nl, buf)
            else:
                gather.save(pages, per, 2 * layer, 2, buf)
            return
        b, dt = layout.block_size, self.dtype
        h, d = self.cfg.num_kv_heads, self.cfg.head_dim
        n = nl if layer is None else 1
        per_bytes = layout.block_nbytes if layer is None else layout.layer_nbytes
        out = as_byte_tensor(buf, writable=True)
        if out.numel() != num_blocks * per_bytes:
            raise InvalidArgument(f"buffer holds {out.numel()} bytes; {num_blocks} blocks need {num_blocks * per_bytes}")
        ls = slice(None) if layer is None else slice(layer, layer + 1)
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        src = self.data[ls].index_select(2, idx).view(n, 2, num_blocks, b, h, d)
        # Put the blocks in the buffer's order ([blocks, layers, K/V, tokens, heads, dim]) on
        # the device, then make one contiguous copy into the buffer: copying into a permuted
        # view of host memory instead stages the bytes on the host and permutes them there
        # (1.3 GB/s on an H200 against 55 GB/s for the contiguous copy).
        staged = src.permute(2, 0, 1, 3, 4, 5).contiguous()
        out.view(dt).view(staged.shape).copy_(staged)

    def _pages_per_block(self, layout: BlockLayout) -> int:
        """Pages a block of ``layout``; the layout is checked against this cache once (a
        BlockLayout is immutable) and remembered, so a save pays the checks only once."""
        known = self._save_layout
        if known is not None and known[0] is layout:
            return known[1]
        b = layout.block_size
        if b % self.page_size:
            raise InvalidArgument(f"block_size {b} is not a multiple of page_size {self.page_size}")
        if torch_dtype(layout.dtype) != self.dtype:
            raise InvalidArgument(f"block layout dtype {layout.dtype} differs from the cache's {self.dtype}")
        if layout.num_layers != self.cfg.num_layers or layout.layer_nbytes != (
                2 * b * self.cfg.num_kv_heads * self.cfg.head_dim * self.data.element_size()):
            raise InvalidArgument(f"block layout of {layout.num_layers} layers x {layout.layer_nbytes} bytes does "
                                  "not match this cache's model")
        self._save_layout = (layout, b // self.page_size)
        return b // self.page_size

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
