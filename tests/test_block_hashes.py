"""BlockHashes (issue 11): the opaque buffer of 16-byte block keys that the hasher returns
and that the index, the conductor, the block cache and the store take, checked against
plain lists of ints as the reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_rs as mr

BIG = [0, 1, 2**64 - 1, 2**64, (1 << 127) + 3, 2**128 - 1]


def le_bytes(keys: list[int]) -> bytes:
    return b"".join(k.to_bytes(16, "little") for k in keys)


def test_hash_blocks_equals_hash_for_every_token_form() -> None:
    h = mr.PrefixHasher(16, seed=7, extra=b"lora")
    toks = np.random.default_rng(0).integers(0, 60_000, 16 * 9 + 5, dtype=np.int64)
    want = h.hash(toks.tolist())
    assert len(want) == 9
    for form in (toks.tolist(), tuple(toks.tolist()), toks.astype(np.int32), toks.astype(np.uint32), toks,
                 toks.astype(np.uint16)):
        got = h.hash_blocks(form)
        assert isinstance(got, mr.BlockHashes)
        assert got.tolist() == want and list(got) == want and len(got) == 9
    # parent continues a chain, as with hash()
    a = h.hash_blocks(toks[:64])
    b = h.hash_blocks(toks[64:], parent=a[-1])
    assert a.tolist() + b.tolist() == want
    assert h.hash_blocks(toks[:15]) == mr.BlockHashes([]) and len(h.hash_blocks([])) == 0
    many = h.hash_many_blocks([toks, toks[:40].tolist(), []])
    assert [m.tolist() for m in many] == h.hash_many([toks, toks[:40].tolist(), []])
    with pytest.raises(mr.InvalidArgument, match="sequence 1"):
        h.hash_many_blocks([toks, [1, -2]])
    with pytest.raises(mr.InvalidArgument, match="position 3"):
        h.hash_blocks([1, 2, 3, -1])
    with pytest.raises(mr.InvalidArgument):
        h.hash_blocks(np.zeros(32, np.float32))


def test_sequence_behaviour_and_equality() -> None:
    bh = mr.BlockHashes(BIG)
    assert len(bh) == 6 and bh[0] == 0 and bh[-1] == 2**128 - 1 and bh[4] == (1 << 127) + 3
    with pytest.raises(IndexError):
        bh[6]
    with pytest.raises(IndexError):
        bh[-7]
    with pytest.raises(TypeError):
        bh["x"]  # type: ignore[call-overload]
    assert bh[1:4].tolist() == BIG[1:4] and isinstance(bh[1:4], mr.BlockHashes)
    assert bh[::-2].tolist() == BIG[::-2] and bh[10:].tolist() == []
    assert bh == mr.BlockHashes(BIG) and bh != mr.BlockHashes(BIG[:5]) and bh[:5] == mr.BlockHashes(BIG[:5])
    assert bh != BIG  # a list compares through tolist()
    assert hash(bh[2:4]) == hash(mr.BlockHashes(BIG[2:4]))
    assert 2**64 in bh and 5 not in bh and "x" not in bh
    assert "BlockHashes(n=6" in repr(bh)
    assert bh.nbytes == 96 and bytes(bh) == bh.tobytes() == le_bytes(BIG)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**128 - 1), max_size=20), st.integers(-25, 25), st.integers(-25, 25),
       st.sampled_from([None, 1, 2, -1, 3]))
def test_slicing_matches_list_slicing(keys: list[int], a: int, b: int, step: int | None) -> None:
    bh = mr.BlockHashes(keys)
    got = bh[a:b:step]
    assert got.tolist() == keys[a:b:step]
    assert bytes(got) == le_bytes(keys[a:b:step])
    assert np.asarray(got).shape == (len(keys[a:b:step]), 16)


def test_buffer_protocol_views_without_copy() -> None:
    bh = mr.BlockHashes(BIG)
    arr = np.asarray(bh)
    assert arr.shape == (6, 16) and arr.dtype == np.uint8 and not arr.flags.writeable
    assert arr.tobytes() == le_bytes(BIG)
    # (numpy's stubs type frombuffer's argument as bytes-like only, hence the ignores)
    v16 = np.frombuffer(bh, dtype="V16")  # type: ignore[call-overload]
    assert len(v16) == 6 and v16[4].tobytes() == BIG[4].to_bytes(16, "little")
    lohi = np.frombuffer(bh, dtype="<u8").reshape(-1, 2)  # type: ignore[call-overload]
    assert [int(lo) | (int(hi) << 64) for lo, hi in lohi] == BIG
    pair = np.frombuffer(bh, dtype=[("lo", "<u8"), ("hi", "<u8")])  # type: ignore[call-overload]
    assert int(pair["hi"][5]) == 2**64 - 1
    m = memoryview(bh[1:3])
    assert m.readonly and m.shape == (2, 16) and m.nbytes == 32
    with pytest.raises(TypeError):
        m[0, 0] = 1
    # a view keeps the buffer alive after the BlockHashes object goes
    sliced = bh[2:5]
    view = np.asarray(sliced)
    del bh, sliced
    assert view.tobytes() == le_bytes(BIG[2:5])
    assert np.asarray(mr.BlockHashes([])).shape == (0, 16)


def test_construction_forms_and_bad_input() -> None:
    raw = le_bytes(BIG)
    for form in (BIG, raw, bytearray(raw), np.frombuffer(raw, np.uint8), np.frombuffer(raw, np.uint8).reshape(-1, 16),
                 np.frombuffer(raw, "V16"), np.frombuffer(raw, "<u8").reshape(-1, 2),
                 np.frombuffer(raw, "<u4").reshape(-1, 4), mr.BlockHashes(BIG), iter(BIG), tuple(BIG),
                 np.array(BIG, dtype=object)):
        assert mr.BlockHashes(form).tolist() == BIG, type(form)
    # an int64 array is one key per item (its value), never raw key bytes
    assert mr.BlockHashes(np.array([3, 4], np.int64)).tolist() == [3, 4]
    assert mr.BlockHashes().tolist() == [] and mr.BlockHashes(b"").tolist() == []
    for bad, match in ((b"x" * 17, "whole number"), ([-1], "outside"), ([2**128], "outside"), (["a"], "not an int"),
                       (np.zeros((2, 3), np.uint8), "rows of 16 bytes"), (np.zeros((1, 2, 16), np.uint8), "1-D or 2-D"),
                       (np.array([-1], np.int64), "outside"), (3.5, "list of ints")):
        with pytest.raises(mr.InvalidArgument, match=match):
            mr.BlockHashes(bad)


def test_every_key_entry_point_takes_block_hashes() -> None:
    h = mr.PrefixHasher(4)
    toks = list(range(40))
    bh = h.hash_blocks(toks)
    keys = bh.tolist()
    forms = (keys, bh, bytes(bh), np.asarray(bh))

    # index
    for form in forms:
        ix = mr.BlockIndex()
        assert ix.insert(1, form[:6] if not isinstance(form, bytes) else form[: 6 * 16]) == 6
        ix.insert(2, keys[:3], "ssd")
        assert ix.match_prefix(form) == {1: 6, 2: 3}
        t = ix.match_prefix_tiers(form)
        assert (t[1].dram, t[1].ssd, t[2].dram, t[2].ssd) == (6, 0, 0, 3)
        assert ix.best_prefix(form) == (1, 6)
        assert ix.remove(1, form) == 6 and ix.match_prefix(form) == {2: 3}
        ix.check_integrity()

    # conductor: the same decisions from a list and from BlockHashes
    def conductor() -> mr.Conductor:
        c = mr.Conductor(mr.ConductorConfig(block_size=4, ttft_slo_s=1e9, tbt_slo_s=1e9, rejection="none"))
        for i in range(3):
            c.add_prefill(i)
            c.add_decode(10 + i)
        return c

    a, b = conductor(), conductor()
    a.on_blocks_stored(2, keys[:7])
    b.on_blocks_stored(2, bh[:7])
    a.on_blocks_evicted(2, keys[5:7], "dram")
    b.on_blocks_evicted(2, bh[5:7], "dram")
    da, db = a.schedule(1, keys, 40, 0.0), b.schedule(1, bh, 40, 0.0)
    assert (da.prefill, da.decode, da.reused_blocks) == (db.prefill, db.decode, db.reused_blocks) == (2, da.decode, 5)
    pa, pb = a.preview(2, keys[:3], 40, 0.0), b.preview(2, bh[:3], 40, 0.0)
    assert (pa.prefill, pa.reused_blocks) == (pb.prefill, pb.reused_blocks)
    assert a.index.match_prefix(keys) == b.index.match_prefix(bh)

    # block cache
    ca, cb = mr.BlockCache(4), mr.BlockCache(4)
    assert ca.insert(keys[:6]) == cb.insert(bh[:6])
    assert ca.lookup_prefix(keys[2:]) == cb.lookup_prefix(bh[2:])

    # store
    s = mr.Store(64, 4096 * 16)
    datas = np.arange(64 * 5, dtype=np.uint8).reshape(5, 64) % 251
    assert s.put_many(bh[:5], datas) == [True] * 5
    out = np.zeros((10, 64), np.uint8)
    assert s.get_many_into(bh, out) == [True] * 5 + [False] * 5
    assert np.array_equal(out[:5], datas)
    assert [b is not None for b in s.get_many(bh[3:7])] == [True, True, False, False]
    assert [blk.key for blk in s.lookup_prefix(bh)] == keys[:5]
    s.check_integrity()


def test_token_lists_with_mixed_items() -> None:
    """The borrowed-item fast path for lists/tuples hands over to the generic route at the
    first non-int item, with the same results and error positions."""
    h = mr.PrefixHasher(4)
    ref = h.hash([1, 2, 3, 1, 5, 6, 7, 8])
    mixed = [1, 2, np.int64(3), True, 5, np.uint32(6), 7, 8]
    assert h.hash_blocks(mixed).tolist() == ref == h.hash(mixed) == h.hash_blocks(tuple(mixed)).tolist()
    for bad, pos in (([1, 2, np.int64(3), -1], 3), ([1, 2**70, 3, 4], 1), ((1, 2, 3, "x"), 3), ([0] * 9 + [-5], 9)):
        with pytest.raises(mr.InvalidArgument, match=f"position {pos} "):
            h.hash_blocks(bad)
