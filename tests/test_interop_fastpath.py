"""The Rust ingest path (``Ingestor``: one ``_core.EventIngestor`` call per payload)
against the pure-Python reference (``ReferenceIngestor``: ``decode_payload`` + a dict
map, event by event) on seeded random event streams: after every payload both must
hold the same index entries, the same engine-hash map (order included) and the same
counters, and raise ``MalformedEvent`` on the same payloads.

The streams mix both payload forms (and both event forms within a batch), int (u64,
negative i64) and bytes hashes, unknown fields and trailing positional fields, unknown
event types, orphans, size mismatches, engine-hash reuse, removes of unknown hashes,
``AllBlocksCleared``, more media than an instance tracks, a small map bound (eviction),
truncated payloads and token ids that are not u32s, and vLLM's per-block ``extra_keys``
(salts, LoRA names, multimodal pairs; sometimes more entries than blocks).
"""

from __future__ import annotations

import random

import msgspec
import pytest

from mooncake_rs import BlockIndex, MalformedEvent, PrefixHasher, Xxh3RollingHasher
from mooncake_rs.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHashMap,
    Ingestor,
    MediumIndex,
    TierTarget,
    decode_payload,
    encode_event,
)
from mooncake_rs.kv_events.hashmap import DictEngineHashMap
from mooncake_rs.kv_events.ingest_ref import ReferenceIngestor

pytestmark = pytest.mark.timeout(300)

BS = 4
enc = msgspec.msgpack.Encoder()
MEDIA = [None, "GPU", "gpu", "CPU", "cpu", "cpu_pinned", "DISK", "ssd", "cxl"]
MANY_MEDIA = [f"M{i}" for i in range(9)]  # with the others, more than the 8 tracked


