import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rs import InvalidArgument, PrefixHasher


def test_full_blocks_only():
    h = PrefixHasher(4)
    assert h.hash([1, 2, 3]) == []
    assert len(h.hash(list(range(9)))) == 2
    assert all(isinstance(x, int) and 0 <= x < 2**128 for x in h.hash(list(range(8))))


def test_pinned_values_match_rust_known_answer():
    # The same pinned values as rust/core/src/hash.rs: Python and Rust agree.
    assert PrefixHasher(4).hash([1, 2, 3, 4, 5, 6, 7, 8]) == [
        0x1B83325EB6A11C3AC5A1C780EF9B7B8C,
        0x0195D8BD8C921590B48C0EF73161423B,
    ]


def test_same_hashes_in_another_process():
    code = "from mooncake_rs import PrefixHasher; print(PrefixHasher(16, seed=7, extra=b'm').hash(list(range(64))))"
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    assert eval(out.stdout) == PrefixHasher(16, seed=7, extra=b"m").hash(list(range(64)))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint16, np.uint64])
def test_numpy_dtypes_equal_list(dtype):
    toks = list(range(1000, 1000 + 256))
    h = PrefixHasher(16, seed=3)
    assert h.hash(np.array(toks, dtype=dtype)) == h.hash(toks)


def test_buffer_protocol_and_tuples():
    import array

    toks = list(range(64))
    h = PrefixHasher(8)
    assert h.hash(array.array("I", toks)) == h.hash(toks)
    assert h.hash(tuple(toks)) == h.hash(toks)
    assert h.hash(memoryview(np.array(toks, dtype=np.uint32))) == h.hash(toks)
    # A slice at an odd offset is not 4-byte aligned: still read correctly.
    raw = np.zeros(4 * 64 + 1, dtype=np.uint8)
    raw[1:].view(np.uint8)[:] = np.array(toks, dtype="<u4").view(np.uint8)
    unaligned = np.frombuffer(raw.data, dtype=np.uint32, offset=1, count=64)
    assert unaligned.ctypes.data % 4 != 0
    assert h.hash(unaligned) == h.hash(toks)


def test_non_contiguous_array_is_rejected_with_advice():
    a = np.arange(64, dtype=np.int32)[::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        PrefixHasher(4).hash(a)


@pytest.mark.parametrize(
    "bad, match",
    [
        ([1, -1, 3, 4], "position 1"),
        ([2**32], "position 0"),
        ([1, "x"], "position 1"),
        (np.array([0.5, 1.0]), "integers"),
        (np.zeros((2, 4), dtype=np.int32), "1-D"),
        (np.array([1, -5], dtype=np.int64), "-5"),
        (np.array([2**40], dtype=np.int64), "outside"),
        ("abcd", "str"),
    ],
)
def test_bad_tokens(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        PrefixHasher(2).hash(bad)


def test_bad_constructor_and_parent():
    with pytest.raises(InvalidArgument):
        PrefixHasher(-3)
    with pytest.raises(InvalidArgument, match="algorithm"):
        PrefixHasher(4, algorithm="md5")
    with pytest.raises(InvalidArgument, match="outside"):
        PrefixHasher(4).hash([1, 2, 3, 4], parent=2**128)
    with pytest.raises(InvalidArgument, match="outside"):
        PrefixHasher(4).hash([1, 2, 3, 4], parent=-1)


def test_hash_many_matches_hash_and_names_the_bad_sequence():
    h = PrefixHasher(4, seed=1)
    seqs = [list(range(n)) for n in (0, 3, 4, 17)] + [np.arange(40, dtype=np.int32)]
    assert h.hash_many(seqs) == [h.hash(s) for s in seqs]
    with pytest.raises(InvalidArgument, match="sequence 1"):
        h.hash_many([[1, 2, 3, 4], [1, -2]])


def test_blake3_algorithm_differs_and_chains():
    a = PrefixHasher(4, algorithm="blake3")
    assert a.algorithm == "blake3"
    toks = list(range(16))
    assert a.hash(toks) != PrefixHasher(4).hash(toks)
    assert a.hash(toks) == a.hash(toks[:8]) + a.hash(toks[8:], parent=a.hash(toks[:8])[-1])


@settings(max_examples=200, deadline=None)
@given(
    bs=st.integers(1, 8),
    a_blocks=st.integers(0, 5),
    b=st.lists(st.integers(0, 2**32 - 1), max_size=50),
    seed=st.integers(0, 2**64 - 1),
    extra=st.one_of(st.none(), st.binary(max_size=8)),
)
def test_parent_continues_the_chain(bs, a_blocks, b, seed, extra):
    h = PrefixHasher(bs, seed=seed, extra=extra)
    a = [(i * 2654435761) % 2**32 for i in range(a_blocks * bs)]
    ha = h.hash(a)
    parent = ha[-1] if ha else None
    assert h.hash(a + b) == ha + h.hash(b, parent=parent)


@settings(max_examples=50, deadline=None)
@given(toks=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=40), i=st.integers(0, 7))
def test_changing_a_token_changes_its_block_and_all_after(toks, i):
    h = PrefixHasher(8)
    other = list(toks)
    other[i] = (other[i] + 1) % 2**32
    a, b = h.hash(toks), h.hash(other)
    assert all(x != y for x, y in zip(a, b))
