"""Saving the full blocks of several requests in one call (the engine's KV save into a
store write that covers a whole step's finished requests).

:meth:`Engine.save_blocks` is one call a request, :meth:`~.engine.Engine.save_requests`
one call for several, :meth:`~.engine.Engine.save_blocks_each` one call for a request's
blocks into separate buffers (the store slots a serving instance reserved, one a block).
For small requests (the tiny model's blocks are 8 KiB; two 64-token requests are
64 KiB) the fixed cost of each call is larger than the copy itself: BENCHMARKS.md,
issue 23, "engine save of small requests".

On CPU all three are one Rust call each, :func:`cpu_saver`'s ``RequestBlockSaver``: it
looks each request up in the engine's dict, checks its spans, reads the page ids from
the request's own list and gathers them out of the cache, where the Python here cost
about as much as the copy. :func:`save_requests` and :func:`save_blocks_each` are the
same saves in Python over the cache's ``save_blocks`` / the engine's ``save_block``:
what a CUDA engine runs (one gather-permute-copy for all the requests; a gather a
block), and they work on CPU too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

from .._core import RequestBlockSaver
from ..errors import InvalidArgument

if TYPE_CHECKING:
    from ..base.layout import BlockLayout
    from .handoff import KVHandoff
    from .kv_cache import KVCache
    from .scheduler import Request

__all__ = ["cpu_saver", "save_requests", "saved_nbytes", "save_blocks_each"]


def cpu_saver(cache: "KVCache", requests: "dict[str, Request]", block_size: int,
              page_size: int) -> RequestBlockSaver | None:
    """The one-call saves over ``cache`` for the engine's ``requests`` (its dict, read at
    each call), or ``None`` on CUDA (no Rust gather there: :func:`save_requests`)."""
    gather = cache.page_gather
    if gather is None:
        return None
    return RequestBlockSaver(gather, requests, block_size, block_size // page_size)


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
    # the checks of Engine.save_blocks, per span
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
    part.cache.save_blocks(part.layout, pages, total, buf, layer)


def save_blocks_each(part: "KVHandoff", req: "Request", block_indices: Sequence[int], outs: Sequence[Any],
                     layer: int | None = None) -> None:
    """Copies full block ``block_indices[i]`` of a request (all layers, or layer ``layer``)
    into ``outs[i]``, a whole store block each (``engine.layout.block_nbytes``, e.g. a
    reserved store slot): the bytes :meth:`Engine.save_block` writes there (a single layer
    goes to its span). ``InvalidArgument`` before anything is written if the request holds
    no pages, a block is not a full block of computed KV, or the counts differ; a buffer
    that is too small or read-only is refused when its turn comes (this path saves a
    block at a time, so the blocks before it are written). The CPU engine's one-call
    save (``_core.RequestBlockSaver.save_each``) checks every buffer first.
    """
    if len(block_indices) != len(outs):
        raise InvalidArgument(f"{len(block_indices)} blocks but {len(outs)} buffers: one buffer a block")
    if not block_indices:
        return
    b = part.block_size
    avail = max(req.kv_end, req.num_computed)
    for i in block_indices:  # every block checked before the first is written
        i = int(i)
        if i < 0 or (i + 1) * b > avail:
            raise InvalidArgument(f"block {i} of request {req.request_id!r} is not a full block of computed KV "
                                  f"({avail} tokens computed)")
    nl = part.config.num_layers
    if layer is not None and not 0 <= layer < nl:
        raise InvalidArgument(f"layer {layer} out of range 0..{nl - 1}")
    for i, out in zip(block_indices, outs):  # a gather a block, each checked by the cache
        part.save_block(req, int(i), out, layer)
