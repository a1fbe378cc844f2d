"""Store.lookup_prefix / lookup_prefix_run (issue 11): the longest held prefix of a key
sequence, leased, with arena offsets, for every key form (list, BlockHashes, key
buffers), against a reference loop of per-key contains/slot_offset; leased blocks survive
eviction pressure until released; WritableBlock.commit() returns the leased block."""

from __future__ import annotations

import numpy as np
import pytest

import mooncake_rs as mr

BB = 4096


def data(key: int) -> np.ndarray:
    return np.random.default_rng(key % 10_000).integers(0, 256, BB, dtype=np.uint8)


def reference(s: mr.Store, keys: list[int]) -> list[tuple[int, int]]:
    """(key, offset) of the leading run of keys held in DRAM, one key at a time."""
    out = []
    for k in keys:
        off = s.slot_offset(k)
        if not s.contains(k) or off is None:
            break
        out.append((k, off))
    return out


def forms(keys: list[int]) -> list[object]:
    bh = mr.BlockHashes(keys)
    return [keys, bh, bytes(bh), np.asarray(bh), mr.BlockHashes([99, *keys])[1:]]


def test_matches_reference_for_every_form() -> None:
    s = mr.Store(BB, 12 * BB)
    held = [3, 4, 5, (1 << 127) + 1, 2**128 - 1, 8]
    for k in held:
        s.put(k, data(k))
    rng = np.random.default_rng(0)
    pool = [*held, 6, 7, 2**100]  # 6, 7, 2**100 are never stored: gaps in the middle
    for _ in range(150):
        keys = [int(x) for x in rng.choice(np.array(pool, dtype=object), size=int(rng.integers(0, 9)))]
        want = reference(s, keys)
        for form in forms(keys):
            blocks = s.lookup_prefix(form)
            assert [(b.key, b.offset) for b in blocks] == want
            with s.lookup_prefix_run(form) as run:
                assert len(run) == len(want)
                assert run.keys.tolist() == [k for k, _ in want] and run.offsets == [o for _, o in want]
                assert np.asarray(run).tolist() == run.offsets and np.asarray(run).dtype == np.uint64
                assert bytes(run) == b"".join(o.to_bytes(8, "little") for _, o in want) == run.offsets_bytes()
                for i, (k, _) in enumerate(want):
                    assert np.array_equal(np.asarray(run.block(i)), data(k))
            assert run.released
            del blocks
    s.check_integrity()
    assert s.stats().pinned == 0


def test_empty_and_missing_first() -> None:
    s = mr.Store(BB, 4 * BB)
    s.put(1, data(1))
    form: object
    for form in ([], b"", mr.BlockHashes([]), np.zeros((0, 16), np.uint8)):
        assert s.lookup_prefix(form) == []
        run = s.lookup_prefix_run(form)
        assert len(run) == 0 and run.offsets == [] and bytes(run) == b"" and np.asarray(run).shape == (0,)
    assert len(s.lookup_prefix_run([2, 1])) == 0  # a gap at the head ends the run at once
    with pytest.raises(IndexError):
        s.lookup_prefix_run([1]).block(1)
    for bad in (b"x" * 15, [-1], np.zeros((2, 3), np.uint8)):
        with pytest.raises(mr.InvalidArgument):
            s.lookup_prefix_run(bad)


def test_leases_hold_under_eviction_until_released() -> None:
    s = mr.Store(BB, 8 * BB)
    keys = list(range(1, 5))
    for k in keys:
        s.put(k, data(k))
    run = s.lookup_prefix_run(keys)
    blocks = s.lookup_prefix(keys[:2])
    offsets = run.offsets
    for k in range(100, 160):  # far more than the free slots: evicts everything unleased
        s.put(k, data(k))
        assert [s.slot_offset(x) for x in keys] == offsets
    kept = run.block(3)
    run.release()
    with pytest.raises(mr.InvalidArgument, match="released"):
        run.block(0)
    assert run.offsets == offsets  # still readable (it is a copy), no longer leased
    for k in range(200, 260):
        s.put(k, data(k))
    # the list's Blocks (keys 1, 2) and block(3) (key 4) kept theirs; key 3 went
    assert [s.contains(k) for k in keys] == [True, True, False, True]
    assert np.array_equal(np.asarray(kept), data(4)) and kept.offset == offsets[3]
    del blocks, kept
    for k in range(300, 360):
        s.put(k, data(k))
    assert not any(s.contains(k) for k in keys)
    s.check_integrity()


def test_ssd_blocks_are_promoted_into_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = mr.Store(BB, 4 * BB, ssd_path=tmp_path, ssd_bytes=64 * 8192, demotion_queue=256)
    for k in range(10):
        s.put(k, data(k))
    s.flush()
    assert s.tier_of(0) == "ssd"
    assert len(s.lookup_prefix_run([0, 1], promote=False)) == 0
    with s.lookup_prefix_run(mr.BlockHashes([8, 9, 0, 55])) as run:
        assert run.keys.tolist() == [8, 9, 0]
        assert run.offsets == [s.slot_offset(k) for k in (8, 9, 0)]
        assert np.array_equal(np.asarray(run.block(2)), data(0))


def test_commit_returns_the_leased_block_no_second_lookup() -> None:
    s = mr.Store(BB, 3 * BB)
    w = s.reserve(7)
    off = w.offset
    w.write(data(7))
    b = w.commit()
    assert b is not None and b.key == 7 and b.offset == off == s.slot_offset(7) and b.tier == "dram"
    assert np.array_equal(np.asarray(b), data(7))
    for k in range(10, 30):  # leased by the returned Block: never evicted meanwhile
        s.put(k, data(k))
    assert s.slot_offset(7) == off
    # callers that ignore the return keep working: the block is committed either way
    w2 = s.reserve(8)
    w2.write(data(8))
    w2.commit()
    assert s.contains(8) and s.get(8) is not None
    del b
    s.check_integrity()
