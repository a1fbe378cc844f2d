"""The engine's KV hand-off: moving a request's KV between the paged cache and store blocks.

:class:`KVHandoff` is a part :class:`~.engine.Engine` composes (``Engine.handoff``). It
works on the paged cache, the model and the block layout it is built with, and on the
:class:`~.scheduler.Request` objects it is handed; it never sees the engine's request
table or scheduler, so what it may touch is its constructor's arguments. The engine keeps
the request bookkeeping (ids, queueing, finishing) and its public methods
(``save_block``, ``save_blocks``, ``add_decode_request``, ``add_request(...,
restored_kv=...)``, ``measure_prefill``, ``prompt_logits``) call into this part.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from ..base.layout import BlockLayout
from ..base.model_config import ModelConfig
from ..base.outputs import LayerEvent, PrefillTiming
from ..errors import InvalidArgument
from .attention import AttentionBackend, BatchMeta
from .kv_cache import KVCache, as_byte_tensor
from .model import LlamaModel
from .scheduler import Request

__all__ = ["KVHandoff"]


class KVHandoff:
    """Loads restored KV into a request's pages, saves a request's blocks into buffers,
    reports blocks as their layers are written, and runs prefills outside the step loop
    (timings for the conductor's cost model, all-position logits)."""

    def __init__(self, config: ModelConfig, layout: BlockLayout, cache: KVCache, model: LlamaModel,
                 attn: AttentionBackend, *, max_num_batched_tokens: int) -> None:
        self.config = config
        self.layout = layout
        self.cache = cache
        self.model = model
        self.attn = attn
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = layout.block_size
        self.page_size = cache.page_size
        self.device = cache.device

    # ---- loading restored KV
    def prompt_blocks(self, prompt_len: int, kv_blocks: Sequence[Any]) -> list[tuple[int, Any]]:
        """``(tokens, buffer)`` for a prompt whose whole KV comes from ``kv_blocks``: one
        buffer per block, the last one partial when the prompt is not block-aligned."""
        b = self.block_size
        nblocks = -(-prompt_len // b)
        if len(kv_blocks) != nblocks:
            raise InvalidArgument(f"a prompt of {prompt_len} tokens needs {nblocks} KV blocks, got {len(kv_blocks)}")
        sizes = [b] * (nblocks - 1) + [prompt_len - (nblocks - 1) * b]
        return list(zip(sizes, kv_blocks))

    def prefix_blocks(self, prompt_len: int, restored_kv: Sequence[Any] | None) -> list[tuple[int, Any]]:
        """``(tokens, buffer)`` for the full prompt blocks ``restored_kv`` covers; the last
        prompt token is always computed, so at most ``(prompt_len - 1) // block_size``."""
        if not restored_kv:
            return []
        usable = (prompt_len - 1) // self.block_size
        return [(self.block_size, b) for b in list(restored_kv)[:usable]]

    def _block_bytes(self, buf: Any, what: str) -> torch.Tensor:
        t = as_byte_tensor(buf, writable=False)
        if t.numel() != self.layout.block_nbytes:
            raise InvalidArgument(f"{what}: buffer holds {t.numel()} bytes, a block needs {self.layout.block_nbytes}")
        return t

    def restore(self, req: Request, blocks: list[tuple[int, Any]]) -> None:
        """Loads ``(tokens, buffer)`` blocks (prompt order) into new pages now, or, when the
        pool lacks free pages, keeps a host copy to load when the request is admitted."""
        if not blocks:
            return
        staged = [(n, self._block_bytes(buf, f"block {i}")) for i, (n, buf) in enumerate(blocks)]
        need = sum(self.cache.pages_for(n) for n, _ in staged)
        if need <= self.cache.num_free:
            req.staged = staged
            self.load_staged(req)
        else:
            req.staged = [(n, t.clone()) for n, t in staged]

    def load_staged(self, req: Request) -> None:
        """Loads a request's staged blocks into new pages (the scheduler calls it at
        admission for a request whose blocks did not fit when it was added)."""
        assert req.staged is not None and not req.pages
        per_block = self.block_size // self.page_size
        total = 0
        for i, (n, buf) in enumerate(req.staged):
            if i < len(req.staged) - 1 and n != self.block_size:
                raise InvalidArgument("only the last restored block may be partial")
            pages = self.cache.allocate(self.cache.pages_for(n))
            req.pages.extend(pages)
            self.cache.load_block(self.layout, pages, n, buf)
            total += n
            if n == self.block_size:
                assert len(pages) == per_block
        req.num_computed = total
        req.staged = None

    # ---- saving KV
    def save_block(self, req: Request, block_index: int, buf: Any, layer: int | None = None) -> int:
        """Copies block ``block_index`` of ``req`` (see :meth:`Engine.save_block`)."""
        b = self.block_size
        avail = max(req.kv_end, req.num_computed)
        n = min(b, avail - int(block_index) * b)
        if block_index < 0 or n <= 0:
            raise InvalidArgument(f"block {block_index} of request {req.request_id!r} has no computed KV "
                                  f"({avail} tokens computed)")
        per_block = b // self.page_size
        pages = req.pages[block_index * per_block:(block_index + 1) * per_block]
        self.cache.save_block(self.layout, pages, n, buf, layer)
        return n

    def save_blocks(self, req: Request, first_block: int, num_blocks: int, buf: Any,
                    layer: int | None = None) -> None:
        """Copies full blocks of ``req`` back to back (see :meth:`Engine.save_blocks`)."""
        b = self.block_size
        avail = max(req.kv_end, req.num_computed)
        if first_block < 0 or num_blocks < 1 or (first_block + num_blocks) * b > avail:
            raise InvalidArgument(f"blocks {first_block}..{first_block + num_blocks - 1} of request "
                                  f"{req.request_id!r} are not all full blocks of computed KV "
                                  f"({avail} tokens computed)")
        per_block = b // self.page_size
        pages = req.pages[first_block * per_block:(first_block + num_blocks) * per_block]
        self.cache.save_blocks(self.layout, pages, num_blocks, buf, layer)

    def layer_hook(self, reqs: list[Request], starts: list[int]) -> Callable[[int], None] | None:
        """For a step that writes KV of ``reqs`` from positions ``starts``: a per-layer
        callback telling each request's ``on_layer`` which prompt blocks that layer
        completed (None when no request listens or completes a block)."""
        b = self.block_size
        events: list[tuple[Callable[[LayerEvent], None], str, tuple[int, ...], int | None, int, bool]] = []
        for req, start in zip(reqs, starts):
            plen = len(req.prompt_token_ids)
            if req.on_layer is None or start >= plen:
                continue
            end = min(req.kv_end, plen)
            full = tuple(range(start // b, end // b))
            last = end == plen
            partial = plen // b if last and plen % b else None
            if full or partial is not None:
                events.append((req.on_layer, req.request_id, full, partial, plen % b if partial is not None else 0,
                               last))
        if not events:
            return None
        last_layer = self.config.num_layers - 1

        def hook(layer: int) -> None:
            for fn, rid, full, partial, ptoks, last in events:
                fn(LayerEvent(rid, layer, full, partial, ptoks, last and layer == last_layer))

        return hook

    # ---- prefills outside the step loop
    def _standalone_prefill(self, token_ids: list[int], cached: int,
                            all_logits: bool) -> torch.Tensor | None:
        """Prefills ``token_ids[cached:]`` in budget-sized chunks on pages of its own (the
        first ``cached`` tokens' KV is whatever the pages hold); frees the pages after."""
        pages = self.cache.allocate(self.cache.pages_for(len(token_ids)))
        chunks = []
        try:
            pos = cached
            with torch.inference_mode():
                while pos < len(token_ids):
                    n = min(self.max_num_batched_tokens, len(token_ids) - pos)
                    meta = BatchMeta.build([n], [pos + n], [pages], self.page_size, self.device)
                    ids = torch.tensor(token_ids[pos:pos + n], dtype=torch.long, device=self.device)
                    rows = torch.arange(n, device=self.device) if all_logits else torch.tensor([n - 1], device=self.device)
                    chunks.append(self.model.forward(ids, meta, self.cache, self.attn, rows))
                    pos += n
        finally:
            self.cache.free(pages)
        return torch.cat([c for c in chunks if c is not None]) if chunks else None

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits ``[len(token_ids), vocab]`` of every position (ids already checked)."""
        out = self._standalone_prefill(token_ids, 0, all_logits=True)
        assert out is not None
        return out

    def measure_prefill(self, points: Sequence[tuple[int, int]], *, repeats: int = 3,
                        warmup: int = 1) -> list[PrefillTiming]:
        """Median prefill time of each ``(new_tokens, cached_tokens)`` point, chunked as the
        scheduler would chunk it. Run it on an idle engine (it borrows free pages)."""
        if repeats < 1 or warmup < 0:
            raise InvalidArgument("repeats must be >= 1 and warmup >= 0")
        out = []
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for new, cached in points:
            if new < 1 or cached < 0:
                raise InvalidArgument(f"bad point ({new}, {cached}): new_tokens >= 1, cached_tokens >= 0")
            total = new + cached
            if total >= self.config.max_position_embeddings or self.cache.pages_for(total) > self.cache.num_free:
                raise InvalidArgument(f"point ({new}, {cached}) does not fit the pool or the model's positions")
            toks = [(7 * i + 3) % self.config.vocab_size for i in range(total)]
            times = []
            for r in range(warmup + repeats):
                sync()
                t0 = time.perf_counter()
                self._standalone_prefill(toks, cached, all_logits=False)
                sync()
                if r >= warmup:
                    times.append(time.perf_counter() - t0)
            out.append(PrefillTiming(new, cached, statistics.median(times)))
        return out
