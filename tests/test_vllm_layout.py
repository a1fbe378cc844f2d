"""The connector's KV layout learning (integrations/vllm/layout.py) on the shapes vLLM
backends use, against plain torch indexing of the same block: what the connector moves
for block b of a layer is exactly that block's bytes, in a fixed order."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _needs_vllm():
    from vllm_support import require_vllm

    require_vllm()


def _bytes_at(storage_view: memoryview, offsets, n):
    return b"".join(bytes(storage_view[o:o + n]) for o in offsets)


def _storage_bytes(t):
    import ctypes

    s = t.untyped_storage()
    return memoryview((ctypes.c_char * s.nbytes()).from_address(s.data_ptr())).cast("B")


@pytest.mark.parametrize("shape,block_dim,pieces", [
    ((40, 2, 32, 64), 0, lambda t, b: [t[b]]),  # vLLM CPU: [blocks, K/V, tokens, heads*dim]
    ((2, 40, 16, 4, 8), 1, lambda t, b: [t[0, b], t[1, b]]),  # flash attention: [K/V, blocks, ...]
    ((40, 16, 72), 0, lambda t, b: [t[b]]),  # MLA: one latent row a token
])
def test_segments_are_the_blocks_bytes(shape, block_dim, pieces):
    from mooncake_rs.integrations.vllm.layout import learn_layout

    g = torch.Generator().manual_seed(0)
    big = torch.randn(2 * torch.Size(shape).numel() + 50, generator=g).to(torch.bfloat16)
    # two layers viewing one storage, the second at an offset (vLLM may carve layers out of one buffer)
    n = torch.Size(shape).numel()
    layers = {"l0": big[:n].view(shape), "l1": big[50 + n:50 + 2 * n].view(shape)}
    lay = learn_layout(layers, 40)
    assert lay.block_bytes == 2 * sum(p.numel() for p in pieces(layers["l0"], 0)) * 2
    view = _storage_bytes(big)
    for i, (name, t) in enumerate(layers.items()):
        _, layer = lay.layer(name)
        assert layer.pool_offset == i * layer.block_bytes
        for b in (0, 7, 39):
            want = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in pieces(t, b))
            assert _bytes_at(view, layer.segments(b), layer.segment_bytes) == want
            local, remote = layer.spans([b], [1000])
            assert local.tolist() == layer.segments(b)
            assert remote.tolist() == [1000 + layer.pool_offset + s * layer.segment_bytes
                                       for s in range(len(layer.outer))]


def test_no_block_dimension_or_scattered_blocks_are_refused():
    from mooncake_rs.errors import InvalidArgument
    from mooncake_rs.integrations.vllm.layout import learn_layout

    with pytest.raises(InvalidArgument, match="no dimension"):
        learn_layout({"l": torch.zeros(8, 2, 4)}, 40)
    scattered = torch.zeros(40, 8, 2).transpose(1, 2)  # [40, 2, 8]: a block's bytes interleave
    with pytest.raises(InvalidArgument, match="not dense"):
        learn_layout({"l": scattered}, 40)


def test_kv_caches_off_the_host_are_refused_before_any_pointer_is_read():
    from mooncake_rs.errors import InvalidArgument
    from mooncake_rs.integrations.vllm.layout import learn_layout

    # "meta" stands in for any device memory the copy paths must never read as host memory
    with pytest.raises(InvalidArgument, match="host \\(CPU\\) KV caches only"):
        learn_layout({"l": torch.zeros(40, 2, 16, 2, 32, device="meta")}, 40)
