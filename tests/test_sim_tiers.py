"""The store's two tiers in the simulator (sim/tiers.py) against the conductor's index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rs import BlockCache, Conductor, ConductorConfig
from mooncake_rs.sim.tiers import prefix_runs, split_runs, store_tiered


def _check(conductor, dram, ssd, inst, keys):
    idx = conductor.index
    idx.check_integrity()
    for k in keys:
        held = set(idx.holders(k))
        assert not (k in dram and k in ssd), f"{k} in both tiers"
        assert ((inst, "dram") in held) == (k in dram)
        assert ((inst, "ssd") in held) == (k in ssd)
    assert len(dram) <= dram.capacity and len(ssd) <= ssd.capacity


@settings(max_examples=80, deadline=None)
@given(
    dram_cap=st.integers(1, 8),
    ssd_big=st.booleans(),
    eviction=st.sampled_from(["lru", "s3fifo", "prefix"]),
    chains=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=10), min_size=1, max_size=25),
)
def test_tiers_stay_disjoint_equal_the_index_and_lose_nothing_with_room(dram_cap, ssd_big, eviction, chains):
    c = Conductor(ConductorConfig())
    c.add_prefill(0)
    dram = BlockCache(dram_cap, eviction)
    ssd = BlockCache(64 if ssd_big else 3, eviction)
    seen: set[int] = set()
    for chain in chains:
        chain = list(dict.fromkeys(chain))  # a prompt's blocks are distinct
        runs = prefix_runs(dram, ssd, chain)
        n = sum(b for b, _ in runs)
        d, s = split_runs(runs, 0, n)
        assert d + s == n and all(k in dram or k in ssd for k in chain[:n])
        known = seen | set(chain)
        in_dram, in_ssd = {k for k in known if k in dram}, {k for k in known if k in ssd}
        demoted = store_tiered(c, dram, ssd, 0, chain)
        # every block new in SSD was written there, and only blocks that left DRAM were
        new_in_ssd = {k for k in known if k in ssd} - in_ssd
        left_dram = {k for k in in_dram | set(chain) if k not in dram}
        assert len(new_in_ssd) <= demoted <= len(left_dram), (demoted, new_in_ssd, left_dram)
        seen.update(chain)
        _check(c, dram, ssd, 0, seen)
        if ssd_big:
            # SSD has room for every key: what DRAM evicts is demoted, never lost
            assert all(k in dram or k in ssd for k in seen)


def test_split_runs_counts_tiers_in_a_range():
    runs = [(3, 0), (2, 1), (4, 0)]  # positions 0-2 dram, 3-4 ssd, 5-8 dram
    assert split_runs(runs, 0, 9) == (7, 2)
    assert split_runs(runs, 2, 6) == (2, 2)
    assert split_runs(runs, 3, 5) == (0, 2)
    assert split_runs(runs, 9, 12) == (0, 0)


def test_without_ssd_evicted_blocks_are_gone():
    c = Conductor(ConductorConfig())
    c.add_prefill(0)
    dram = BlockCache(2, "lru")
    assert store_tiered(c, dram, None, 0, [1, 2]) == 0
    assert store_tiered(c, dram, None, 0, [3, 4]) == 0
    assert c.index.holders(1) == [] and set(c.index.holders(3)) == {(0, "dram")}
    assert prefix_runs(dram, None, [3, 4, 5]) == [(2, 0)]


def test_a_block_evicted_twice_by_one_chain_is_demoted_once():
    c = Conductor(ConductorConfig())
    c.add_prefill(0)
    dram, ssd = BlockCache(2, "lru"), BlockCache(16, "lru")
    store_tiered(c, dram, ssd, 0, [9])  # 9 is in DRAM, the oldest
    # inserting a evicts 9, 9 comes back, c and d evict it again: 9 leaves DRAM twice
    n = store_tiered(c, dram, ssd, 0, [1, 2, 9, 3, 4])
    on_ssd = [k for k in (1, 2, 3, 4, 9) if k in ssd]
    assert n == len(on_ssd) == len(set(on_ssd))
    assert 9 in ssd and (0, "ssd") in c.index.holders(9)
    _check(c, dram, ssd, 0, [1, 2, 3, 4, 9])
