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
                        ((a, [0, 1, 2], outs[:2] + [bytes(nb)]), "writable")]:
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