class Stream:
    """A random publisher: chains of blocks, with every kind of oddity now and then."""

    def __init__(self, seed: int, groups: bool = True) -> None:
        self.rng = random.Random(seed)
        self.known: list[int | bytes] = []
        self.next = 1
        self.recent: list[tuple] = []  # stored events to store again under other hashes
        self.groups = groups

    def fresh(self) -> int | bytes:
        r = self.rng.random()
        self.next += 1
        if r < 0.5:
            return self.next * 0x9E3779B97F4A7C15 % (1 << 64)  # u64
        if r < 0.7:
            return -self.next  # i64 (old vLLM)
        return self.next.to_bytes(self.rng.choice([8, 16, 32]), "big")  # bytes (SHA-256 etc.)

    def medium(self) -> str | None:
        if self.rng.random() < 0.03:
            return self.rng.choice(MANY_MEDIA)
        return self.rng.choice(MEDIA)

    def group(self) -> tuple[int | None, str | None]:
        """(group_idx, kv_cache_spec_kind): mostly the one group (nil or 0), now and then a
        second full-attention group, a sliding-window one, or a kind not said."""
        if not self.groups:
            return None, None
        rng = self.rng
        r = rng.random()
        if r < 0.7:
            return rng.choice([None, 0]), rng.choice([None, "full_attention"])
        if r < 0.85:
            return 1, rng.choice([None, "full_attention"])
        return 2, rng.choice([None, "sliding_window", "sliding_window"])

    def extra_keys(self, n: int) -> tuple[str | None, list | None]:
        """(lora_name, extra_keys) as vLLM sends them: nil, or an entry per block (now
        and then one too many): a salt, a LoRA name, multimodal [id, offset] pairs."""
        rng = self.rng
        r = rng.random()
        if r < 0.5:
            return None, None
        lora = rng.choice([None, "lora-a", "lora-b"])
        salt = rng.choice([None, "tenant-a", "tenant-b"])
        entries: list = []
        for i in range(n + (rng.random() < 0.05)):
            keys: list = [lora] if lora else []
            if rng.random() < 0.2:
                keys.append([rng.choice(["img-1", "img-2"]), rng.randrange(BS)])
            if i == 0 and salt:
                keys.append(salt)
            entries.append(keys or None)
        return lora, entries if rng.random() < 0.9 else entries[: rng.randrange(n + 1)]

    def event(self) -> tuple[object, bool]:
        """(an encodable event or a raw msgpack-ready object, whether it is an unknown type)."""
        rng = self.rng
        r = rng.random()
        if r < 0.06 and self.recent:
            # the same blocks again under other engine hashes (one hash of ours, several
            # engine hashes: refcounted), sometimes in another group
            parent, toks, lora, extra_keys, group, kind = rng.choice(self.recent)
            hashes = [self.fresh() for _ in range(len(toks) // BS)]
            self.known.extend(hashes)
            if rng.random() < 0.3:
                group, kind = self.group()
            return BlockStored(hashes, parent, toks, BS, None, self.medium(), lora, extra_keys, group, kind), False
        if r < 0.55:
            n = rng.choice([0, 1, 1, 2, 3, 5])
            hashes = [rng.choice(self.known) if self.known and rng.random() < 0.1 else self.fresh() for _ in range(n)]
            p = rng.random()
            recent = self.known[-20:]
            parent = None if p < 0.25 or not recent else (rng.choice(recent) if p < 0.95 else self.fresh())
            ntok = n * BS if rng.random() > 0.05 else n * BS + rng.choice([-1, 1])
            toks = [rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1 << 32) for _ in range(max(ntok, 0))]
            if toks and rng.random() < 0.02:
                toks[rng.randrange(len(toks))] = rng.choice([-1, 1 << 32])
            bs = BS if rng.random() > 0.04 else rng.choice([0, 8])
            self.known.extend(hashes)
            lora, extra_keys = self.extra_keys(n)
            group, kind = self.group()
            if n and len(toks) == n * BS:
                self.recent = (self.recent + [(parent, toks, lora, extra_keys, group, kind)])[-30:]
            return BlockStored(hashes, parent, toks, bs, None, self.medium(), lora, extra_keys, group, kind), False
        if r < 0.86:
            k = rng.randrange(0, 5)
            hs = [rng.choice(self.known[-60:]) if self.known and rng.random() < 0.9 else self.fresh() for _ in range(k)]
            return BlockRemoved(hs, self.medium(), self.group()[0]), False
        if r < 0.865:
            self.known = []
            self.recent = []
            return AllBlocksCleared(), False
        return (["BlockUpdated", 1, "x"] if rng.random() < 0.5 else {"type": "SomethingNew", "a": [1]}), True

    def encode(self, ev: object, unknown: bool, form: str) -> object:
        if unknown:
            return ev
        obj = encode_event(ev, form)  # type: ignore[arg-type]
        if self.rng.random() < 0.2:  # a newer engine's extra fields
            if isinstance(obj, dict):
                obj["future_field"] = [1, {"x": b"y"}]
            else:
                width = {"BlockStored": 10, "BlockRemoved": 4, "AllBlocksCleared": 1}[obj[0]]
                obj = obj + [None] * (width - len(obj)) + ["full_attention", 42]
        return obj

    def payload(self) -> bytes:
        rng = self.rng
        form = rng.choice(["positional", "map"])
        mixed = rng.random() < 0.15
        evs = []
        for _ in range(rng.randrange(0, 6)):
            ev, unknown = self.event()
            f = rng.choice(["positional", "map"]) if mixed else form
            evs.append(self.encode(ev, unknown, f))
        if form == "map":
            batch: object = {"ts": rng.random(), "events": evs}
            if rng.random() < 0.5:
                batch["data_parallel_rank"] = 0  # type: ignore[index]
            if rng.random() < 0.2:
                batch["new_batch_field"] = [1, 2]  # type: ignore[index]
        else:
            batch = [rng.random(), evs] + ([0] if rng.random() < 0.5 else [])
        data = enc.encode(batch)
        if rng.random() < 0.04:
            data = data[: rng.randrange(len(data))]  # a truncated frame
        return data


def index_state(target, hashes):
    """{(key, our hash): holders} of every hash we ever computed, in every index."""
    idxs = target.indexes if isinstance(target, MediumIndex) else {"": target.index}
    out = {}
    for key, idx in idxs.items():
        idx.check_integrity()
        for h in hashes:
            got = idx.holders(h)
            if got:
                out[(key, h)] = got
    sizes = {k: len(ix) for k, ix in idxs.items() if len(ix)}
    return out, sizes


def apply(f, *args) -> bool:
    try:
        f(*args)
        return True
    except MalformedEvent:
        return False


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["medium", "tier"])
def test_rust_payload_path_matches_the_reference(seed, kind):
    hasher = PrefixHasher(BS, seed=seed) if seed % 2 else Xxh3RollingHasher(BS, seed=seed)
    cap = 48 if seed < 3 else 1 << 20

    def target():
        return MediumIndex() if kind == "medium" else TierTarget(BlockIndex())

    ref_t, fast_t = target(), target()
    ref = ReferenceIngestor(ref_t, 7, hasher, cap)
    fast = Ingestor(fast_t, 7, hasher, cap)
    assert fast.fast and isinstance(fast.map, EngineHashMap) and isinstance(ref.map, DictEngineHashMap)
    stream = Stream(seed, groups=seed % 3 != 0)
    seen: set[int] = set()
    errors = shared = 0
    for i in range(250):
        p = stream.payload()

        def ref_apply(p=p):
            ref.apply(decode_payload(p, raw_tokens=True))

        ok_ref = apply(ref_apply)
        ok_fast = apply(fast.apply_payload, p)
        assert ok_ref == ok_fast, (i, p)
        errors += not ok_ref
        items = list(ref.map.items())
        assert list(fast.map.items()) == items, i
        seen.update(o for _, o, _ in items)
        shared += len(items) - len({o for _, o, _ in items})  # entries sharing a hash of ours
        assert fast.stats() == ref.stats(), i
        if i % 10 == 0 or not ok_ref:
            assert index_state(fast_t, seen) == index_state(ref_t, seen), i
        fast.map.check_integrity()
    st = ref.stats()
    # the stream did exercise what it is meant to
    assert errors and st.orphans and st.mismatched and st.unknown_removed and st.cleared and st.unknown_events
    assert st.stored_blocks and st.removed_blocks and shared
    if cap < 100:
        assert st.evicted
    if stream.groups:
        assert st.other_groups and fast.groups() == ref.groups() and len(ref.groups()) == 3
    fast.reset("test")
    ref.reset("test")
    assert fast.stats() == ref.stats() and len(fast.map) == 0
    assert index_state(fast_t, seen) == index_state(ref_t, seen) == ({}, {})


