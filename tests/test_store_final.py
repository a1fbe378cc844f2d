"""Store data plane (issue 11): ``lookup_prefix`` (list or 16-byte-key buffers),
``Block.offset``, ``WritableBlock.commit()`` returning the leased Block; and the store
defences of issue 17: no deadlock between a large ``write()`` and another thread on the
same block, ``remove()`` final across threads and restarts, one owner per SSD tier file
(two processes), damaged tier headers, ``ssd_path=""``, zero-length writes, remove of a
pinned block."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import mooncake_rs as mr

BB = 4096


def data(key: int, n: int = BB) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, n, dtype=np.uint8)


def key_buffer(keys: list[int]) -> np.ndarray:
    return np.frombuffer(b"".join(k.to_bytes(16, "little") for k in keys), np.uint8).reshape(-1, 16)


def reference_prefix(s: mr.Store, keys: list[int]) -> list[int]:
    out = []
    for k in keys:
        if not s.contains(k):
            break
        out.append(k)
    return out


def test_lookup_prefix_matches_reference_and_leases() -> None:
    s = mr.Store(BB, 16 * BB)
    big = [(1 << 127) + 3, 2**128 - 1]
    held = [5, 6, 7, *big, 9]
    for k in held:
        s.put(k, data(k % 1000))
    rng = np.random.default_rng(0)
    for _ in range(200):
        keys = [int(x) for x in rng.choice([5, 6, 7, 8, 9, *big], size=int(rng.integers(0, 7)))]
        want = reference_prefix(s, keys)
        for form in (keys, key_buffer(keys), key_buffer(keys).tobytes()):
            got = s.lookup_prefix(form)
            assert [b.key for b in got] == want
            for b in got:
                assert b.tier == "dram" and b.offset == s.slot_offset(b.key)
                assert np.array_equal(np.asarray(b), data(b.key % 1000))
            del got
    # leased: filling the store evicts other blocks, never the leased run
    run = s.lookup_prefix([5, 6])
    for k in range(100, 140):
        s.put(k, data(k))
    assert s.contains(5) and s.contains(6)
    run[0].release()
    with pytest.raises(mr.InvalidArgument, match="released"):
        run[0].offset
    del run
    s.check_integrity()


def test_lookup_prefix_bad_keys() -> None:
    s = mr.Store(BB, 4 * BB)
    s.put(2, data(2))
    # an int64 array is int keys (one per item), never reinterpreted as raw key bytes
    assert [b.key for b in s.lookup_prefix(np.array([2, 3], dtype=np.int64))] == [2]
    with pytest.raises(mr.InvalidArgument):
        s.lookup_prefix(np.array([-1], dtype=np.int64))
    with pytest.raises(mr.InvalidArgument, match="whole number"):
        s.lookup_prefix(b"x" * 17)
    with pytest.raises(mr.InvalidArgument):
        s.lookup_prefix([-1])
    assert s.lookup_prefix([]) == [] and s.lookup_prefix(b"") == []
    # the other batch calls take key buffers too
    s.remove(2)
    s.put_many(key_buffer([1, 2]), np.stack([data(1), data(2)]))
    out = np.zeros((2, BB), np.uint8)
    assert s.get_many_into(key_buffer([1, 2]), out) == [True, True]
    assert np.array_equal(out[1], data(2))


def test_lookup_prefix_promotes_from_ssd(tmp_path: Path) -> None:
    s = mr.Store(BB, 4 * BB, ssd_path=tmp_path, ssd_bytes=64 * 8192, demotion_queue=256)
    for k in range(10):
        s.put(k, data(k))
    s.flush()
    assert s.tier_of(0) == "ssd"
    assert s.lookup_prefix([0, 1], promote=False) == []
    got = s.lookup_prefix([8, 9, 0, 1, 55])
    assert [b.key for b in got] == [8, 9, 0, 1]
    assert all(b.tier == "dram" and b.offset is not None for b in got)
    assert s.tier_of(0) == "dram" and np.array_equal(np.asarray(got[2]), data(0))
    del got


def test_commit_returns_leased_block() -> None:
    s = mr.Store(BB, 2 * BB)
    w = s.reserve(1)
    off = w.offset
    w.write(data(1))
    b = w.commit()
    assert isinstance(b, mr.Block) and b.key == 1 and b.offset == off == s.slot_offset(1)
    assert np.array_equal(np.asarray(b), data(1))
    # leased: not evicted by later puts into the other slot
    for k in range(10, 20):
        s.put(k, data(k))
    assert s.contains(1)
    loser = s.reserve(1)
    assert loser.commit() is None and loser.done
    del b
    s.check_integrity()


def test_block_offset_of_ssd_copy_is_none(tmp_path: Path) -> None:
    s = mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=16 * 8192)
    for k in range(6):
        s.put(k, data(k))
    s.flush()
    b = s.get(0, promote=False)
    assert b is not None and b.tier == "ssd" and b.offset is None


def run_bounded(target, n_threads: int, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Runs target(i) on n threads; fails on a hang or on any exception in a thread."""
    failures: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    ts = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "deadlock: a thread did not finish"
    assert not failures, failures


