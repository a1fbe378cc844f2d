"""The one-call paths of a small key against the Python they replaced, as references:
``present_flags`` (a node's batch_is_exist) against ``[1 if k in table else 0 ...]``,
``all_nonempty_str`` (the client's key check) against the per-key test, a small
``put_value`` (padded in the Rust store) against ``put_from`` of the same bytes, and
``Store.get_head`` against a slice of the Block view ``Store.get`` returns."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mooncake_rs._core import Store, all_nonempty_str, present_flags
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.segment import ObjectSegment

MiB = 1 << 20


class StrKey(str):
    pass


def test_present_flags_match_the_dict_test_key_by_key():
    rng = random.Random(3)
    table = {f"k{i}": i for i in range(0, 500, 3)} | {7: "int key", StrKey("sub"): 1}
    pool = [f"k{i}" for i in range(500)] + [7, 8, "sub", StrKey("k3"), "", (1, 2)]
    for n in (0, 1, 2, 100, 400):
        keys = rng.choices(pool, k=n)
        assert present_flags(table, keys) == [1 if k in table else 0 for k in keys]
    with pytest.raises(TypeError):  # an unhashable key fails as `in` does
        present_flags(table, ["k0", [1]])


def test_all_nonempty_str_matches_the_per_key_check():
    cases = [[], ["a"], ["a", ""], ["a", None], ["a", b"b"], [StrKey("x"), "y"], [""], ["é" * 3, "k"], [1],
             ["k"] * 500 + [""], ["k"] * 500 + [StrKey("x")], ["k"] * 500, ["\ud800"], [str(i) for i in range(300)]]
    for keys in cases:
        # (a str subclass is False: the per-key check then makes it a plain str, the one
        # type the wire's encoder takes)
        assert all_nonempty_str(keys) == all(type(k) is str and k for k in keys), keys


def test_batch_exists_flags_match_batch_exists_and_keep_the_key_errors():
    with DistributedStore.embedded(16 * MiB, chunk_bytes=64 << 10) as s:
        keys = [f"e{i}" for i in range(60)]
        assert s.batch_put_values(keys[::2], [b"v" * (i + 1) for i in range(30)]) == [KeyStatus.OK] * 30
        ask = keys + ["nope"]
        assert s.batch_exists_flags(ask) == [int(b) for b in s.batch_exists(ask)] == [int(k in keys[::2]) for k in ask]
        for bad in ([""], ["ok", 5], [None]):
            with pytest.raises(InvalidArgument):
                s.batch_exists_flags(bad)
            with pytest.raises(InvalidArgument):
                s.batch_exists(bad)


@pytest.mark.parametrize("make", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8)])
def test_small_put_value_reads_back_as_put_from_of_the_same_bytes(make):
    seg = ObjectSegment(8 * MiB, chunk_bytes=64 << 10, small_bytes=4096)
    ref = ObjectSegment(8 * MiB, chunk_bytes=64 << 10, small_bytes=4096)
    rng = random.Random(5)
    # fill and empty the small class first, so the padded puts land in used slots
    for i in range(50):
        assert seg.put_value(f"old{i}", b"\xff" * 4096) == KeyStatus.OK
    assert all(seg.remove(f"old{i}") for i in range(50))
    for size in (1, 2, 127, 128, 129, 4095, 4096, 4097):
        raw = rng.randbytes(size)
        arr = np.frombuffer(raw, dtype=np.uint8)
        assert seg.put_value(f"s{size}", make(raw), pin=size == 128) == KeyStatus.OK
        assert ref.put_from(f"s{size}", [arr.ctypes.data], [size], pin=size == 128) == KeyStatus.OK
        assert seg.get_bytes(f"s{size}") == ref.get_bytes(f"s{size}") == raw
        assert seg.size_of(f"s{size}") == size
        out = np.zeros(4096 + size, dtype=np.uint8)  # a larger buffer: only the value's bytes change
        assert seg.get_into(f"s{size}", [out.ctypes.data], [out.size]) == size
        assert out[:size].tobytes() == raw and not out[size:].any()
        # put-if-absent: a second put of the key returns OK and changes nothing
        assert seg.put_value(f"s{size}", make(b"\x01" * size)) == KeyStatus.OK
        assert seg.get_bytes(f"s{size}") == raw
    assert seg.put_value("empty", b"") == KeyStatus.INVALID
    assert seg.exists_many(["s1", "empty", "s4096"]) == [1, 0, 1]


def test_get_head_matches_a_slice_of_the_block_view():
    store = Store(256, 64 * 4096)
    rng = random.Random(11)
    blocks = {k: rng.randbytes(256) for k in range(1, 20)}
    for k, b in blocks.items():
        assert store.put(k, b)
    for k, b in blocks.items():
        for n in (0, 1, 128, 255, 256):
            blk = store.get(k)
            with blk:
                want = bytes(memoryview(blk)[:n])
            assert store.get_head(k, n) == want == b[:n]
    assert store.get_head(999, 10) is None
    with pytest.raises(InvalidArgument):
        store.get_head(1, 257)


def _general_outcome(rb, n: int, rep, replicas: int) -> list[KeyStatus]:
    """What the many-node path makes of one node's answer (the reference)."""
    done, errors = [0] * n, [None] * n
    for i, st in zip(range(n), rep.values if rep is not None else [int(KeyStatus.RPC_FAILED)] * n):
        if st == 0:
            done[i] += 1
        elif errors[i] is None:
            errors[i] = KeyStatus(st)
    return rb._outcome(done, errors, replicas)


