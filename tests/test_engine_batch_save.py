"""``batch_save.save_requests`` (one call for the blocks of several requests) against the
simple reference, ``Engine.save_block`` block by block: byte for byte, whole blocks and
one layer, into numpy arrays, bytearrays and CPU tensors; bad input is typed."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake_rs import InvalidArgument  # noqa: E402
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.engine.batch_save import saved_nbytes  # noqa: E402

CFG = ModelConfig.tiny()
B = 8


@pytest.fixture(scope="module", params=[4, 8], ids=["2-pages-a-block", "1-page-a-block"])
def held(request):
    """An engine holding the KV of three prefilled requests (41, 24 and 17 tokens), their
    pages interleaved in the cache (prefilled in one batch, chunked)."""
    e = Engine(CFG, block_size=B, page_size=request.param, num_pages=128, seed=3,
               max_num_batched_tokens=16)
    rng = random.Random(5)
    ids = []
    for n in (41, 24, 17):
        ids.append(e.add_request([rng.randrange(CFG.vocab_size) for _ in range(n)],
                                 SamplingParams(max_tokens=1, ignore_eos=True), prefill_only=True, hold_kv=True))
    while e.has_unfinished():
        e.step()
    yield e, ids
    for rid in ids:
        e.release(rid)


def _reference(e, spans, layer):
    per = e.layout.block_nbytes if layer is None else e.layout.layer_nbytes
    out = []
    for rid, first, num in spans:
        for i in range(first, first + num):
            buf = np.zeros(per, np.uint8)
            assert e.save_block(rid, i, buf, layer) == B
            out.append(buf.tobytes())
    return b"".join(out)


@pytest.mark.parametrize("layer", [None, 0, 1])
def test_save_requests_equals_save_block_per_block(held, layer):
    e, (a, b, c) = held
    cases = [[(a, 0, 5), (b, 0, 3), (c, 0, 2)],   # every full block of each, in order
             [(c, 1, 1), (a, 2, 3), (b, 1, 1)],   # mid-request spans, another order
             [(b, 0, 3), (b, 0, 3)]]              # one request twice
    for spans in cases:
        want = _reference(e, spans, layer)
        n = saved_nbytes(e.layout, spans, layer)
        assert n == len(want)
        for dst in (np.full(n, 0xAB, np.uint8), bytearray(n), torch.zeros(n // 4, dtype=torch.float32)):
            e.save_requests(spans, dst, layer)
            got = dst.view(torch.uint8).numpy().tobytes() if isinstance(dst, torch.Tensor) else bytes(dst)
            assert got == want, (spans, layer, type(dst))


def test_save_requests_refuses_bad_input_before_writing(held):
    e, (a, b, c) = held
    n = saved_nbytes(e.layout, [(a, 0, 5)])
    dst = np.zeros(n, np.uint8)
    bad = [([("nope", 0, 1)], "holds no KV"),
           ([(a, 0, 6)], "not all full blocks"),    # 41 tokens: 5 full blocks
           ([(c, 2, 1)], "not all full blocks"),    # 17 tokens: the third block is partial
           ([(a, -1, 2)], "not all full blocks"),
           ([(a, 0, 0)], "not all full blocks"),
           ([], "spans is empty")]
    for spans, match in bad:
        with pytest.raises(InvalidArgument, match=match):
            e.save_requests(spans, dst)
    with pytest.raises(InvalidArgument):
        e.save_requests([(a, 0, 4)], dst)  # the buffer is a block too large
    with pytest.raises(InvalidArgument, match="writable"):
        e.save_requests([(a, 0, 5)], bytes(n))
    for layer in (-1, CFG.num_layers):
        with pytest.raises(InvalidArgument, match="layer"):
            e.save_requests([(a, 0, 5)], dst[:saved_nbytes(e.layout, [(a, 0, 5)], 0)], layer)
    assert not dst.any()


@pytest.mark.parametrize("layer", [None, 0, 1])
def test_save_blocks_each_equals_save_block_into_store_slots(held, layer):
    """One call for a request's blocks into separate buffers (reserved store slots, numpy
    arrays, tensors): each holds what save_block writes there; with a layer, only that
    layer's span of each slot is written."""
    from mooncake_rs import Store

    e, (a, b, c) = held
    nb = e.layout.block_nbytes
    idx = [4, 0, 2]  # any order, any subset of the full blocks
    want = []
    for i in idx:
        buf = np.full(nb, 0x5A, np.uint8)
        e.save_block(a, i, buf, layer)
        want.append(buf.tobytes())
    store = Store(nb, 16 * nb)
    slots = [store.reserve(1000 + i) for i in idx]
    for s in slots:
        np.asarray(s)[:] = 0x5A
    arrays = [np.full(nb, 0x5A, np.uint8) for _ in idx]
    tensors = [torch.full((nb,), 0x5A, dtype=torch.uint8) for _ in idx]
    for outs in (slots, arrays, tensors):
        e.save_blocks_each(a, idx, outs, layer)
        got = [o.numpy().tobytes() if isinstance(o, torch.Tensor) else np.asarray(o).tobytes() for o in outs]
        assert got == want, (layer, type(outs[0]))
    for s in slots:
        s.abort()


