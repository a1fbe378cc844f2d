"""Paged KV cache, block layout and the attention backends (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake_rs import InvalidArgument  # noqa: E402
from mooncake_rs.engine import BlockLayout, KVCache, ModelConfig  # noqa: E402
from mooncake_rs.engine.attention import BatchMeta, TorchAttention, make_backend  # noqa: E402

CFG = ModelConfig.tiny()


def _dense_attention(q, k, v, q_len, kv_len, scale):
    """Causal attention for one sequence, by hand: q [n, Hq, d], k/v [kv, Hkv, d]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(kv_len - q_len, kv_len)[:, None]
    s = s.masked_fill(torch.arange(kv_len)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_attention_equals_dense(page_size):
    g = torch.Generator().manual_seed(0)
    h, hkv, d = 4, 2, 16
    cache = KVCache(CFG, num_pages=200, page_size=page_size, dtype="float32", device="cpu")
    # a decode, a chunk after a prefix, a whole prompt, a one-token prompt
    q_lens, kv_lens = [1, 5, 9, 1], [23, 17, 9, 1]
    perm = torch.randperm(200, generator=g).tolist()
    tables, dense_k, dense_v = [], [], []
    for kv in kv_lens:
        npg = -(-kv // page_size)
        tables.append([perm.pop() for _ in range(npg)])
        k = torch.randn(kv, hkv, d, generator=g)
        v = torch.randn(kv, hkv, d, generator=g)
        slots = torch.tensor([tables[-1][t // page_size] * page_size + t % page_size for t in range(kv)])
        cache.write(0, slots, k, v)
        dense_k.append(k)
        dense_v.append(v)
    meta = BatchMeta.build(q_lens, kv_lens, tables, page_size, torch.device("cpu"))
    q = torch.randn(sum(q_lens), h, d, generator=g)
    backend = TorchAttention(h, hkv, d, torch.float32, torch.device("cpu"))
    backend.plan(meta)
    out = backend.forward(q, cache.k(0), cache.v(0))
    start = 0
    for i, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        ref = _dense_attention(q[start:start + n], dense_k[i], dense_v[i], n, kv, d ** -0.5)
        torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-5)
        start += n
    # the single-prompt fast path too
    meta1 = BatchMeta.build([9], [9], [tables[2]], page_size, torch.device("cpu"))
    backend.plan(meta1)
    torch.testing.assert_close(backend.forward(q[6:15], cache.k(0), cache.v(0)),
                               _dense_attention(q[6:15], dense_k[2], dense_v[2], 9, 9, d ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_block_layout_offsets():
    lay = BlockLayout.for_model(CFG, 16, "bfloat16")
    assert lay.layer_nbytes == 2 * 16 * CFG.num_kv_heads * CFG.head_dim * 2
    assert lay.block_nbytes == CFG.num_layers * lay.layer_nbytes
    spans = lay.spans()
    assert [s.offset for s in spans] == [i * lay.layer_nbytes for i in range(CFG.num_layers)]
    assert spans[-1].end == lay.block_nbytes
    with pytest.raises(InvalidArgument):
        lay.layer_span(CFG.num_layers)


@pytest.mark.parametrize("page_size", [2, 8])
def test_save_load_block_round_trip(page_size):
    g = torch.Generator().manual_seed(1)
    b = 8
    lay = BlockLayout.for_model(CFG, b, "float32")
    cache = KVCache(CFG, num_pages=32, page_size=page_size, dtype="float32", device="cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    pages = cache.allocate(b // page_size)
    whole = np.zeros(lay.block_nbytes, dtype=np.uint8)
    cache.save_block(lay, pages, b, whole)
    # the layout: layer l, K then V, [block, heads, dim]
    view = torch.from_numpy(whole).view(torch.float32).view(CFG.num_layers, 2, b, CFG.num_kv_heads, CFG.head_dim)
    for l in range(CFG.num_layers):
        got = cache.data[l, :, pages].reshape(2, b, CFG.num_kv_heads, CFG.head_dim)
        assert torch.equal(view[l], got)
    # per layer into a layer-sized buffer and into the layer's span of a block buffer
    for l in range(CFG.num_layers):
        one = bytearray(lay.layer_nbytes)
        cache.save_block(lay, pages, b, one, layer=l)
        s = lay.layer_span(l)
        assert bytes(one) == whole[s.offset:s.end].tobytes()
    # load into other pages (all layers, then one layer from a torch tensor), then compare
    other = cache.allocate(b // page_size)
    cache.load_block(lay, other, b, memoryview(whole.tobytes()))
    assert torch.equal(cache.data[:, :, other], cache.data[:, :, pages])
    third = cache.allocate(b // page_size)
    cache.load_block(lay, third, b, torch.from_numpy(whole), layer=1)
    assert torch.equal(cache.data[1, :, third], cache.data[1, :, pages])
    # a partial block touches only its rows
    part = np.zeros(lay.block_nbytes, dtype=np.uint8)
    cache.save_block(lay, pages, 3, part)
    pv = torch.from_numpy(part).view(torch.float32).view(view.shape)
    assert torch.equal(pv[:, :, :3], view[:, :, :3]) and not pv[:, :, 3:].any()
    with pytest.raises(InvalidArgument, match="bytes"):
        cache.save_block(lay, pages, b, bytearray(10))
    with pytest.raises(InvalidArgument, match="read-only"):
        cache.save_block(lay, pages, b, bytes(lay.block_nbytes))


def test_allocator_and_backend_choice():
    cache = KVCache(CFG, num_pages=4, page_size=4, dtype="float32", device="cpu")
    a = cache.allocate(3)
    assert len(set(a)) == 3 and cache.num_free == 1
    with pytest.raises(InvalidArgument):
        cache.allocate(2)
    cache.free(a)
    assert cache.num_free == 4
    # auto on CPU is the torch reference; flashinfer on CPU is refused with a clear message
    assert make_backend("auto", 4, 2, 16, torch.float32, torch.device("cpu")).name == "torch"
    with pytest.raises(InvalidArgument, match="flashinfer"):
        make_backend("flashinfer", 4, 2, 16, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("page_size", [2, 8])
def test_save_blocks_equals_save_block_per_block(page_size):
    """The batched save (one call for many blocks, whole or one layer) writes exactly what
    save_block writes block by block; bad arguments are typed errors."""
    g = torch.Generator().manual_seed(2)
    b = 8
    lay = BlockLayout.for_model(CFG, b, "float32")
    cache = KVCache(CFG, num_pages=64, page_size=page_size, dtype="float32", device="cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    per = b // page_size
    pages = cache.allocate(5 * per)
    pages = pages[::-1]  # not in page order: the gather must follow the list
    ref = b"".join(_one_block(cache, lay, pages[i * per:(i + 1) * per], None) for i in range(5))
    out = bytearray(5 * lay.block_nbytes)
    cache.save_blocks(lay, pages, 5, out)
    assert bytes(out) == ref
    for layer in range(CFG.num_layers):
        ref_l = b"".join(_one_block(cache, lay, pages[i * per:(i + 1) * per], layer) for i in range(5))
        out_l = bytearray(5 * lay.layer_nbytes)
        cache.save_blocks(lay, pages, 5, out_l, layer=layer)
        assert bytes(out_l) == ref_l
    with pytest.raises(InvalidArgument):
        cache.save_blocks(lay, pages, 4, out)  # 5 blocks of pages for 4 blocks
    with pytest.raises(InvalidArgument):
        cache.save_blocks(lay, pages, 5, bytearray(10))
    # pages in cache order (a block's pages move as one run), into a CPU tensor of any
    # dtype and into a numpy array: the same bytes as block by block
    pages = sorted(pages)
    ref = b"".join(_one_block(cache, lay, pages[i * per:(i + 1) * per], None) for i in range(5))
    as_tensor = torch.zeros(5 * lay.block_nbytes // 4, dtype=torch.float32)
    cache.save_blocks(lay, pages, 5, as_tensor)
    assert as_tensor.view(torch.uint8).numpy().tobytes() == ref
    as_array = np.zeros(5 * lay.block_nbytes, np.uint8)
    cache.save_blocks(lay, pages, 5, as_array)
    assert as_array.tobytes() == ref
    # bad destinations and layers: typed errors, nothing written
    as_array[:] = 0
    for bad, match in [(torch.zeros(10 * lay.block_nbytes, dtype=torch.uint8)[::2], "contiguous"),
                       (torch.empty(5 * lay.block_nbytes, dtype=torch.uint8, device="meta"), "host memory"),
                       (bytes(5 * lay.block_nbytes), "writable"), ("no buffer", "writable buffer")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.save_blocks(lay, pages, 5, bad)
    for layer in (-1, CFG.num_layers):
        with pytest.raises(InvalidArgument, match="layer"):
            cache.save_blocks(lay, pages, 5, as_array[:5 * lay.layer_nbytes], layer=layer)
    with pytest.raises(InvalidArgument, match="shares memory"):
        cache.save_blocks(lay, pages, 5, cache.data.view(-1).view(torch.uint8)[:5 * lay.block_nbytes])
    assert not as_array.any()


def test_page_gather_equals_a_page_by_page_reference():
    """PageGather (the CPU save's one Rust call) against numpy, page by page: many blocks,
    runs and gaps, one plane range at a time; bad pages, planes and sizes are refused."""
    from mooncake_rs._core import PageGather

    rng = np.random.default_rng(5)
    planes, num_pages, page_bytes = 6, 50, 40
    cache = rng.integers(0, 256, planes * num_pages * page_bytes, dtype=np.uint8)
    g = PageGather(cache, planes, num_pages, page_bytes)
    assert (g.planes, g.num_pages, g.page_bytes) == (planes, num_pages, page_bytes)
    view = cache.reshape(planes, num_pages, page_bytes)
    for per in (1, 3, 4):
        for n_blocks in (1, 7):
            pages = rng.integers(0, num_pages, per * n_blocks)
            pages[:per] = np.arange(per) + 10  # one block of consecutive pages (one run)
            for first, n in ((0, planes), (2, 2), (5, 1)):
                want = np.concatenate([view[first:first + n, pages[b * per:(b + 1) * per]].ravel()
                                       for b in range(n_blocks)])
                out = np.zeros(want.size, np.uint8)
                g.save(pages.tolist(), per, first, n, out)
                assert np.array_equal(out, want)
                out[:] = 0
                g.save(pages.astype(np.uint64), per, first, n, out)  # a uint64 buffer of page ids
                assert np.array_equal(out, want)
    out = np.zeros(2 * planes * page_bytes, np.uint8)
    for pages, per, first, n in (([0, num_pages], 1, 0, planes), ([0, 1, 2], 2, 0, planes), ([0, 1], 1, 4, 3),
                                 ([0, 1], 0, 0, planes), ([0], 1, 0, planes)):
        with pytest.raises(InvalidArgument):
            g.save(pages, per, first, n, out)
    assert not out.any()
    with pytest.raises(InvalidArgument, match="need"):
        PageGather(cache[:-1], planes, num_pages, page_bytes)


def _one_block(cache, lay, pages, layer):
    buf = bytearray(lay.block_nbytes if layer is None else lay.layer_nbytes)
    cache.save_block(lay, pages, lay.block_size, buf, layer=layer)
    return bytes(buf)
