"""The engine of one instance: model, paged KV cache, scheduler and sampler in a step loop.

``generate`` runs prompts to completion; ``add_request`` + ``step`` embed the engine in a
server loop; ``stream`` yields tokens as they come. The KV hand-off the serving layer
uses (block layout, save/load of blocks, restored prefixes, per-layer block events,
prefill timing) is a part the engine composes, :class:`~.handoff.KVHandoff`
(``Engine.handoff``); the engine's methods below add the request bookkeeping to it.
"""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..base.layout import BlockLayout
from ..base.model_config import DTYPES, ModelConfig
from ..base.outputs import LayerEvent, PrefillTiming, RequestOutput, TokenEvent
from ..base.params import SamplingParams
from ..errors import InvalidArgument
from . import batch_save
from .attention import BatchMeta, make_backend
from .backend_choice import resolve_dtype
from .handoff import KVHandoff
from .kv_cache import KVCache
from .model import LlamaModel
from .sampler import Sampler
from .scheduler import Request, RequestStatus, Scheduler
from .tokens import prompt_tokens, token_id
from .weights import load_model, torch_dtype

__all__ = ["Engine"]

log = logging.getLogger("mooncake_rs.engine")

_CPU_KV_BYTES = 64 * 1024 * 1024  # default pool size on CPU
_GPU_KV_FRACTION = 0.85  # default share of free device memory for the pool


