"""The engine's KV hand-off part (``KVHandoff``) used on its own, from the parts it is built
with and no engine: what it needs is its constructor's arguments."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake_rs import InvalidArgument, SamplingParams  # noqa: E402
from mooncake_rs.engine import Engine, KVCache, ModelConfig  # noqa: E402
from mooncake_rs.engine.handoff import KVHandoff  # noqa: E402
from mooncake_rs.engine.scheduler import Request  # noqa: E402

CFG = ModelConfig.tiny()
B = 8  # tokens per block
PROMPT = [(5 * i + 1) % CFG.vocab_size for i in range(3 * B + 3)]  # three full blocks and 3 tokens


def _prefilled() -> tuple[Engine, str, list[np.ndarray]]:
    """An engine holding the KV of PROMPT (finished, hold_kv) and its blocks as saved by it."""
    eng = Engine(CFG, block_size=B, num_pages=64)
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=1), hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    blocks = []
    for i in range(4):
        buf = np.zeros(eng.layout.block_nbytes, dtype=np.uint8)
        eng.save_block(rid, i, buf)
        blocks.append(buf)
    return eng, rid, blocks


def _part(eng: Engine, num_pages: int) -> KVHandoff:
    """A hand-off over a fresh cache of ``num_pages`` and the engine's model (its weights)."""
    cache = KVCache(CFG, num_pages=num_pages, page_size=eng.page_size, dtype=eng.dtype, device="cpu")
    return KVHandoff(eng.config, eng.layout, cache, eng.model, eng.attn, max_num_batched_tokens=64)


def _saved(part: KVHandoff, req: Request) -> list[np.ndarray]:
    out = []
    for i in range(-(-req.num_computed // B)):
        buf = np.zeros(part.layout.block_nbytes, dtype=np.uint8)
        n = part.save_block(req, i, buf)
        out.append((n, buf))
    return out


def test_restore_then_save_gives_the_bytes_back_without_an_engine():
    eng, _, blocks = _prefilled()
    part = _part(eng, num_pages=32)
    req = Request("r", list(PROMPT), SamplingParams(), 0)
    part.restore(req, part.prompt_blocks(len(PROMPT), blocks))
    assert req.staged is None and req.num_computed == len(PROMPT)
    got = _saved(part, req)
    assert [n for n, _ in got] == [B, B, B, 3]
    lay = part.layout
    for (n, buf), want in zip(got, blocks):
        # each layer's K then V; of the partial block only the first n token rows are the prompt's
        for span in lay.spans():
            for start in (span.offset, span.offset + B * lay.token_nbytes):
                end = start + n * lay.token_nbytes
                assert np.array_equal(buf[start:end], want[start:end])


def test_restore_without_free_pages_stages_a_copy_loaded_later():
    eng, _, blocks = _prefilled()
    part = _part(eng, num_pages=6)  # 4 blocks of 8 tokens need 4 pages of 8 (or more of less)
    hog = part.cache.allocate(part.cache.num_free)  # nothing free: the restore must stage
    req = Request("r", list(PROMPT), SamplingParams(), 0)
    src = [b.copy() for b in blocks]
    part.restore(req, part.prompt_blocks(len(PROMPT), src))
    assert req.staged is not None and not req.pages and req.num_computed == 0
    for b in src:
        b[:] = 0  # the caller's buffers may go once restore returns: the staged copy is the part's own
    part.cache.free(hog)
    part.load_staged(req)
    assert req.staged is None and req.num_computed == len(PROMPT)
    full = _saved(part, req)[:3]
    for (n, buf), want in zip(full, blocks):
        assert n == B and np.array_equal(buf, want)


def test_block_counts_and_the_prefix_cap():
    eng = Engine(CFG, block_size=B, num_pages=16)
    part = eng.handoff
    assert [n for n, _ in part.prompt_blocks(2 * B + 1, ["a", "b", "c"])] == [B, B, 1]
    assert [n for n, _ in part.prompt_blocks(2 * B, ["a", "b"])] == [B, B]
    with pytest.raises(InvalidArgument, match="needs 3 KV blocks, got 2"):
        part.prompt_blocks(2 * B + 1, ["a", "b"])
    # the last prompt token is always computed: a block-aligned prompt restores all but its last block
    assert len(part.prefix_blocks(2 * B, ["a", "b", "c"])) == 1
    assert len(part.prefix_blocks(2 * B + 1, ["a", "b", "c"])) == 2
    assert part.prefix_blocks(2 * B + 1, None) == []
    req = Request("r", list(range(1, 2 * B + 1)), SamplingParams(), 0)
    with pytest.raises(InvalidArgument, match="bytes, a block needs"):
        part.restore(req, [(B, np.zeros(7, dtype=np.uint8))])
