"""BlockCache: the metadata-only eviction model used by the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_rs as mr

POLICIES = ["lru", "s3fifo", "prefix"]


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_prefix_and_capacity(policy: str) -> None:
    c = mr.BlockCache(3, policy)
    assert c.capacity == 3 and len(c) == 0 and c.eviction == policy
    assert c.insert([1, 2]) == []
    assert c.lookup_prefix([1, 2, 3]) == 2
    assert c.lookup_prefix([2, 1]) == 2
    assert c.lookup_prefix([7, 1]) == 0
    evicted = c.insert([4, 5])
    assert len(evicted) == 1 and len(c) == 3
    assert all(not c.contains(k) for k in evicted)
    assert c.contains(5) and 5 in c
    assert c.evictions == 1


def test_big_keys_and_bad_input() -> None:
    c = mr.BlockCache(2)
    big = 2**128 - 1
    c.insert([big])
    assert c.contains(big)
    with pytest.raises(mr.InvalidArgument):
        c.insert([2**128])
    with pytest.raises(mr.InvalidArgument):
        mr.BlockCache(0)
    with pytest.raises(mr.InvalidArgument, match="eviction"):
        mr.BlockCache(4, "random")


def test_lru_drops_chain_heads_prefix_keeps_them() -> None:
    lru = mr.BlockCache(4, "lru")
    pre = mr.BlockCache(4, "prefix")
    for c in (lru, pre):
        c.insert([1, 2, 3, 4])
        c.insert([10, 11])
    assert lru.lookup_prefix([1, 2, 3, 4]) == 0  # LRU evicted the head first
    assert pre.lookup_prefix([1, 2, 3, 4]) == 2  # prefix-aware evicted the tail


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(POLICIES),
    st.integers(1, 6),
    st.lists(st.lists(st.integers(0, 12), max_size=5, unique=True), max_size=40),
)
def test_matches_a_set_model(policy: str, cap: int, requests: list[list[int]]) -> None:
    c = mr.BlockCache(cap, policy)
    model: set[int] = set()
    for keys in requests:
        run = 0
        for k in keys:
            if k not in model:
                break
            run += 1
        assert c.lookup_prefix(keys) == run
        evicted = set(c.insert(keys))
        universe = model | set(keys)
        assert evicted <= universe
        kept = universe - evicted
        assert all(c.contains(k) for k in kept)
        # a key evicted earlier in the same call may have been inserted again later in it
        back = {e for e in evicted if c.contains(e)}
        assert back <= set(keys)
        assert len(c) == len(kept) + len(back) <= cap
        model = kept | back