def test_save_blocks_each_refuses_bad_input_before_writing(held):
    from mooncake_rs._core import page_gather_each

    e, (a, b, c) = held
    nb = e.layout.block_nbytes
    outs = [np.zeros(nb, np.uint8) for _ in range(3)]
    for args, match in [((a, [0, 1], outs), "one buffer a block"),
                        ((a, [0, 1, 5], outs), "not a full block"),   # 41 tokens: 5 full blocks
                        ((c, [0, 2, 1], outs), "not a full block"),   # 17 tokens: block 2 is partial
                        (("nope", [0, 1, 2], outs), "holds no KV"),
                        ((a, [0, 1, 2], outs[:2] + [np.zeros(nb - 1, np.uint8)]), "needs"),
                        ((a, [0, 1, 2], outs[:2] + [bytes(nb)]), "writable"),
                        ((a, [0, "1", 2], outs), "block_indices must hold ints"),
                        ((a, [0, 2**70, 2], outs), "block_indices must hold ints")]:
        with pytest.raises(InvalidArgument, match=match):
            e.save_blocks_each(*args)
    with pytest.raises(InvalidArgument, match="layer"):
        e.save_blocks_each(a, [0], outs[:1], CFG.num_layers)
    g = e.cache._gather
    with pytest.raises(InvalidArgument, match="the cache has"):
        page_gather_each(g, [0, g.num_pages], 1, 0, g.planes, outs[:2])
    with pytest.raises(InvalidArgument, match="planes"):
        page_gather_each(g, [0], 1, 0, g.planes + 1, outs[:1])
    with pytest.raises(InvalidArgument, match="shares memory"):
        page_gather_each(g, [0], 1, 0, 1, [e.cache.data.view(-1).view(torch.uint8)[:nb]])
    assert not any(o.any() for o in outs)