class Engine:
    """One instance's inference engine (see docs/engine.md).

    ``model``: a local Hugging Face directory, a preset name (``"tiny"``,
    ``"llama-3-8b"``, ...) or a :class:`ModelConfig` (seeded random weights).
    ``block_size``: tokens per store block (the hash block); ``page_size`` (default: the
    largest divisor of ``block_size`` up to 16) must divide it. ``num_pages``: KV pool
    size (default: 64 MiB on CPU, 85% of free memory on CUDA). ``dtype``: ``None`` (the
    default) is ``bfloat16`` on CUDA and ``float32`` elsewhere. ``attention_backend``:
    ``"auto"`` takes FlashInfer only where its kernels support the device, dtype, head dim
    and page size (else torch, logged); ``"flashinfer"`` refuses what it cannot run.
    """

    def __init__(self, model: str | Path | ModelConfig, *, dtype: str | None = None, device: str = "cpu",
                 block_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, attention_backend: str = "auto", seed: int = 0,
                 page_size: int | None = None) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {DTYPES}, got {dtype!r}")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgument(f"bad device {device!r}: {e}") from None
        dtype = resolve_dtype(dtype, dev.type)  # None: bfloat16 on CUDA, float32 elsewhere
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgument("device='cuda' but CUDA is not available")
        for name, v in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {v!r}")
        if page_size is None:
            page_size = math.gcd(block_size, 16)
        if not isinstance(page_size, int) or page_size < 1 or block_size % page_size:
            raise InvalidArgument(f"page_size {page_size!r} must be a positive divisor of block_size {block_size}")
        cfg, weights = load_model(model, dtype=dtype, device=dev, seed=seed)
        self.config = cfg
        self.device = dev
        self.dtype = dtype
        self.block_size = block_size
        self.page_size = page_size
        self.layout = BlockLayout.for_model(cfg, block_size, dtype)
        page_bytes = page_size * cfg.kv_bytes_per_token(torch.empty((), dtype=torch_dtype(dtype)).element_size())
        if num_pages is None:
            if dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                num_pages = int(free * _GPU_KV_FRACTION) // page_bytes
            else:
                num_pages = max(_CPU_KV_BYTES // page_bytes, 1)
        if not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgument(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.model = LlamaModel(cfg, weights)
        self.cache = KVCache(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype, device=dev)
        self.attn = make_backend(attention_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 torch_dtype(dtype), dev, page_size=page_size)
        self.handoff = KVHandoff(cfg, self.layout, self.cache, self.model, self.attn,
                                 max_num_batched_tokens=max_num_batched_tokens)
        self.scheduler = Scheduler(self.cache, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   load_staged=self.handoff.load_staged)
        self.sampler = Sampler(seed)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._requests: dict[str, Request] = {}
        # CPU: save_blocks / save_requests / save_blocks_each as one Rust call each
        self._saver = batch_save.cpu_saver(self.cache, self._requests, block_size, page_size)
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._eos = frozenset(cfg.eos_token_ids)
        log.info("engine: %s, %s on %s, %d pages of %d tokens, attention=%s", cfg.name, dtype, dev,
                 num_pages, page_size, self.attn.name)

    # ---- properties
    @property
    def attention_backend(self) -> str:
        return self.attn.name

    @property
    def num_free_pages(self) -> int:
        return self.cache.num_free

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- requests
    def _check_prompt(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        toks = prompt_tokens(prompt, params)
        v = self.config.vocab_size
        if min(toks) < 0 or max(toks) >= v:
            raise InvalidArgument(f"token ids must be in 0..{v - 1}")
        if len(toks) >= self.config.max_position_embeddings:
            raise InvalidArgument(f"prompt of {len(toks)} tokens reaches max_position_embeddings "
                                  f"{self.config.max_position_embeddings}")
        need = self.cache.pages_for(len(toks) + params.max_tokens)
        if need > self.cache.num_pages:
            raise InvalidArgument(f"prompt + max_tokens needs {need} pages, the pool has {self.cache.num_pages}; "
                                  "raise num_pages or lower max_tokens")
        return toks

    def _new_request(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> Request:
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise InvalidArgument(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, params, next(self._arrivals))
        self._requests[rid] = req
        return req

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, restored_kv: Sequence[Any] | None = None,
                    prefill_only: bool = False, hold_kv: bool = False,
                    on_layer: Callable[[LayerEvent], None] | None = None) -> str:
        """Queues a request; returns its id.

        ``restored_kv``: buffers holding the KV of the prompt's first full blocks (one
        store block each, :attr:`layout`); loaded now, so the buffers may be released when
        this returns. At most ``(len(prompt) - 1) // block_size`` are used (the last prompt
        token is always computed). ``prefill_only``: finish after the first token
        (``finish_reason="prefill"``). ``hold_kv``: keep the pages after finishing, until
        :meth:`release`. ``on_layer``: called with a :class:`LayerEvent` after each layer
        of each step that completes prompt blocks.
        """
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_token_ids, params)
        blocks = self.handoff.prefix_blocks(len(prompt), restored_kv)
        req = self._new_request(prompt, params, request_id)
        req.prefill_only, req.hold_kv, req.on_layer = bool(prefill_only), bool(hold_kv), on_layer
        self._restore(req, blocks)
        req.num_cached_tokens = req.num_computed if req.staged is None else sum(n for n, _ in req.staged)
        self.scheduler.add(req)
        return req.request_id

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
        blocks = self.handoff.prompt_blocks(len(prompt), kv_blocks)
        tok = token_id(first_token_id)
        if not 0 <= tok < self.config.vocab_size:
            raise InvalidArgument(f"first_token_id must be in 0..{self.config.vocab_size - 1}")
        req = self._new_request(prompt, params, request_id)
        self._restore(req, blocks)
        req.num_cached_tokens = len(prompt)
        req.output_token_ids.append(tok)
        reason = self._stop_reason(req, tok)
        if reason is None:
            self.scheduler.add(req)
            return req.request_id
        self.scheduler.free(req)  # done at its first token: nothing to decode
        req.staged = None
        req.finish_reason = reason
        self._pending.append(self._output(req, []))
        del self._requests[req.request_id]
        return req.request_id

    def _restore(self, req: Request, blocks: list[tuple[int, Any]]) -> None:
        """Loads a new request's restored blocks; if that fails, the request is forgotten."""
        try:
            self.handoff.restore(req, blocks)
        except Exception:
            del self._requests[req.request_id]
            raise

    def abort(self, request_id: str) -> None:
        req = self._requests.get(str(request_id))
        if req is None or req.status is RequestStatus.FINISHED:
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(self._output(req, []))
        if not req.hold_kv:
            del self._requests[req.request_id]

    def unfinished_ids(self) -> list[str]:
        """Ids of the requests queued or running (not finished)."""
        return [rid for rid, r in self._requests.items() if r.status is not RequestStatus.FINISHED]

    def _holding_pages(self, request_id: str) -> Request:
        req = self._requests.get(str(request_id))
        if req is None or not req.pages:
            raise InvalidArgument(f"request {request_id!r} holds no KV pages")
        return req

    def release(self, request_id: str) -> None:
        """Frees the pages of a finished ``hold_kv`` request."""
        req = self._requests.get(str(request_id))
        if req is None:
            return
        if req.status is not RequestStatus.FINISHED:
            raise InvalidArgument(f"request {request_id!r} is not finished; abort it first")
        self.scheduler.free(req)
        del self._requests[req.request_id]

    # ---- KV hand-off (the work is :attr:`handoff`'s; these find the request)
    def save_block(self, request_id: str, block_index: int, buf: Any, layer: int | None = None) -> int:
        """Copies block ``block_index`` of a request (layer ``layer``, or all layers) into ``buf``.

        ``buf``: a writable buffer of one whole block (:attr:`layout`.block_nbytes; the
        layer goes to its span) or, with ``layer`` given, of one layer (layer_nbytes).
        Valid while the request holds its pages: during its steps (from an ``on_layer``
        callback, for layers already done), while it runs, or after it finished with
        ``hold_kv=True``. Returns the number of tokens copied (less than block_size for a
        partial last block).
        """
        return self.handoff.save_block(self._holding_pages(request_id), block_index, buf, layer)

    def save_blocks(self, request_id: str, first_block: int, num_blocks: int, buf: Any,
                    layer: int | None = None) -> None:
        """Copies full blocks ``first_block .. first_block + num_blocks`` of a request (all
        layers, or layer ``layer``) into ``buf`` in one call: ``num_blocks`` whole blocks
        (or layer spans) back to back, each laid out as :meth:`save_block` writes it.
        ``InvalidArgument`` if one of them is not a full block of computed KV."""
        if self._saver is not None:
            return self._saver.save_blocks(request_id, first_block, num_blocks, buf, layer)
        self.handoff.save_blocks(self._holding_pages(request_id), first_block, num_blocks, buf, layer)

    def save_requests(self, spans: Sequence[tuple[str, int, int]], buf: Any, layer: int | None = None) -> None:
        """Full blocks of several requests in one call: for each ``(request_id,
        first_block, num_blocks)`` in order, what :meth:`save_blocks` writes, back to back
        in ``buf`` (``batch_save.saved_nbytes(engine.layout, spans, layer)`` bytes).
        ``InvalidArgument`` before anything is written (engine/batch_save.py)."""
        if self._saver is not None:
            return self._saver.save_spans(spans, buf, layer)
        batch_save.save_requests(self.handoff, self._requests, spans, buf, layer)

    def save_blocks_each(self, request_id: str, block_indices: Sequence[int], outs: Sequence[Any],
                         layer: int | None = None) -> None:
        """Full block ``block_indices[i]`` of a request into ``outs[i]`` (a whole store
        block each, e.g. a reserved slot) in one call: what :meth:`save_block` writes
        there. ``InvalidArgument`` before anything is written (engine/batch_save.py)."""
        if self._saver is not None:
            return self._saver.save_each(request_id, block_indices, outs, layer)
        batch_save.save_blocks_each(self.handoff, self._holding_pages(request_id), block_indices, outs, layer)

    def prompt_logits(self, prompt_token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits ``[len(prompt), vocab]`` of every prompt position."""
        return self.handoff.prompt_logits(self._check_prompt(prompt_token_ids, SamplingParams(max_tokens=1)))

    def measure_prefill(self, points: Sequence[tuple[int, int]], *, repeats: int = 3,
                        warmup: int = 1) -> list[PrefillTiming]:
        """Median prefill time of each ``(new_tokens, cached_tokens)`` point, chunked as the
        scheduler would chunk it. Run it on an idle engine (it borrows free pages)."""
        return self.handoff.measure_prefill(points, repeats=repeats, warmup=warmup)

    # ---- the step loop
    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), req.finish_reason,
                             new, req.num_cached_tokens, req.num_preemptions)

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self._eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_position_embeddings:
            return "length"
        if req.prefill_only:
            return "prefill"
        return None

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns the outputs of requests that got a token or finished."""
        with torch.inference_mode():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        """One step in three parts: schedule (which tokens of which requests run, as the
        model's inputs), run (the forward pass), post-process (sample, stop, outputs)."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.requests:
            return outputs
        meta, starts, sampling, rows = self._batch_inputs(batch)
        try:
            logits = self._run(batch, meta, starts, rows)
        except Exception as e:  # noqa: BLE001 - the batch's requests fail, the engine goes on
            log.exception("engine: a forward pass of %d requests failed", len(batch.requests))
            outputs.extend(self._fail(req, f"the forward pass failed: {type(e).__name__}: {e}")
                           for req in batch.requests)
            return outputs
        if logits is not None:
            outputs.extend(self._sample_and_finish(logits, [batch.requests[i] for i in sampling]))
        return outputs

    def _batch_inputs(self, batch: Any) -> tuple[BatchMeta, list[int], list[int], torch.Tensor | slice | None]:
        """The scheduled batch as the model's inputs: its attention metadata (tokens, KV
        lengths, page tables), each request's first new position, the requests that
        sample a token this step (their prompt is done) and the logits rows they read."""
        tokens: list[int] = []
        kv_lens, tables, starts = [], [], []
        for req, n in zip(batch.requests, batch.num_new):
            starts.append(req.num_computed)
            req.kv_end = req.num_computed + n
            tokens.extend(req.token_slice(req.num_computed, req.kv_end))
            kv_lens.append(req.kv_end)
            tables.append(req.pages)
        meta = BatchMeta.build(batch.num_new, kv_lens, tables, self.page_size, self.device, tokens)
        sampling = [i for i, r in enumerate(batch.requests) if r.kv_end == r.num_tokens]
        rows: torch.Tensor | slice | None = None
        if len(sampling) == len(batch.requests) and meta.is_decode:
            rows = slice(None)  # every row samples
        elif sampling:
            ends = list(itertools.accumulate(batch.num_new))
            rows = torch.tensor([ends[i] - 1 for i in sampling], dtype=torch.long, device=self.device)
        return meta, starts, sampling, rows

    def _run(self, batch: Any, meta: BatchMeta, starts: list[int],
             rows: torch.Tensor | slice | None) -> torch.Tensor | None:
        """The forward pass (per-layer hooks for requests that save their KV as it is
        made); the logits of ``rows``, or None when no request samples."""
        ids = meta.token_ids
        assert ids is not None
        hook = self.handoff.layer_hook(batch.requests, starts)
        logits = self.model.forward(ids, meta, self.cache, self.attn, rows, hook)
        for req in batch.requests:
            req.num_computed = req.kv_end
        return logits

    def _sample_and_finish(self, logits: torch.Tensor, picked: list[Request]) -> list[RequestOutput]:
        """A token for each request that samples; the ones that stop are finished (and
        forgotten unless they hold their KV); an output each. A request whose sampling
        raised fails alone (:meth:`Sampler.sample_each`)."""
        outputs = []
        tokens = self.sampler.sample_each(logits, [r.params for r in picked],
                                          [len(r.output_token_ids) for r in picked])
        for req, tok in zip(picked, tokens):
            if isinstance(tok, str):
                outputs.append(self._fail(req, tok))
                continue
            req.output_token_ids.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                if not req.hold_kv:
                    del self._requests[req.request_id]
            outputs.append(self._output(req, [tok]))
        return outputs

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """Ends ``req`` as failed (``finish_reason`` abort, ``error`` set): its pages are
        freed (or held for :meth:`release` with ``hold_kv``), the other requests go on."""
        log.warning("engine: request %s failed: %s", req.request_id, error)
        if req.status is not RequestStatus.FINISHED:
            self.scheduler.finish(req, "abort")
        if not req.hold_kv:
            self._requests.pop(req.request_id, None)
        out = self._output(req, [])
        out.error = error
        return out

    # ---- convenience
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion (with any requests already queued); outputs in order."""
        plist = self._param_list(prompts, params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        want = set(ids)
        done: dict[str, RequestOutput] = {}
        while want - done.keys():
            for out in self.step():
                if out.request_id in want and out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[TokenEvent]:
        """Yields each generated token as soon as its step finishes."""
        plist = self._param_list(prompts, params)
        index = {self.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, plist))}
        left = set(index)
        while left:
            for out in self.step():
                if out.request_id not in left:
                    continue
                for j, tok in enumerate(out.new_token_ids):
                    last = j == len(out.new_token_ids) - 1
                    yield TokenEvent(index[out.request_id], out.request_id, tok, out.finish_reason if last else None)
                if out.finished:
                    left.discard(out.request_id)

    @staticmethod
    def _param_list(prompts: Sequence[Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgument("prompts must be a list of token-id lists")
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * len(prompts)
        plist = list(params)
        if len(plist) != len(prompts):
            raise InvalidArgument(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        return plist
