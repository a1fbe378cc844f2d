"""The tiered Store from Python: views and leases, pins, StoreFull, the SSD tier,
recovery after SIGKILL, corruption, I/O errors, threads, and a stateful model test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mooncake_rs as mr

BB = 4096


def data(key: int, salt: int = 0, n: int = BB) -> np.ndarray:
    rng = np.random.default_rng(key * 1000 + salt)
    return rng.integers(0, 256, n, dtype=np.uint8)


def test_put_get_views_and_content_addressing() -> None:
    s = mr.Store(BB, 16 * BB)
    assert s.put(1, data(1)) is True
    assert s.put(1, data(1, 5)) is False
    b = s.get(1)
    assert b is not None and b.key == 1 and b.tier == "dram" and len(b) == BB
    arr = np.asarray(b)
    assert not arr.flags.writeable
    assert np.array_equal(arr, data(1))
    assert memoryview(b).readonly
    assert s.get(2) is None
    out = np.zeros(BB, np.uint8)
    assert s.get_into(1, out) and np.array_equal(out, data(1))
    assert not s.get_into(2, out)
    assert s.put(3, bytes(data(3))) is True  # bytes work too
    assert 3 in s and s.contains(3) and s.tier_of(3) == "dram"
    with pytest.raises(mr.InvalidArgument, match="block_bytes"):
        s.put(4, b"short")
    with pytest.raises(mr.InvalidArgument):
        s.put(-1, data(1))
    with pytest.raises(mr.InvalidArgument):
        mr.Store(BB, 16 * BB, eviction="nope")
    with pytest.raises(mr.InvalidArgument):
        mr.Store(BB, 10)
    s.check_integrity()


def test_batch_calls() -> None:
    s = mr.Store(1024, 64 * 4096, eviction="prefix")
    keys = list(range(10, 20))
    rows = np.stack([data(k, n=1024) for k in keys])
    assert s.put_many(keys, rows) == [True] * 10
    assert s.put_many(keys[:2], [rows[0], rows[1]]) == [False, False]
    got = s.get_many(keys + [99])
    assert got[-1] is None
    for k, b in zip(keys, got[:-1]):
        assert b is not None and np.array_equal(np.asarray(b), data(k, n=1024))
    out = np.zeros((11, 1024), np.uint8)
    assert s.get_many_into(keys + [99], out) == [True] * 10 + [False]
    assert np.array_equal(out[:10], rows)
    with pytest.raises(mr.InvalidArgument):
        s.put_many(keys, rows[:3])


def test_lease_blocks_eviction_store_full_nothing_lost() -> None:
    s = mr.Store(BB, 2 * BB)
    s.put(1, data(1))
    s.put(2, data(2))
    with s.get(1) as b1:
        view = np.asarray(b1)
        s.pin(2)
        with pytest.raises(mr.StoreFull):
            s.put(3, data(3))
        with pytest.raises(mr.StoreFull):
            s.reserve(3)
        assert s.contains(1) and s.contains(2)
        assert np.array_equal(view, data(1))
    # the with block released the Block, but the array still holds the lease
    assert b1.released
    with pytest.raises(mr.StoreFull):
        s.put(3, data(3))
    del view
    assert s.put(3, data(3))
    assert not s.contains(1) and s.contains(2)
    assert s.unpin(2) == 0
    with pytest.raises(mr.InvalidArgument):
        s.unpin(2)
    with pytest.raises(mr.BlockNotFound):
        s.pin(12345)
    with pytest.raises(BufferError):
        memoryview(b1)
    s.check_integrity()


def test_writable_block_commit_and_drop() -> None:
    s = mr.Store(BB, 4 * BB)
    w = s.reserve(5)
    w.write(data(5)[: BB // 2])
    w.write(data(5)[BB // 2 :], offset=BB // 2)
    assert not s.contains(5), "readers never see a block before its commit"
    m = memoryview(w)
    with pytest.raises(mr.InvalidArgument, match="release"):
        w.commit()
    m.release()
    committed = w.commit()
    assert isinstance(committed, mr.Block) and w.done and committed.offset == s.slot_offset(5)
    del committed
    assert np.array_equal(np.asarray(s.get(5)), data(5))
    with pytest.raises(mr.InvalidArgument):
        w.commit()
    with pytest.raises(mr.InvalidArgument):
        w.write(b"x" * 10, offset=BB - 5)
    # dropped uncommitted: the slot comes back
    for _ in range(10):
        w2 = s.reserve(6)
        np.asarray(w2)[:] = 1
        del w2
    with s.reserve(7) as w3:
        w3.write(data(7))
    assert not s.contains(7) and s.stats().blocks_dram == 1
    s.check_integrity()
    # a second writer of the same key loses
    a, b = s.reserve(8), s.reserve(8)
    a.write(data(8))
    b.write(data(8, 1))
    assert a.commit() and not b.commit()
    assert np.array_equal(np.asarray(s.get(8)), data(8))


def test_remove_events_and_region() -> None:
    s = mr.Store(BB, 2 * BB, shared_memory=True)
    r = s.region()
    assert r.shm_name is not None and r.shm_name.startswith("/mooncake_rs.")
    assert r.length >= 2 * BB and r.block_bytes == BB and r.slots == 2
    s.put(1, data(1))
    off = s.slot_offset(1)
    assert off is not None and off % 4096 == 0
    view = s.get(1)
    assert s.remove(1) and not s.remove(1)
    assert view is not None and np.array_equal(np.asarray(view), data(1)), "a live view keeps its bytes"
    s.put(2, data(2))
    s.put(3, data(3))
    s.put(4, data(4))  # 1's slot is still leased by the view: 2, then 3, are evicted
    kinds = [(e.kind, e.key, e.tier) for e in s.drain_events()]
    assert kinds == [
        ("stored", 1, "dram"),
        ("removed", 1, "dram"),
        ("stored", 2, "dram"),
        ("evicted", 2, "dram"),
        ("stored", 3, "dram"),
        ("evicted", 3, "dram"),
        ("stored", 4, "dram"),
    ]
    assert s.drain_events() == []
    assert s.region().shm_name == r.shm_name
    assert mr.Store(BB, 2 * BB).region().shm_name is None


def test_ssd_demotion_promotion_direct_and_stats(tmp_path: Path) -> None:
    s = mr.Store(BB, 2 * BB, ssd_path=str(tmp_path / "ssd"), ssd_bytes=64 * 2 * BB, demotion_queue=256)
    for k in range(8):
        s.put(k, data(k))
    s.flush()
    st = s.stats()
    assert st.evictions_dram == 6 and st.demotions + st.demotions_dropped == 6
    demoted = [k for k in range(8) if s.tier_of(k) == "ssd"]
    assert len(demoted) == st.demotions > 0
    k = demoted[0]
    b = s.get(k, promote=False)
    assert b is not None and b.tier == "ssd" and np.array_equal(np.asarray(b), data(k))
    assert s.tier_of(k) == "ssd"
    b = s.get(k)
    assert b is not None and b.tier == "dram" and np.array_equal(np.asarray(b), data(k))
    assert s.tier_of(k) == "dram" and s.stats().promotions == 1
    out = np.zeros(BB, np.uint8)
    k2 = demoted[1]
    assert s.get_into(k2, out, promote=False) and np.array_equal(out, data(k2))
    assert any(e.kind == "demoted" and e.tier == "ssd" for e in s.drain_events())
    assert s.remove(k2) and s.tier_of(k2) is None
    st = s.stats()
    assert st.hits_ssd >= 3 and st.blocks_ssd >= 1 and st.slots_ssd > 0


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    s = mr.Store(BB, BB, ssd_path=str(d), ssd_bytes=16 * 2 * BB)
    for k in range(5):
        s.put(k, data(k))
    s.flush()
    assert s.stats().demotions == 4
    # flip a byte inside one slot's data, while the store is open
    f = d / "blocks.slots"
    raw = bytearray(f.read_bytes())
    raw[4096 + 64 + 100] ^= 0x01
    f.write_bytes(bytes(raw))
    served = {k: s.get(k, promote=False) for k in range(4)}
    assert sum(b is None for b in served.values()) == 1
    for k, b in served.items():
        if b is not None:
            assert np.array_equal(np.asarray(b), data(k))
    assert s.stats().corrupt_dropped == 1
    del s, served
    # and at reopen (a second flip, in another slot)
    raw = bytearray(f.read_bytes())
    raw[4096 + 2 * 8192 + 64 + 5] ^= 0xFF
    f.write_bytes(bytes(raw))
    s2 = mr.Store(BB, BB, ssd_path=str(d), ssd_bytes=16 * 2 * BB)
    st = s2.stats()
    assert st.corrupt_dropped == 2 and st.recovered == 2
    for k in range(4):
        b = s2.get(k)
        assert b is None or np.array_equal(np.asarray(b), data(k))


CHILD = textwrap.dedent(
    """
    import sys, numpy as np, mooncake_rs as mr
    path, n = sys.argv[1], int(sys.argv[2])
    s = mr.Store(4096, 4096 * 2, ssd_path=path, ssd_bytes=(n + 8) * 8192, demotion_queue=1024)
    for k in range(n):
        s.put(k, np.random.default_rng(k * 1000).integers(0, 256, 4096, dtype=np.uint8))
        if k == 40:
            s.flush()
            print("flushed", flush=True)
    s.flush()
    print("done", flush=True)
    """
)


def test_sigkill_mid_fill_then_reopen_serves_only_intact(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    n = 4000
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(d), str(n)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "flushed"
    time.sleep(0.05)  # let it get further into the fill
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    s = mr.Store(BB, 2 * BB, ssd_path=str(d), ssd_bytes=(n + 8) * 8192)
    st = s.stats()
    found = 0
    for k in range(n):
        b = s.get(k, promote=False)
        if b is not None:
            assert np.array_equal(np.asarray(b), data(k)), f"block {k} differs"
            found += 1
    # everything flushed before the kill (blocks 0..38 were demoted by then) survives
    assert all(s.contains(k) for k in range(39))
    assert found == st.recovered >= 39
    assert st.recovered < n


def test_unwritable_path_is_store_io_error() -> None:
    with pytest.raises(mr.StoreIOError):
        mr.Store(BB, 4 * BB, ssd_path="/proc/mooncake_rs_test/ssd", ssd_bytes=1 << 20)
    with pytest.raises(mr.InvalidArgument):
        mr.Store(BB, 4 * BB, ssd_path=tempfile.gettempdir(), ssd_bytes=0)


@pytest.fixture
def tiny_tmpfs():
    d = tempfile.mkdtemp(prefix="mooncake_tmpfs_")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield Path(d)
    finally:
        subprocess.run(["umount", d], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def test_full_disk_at_open_and_on_flush_dram_keeps_serving(tiny_tmpfs: Path) -> None:
    with pytest.raises(mr.StoreIOError, match="free"):
        mr.Store(BB, 4 * BB, ssd_path=str(tiny_tmpfs / "big"), ssd_bytes=4 << 20)
    s = mr.Store(BB, 2 * BB, ssd_path=str(tiny_tmpfs / "ssd"), ssd_bytes=24 * 8192)
    # fill the filesystem so the sparse slot file cannot grow
    filler = tiny_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\1" * 4096) > 0:
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    for k in range(12):
        s.put(k, data(k))
    with pytest.raises(mr.StoreIOError):
        s.flush()
    assert s.stats().demotion_failures > 0
    # DRAM keeps serving
    for k in (10, 11):
        b = s.get(k)
        assert b is not None and np.array_equal(np.asarray(b), data(k))
    assert s.put(100, data(100)) and s.get(100) is not None
    with pytest.raises(mr.StoreIOError):
        s.flush()  # that put's eviction failed to demote too
    # with space again, demotion works again
    filler.unlink()
    before = s.stats().demotions
    s.put(101, data(101))
    s.flush()
    assert s.stats().demotions == before + 1
    del s


def test_threads_never_see_other_bytes() -> None:
    s = mr.Store(BB, 32 * BB, eviction="s3fifo")
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(1500):
            k = (i * 7 + t) % 100
            try:
                s.put(k, data(k))
            except mr.StoreFull:
                pass
            b = s.get((k * 3) % 100)
            if b is not None and not np.array_equal(np.asarray(b), data((k * 3) % 100)):
                errors.append(f"key {(k * 3) % 100}")
            if i % 50 == 0:
                s.remove(k)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    s.check_integrity()


class StoreModel(RuleBasedStateMachine):
    """Every get returns exactly what was put, or None; never other bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.store = mr.Store(256, 4 * 4096, eviction="prefix")
        self.model: dict[int, bytes] = {}
        self.views: list[tuple[int, mr.Block]] = []

    @rule(k=st.integers(0, 9), salt=st.integers(0, 2))
    def put(self, k: int, salt: int) -> None:
        d = bytes(data(k, salt, 256))
        try:
            stored = self.store.put(k, d)
        except mr.StoreFull:
            assert len(self.views) >= 4 - 0
            return
        if stored:
            self.model[k] = d
        else:
            assert self.store.contains(k)

    @rule(k=st.integers(0, 9), keep=st.booleans())
    def get(self, k: int, keep: bool) -> None:
        b = self.store.get(k)
        if b is None:
            self.model.pop(k, None)  # evicted
            return
        assert k in self.model and b.tobytes() == self.model[k]
        if keep and len(self.views) < 3:
            self.views.append((k, b))

    @rule(k=st.integers(0, 9))
    def remove(self, k: int) -> None:
        # remove() says whether the store held k; the model may still list a k the store
        # evicted, so what the store held is read first and the model only bounds it
        held = self.store.contains(k)
        assert held <= (k in self.model), "the store holds a key that was never put"
        assert self.store.remove(k) is held
        self.model.pop(k, None)
        assert not self.store.contains(k)

    @precondition(lambda self: self.views)
    @rule()
    def drop_view(self) -> None:
        self.views.pop(0)

    @invariant()
    def views_never_change(self) -> None:
        for k, b in self.views:
            got = b.tobytes()
            assert any(got == bytes(data(k, salt, 256)) for salt in range(3))

    @invariant()
    def stored_bytes_match(self) -> None:
        for k in list(self.model):
            b = self.store.get_into(k, out := bytearray(256))
            if b:
                assert bytes(out) == self.model[k]
            else:
                del self.model[k]

    def teardown(self) -> None:
        self.views.clear()
        self.store.check_integrity()


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