@pytest.mark.parametrize("seed", range(4))
def test_rust_object_path_matches_the_reference(seed):
    # Ingestor.apply(decoded batch) on the Rust path against the reference on the same
    # objects: typed token ints (errors raised where the hash is computed) and Raw tokens.
    hasher = PrefixHasher(BS, seed=seed)
    ref_t, fast_t = MediumIndex(), MediumIndex()
    ref = ReferenceIngestor(ref_t, 1, hasher, 40)
    fast = Ingestor(fast_t, 1, hasher, 40)
    stream = Stream(100 + seed)
    seen: set[int] = set()
    for i in range(200):
        p = stream.payload()
        try:
            batch = decode_payload(p, raw_tokens=bool(i % 2))
        except MalformedEvent:
            continue
        assert apply(ref.apply, batch) == apply(fast.apply, batch), i
        items = list(ref.map.items())
        assert list(fast.map.items()) == items, i
        seen.update(o for _, o, _ in items)
        assert fast.stats() == ref.stats(), i
    assert index_state(fast_t, seen) == index_state(ref_t, seen)


def test_the_rust_map_has_the_dict_maps_api_and_semantics():
    rng = random.Random(5)
    a, b = EngineHashMap(6), DictEngineHashMap(6)
    keys = [1, -1, 2**64 - 1, b"\x01", b"\x01" * 32, 7, 8, 9, 10]
    for _ in range(600):
        op = rng.random()
        group = rng.choice([0, 0, 1])
        if op < 0.6:
            ks = [rng.choice(keys) for _ in range(rng.randrange(4))]
            os = [rng.randrange(2**128) if rng.random() < 0.2 else rng.randrange(3) for _ in ks]
            bit = 1 << rng.randrange(3)
            assert a.store(ks, os, bit, group) == b.store(ks, os, bit, group)
            assert a.evict_overflow() == b.evict_overflow()
        elif op < 0.95:
            ks = [rng.choice(keys + [12345]) for _ in range(rng.randrange(4))]
            bit = 1 << rng.randrange(3)
            same = bit | (1 << rng.randrange(3))
            deciding = rng.choice([1, 1, 3])
            assert a.remove(ks, bit, same, group, deciding) == b.remove(ks, bit, same, group, deciding)
        else:
            a.clear()
            b.clear()
        assert list(a.items()) == list(b.items())
        assert (len(a), a.evicted, a.capacity) == (len(b), b.evicted, b.capacity)
        for k in keys:
            for g in (0, 1):
                assert (k in a, a.ours(k, g), a.media(k, g)) == (k in b, b.ours(k, g), b.media(k, g))
        for o in range(3):
            for mask, deciding in ((1, 1), (3, 1), (7, 3), (2, 2)):
                assert a.held(o, mask, deciding) == b.held(o, mask, deciding)
        a.check_integrity()
    assert "x" not in a and a.ours("x") is None and a.media(3.5) == 0


def test_custom_targets_and_hashers_use_the_reference_path():
    class Recorder:
        def __init__(self):
            self.calls = []

        def key_of(self, medium):
            return medium

        def insert(self, slot, hashes, key):
            self.calls.append(("insert", key, list(hashes)))

        def remove(self, slot, hashes, key):
            self.calls.append(("remove", key, list(hashes)))

        def clear(self, slot):
            self.calls.append(("clear",))

    t = Recorder()
    ing = Ingestor(t, 1, PrefixHasher(BS))
    assert not ing.fast
    p = enc.encode([0.0, [["BlockStored", [5], None, [1, 2, 3, 4], BS, None, "GPU"], ["AllBlocksCleared"]]])
    ing.apply_payload(p)
    assert [c[0] for c in t.calls] == ["insert", "clear"]
    assert ing.stats().stored_blocks == 1


def test_random_bytes_only_ever_raise_malformed_event_on_the_rust_path():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    stream = Stream(9)
    good = [stream.payload() for _ in range(20)]
    ing = Ingestor(MediumIndex(), 0, PrefixHasher(BS), 32)

    @settings(max_examples=400, deadline=None)
    @given(st.binary(max_size=200), st.integers(0, 19), st.integers(0, 10_000), st.integers(0, 255))
    def check(junk, which, cut, byte):
        g = good[which]
        cut %= len(g) + 1
        for data in (junk, g[:cut], g[:cut] + bytes([byte]) + g[cut + 1 :]):
            try:
                ing.apply_payload(data)
            except MalformedEvent:
                pass
        ing.map.check_integrity()

    check()
