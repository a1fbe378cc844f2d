"""The engine of one instance: model, paged KV cache, scheduler and sampler in a step loop.

``generate`` runs prompts to completion; ``add_request`` + ``step`` embed the engine in a
server loop; ``stream`` yields tokens as they come. The KV hand-off hooks used by the
serving layer (block layout, save/load of blocks, restored prefixes, prefill-only and
decode-side requests, prefill timing) live in :mod:`.handoff`.
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
from ..base.outputs import LayerEvent, RequestOutput, TokenEvent
from ..base.params import SamplingParams
from ..errors import InvalidArgument
from .attention import BatchMeta, make_backend
from .backend_choice import resolve_dtype
from .handoff import HandoffMixin
from .kv_cache import KVCache
from .model import LlamaModel
from .sampler import Sampler
from .scheduler import Request, RequestStatus, Scheduler
from .tokens import prompt_tokens, token_id
from .weights import load_hf_dir, random_weights, torch_dtype

__all__ = ["Engine"]

log = logging.getLogger("mooncake_rs.engine")

_CPU_KV_BYTES = 64 * 1024 * 1024  # default pool size on CPU
_GPU_KV_FRACTION = 0.85  # default share of free device memory for the pool


class Engine(HandoffMixin):
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
        if isinstance(model, ModelConfig):
            cfg = model.replace(dtype=dtype)
            weights = random_weights(cfg, seed=seed, dtype=dtype, device=dev)
        elif isinstance(model, (str, Path)) and Path(model).is_dir():
            cfg, weights = load_hf_dir(model, dtype=dtype, device=dev)
        elif isinstance(model, str):
            cfg = ModelConfig.preset(model).replace(dtype=dtype)
            weights = random_weights(cfg, seed=seed, dtype=dtype, device=dev)
        else:
            raise InvalidArgument(f"model must be a ModelConfig, a preset name or a model directory, got {model!r}")
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
        self.scheduler = Scheduler(self.cache, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, load_staged=self._load_staged)
        self.sampler = Sampler(seed)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._requests: dict[str, Request] = {}
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
        blocks = []
        if restored_kv:
            usable = (len(prompt) - 1) // self.block_size
            blocks = [(self.block_size, b) for b in list(restored_kv)[:usable]]
        req = self._new_request(prompt, params, request_id)
        req.prefill_only, req.hold_kv, req.on_layer = bool(prefill_only), bool(hold_kv), on_layer
        try:
            self._restore(req, blocks)
        except Exception:
            del self._requests[req.request_id]
            raise
        req.num_cached_tokens = req.num_computed if req.staged is None else sum(n for n, _ in req.staged)
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        req = self._requests.get(str(request_id))
        if req is None or req.status is RequestStatus.FINISHED:
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(self._output(req, []))
        if not req.hold_kv:
            del self._requests[req.request_id]

    def release(self, request_id: str) -> None:
        """Frees the pages of a finished ``hold_kv`` request."""
        req = self._requests.get(str(request_id))
        if req is None:
            return
        if req.status is not RequestStatus.FINISHED:
            raise InvalidArgument(f"request {request_id!r} is not finished; abort it first")
        self.scheduler.free(req)
        del self._requests[req.request_id]

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

    def _layer_hook(self, reqs: list[Request], starts: list[int]) -> Callable[[int], None] | None:
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

        def hook(layer: int) -> None:
            for fn, rid, full, partial, ptoks, last in events:
                fn(LayerEvent(rid, layer, full, partial, ptoks, last and layer == self.config.num_layers - 1))

        return hook

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
        logits = self._run(batch, meta, starts, rows)
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
        hook = self._layer_hook(batch.requests, starts)
        logits = self.model.forward(ids, meta, self.cache, self.attn, rows, hook)
        for req in batch.requests:
            req.num_computed = req.kv_end
        return logits

    def _sample_and_finish(self, logits: torch.Tensor, picked: list[Request]) -> list[RequestOutput]:
        """A token for each request that samples; the ones that stop are finished (and
        forgotten unless they hold their KV); an output each."""
        outputs = []
        toks = self.sampler.sample(logits, [r.params for r in picked], [len(r.output_token_ids) for r in picked])
        for req, tok in zip(picked, toks):
            req.output_token_ids.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                if not req.hold_kv:
                    del self._requests[req.request_id]
            outputs.append(self._output(req, [tok]))
        return outputs

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