@pytest.mark.parametrize("poke", ["offset", "done", "memoryview", "commit", "abort", "repr"])
def test_large_write_does_not_deadlock_with_another_thread(poke: str) -> None:
    """Issue 17 #3: write() of >= 64 KiB releases the GIL; it must not hold the block's
    lock while it does, or a thread touching the same block hangs the interpreter. Nor may
    a refusal (commit/abort while a write runs) build its exception under that lock: the
    first error of a process looks the exception classes up through a once-cell that
    releases the GIL, and the writer, taking the GIL then, waited for the lock forever
    (seen about once in ten runs under load before the fix). Run in a child process, so a
    regression fails by timeout instead of hanging the suite."""
    code = textwrap.dedent(f"""
        import threading, numpy as np, mooncake_rs as mr
        s = mr.Store(1 << 20, 8 << 20)
        src = np.ones(1 << 20, np.uint8)
        for round in range(30):
            w = s.reserve(round)
            stop = threading.Event()
            def writer():
                for _ in range(20):
                    w.write(src)
                stop.set()
            def poker():
                while not stop.is_set():
                    try:
                        if {poke!r} == "offset": w.offset
                        elif {poke!r} == "done": w.done
                        elif {poke!r} == "memoryview": memoryview(w).release()
                        elif {poke!r} == "commit": w.commit(); stop.set()
                        elif {poke!r} == "abort": w.abort(); stop.set()
                        else: repr(w)
                    except mr.InvalidArgument:
                        pass  # refused while a write runs, or done: fine, never a hang
            ts = [threading.Thread(target=f) for f in (writer, poker)]
            [t.start() for t in ts]
            for t in ts:
                t.join()
            if not w.done:
                w.abort()
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


def test_commit_refused_while_write_runs() -> None:
    s = mr.Store(1 << 20, 4 << 20)
    src = np.ones(1 << 20, np.uint8)
    w = s.reserve(1)
    refused = 0
    done = threading.Event()

    def writer(_: int) -> None:
        for _ in range(50):
            w.write(src)
        done.set()

    def committer(_: int) -> None:
        nonlocal refused
        while not done.is_set():
            try:
                w.commit()
                return
            except mr.InvalidArgument as e:
                if "write()" in str(e):
                    refused += 1
                elif "already" not in str(e):
                    raise

    run_bounded(lambda i: writer(i) if i == 0 else committer(i), 2)
    # whichever won, the store is consistent and a committed block holds the bytes
    if s.contains(1):
        assert np.array_equal(np.asarray(s.get(1)), src)
    s.check_integrity()


def test_remove_final_under_demotion_and_promotion(tmp_path: Path) -> None:
    """Issue 17 #5: a 2-slot DRAM tier demotes constantly while readers promote; a key
    its only writer removed never comes back, then or after flush + reopen."""
    s = mr.Store(BB, 4 * BB, ssd_path=tmp_path, ssd_bytes=128 * 8192, demotion_queue=16)
    stop = threading.Event()
    removed: list[set[int]] = [set(), set()]
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            k = int(rng.integers(0, 400))
            try:
                b = s.get(k)
            except mr.StoreFull:
                continue
            if b is not None and not np.array_equal(np.asarray(b), data(k)):
                errors.append(f"wrong bytes for {k}")
            del b

    def writer(w: int) -> None:
        for i in range(450):
            k = w * 200 + i % 200
            try:
                s.put(k, data(k))
                if i % 3 == 0:
                    s.get(k)
            except mr.StoreFull:
                pass  # every slot leased by the readers for a moment
            if i >= 300:
                s.remove(k)
                if s.contains(k):
                    errors.append(f"{k} present right after remove")
                removed[w].add(k)

    readers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
    for t in readers:
        t.start()
    run_bounded(writer, 2, timeout=120)
    stop.set()
    for t in readers:
        t.join(10)
    s.flush()
    gone = removed[0] | removed[1]
    assert errors == []
    assert not [k for k in gone if s.contains(k) or s.get(k) is not None]
    del s
    s2 = mr.Store(BB, 4 * BB, ssd_path=tmp_path, ssd_bytes=128 * 8192)
    assert not [k for k in gone if s2.contains(k)], "removed keys recovered after reopen"


def test_remove_durable_across_reopen(tmp_path: Path) -> None:
    s = mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=64 * 8192, demotion_queue=256)
    for k in range(20):
        s.put(k, data(k))
    s.flush()
    for k in range(10):
        assert s.remove(k)
    s.flush()
    del s
    s = mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=64 * 8192)
    assert [k for k in range(10) if s.contains(k)] == []
    assert all(s.contains(k) for k in range(10, 18))
    assert s.put(3, data(3)), "put again after remove"
    for k in (100, 101):  # push it out of the 2-slot DRAM tier onto SSD
        s.put(k, data(k))
    s.flush()
    del s
    s = mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=64 * 8192)
    b = s.get(3)
    assert b is not None and np.array_equal(np.asarray(b), data(3))


def test_second_process_on_one_tier_file_is_refused(tmp_path: Path) -> None:
    s = mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=16 * 8192)
    for k in range(8):
        s.put(k, data(k))
    s.flush()
    code = textwrap.dedent(f"""
        import mooncake_rs as mr
        try:
            mr.Store({BB}, {2 * BB}, ssd_path={str(tmp_path)!r}, ssd_bytes={16 * 8192})
        except mr.StoreIOError as e:
            print("refused:", e)
        else:
            print("opened")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "refused:" in p.stdout and "in use by another Store" in p.stdout, p.stdout + p.stderr
    with pytest.raises(mr.StoreIOError, match="in use"):
        mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=16 * 8192)  # same process, too
    # the first store's data is intact
    assert all(s.contains(k) for k in range(8))
    b = s.get(0)
    assert b is not None and np.array_equal(np.asarray(b), data(0))
    del b, s
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "opened" in p.stdout, p.stdout + p.stderr


