"""Saving the full blocks of several requests in one call (the engine's KV save into a
store write that covers a whole step's finished requests).

:meth:`Engine.save_blocks` is one call a request. The engine's
:meth:`~.engine.Engine.save_requests` and :meth:`~.engine.Engine.save_blocks_each` find
the requests and call these with its hand-off part. For small requests (the tiny model's
blocks are 8 KiB; two 64-token requests are 64 KiB) the fixed cost of each call (the
request lookup, the checks, the destination's slice and the crossing into Rust, ~2.5 us
together) is larger than the copy itself: BENCHMARKS.md, issue 23, "engine save of
small requests". :func:`save_requests` looks every request up and checks it, joins their
pages in the buffer's order, and makes one gather over the cache (one Rust call on CPU,
one gather-permute-copy on CUDA) into one destination, with no slice per request.
:func:`save_blocks_each` is the same for one request's blocks into separate buffers
(the store slots a serving instance reserved, one a block): one Rust call on CPU, where
``Engine.save_block`` per block was a torch gather each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

from .._core import page_gather_each
from ..errors import InvalidArgument

if TYPE_CHECKING:
    from ..base.layout import BlockLayout
    from .handoff import KVHandoff
    from .scheduler import Request

__all__ = ["save_requests", "saved_nbytes", "save_blocks_each"]


def saved_nbytes(layout: "BlockLayout", spans: Sequence[tuple[str, int, int]], layer: int | None = None) -> int:
    """Bytes :func:`save_requests` writes for ``spans`` (``Engine.layout``): the destination's size."""
    lay = layout
    per = lay.block_nbytes if layer is None else lay.layer_nbytes
    return sum(int(n) for _, _, n in spans) * per


def save_requests(part: "KVHandoff", requests: "Mapping[str, Request]", spans: Sequence[tuple[str, int, int]],
                  buf: Any, layer: int | None = None) -> None:
    """Copies, for each ``(request_id, first_block, num_blocks)`` of ``spans`` in order,
    those full blocks of the request (all layers, or layer ``layer``) into ``buf``, back
    to back: the bytes that :meth:`Engine.save_blocks` writes for each span, one after
    the other (and so what :meth:`Engine.save_block` writes block by block).

    ``buf``: a writable buffer or a contiguous CPU tensor of exactly
    :func:`saved_nbytes` bytes (a CUDA engine also takes a device tensor). Valid while
    each request holds its pages (during its steps for finished layers, or after it
    finished with ``hold_kv=True``). ``InvalidArgument`` before anything is written if a
    request holds no pages, a span is not all full blocks of computed KV, ``spans`` is
    empty, or ``buf`` has the wrong size or kind.
    """
    b = part.block_size
    per_block = b // part.page_size
    pages: list[int] = []
    total = 0
    # the checks of Engine.save_blocks, per span; written for few bytecodes a span (at the
    # tiny model's 32 KiB a request, this loop was a third of the call)
    for rid, first, num in spans:
        req = requests.get(rid)
        if req is None:
            req = requests.get(str(rid))
            if req is None:
                raise InvalidArgument(f"request {rid!r} holds no KV pages")
        kv_end, computed, held = req.kv_end, req.num_computed, req.pages
        end = first + num
        if first < 0 or num < 1 or end * b > (kv_end if kv_end > computed else computed) or not held:
            if not held:
                raise InvalidArgument(f"request {rid!r} holds no KV pages")
            raise InvalidArgument(f"blocks {first}..{end - 1} of request {rid!r} are not all full "
                                  f"blocks of computed KV ({max(kv_end, computed)} tokens computed)")
        pages += held[first * per_block:end * per_block]
        total += num
    if not total:
        raise InvalidArgument("spans is empty: name at least one (request_id, first_block, num_blocks)")
    # blocks of different requests laid back to back are exactly one longer run of blocks
    # to the cache's batched save (it takes any page ids, in any order)
    cache = part.cache
    gather = cache.page_gather
    if gather is None:  # CUDA: the cache's gather-permute-copy, with its checks
        cache.save_blocks(part.layout, pages, total, buf, layer)
        return
    # CPU: straight to the cache's PageGather (KVCache.save_blocks' Python layer and its
    # layout check are skipped: the engine's layout is made from the cache's model and
    # block size, so it always matches); the Rust call checks the pages and the buffer
    if layer is None:
        gather.save(pages, per_block, 0, gather.planes, buf)
    elif 0 <= layer < part.config.num_layers:
        gather.save(pages, per_block, 2 * layer, 2, buf)
    else:
        raise InvalidArgument(f"layer {layer} out of range 0..{part.config.num_layers - 1}")


def save_blocks_each(part: "KVHandoff", req: "Request", block_indices: Sequence[int], outs: Sequence[Any],
                     layer: int | None = None) -> None:
    """Copies full block ``block_indices[i]`` of a request (all layers, or layer ``layer``)
    into ``outs[i]``, a whole store block each (``engine.layout.block_nbytes``, e.g. a
    reserved store slot): the bytes :meth:`Engine.save_block` writes there (a single layer
    goes to its span). ``InvalidArgument`` before anything is written if the request holds
    no pages, a block is not a full block of computed KV, the counts differ, or a buffer is
    too small or read-only.
    """
    if len(block_indices) != len(outs):
        raise InvalidArgument(f"{len(block_indices)} blocks but {len(outs)} buffers: one buffer a block")
    if not block_indices:
        return
    request_id = req.request_id
    b = part.block_size
    per_block = b // part.page_size
    avail = max(req.kv_end, req.num_computed)
    pages: list[int] = []
    held = req.pages
    for i in block_indices:
        i = int(i)
        if i < 0 or (i + 1) * b > avail:
            raise InvalidArgument(f"block {i} of request {request_id!r} is not a full block of computed KV "
                                  f"({avail} tokens computed)")
        pages += held[i * per_block:(i + 1) * per_block]
    nl = part.config.num_layers
    if layer is not None and not 0 <= layer < nl:
        raise InvalidArgument(f"layer {layer} out of range 0..{nl - 1}")
    gather = part.cache.page_gather
    if gather is None:  # CUDA: a gather a block, each checked by the cache
        for i, out in zip(block_indices, outs):
            part.save_block(req, int(i), out, layer)
        return
    if layer is None:
        page_gather_each(gather, pages, per_block, 0, gather.planes, list(outs))
    else:
        page_gather_each(gather, pages, per_block, 2 * layer, 2, list(outs), part.layout.layer_span(layer).offset)
