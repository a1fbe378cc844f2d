"""The RFC standard rolling hash (XXH3-64, seed S): known answers and an independent reference."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

import mooncake_rs as mr
from mooncake_rs import InvalidArgument, Xxh3RollingHasher

# Computed independently with the `xxhash` PyPI package (xxh3_64_intdigest over
# struct.pack("<nI", block) for local hashes, struct.pack("<QQ", prev, local) to roll).
KNOWN = [
    (list(range(1, 13)), 4, 0, [0x6FC1EBD4F4D6EA31, 0x3A14937FD5340C7A, 0x829711B6D52F08EB]),
    (list(range(1, 13)), 4, 42, [0xCABC6CF291A3BA46, 0x1C4CB0B75E1705CE, 0xE7249E43E2BD2637]),
    (list(range(128)), 64, 0, [0xA6DCFFC376D6710F, 0x913780EB4BB7784F]),
]


@pytest.mark.parametrize("tokens,bs,seed,expected", KNOWN)
def test_known_answers(tokens, bs, seed, expected):
    h = Xxh3RollingHasher(bs, seed)
    assert h.hash(tokens) == expected
    assert h.hash(np.asarray(tokens, dtype=np.int64)) == expected
    assert h.hash(tokens + [1] * (bs - 1)) == expected  # a partial block gets no hash
    assert h.local_hashes(tokens)[0] == expected[0]  # seq[0] = local[0]
    assert h.hash(tokens[bs:], parent=expected[0]) == expected[1:]
    assert h.hash_many([tokens, tokens[:bs]]) == [expected, expected[:1]]
    assert (h.block_size, h.seed) == (bs, seed)


def _reference(xxhash, tokens, bs, seed):
    out, prev = [], None
    for i in range(len(tokens) // bs):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs]), seed)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), seed)
        out.append(prev)
    return out


def test_matches_the_xxhash_package_on_random_input():
    xxhash = pytest.importorskip("xxhash")
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 2, 3, 16, 64, 128])
        seed = rng.choice([0, 1, 2**64 - 1, rng.randrange(2**64)])
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 5 * bs + 3))]
        assert Xxh3RollingHasher(bs, seed).hash(tokens) == _reference(xxhash, tokens, bs, seed)


def test_bad_input():
    with pytest.raises(InvalidArgument):
        Xxh3RollingHasher(0)
    h = Xxh3RollingHasher(4)
    with pytest.raises(InvalidArgument):
        h.hash([1, 2, 3, -1])
    with pytest.raises(InvalidArgument):
        h.hash([1, 2, 3, 4], parent=-1)
    with pytest.raises(InvalidArgument):
        h.hash([1, 2, 3, 4], parent=2**64)
    with pytest.raises(InvalidArgument):
        h.hash_many([[1, 2, 3, 4], ["x"]])


def test_the_rfc_hash_is_a_prefix_hasher_algorithm():
    """``PrefixHasher(algorithm="xxh3-64-rfc")`` is the RFC chain (the standalone
    ``Xxh3RollingHasher``'s values), so everything that takes a PrefixHasher's hashes (the
    index, the conductor, BlockHashes) can run on the engines' standard hash."""
    import numpy as np

    toks = list(np.random.default_rng(3).integers(0, 2**31, 200))
    toks = [int(t) for t in toks]
    ours = mr.PrefixHasher(16, seed=11, algorithm="xxh3-64-rfc")
    assert ours.algorithm == "xxh3-64-rfc" and ours.root == 0
    want = mr.Xxh3RollingHasher(16, seed=11).hash(toks)
    assert ours.hash(toks) == want
    assert ours.hash_blocks(toks).tolist() == want
    assert ours.hash(toks[32:], parent=want[1]) == want[2:]
    with pytest.raises(mr.InvalidArgument, match="no extra key"):
        mr.PrefixHasher(16, extra=b"llama", algorithm="xxh3-64-rfc")
    with pytest.raises(mr.InvalidArgument, match="below 2\\^64"):
        ours.hash(toks, parent=1 << 64)
    with pytest.raises(mr.InvalidArgument, match="xxh3-64-rfc"):
        mr.PrefixHasher(16, algorithm="sha1")