@pytest.mark.parametrize("layer", [None, 0, 1])
def test_save_blocks_one_call_equals_save_block_per_block(held, layer):
    """Engine.save_blocks (on CPU one Rust call: lookup, checks, page ids read from the
    request's list) writes what save_block writes block by block, into every kind of
    destination; request ids given as str or as anything whose str names the request."""
    e, (a, b, c) = held
    per = e.layout.block_nbytes if layer is None else e.layout.layer_nbytes
    for rid, first, num in [(a, 0, 5), (a, 1, 3), (b, 2, 1), (c, 0, 2)]:
        want = _reference(e, [(rid, first, num)], layer)
        for dst in (np.full(num * per, 0xCD, np.uint8), bytearray(num * per),
                    torch.zeros(num * per // 2, dtype=torch.float16), torch.zeros(2 * num * per, dtype=torch.uint8)[::2]
                    .contiguous()):
            e.save_blocks(rid, first, num, dst, layer)
            got = dst.view(torch.uint8).numpy().tobytes() if isinstance(dst, torch.Tensor) else bytes(dst)
            assert got == want, (rid, first, num, layer, type(dst))


def test_save_blocks_one_call_refuses_bad_input_before_writing(held):
    e, (a, b, c) = held
    nb = e.layout.block_nbytes
    dst = np.zeros(2 * nb, np.uint8)
    for args, match in [(("nope", 0, 2), "holds no KV"),
                        ((a, 4, 2), "not all full blocks"),   # 41 tokens: blocks 0..4 are full
                        ((c, 1, 2), "not all full blocks"),   # 17 tokens: block 2 is partial
                        ((a, -1, 2), "not all full blocks"),
                        ((a, 0, 0), "not all full blocks"),
                        ((a, 2**62, 2), "not all full blocks"),  # no overflow into a "valid" span
                        ((a, 2**70, 2), "first_block must hold ints"),
                        ((a, 0, 1.0), "num_blocks must hold ints")]:
        with pytest.raises(InvalidArgument, match=match):
            e.save_blocks(*args, dst)
    with pytest.raises(InvalidArgument, match="buffer holds"):
        e.save_blocks(a, 0, 1, dst)  # the buffer is a block too large
    with pytest.raises(InvalidArgument, match="writable"):
        e.save_blocks(a, 0, 2, bytes(2 * nb))
    with pytest.raises(InvalidArgument, match="non-contiguous"):
        e.save_blocks(a, 0, 2, torch.zeros(4 * nb, dtype=torch.uint8)[::2])
    for layer in (-1, CFG.num_layers, 2**70, "0"):
        with pytest.raises(InvalidArgument, match="layer"):
            e.save_blocks(a, 0, 2, dst[:2 * e.layout.layer_nbytes], layer)
    assert not dst.any()


def test_save_requests_takes_any_span_sequence_and_refuses_malformed_spans(held):
    """Spans as lists, tuples or a generator, with numpy ints, give the same bytes; a
    span that is not a (request_id, first_block, num_blocks) triple is InvalidArgument."""
    e, (a, b, c) = held
    spans = [(a, 1, 2), (c, 0, 2)]
    want = _reference(e, spans, None)
    n = len(want)
    for form in ([list(s) for s in spans], tuple(spans), (s for s in spans),
                 [(rid, np.int64(f), np.int32(k)) for rid, f, k in spans]):
        dst = np.zeros(n, np.uint8)
        e.save_requests(form, dst)
        assert dst.tobytes() == want
    dst = np.zeros(n, np.uint8)
    for spans_bad in ([(a, 1)], [(a, 1, 2, 3)], [(a, "1", 2)], [a], [(a, 1.5, 2)]):
        with pytest.raises(InvalidArgument, match="triples"):
            e.save_requests(spans_bad, dst)
    assert not dst.any()


@pytest.mark.parametrize("layer", [None, 1])
def test_python_saves_of_cuda_engines_equal_the_one_call_saves(held, layer):
    """batch_save.save_requests / save_blocks_each are what a CUDA engine runs (no Rust
    gather there); on CPU they run over the same cache, so they are checked here against
    the one-call saves, byte for byte, and refuse the same bad input."""
    from mooncake_rs.engine import batch_save

    e, (a, b, c) = held
    spans = [(c, 0, 2), (a, 1, 4), (b, 0, 3)]
    n = saved_nbytes(e.layout, spans, layer)
    fast, slow = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    e.save_requests(spans, fast, layer)
    batch_save.save_requests(e.handoff, e._requests, spans, slow, layer)
    assert fast.tobytes() == slow.tobytes() == _reference(e, spans, layer)
    nb = e.layout.block_nbytes
    idx = [3, 1]
    fast_each = [np.zeros(nb, np.uint8) for _ in idx]
    slow_each = [np.zeros(nb, np.uint8) for _ in idx]
    e.save_blocks_each(a, idx, fast_each, layer)
    batch_save.save_blocks_each(e.handoff, e._requests[a], idx, slow_each, layer)
    assert [x.tobytes() for x in fast_each] == [x.tobytes() for x in slow_each]
    for spans_bad, match in [([(a, 0, 6)], "not all full blocks"), ([], "spans is empty")]:
        with pytest.raises(InvalidArgument, match=match):
            batch_save.save_requests(e.handoff, e._requests, spans_bad, slow, layer)
    with pytest.raises(InvalidArgument, match="not a full block"):
        batch_save.save_blocks_each(e.handoff, e._requests[c], [2], slow_each[:1], layer)


def test_request_block_saver_refuses_a_bad_shape(held):
    from mooncake_rs._core import RequestBlockSaver

    e, _ = held
    for block_size, per in [(0, 1), (8, 0), (8, 9)]:
        with pytest.raises(InvalidArgument, match="pages_per_block"):
            RequestBlockSaver(e.cache.page_gather, {}, block_size, per)


def test_a_request_with_fewer_pages_than_its_blocks_need_is_refused_the_same_on_both_paths(held):
    """A request whose page table is shorter than its computed blocks (a caller's bookkeeping
    error) is refused with the same message whether its pages are a list or a buffer of ints."""
    from types import SimpleNamespace

    from mooncake_rs.engine.batch_save import cpu_saver

    e, _ = held
    ppb = B // e.page_size
    out = np.zeros(2 * e.layout.block_nbytes, np.uint8)
    for pages in ([0] * ppb, np.zeros(ppb, np.int64)):  # one block's pages (list, array); two blocks asked
        requests = {"short": SimpleNamespace(pages=pages, kv_end=2 * B, num_computed=2 * B)}
        saver = cpu_saver(e.cache, requests, B, e.page_size)
        with pytest.raises(InvalidArgument, match=rf"are {ppb} ids; its blocks 0\.\.1 need {2 * ppb}"):
            saver.save_spans([("short", 0, 2)], out)
    assert not out.any()