def test_one_node_small_put_maps_the_answer_as_the_many_node_path_does():
    from mooncake_rs.pool.protocol import Answer, PutInline
    from mooncake_rs.pool.remote import RemoteBackend

    class OneNode:
        answer = None

        def live(self):
            return ["one"]

        def ask_one(self, node, make, **fields):
            assert make is PutInline and fields["keys"] == keys
            return self.answer

    rng = random.Random(13)
    codes = [0, 0, 0, int(KeyStatus.NO_SPACE), int(KeyStatus.INVALID)]
    for trial in range(200):
        n = rng.randint(1, 6)
        keys = [f"p{trial}-{i}" for i in range(n)]
        vals = [rng.choice(codes) for _ in range(rng.randint(0, n))]  # (a short answer too)
        replicas = rng.choice([1, 1, 2])
        fast, ref = object.__new__(RemoteBackend), object.__new__(RemoteBackend)
        fast.nodes = OneNode()
        fast.nodes.answer = None if trial % 17 == 0 else Answer(1, vals)
        fast.under_replicated = ref.under_replicated = 0
        got = fast.put_values(keys, [b"v"] * n, replicas, False)
        assert got == _general_outcome(ref, n, fast.nodes.answer, replicas)
        assert fast.under_replicated == ref.under_replicated


def _keys_msgpack(keys: list[str]) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(keys)


def _exists_reference(seg: ObjectSegment, keys: list[str]) -> list[int]:
    return [1 if k in seg._objects else 0 for k in keys]


def _check_held_keys(seg: ObjectSegment, rng: random.Random, universe: list[str]) -> None:
    import msgspec

    for n in (0, 1, 17, 100, len(universe)):
        keys = rng.choices(universe, k=n)
        got = msgspec.msgpack.decode(seg.exists_encoded(_keys_msgpack(keys)))
        assert got == _exists_reference(seg, keys) == seg.exists_many(keys)
    assert len(seg._held) == len(seg._objects)


def test_held_keys_answer_as_the_object_table_through_puts_evictions_removals_and_recovery(tmp_path):
    """The node's Rust key set (``exists_encoded``, a batch_is_exist answered from the
    request's msgpack) against the object table itself after each kind of change: small and
    large puts, put-if-absent, reserve + commit (committed, aborted), removals, evictions
    of a full class (reaped), remove_all, and a restart that recovers from the SSD tier."""
    import gc

    from mooncake_rs.pool.objects import Reservation

    rng = random.Random(29)
    universe = [f"h{i}" for i in range(400)] + ["é-key", "x" * 300, "absent"]

    def segment() -> ObjectSegment:
        return ObjectSegment(8 * MiB, chunk_bytes=64 << 10, small_bytes=4096, ssd_path=str(tmp_path),
                             ssd_bytes=32 * MiB)

    def churn() -> set[str]:
        seg = segment()
        for step in range(12):
            for _ in range(60):
                k = rng.choice(universe[:-1])
                size = rng.choice([1, 100, 4096, 70_000])
                arr = np.full(size, step, np.uint8)
                if rng.random() < 0.5:
                    seg.put_value(k, arr.tobytes())
                else:
                    seg.put_from(k, [arr.ctypes.data], [size])
            ks = rng.sample(universe[:-1], 8)
            res = [r for r in seg.reserve_many(ks, [rng.choice([10, 100_000]) for _ in ks])
                   if isinstance(r, Reservation)]
            for r in res[::2]:
                seg.abort(r)
            seg.commit_many(res[1::2])
            for k in rng.sample(universe, 20):
                seg.remove(k)
            seg.reap_evicted()
            _check_held_keys(seg, rng, universe)
            if step == 8:
                seg.remove_all()
                _check_held_keys(seg, rng, universe)
        seg.flush()
        return set(seg._objects)

    held = churn()
    gc.collect()  # (the SSD tier has one owner: the first segment's stores are closed by now)
    back = segment()
    assert 0 < len(back) and set(back._objects) <= held
    _check_held_keys(back, rng, universe)


def test_exists_encoded_refuses_what_is_no_key_list():
    seg = ObjectSegment(8 * MiB, chunk_bytes=64 << 10, small_bytes=4096)
    for bad in (b"", b"\xa1k", b"\x92\xa1k\x05", b"\x91\xa1\xff", b"\x91\xa1k\xc0", b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(InvalidArgument, match="exists: "):
            seg.exists_encoded(bad)
    assert seg.exists_encoded(b"\x90") == b"\x90"
