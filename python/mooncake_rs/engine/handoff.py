"""KV hand-off hooks of the engine, used by the serving layer (see docs/engine.md).

- :attr:`Engine.layout`: the byte layout of a store block (:class:`~.kv_cache.BlockLayout`).
- :meth:`Engine.save_block`: copy a request's block (one layer or all) into a buffer.
- ``Engine.add_request(..., restored_kv=[...])``: a prefix loaded from buffers.
- :meth:`Engine.add_decode_request`: a request whose whole prompt KV comes from buffers.
- :meth:`Engine.measure_prefill`: prefill times for the conductor's cost model.
- :meth:`Engine.prompt_logits`: logits of every prompt position (tests, debugging).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..errors import InvalidArgument
from .attention import BatchMeta
from .kv_cache import as_byte_tensor
from ..base.outputs import PrefillTiming
from ..base.params import SamplingParams
from .tokens import token_id

if TYPE_CHECKING:
    from ..base.model_config import ModelConfig
    from ..base.layout import BlockLayout
    from .kv_cache import KVCache
    from .model import LlamaModel
    from .attention import AttentionBackend
    from ..base.outputs import RequestOutput
    from .scheduler import Request, Scheduler

__all__ = ["HandoffMixin"]


class HandoffMixin:
    """Methods of :class:`~.engine.Engine` that move KV in and out (split off for size)."""

    if TYPE_CHECKING:  # provided by Engine
        config: ModelConfig
        device: torch.device
        block_size: int
        page_size: int
        layout: BlockLayout
        cache: KVCache
        model: LlamaModel
        attn: AttentionBackend
        scheduler: Scheduler
        max_num_batched_tokens: int
        _requests: dict[str, Request]
        _pending: list[RequestOutput]

        def _check_prompt(self, prompt: Sequence[int], params: SamplingParams) -> list[int]: ...
        def _new_request(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> Request: ...
        def _stop_reason(self, req: Request, tok: int) -> str | None: ...
        def _output(self, req: Request, new: list[int]) -> RequestOutput: ...
    # ---- loading restored KV
    def _block_bytes(self, buf: Any, what: str) -> torch.Tensor:
        t = as_byte_tensor(buf, writable=False)
        if t.numel() != self.layout.block_nbytes:
            raise InvalidArgument(f"{what}: buffer holds {t.numel()} bytes, a block needs {self.layout.block_nbytes}")
        return t

    def _restore(self, req: "Request", blocks: list[tuple[int, Any]]) -> None:
        """Loads ``(tokens, buffer)`` blocks (prompt order) into new pages now, or, when the
        pool lacks free pages, keeps a host copy to load when the request is admitted."""
        if not blocks:
            return
        staged = [(n, self._block_bytes(buf, f"block {i}")) for i, (n, buf) in enumerate(blocks)]
        need = sum(self.cache.pages_for(n) for n, _ in staged)
        if need <= self.cache.num_free:
            req.staged = staged
            self._load_staged(req)
        else:
            req.staged = [(n, t.clone()) for n, t in staged]

    def _load_staged(self, req: "Request") -> None:
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

    def add_decode_request(self, prompt_token_ids: Sequence[int], first_token_id: int,
                           params: SamplingParams | None, kv_blocks: Sequence[Any], *,
                           request_id: str | None = None) -> str:
        """Adds a request whose prompt was prefilled elsewhere, straight into the decode batch.

        ``kv_blocks``: one buffer per prompt block, ``ceil(len(prompt) / block_size)`` of
        them, the last one partial when the prompt is not block-aligned (its first
        ``len(prompt) % block_size`` token rows are used). ``first_token_id``: the token
        the prefill instance sampled. The buffers may be released when this returns.
        """
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_token_ids, params)
        b = self.block_size
        nblocks = -(-len(prompt) // b)
        if len(kv_blocks) != nblocks:
            raise InvalidArgument(f"a prompt of {len(prompt)} tokens needs {nblocks} KV blocks, got {len(kv_blocks)}")
        first_token_id = token_id(first_token_id)
        if not 0 <= first_token_id < self.config.vocab_size:
            raise InvalidArgument(f"first_token_id must be in 0..{self.config.vocab_size - 1}")
        sizes = [b] * (nblocks - 1) + [len(prompt) - (nblocks - 1) * b]
        req = self._new_request(prompt, params, request_id)
        try:
            self._restore(req, list(zip(sizes, kv_blocks)))
        except Exception:
            del self._requests[req.request_id]
            raise
        req.num_cached_tokens = len(prompt)
        tok = first_token_id
        req.output_token_ids.append(tok)
        reason = self._stop_reason(req, tok) if not req.prefill_only else None
        if reason is not None:
            self.scheduler.free(req)
            req.staged = None
            req.finish_reason = reason
            self._pending.append(self._output(req, []))
            del self._requests[req.request_id]
        else:
            self.scheduler.add(req)
        return req.request_id

    # ---- saving KV
    def save_block(self, request_id: str, block_index: int, buf: Any, layer: int | None = None) -> int:
        """Copies block ``block_index`` of a request (layer ``layer``, or all layers) into ``buf``.

        ``buf``: a writable buffer of one whole block (:attr:`layout`.block_nbytes; the
        layer goes to its span) or, with ``layer`` given, of one layer (layer_nbytes).
        Valid while the request holds its pages: during its steps (from an ``on_layer``
        callback, for layers already done), while it runs, or after it finished with
        ``hold_kv=True``. Returns the number of tokens copied (less than block_size for a
        partial last block).
        """
        req = self._requests.get(str(request_id))
        if req is None or not req.pages:
            raise InvalidArgument(f"request {request_id!r} holds no KV pages")
        b = self.block_size
        avail = max(req.kv_end, req.num_computed)
        n = min(b, avail - int(block_index) * b)
        if block_index < 0 or n <= 0:
            raise InvalidArgument(f"block {block_index} of request {request_id!r} has no computed KV "
                                  f"({avail} tokens computed)")
        per_block = b // self.page_size
        pages = req.pages[block_index * per_block:(block_index + 1) * per_block]
        self.cache.save_block(self.layout, pages, n, buf, layer)
        return n

    def save_blocks(self, request_id: str, first_block: int, num_blocks: int, buf: Any,
                    layer: int | None = None) -> None:
        """Copies full blocks ``first_block .. first_block + num_blocks`` of a request (all
        layers, or layer ``layer``) into ``buf`` in one call: ``num_blocks`` whole blocks
        (or layer spans) back to back, each laid out as :meth:`save_block` writes it.
        ``InvalidArgument`` if one of them is not a full block of computed KV."""
        req = self._requests.get(str(request_id))
        if req is None or not req.pages:
            raise InvalidArgument(f"request {request_id!r} holds no KV pages")
        b = self.block_size
        avail = max(req.kv_end, req.num_computed)
        if first_block < 0 or num_blocks < 1 or (first_block + num_blocks) * b > avail:
            raise InvalidArgument(f"blocks {first_block}..{first_block + num_blocks - 1} of request {request_id!r} "
                                  f"are not all full blocks of computed KV ({avail} tokens computed)")
        per_block = b // self.page_size
        pages = req.pages[first_block * per_block:(first_block + num_blocks) * per_block]
        self.cache.save_blocks(self.layout, pages, num_blocks, buf, layer)

    # ---- measurements
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

    def prompt_logits(self, prompt_token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits ``[len(prompt), vocab]`` of every prompt position."""
        toks = self._check_prompt(prompt_token_ids, SamplingParams(max_tokens=1))
        out = self._standalone_prefill(toks, 0, all_logits=True)
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