def test_damaged_tier_header_is_named(tmp_path: Path) -> None:
    del_ = mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=16 * 8192)
    del del_
    f = tmp_path / "blocks.slots"
    raw = bytearray(f.read_bytes())
    raw[9] ^= 0x04  # one bit of block_bytes
    f.write_bytes(bytes(raw))
    with pytest.raises(mr.StoreIOError, match="damaged"):
        mr.Store(BB, 2 * BB, ssd_path=tmp_path, ssd_bytes=16 * 8192)


def test_empty_ssd_path_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(mr.InvalidArgument, match="empty"):
        mr.Store(BB, 2 * BB, ssd_path="", ssd_bytes=16 * 8192)
    assert list(tmp_path.iterdir()) == [], "nothing written into the current directory"


def test_zero_length_write_is_bounds_checked() -> None:
    s = mr.Store(BB, 2 * BB)
    w = s.reserve(1)
    w.write(b"", offset=BB)  # empty, at the end: fine
    with pytest.raises(mr.InvalidArgument, match="do not fit"):
        w.write(b"", offset=BB + 1)
    with pytest.raises(mr.InvalidArgument):
        s.get_many_into([], bytearray(1))
    with pytest.raises(mr.InvalidArgument):
        s.put_many([], b"x")


def test_remove_of_pinned_block_is_refused() -> None:
    s = mr.Store(BB, 2 * BB)
    s.put(1, data(1))
    assert s.pin(1) == 1
    with pytest.raises(mr.InvalidArgument, match="pinned"):
        s.remove(1)
    assert s.contains(1)
    assert s.unpin(1) == 0, "the pinner's unpin still works"
    assert s.remove(1) and not s.contains(1)
