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
from mooncake_rs.engine.batch_save import save_requests, saved_nbytes  # noqa: E402

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
        n = saved_nbytes(e, spans, layer)
        assert n == len(want)
        for dst in (np.full(n, 0xAB, np.uint8), bytearray(n), torch.zeros(n // 4, dtype=torch.float32)):
            save_requests(e, spans, dst, layer)
            got = dst.view(torch.uint8).numpy().tobytes() if isinstance(dst, torch.Tensor) else bytes(dst)
            assert got == want, (spans, layer, type(dst))


def test_save_requests_refuses_bad_input_before_writing(held):
    e, (a, b, c) = held
    n = saved_nbytes(e, [(a, 0, 5)])
    dst = np.zeros(n, np.uint8)
    bad = [([("nope", 0, 1)], "holds no KV"),
           ([(a, 0, 6)], "not all full blocks"),    # 41 tokens: 5 full blocks
           ([(c, 2, 1)], "not all full blocks"),    # 17 tokens: the third block is partial
           ([(a, -1, 2)], "not all full blocks"),
           ([(a, 0, 0)], "not all full blocks"),
           ([], "spans is empty")]
    for spans, match in bad:
        with pytest.raises(InvalidArgument, match=match):
            save_requests(e, spans, dst)
    with pytest.raises(InvalidArgument):
        save_requests(e, [(a, 0, 4)], dst)  # the buffer is a block too large
    with pytest.raises(InvalidArgument, match="writable"):
        save_requests(e, [(a, 0, 5)], bytes(n))
    for layer in (-1, CFG.num_layers):
        with pytest.raises(InvalidArgument, match="layer"):
            save_requests(e, [(a, 0, 5)], dst[:saved_nbytes(e, [(a, 0, 5)], 0)], layer)
    assert not dst.any()
