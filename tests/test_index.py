import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake_rs import BlockIndex, InvalidArgument, PrefixHasher


def test_hand_computed_match():
    idx = BlockIndex()
    h = PrefixHasher(4).hash(list(range(16)))  # 4 chained blocks
    assert idx.insert(1, h[:3]) == 3
    assert idx.insert(2, h[:2], "ssd") == 2
    assert idx.insert(2, h[:1], "dram") == 1
    assert idx.insert(3, h[1:]) == 3  # lacks the first block
    assert idx.match_prefix(h) == {1: 3, 2: 2}
    tiers = idx.match_prefix_tiers(h)
    assert (tiers[2].dram, tiers[2].ssd, tiers[2].total) == (1, 1, 2)
    assert idx.best_prefix(h) == (1, 3)
    assert idx.best_prefix([12345]) is None
    assert idx.holders(h[0]) == [(1, "dram"), (2, "dram"), (2, "ssd")]
    assert len(idx) == 4 and h[3] in idx and 999 not in idx
    assert idx.remove(2, h[:1], "ssd") == 1
    assert idx.remove(9, h) == 0  # unknown instance: nothing to remove
    assert idx.remove_instance(1) == 3
    assert idx.match_prefix(h) == {2: 2}
    s = idx.stats()
    assert (s.blocks, s.entries, s.instances) == (4, 5, 2)
    assert s.per_instance == {2: (1, 1), 3: (3, 0)}
    idx.check_integrity()


def test_bad_input():
    idx = BlockIndex()
    with pytest.raises(InvalidArgument, match="tier"):
        idx.insert(0, [1], "tape")
    with pytest.raises(InvalidArgument, match="outside"):
        idx.insert(0, [-1])
    with pytest.raises(InvalidArgument, match="outside"):
        idx.match_prefix([2**130])
    with pytest.raises(InvalidArgument, match="not an int"):
        idx.match_prefix(["a"])
    with pytest.raises(InvalidArgument):
        idx.insert(0, 5)
    assert len(idx) == 0  # nothing changed


def test_large_calls_from_threads():
    idx = BlockIndex()
    hs = PrefixHasher(1).hash(list(range(5000)))

    def work(i):
        for _ in range(5):
            idx.insert(i, hs)
            assert idx.match_prefix(hs)[i] == len(hs)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert idx.match_prefix(hs) == {i: 5000 for i in range(4)}
    idx.check_integrity()


class IndexMachine(RuleBasedStateMachine):
    """Random insert/remove/match sequences against a brute-force set."""

    def __init__(self):
        super().__init__()
        self.idx = BlockIndex()
        self.ref: set[tuple[int, int, str]] = set()

    instances = st.integers(0, 4)
    hashes = st.lists(st.integers(0, 15) | st.just(2**127 + 5), max_size=8)
    tiers = st.sampled_from(["dram", "ssd"])

    @rule(i=instances, hs=hashes, t=tiers)
    def insert(self, i, hs, t):
        new = {(h, i, t) for h in hs} - self.ref
        assert self.idx.insert(i, hs, t) == len(new)
        self.ref |= new

    @rule(i=instances, hs=hashes, t=st.none() | tiers)
    def remove(self, i, hs, t):
        gone = {e for e in self.ref if e[1] == i and e[0] in hs and (t is None or e[2] == t)}
        assert self.idx.remove(i, hs, t) == len(gone)
        self.ref -= gone

    @rule(i=instances)
    def remove_instance(self, i):
        gone = {e for e in self.ref if e[1] == i}
        assert self.idx.remove_instance(i) == len(gone)
        self.ref -= gone

    @rule(hs=hashes)
    def match(self, hs):
        want = {}
        for i in {e[1] for e in self.ref}:
            n = 0
            for h in hs:
                if (h, i, "dram") in self.ref or (h, i, "ssd") in self.ref:
                    n += 1
                else:
                    break
            if n:
                want[i] = n
        assert self.idx.match_prefix(hs) == want
        best = self.idx.best_prefix(hs)
        if want:
            assert best is not None and best[1] == max(want.values())
        else:
            assert best is None

    @invariant()
    def consistent(self):
        self.idx.check_integrity()
        assert len(self.idx) == len({e[0] for e in self.ref})
        assert self.idx.stats().entries == len(self.ref)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
