"""KV cache groups (hybrid models) and hashes of ours held under several engine hashes,
on the Rust ingest path and the reference alike."""

from __future__ import annotations

import msgspec
import pytest

from mooncake_rs import BlockIndex, PrefixHasher
from mooncake_rs.kv_events import Ingestor, MediumIndex, TierTarget, decode_payload
from mooncake_rs.kv_events.ingest_ref import ReferenceIngestor

BS = 4
enc = msgspec.msgpack.Encoder()
HASHER = PrefixHasher(BS, seed=1)
TOKS = list(range(50, 50 + 2 * BS))
OURS = HASHER.hash(TOKS)


def stored(hashes, tokens=TOKS, group=None, kind=None, medium=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": BS, "medium": medium, "group_idx": group, "kv_cache_spec_kind": kind}


def removed(hashes, group=None, medium=None):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": group}


class Both:
    """The Rust ingestor and the reference fed the same payloads; `held()` asserts they agree."""

    def __init__(self, cap: int = 1 << 20, tier: bool = False):
        make = (lambda: TierTarget(BlockIndex())) if tier else MediumIndex
        self.targets = [make(), make()]
        self.ings = [ReferenceIngestor(self.targets[0], 9, HASHER, cap), Ingestor(self.targets[1], 9, HASHER, cap)]
        assert self.ings[1].fast

    def feed(self, *events):
        p = enc.encode([0.0, list(events), 0])
        self.ings[0].apply(decode_payload(p, raw_tokens=True))
        self.ings[1].apply_payload(p)
        assert list(self.ings[0].map.items()) == list(self.ings[1].map.items())
        assert self.ings[0].stats() == self.ings[1].stats()

    def held(self, medium="GPU"):
        """How many of the prompt's blocks the instance holds, as a prefix."""
        got = []
        for t in self.targets:
            if isinstance(t, MediumIndex):
                idx, tier = t.indexes.get(medium), None
            else:
                idx, tier = t.index, {"GPU": "gpu", "CPU": "dram"}[medium]

            def has(h, idx=idx, tier=tier):
                return any(tier in (None, ti) for _, ti in idx.holders(h))

            got.append(0 if idx is None else next((i for i, h in enumerate(OURS) if not has(h)), len(OURS)))
        assert got[0] == got[1], got
        return got[0]


def test_two_full_attention_groups_each_decide():
    b = Both()
    b.feed(stored([1, 2], group=0, kind="full_attention"), stored([1, 2], group=1, kind="full_attention"))
    assert b.held() == 2
    b.feed(removed([2], group=1))  # one group lost block 1: the instance cannot reuse it
    assert b.held() == 1
    b.feed(stored([2], TOKS[BS:], group=1))  # no parent: a first block of other tokens
    assert b.held() == 1
    b.feed(removed([1], group=0))
    assert b.held() == 0
    assert b.ings[1].groups() == b.ings[0].groups() == [(0, True), (1, True)]


def test_a_sliding_window_group_changes_nothing():
    b = Both()
    b.feed(stored([1, 2], group=0, kind="full_attention"), stored([7, 8], group=1, kind="sliding_window"))
    assert b.held() == 2
    b.feed(removed([1, 2, 7, 8], group=1), stored([9], TOKS[:BS], group=1, kind="sliding_window"))
    assert b.held() == 2
    assert b.ings[1].stats().other_groups == 3
    assert b.ings[1].groups() == [(0, True), (1, False)]
    b.feed(removed([1], group=0))
    assert b.held() == 0


def test_one_group_nil_or_zero_is_todays_behaviour():
    b = Both()
    b.feed(stored([1, 2]), removed([2], group=0))  # nil and 0 are one group
    assert b.held() == 1 and b.ings[1].groups() == [(0, True)]


@pytest.mark.parametrize("tier", [False, True])
def test_a_hash_of_ours_under_two_engine_hashes_is_refcounted(tier):
    b = Both(tier=tier)
    b.feed(stored([1, 2]), stored([3, 4]))  # the same blocks, two engine hashes each
    b.feed(removed([1, 2]))
    assert b.held() == 2  # 3, 4 still hold them
    b.feed(stored([5, 6], medium="CPU"), removed([3, 4]))
    assert b.held() == 0
    assert b.held("CPU") == 2


def test_capacity_eviction_keeps_blocks_other_engine_hashes_hold():
    b = Both(cap=4)
    b.feed(stored([1, 2]), stored([3, 4]))
    assert b.held() == 2
    b.feed(stored([10], list(range(BS))), stored([11], list(range(1, BS + 1))))  # evicts 1 and 2
    assert b.ings[1].map.evicted == 2 and 1 not in b.ings[1].map
    assert b.held() == 2
    b.feed(stored([12], list(range(2, BS + 2))), stored([13], list(range(3, BS + 3))))  # evicts 3 and 4
    assert b.held() == 0
