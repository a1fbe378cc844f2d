"""Conductor.apply_store_events (issue 11): a store's drained events go to the conductor's
index as they are, with no Python translation. Reference: the translation serving did
before (StoreSlots.drain_events + Router._store_events, copied here verbatim in meaning):
both paths must leave the same index state after random store workloads, with and
without an SSD tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mooncake_rs as mr

BB = 4096
INST = 3


def translate(events: list[mr.StoreEvent]) -> list[tuple[str, int, str]]:
    """The old serving translation (StoreSlots.drain_events)."""
    out = []
    for e in events:
        if e.kind in ("stored", "promoted", "demoted"):
            out.append(("stored", e.key, e.tier))
        elif e.kind in ("evicted", "removed"):
            out.append(("evicted", e.key, e.tier))
    return out


def apply_translated(c: mr.Conductor, inst: int, events: list[tuple[str, int, str]]) -> None:
    """The old router feed (Router._store_events): runs of one kind and tier, in order."""
    run: list[int] = []
    run_kind: tuple[str, str] | None = None
    for kind, key, tier in list(events) + [("end", 0, "")]:
        if (kind, tier) != run_kind and run and run_kind is not None:
            if run_kind[0] == "stored":
                c.on_blocks_stored(inst, run, run_kind[1])
            else:
                c.on_blocks_evicted(inst, run, run_kind[1])
            run = []
        run_kind = (kind, tier)
        run.append(key)


def conductor() -> mr.Conductor:
    c = mr.Conductor(mr.ConductorConfig(block_size=16))
    c.add_prefill(INST)
    c.add_prefill(INST + 1)
    c.add_decode(9)
    return c


def state(c: mr.Conductor, keys: set[int]) -> tuple[object, ...]:
    ix = c.index
    return tuple(ix.holders(k) for k in sorted(keys)) + (ix.stats().entries, ix.stats().per_instance)


def workload(s: mr.Store, rng: np.random.Generator, keys: set[int], steps: int) -> None:
    for _ in range(steps):
        op = rng.integers(0, 10)
        k = int(rng.integers(0, 40)) | (int(rng.integers(0, 2)) << 127)
        keys.add(k)
        if op < 5:
            s.put(k, np.full(BB, k % 251, np.uint8))
        elif op < 7:
            b = s.get(k)
            if b is not None:
                b.release()
        elif op < 8:
            try:
                s.remove(k)
            except mr.InvalidArgument:
                pass
        else:
            w = s.reserve(k) if not s.contains(k) else None
            if w is not None:
                w.write(np.full(BB, 7, np.uint8))
                committed = w.commit()
                if committed is not None:
                    committed.release()


@pytest.mark.parametrize("ssd", [False, True])
def test_apply_store_events_equals_the_python_translation(tmp_path: Path, ssd: bool) -> None:
    kw = {"ssd_path": tmp_path, "ssd_bytes": 64 * 8192, "demotion_queue": 256} if ssd else {}
    s = mr.Store(BB, 6 * BB, **kw)  # type: ignore[arg-type]
    old, via_batch, via_bytes, via_list = conductor(), conductor(), conductor(), conductor()
    rng = np.random.default_rng(1)
    keys: set[int] = set()
    kinds: set[str] = set()
    for _ in range(40):
        workload(s, rng, keys, int(rng.integers(0, 25)))
        if ssd:
            s.flush()
        batch = s.drain_events_batch()
        events = list(batch)
        kinds |= {e.kind for e in events}
        assert len(batch) == len(events) and bool(batch) == bool(events)
        apply_translated(old, INST, translate(events))
        entries_before = via_batch.index.stats().entries
        r = via_batch.apply_store_events(INST, batch)
        via_bytes.apply_store_events(INST, batch.to_bytes())
        via_list.apply_store_events(INST, mr.StoreEvents.from_bytes(bytes(batch)).tolist())
        # what apply says it changed is what the index's entry count moved by
        assert r.inserted - r.removed == via_batch.index.stats().entries - entries_before, r
        assert r.inserted <= len(events) and r.removed <= len(events)
        want = state(old, keys)
        assert state(via_batch, keys) == want
        assert state(via_bytes, keys) == want
        assert state(via_list, keys) == want
    for c in (old, via_batch, via_bytes, via_list):
        c.check_integrity()
    assert {"stored", "evicted", "removed"} <= kinds
    if ssd:
        assert {"demoted", "promoted"} <= kinds
    # what the index holds for INST is what the store holds, tier by tier
    for k in keys:
        tier = s.tier_of(k)
        held = {t for i, t in via_batch.index.holders(k) if i == INST}
        if tier is None:
            assert held == set()
        else:
            assert tier in held


def test_drain_events_list_is_accepted_directly() -> None:
    s = mr.Store(BB, 2 * BB)
    for k in (1, 2, 3):
        s.put(k, np.zeros(BB, np.uint8))
    c = conductor()
    r = c.apply_store_events(INST, s.drain_events())  # stored 1, 2, evicted 1, stored 3
    assert (r.inserted, r.removed) == (3, 1)
    empty = c.apply_store_events(INST, [])
    assert (empty.inserted, empty.removed) == (0, 0) and empty == c.apply_store_events(INST, b"MCE1")
    assert c.index.match_prefix([2, 3]) == {INST: 2} and c.index.holders(1) == []
    assert s.drain_events_batch() == mr.StoreEvents([]) and len(s.drain_events_batch()) == 0


def test_round_trip_and_bad_input() -> None:
    s = mr.Store(BB, 2 * BB)
    s.put(2**128 - 1, np.zeros(BB, np.uint8))
    s.put(5, np.zeros(BB, np.uint8))
    s.remove(5)
    batch = s.drain_events_batch()
    assert [(e.kind, e.key, e.tier) for e in batch] == [("stored", 2**128 - 1, "dram"), ("stored", 5, "dram"),
                                                        ("removed", 5, "dram")]
    raw = batch.to_bytes()
    assert raw[:4] == b"MCE1" and len(raw) == 4 + 3 * 18
    assert mr.StoreEvents.from_bytes(raw) == batch == mr.StoreEvents(raw) == mr.StoreEvents(batch.tolist())
    assert batch[-1].kind == "removed" and "StoreEvents(n=3)" == repr(batch)
    with pytest.raises(IndexError):
        batch[3]
    c = conductor()
    for bad, match in ((b"", "MCE1"), (b"MCE1" + b"\0" * 17, "whole number"), (b"MCE1" + b"\x09" + b"\0" * 17, "kind"),
                       (b"MCE1\x00\x05" + b"\0" * 16, "tier")):
        with pytest.raises(mr.InvalidArgument, match=match):
            c.apply_store_events(INST, bad)
        with pytest.raises(mr.InvalidArgument):
            mr.StoreEvents.from_bytes(bad)
    with pytest.raises(mr.InvalidArgument, match="not a StoreEvent"):
        c.apply_store_events(INST, [("stored", 1, "dram")])
    with pytest.raises(mr.InvalidArgument, match="StoreEvents"):
        c.apply_store_events(INST, 42)
    # an unknown instance changes nothing
    with pytest.raises(mr.InvalidArgument, match="unknown instance"):
        c.apply_store_events(77, batch)
    assert len(c.index) == 0
    r = c.apply_store_events(INST, batch)
    assert (r.inserted, r.removed) == (2, 1)
    assert c.index.holders(2**128 - 1) == [(INST, "dram")] and c.index.holders(5) == []
