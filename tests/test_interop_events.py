"""KV events in: the wire decoder, hash mapping into the index, the ZMQ subscriber."""

from __future__ import annotations

import random

import msgspec
import pytest

from mooncake_rs import BlockIndex, InvalidArgument, MalformedEvent, MooncakeError, PrefixHasher
from mooncake_rs.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHashMap,
    Ingestor,
    MediumIndex,
    TierTarget,
    canonical_medium,
    decode_message,
    decode_payload,
    encode_batch,
    encode_message,
)

pytestmark = pytest.mark.timeout(60)

BS = 4
enc = msgspec.msgpack.Encoder()


def norm(ev):  # positional events are subclasses of the public types: compare by content
    for t in (BlockStored, BlockRemoved, AllBlocksCleared):
        if isinstance(ev, t):
            return (t.__name__, msgspec.structs.asdict(ev))
    raise AssertionError(ev)


def sample_events():
    return [
        BlockStored([11, 12], None, list(range(8)), BS, None, "GPU", None),
        BlockStored([b"\x01" * 32], b"\x02" * 32, list(range(4)), BS, 3, "CPU", "sql"),
        BlockStored([-5, 2**64 - 1], 12, list(range(8)), BS, None, None, None, None, 1),
        BlockRemoved([11, b"\x01" * 32], "GPU"),
        BlockRemoved([2**64 - 1], None, 0),
        AllBlocksCleared(),
    ]


# --- decoding --------------------------------------------------------------------


@pytest.mark.parametrize("form", ["positional", "map"])
@pytest.mark.parametrize("dp", [None, 2])
def test_both_payload_forms_round_trip(form, dp):
    evs = sample_events()
    b = decode_payload(encode_batch(evs, ts=12.5, dp_rank=dp, form=form))
    assert b.ts == 12.5 and b.data_parallel_rank == dp and b.unknown == 0
    assert [norm(e) for e in b.events] == [norm(e) for e in evs]


def test_hand_written_positional_and_map_payloads():
    # Exactly as engines lay them out (not through our encoder), int and bytes hashes.
    pos = enc.encode([1.0, [["BlockStored", [1, 2], None, [5, 6, 7, 8, 9, 10, 11, 12], 4, None, "GPU"],
                            ["BlockRemoved", [b"\xaa"], "CPU"], ["AllBlocksCleared"]], 0])
    mp = enc.encode({"ts": 1.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [5, 6, 7, 8, 9, 10, 11, 12], "block_size": 4, "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [b"\xaa"], "medium": "CPU"},
        {"type": "AllBlocksCleared"}]})
    a, b = decode_payload(pos), decode_payload(mp)
    assert [norm(e) for e in a.events] == [norm(e) for e in b.events]
    assert isinstance(a.events[0], BlockStored) and a.events[0].block_hashes == [1, 2]
    assert a.events[1].block_hashes == [b"\xaa"] and a.events[1].medium == "CPU"
    assert isinstance(a.events[2], AllBlocksCleared)
    # SGLang's shape: no medium on either event, no dp rank on the batch.
    sg = decode_payload(enc.encode([3.0, [["BlockStored", [7], None, [1, 2, 3, 4], 4, None], ["BlockRemoved", [7]]]]))
    assert [norm(e) for e in sg.events] == [norm(BlockStored([7], None, [1, 2, 3, 4], 4)), norm(BlockRemoved([7]))]
    # An old two-element batch (no dp rank) and i64 hashes.
    old = decode_payload(enc.encode([2.0, [["BlockRemoved", [-(2**63), 7], None]]]))
    assert old.data_parallel_rank is None and old.events[0].block_hashes == [-(2**63), 7]


def test_unknown_fields_and_event_types_are_ignored():
    pos = enc.encode([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", "lora", [None], 0,
                             "full_attention", None, "a-future-field", 42],
                            ["BlockUpdated", [1], "whatever"]], 0])
    b = decode_payload(pos)
    assert b.unknown == 1 and len(b.events) == 1
    ev = b.events[0]
    assert isinstance(ev, BlockStored) and ev.lora_name == "lora" and ev.group_idx == 0
    mp = enc.encode({"ts": 1.0, "events": [
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "future": {"x": 1}},
        {"type": "SomethingNew", "a": 1}], "new_batch_field": [1, 2]})
    b = decode_payload(mp)
    assert b.unknown == 1 and norm(b.events[0]) == norm(BlockRemoved([3], "GPU"))
    # Mixed forms in one batch go through the per-event path.
    mixed = enc.encode([1.0, [["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": [9]}]])
    b = decode_payload(mixed)
    assert [norm(e) for e in b.events] == [norm(AllBlocksCleared()), norm(BlockRemoved([9]))]


def test_truncated_and_malformed_frames_raise_typed_errors():
    payload = encode_batch(sample_events())
    frames = encode_message(7, payload)
    m = decode_message(frames)
    assert m.seq == 7 and m.topic == b"" and len(m.batch.events) == 6
    bad = [
        frames[:2],  # a frame missing
        [b"", b"\x00\x00\x07", payload],  # a short sequence frame
        [b"", frames[1], payload[: len(payload) // 2]],  # truncated payload
        [b"", frames[1], b""],  # empty payload
        [b"", frames[1], b"\xc1"],  # not msgpack
        [b"", frames[1], enc.encode("a string")],  # not a batch
        [b"", frames[1], enc.encode([1.0, [["BlockStored", "not a list"]]])],  # a broken known event
        [b"", frames[1], enc.encode({"events": []})],  # no ts
    ]
    for f in bad:
        with pytest.raises(MalformedEvent) as ei:
            decode_message(f)
        assert isinstance(ei.value, InvalidArgument) and isinstance(ei.value, MooncakeError)
        assert str(ei.value)


def test_canonical_medium():
    assert [canonical_medium(m) for m in (None, "GPU", "gpu", "cpu", "CPU_PINNED", "disk", "SSD", "EXTERNAL")] == [
        "GPU", "GPU", "GPU", "CPU", "CPU", "DISK", "DISK", "EXTERNAL"]
    # vLLM's offloading tiers: "CPU" and "STORAGE" (a file system or object store) -> disk
    assert [canonical_medium(m) for m in ("STORAGE", "storage")] == ["DISK", "DISK"]
    kv = pytest.importorskip("vllm.distributed.kv_events")
    assert canonical_medium(kv.MEDIUM_STORAGE) == "DISK" and canonical_medium(kv.MEDIUM_CPU) == "CPU"


def test_vllm_classes_decode_identically():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv.KVEventBatch(ts=1.0, events=[
        kv.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                       lora_id=None, medium="GPU", lora_name=None),
        kv.BlockRemoved(block_hashes=[2], medium="GPU"), kv.AllBlocksCleared()], data_parallel_rank=0)
    ours = decode_payload(msgspec.msgpack.Encoder().encode(batch))
    assert [norm(e) for e in ours.events] == [
        norm(BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None)),
        norm(BlockRemoved([2], "GPU")), norm(AllBlocksCleared())]


# --- hash mapping into the index ---------------------------------------------------


def chain(hasher, tokens):
    return hasher.hash(tokens)


def test_ingest_recomputes_our_chained_hashes():
    hasher = PrefixHasher(BS, seed=7)
    target = MediumIndex()
    ing = Ingestor(target, slot=3, hasher=hasher)
    toks = list(range(100, 116))  # 4 blocks
    ours = chain(hasher, toks)
    # Stored in two events, the second chained on the engine's parent hash (bytes).
    ing.apply(decode_payload(encode_batch([BlockStored([b"e0", b"e1"], None, toks[:8], BS, None, "GPU")])))
    ing.apply(decode_payload(encode_batch([BlockStored([b"e2", b"e3"], b"e1", toks[8:], BS, None, "GPU")],
                                          form="map")))
    gpu = target.indexes["GPU"]
    assert gpu.match_prefix(ours) == {3: 4}
    # The same block offloaded to CPU, then evicted from GPU: CPU still has it.
    ing.apply(decode_payload(encode_batch([BlockStored([b"e0"], None, toks[:4], BS, None, "cpu")])))
    ing.apply(decode_payload(encode_batch([BlockRemoved([b"e0", b"e1", b"unknown"], "GPU")])))
    assert gpu.match_prefix(ours) == {}
    assert target.indexes["CPU"].match_prefix(ours) == {3: 1}
    assert gpu.holders(ours[2]) == [(3, "dram")]
    st = ing.stats()
    assert st.stored_blocks == 5 and st.removed_blocks == 2 and st.unknown_removed == 1
    # A removed parent is still known, so a re-store below it chains correctly.
    ing.apply(decode_payload(encode_batch([BlockStored([b"e1"], b"e0", toks[4:8], BS, None, None)])))
    assert gpu.holders(ours[1]) == [(3, "dram")]
    # Orphans (unknown parent) and mismatched sizes are counted and skipped.
    ing.apply(decode_payload(encode_batch([BlockStored([b"x"], b"never-seen", toks[:4], BS, None, "GPU"),
                                           BlockStored([b"y"], None, toks[:4], 8, None, "GPU"),
                                           BlockStored([b"z"], None, toks[:6], BS, None, "GPU")])))
    st = ing.stats()
    assert st.orphans == 1 and st.mismatched == 2
    ing.apply(decode_payload(encode_batch([AllBlocksCleared()])))
    assert all(len(ix) == 0 for ix in target.indexes.values()) and len(ing.map) == 0
    for ix in target.indexes.values():
        ix.check_integrity()


@pytest.mark.parametrize("form", ["positional", "map"])
def test_raw_token_path_indexes_the_same_blocks(form):
    # Ingestion decodes token_ids in Rust (no Python ints): same hashes as the list path.
    hasher = PrefixHasher(BS, seed=3)
    rng = random.Random(2)
    toks = [rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]) for _ in range(40 * BS)]
    evs = [BlockStored(list(range(20)), None, toks[:20 * BS], BS, None, "GPU"),
           BlockStored(list(range(20, 40)), 19, toks[20 * BS:], BS, None, "GPU")]
    payload = encode_batch(evs, form=form)
    raw = decode_payload(payload, raw_tokens=True)
    assert type(raw.events[0].token_ids) is msgspec.Raw
    a, b = MediumIndex(), MediumIndex()
    Ingestor(a, 1, hasher).apply(raw)
    Ingestor(b, 1, hasher).apply(decode_payload(payload))
    want = hasher.hash(toks)
    assert a.indexes["GPU"].match_prefix(want) == b.indexes["GPU"].match_prefix(want) == {1: 40}
    # token_ids that are not u32s: a typed error, nothing indexed.
    for bad in ([1, 2, 3, -1], [1, 2, 3, 2**32], [1, 2, 3, "x"], [1, 2, 3, 1.5]):
        p = enc.encode([0.0, [["BlockStored", [1], None, bad, BS, None, "GPU"]]])
        c = MediumIndex()
        with pytest.raises(MalformedEvent):
            Ingestor(c, 1, hasher).apply(decode_payload(p, raw_tokens=True))
        assert len(c.indexes["GPU"]) == 0


def test_tier_target_maps_each_medium_to_its_tier():
    # GPU -> gpu (the engine's device cache), CPU (and its aliases, and media we do not
    # know) -> dram, disk -> ssd; media sharing a tier keep it while any of them holds it
    hasher = PrefixHasher(BS)
    idx = BlockIndex()
    ing = Ingestor(TierTarget(idx), slot=1, hasher=hasher)
    toks = [1, 2, 3, 4]
    (h,) = hasher.hash(toks)
    ing.apply(decode_payload(encode_batch([BlockStored([5], None, toks, BS, None, "GPU"),
                                           BlockStored([5], None, toks, BS, None, "CPU"),
                                           BlockStored([5], None, toks, BS, None, "cxl"),
                                           BlockStored([5], None, toks, BS, None, "disk")])))
    assert idx.holders(h) == [(1, "dram"), (1, "ssd"), (1, "gpu")]
    assert idx.match_prefix_tiers([h])[1].gpu == 1  # counted in the fastest tier
    ing.apply(decode_payload(encode_batch([BlockRemoved([5], "GPU")])))
    assert idx.holders(h) == [(1, "dram"), (1, "ssd")]
    ing.apply(decode_payload(encode_batch([BlockRemoved([5], "CPU")])))
    assert idx.holders(h) == [(1, "dram"), (1, "ssd")]  # CXL (also dram) still holds it
    ing.apply(decode_payload(encode_batch([BlockRemoved([5], "CXL")])))
    assert idx.holders(h) == [(1, "ssd")]
    ing.apply(decode_payload(encode_batch([BlockRemoved([5], "DISK")])))
    assert idx.holders(h) == []
    # vLLM's STORAGE offload tier is the disk tier
    ing.apply_payload(encode_batch([BlockStored([5], None, toks, BS, None, "STORAGE")]))
    assert idx.holders(h) == [(1, "ssd")]


def test_conductor_prefers_a_gpu_resident_prefix_when_dram_reloads_cost():
    # Two external engines hold the same prefix, one on its GPU, one offloaded to CPU:
    # with a finite DRAM -> device bandwidth the GPU holder wins (no reload), and a
    # disk-only holder loses to both.
    from mooncake_rs import Conductor, ConductorConfig, TransferCostModel

    bs = 16
    cfg = ConductorConfig(block_size=bs, policy="ttft_optimal",
                          transfer_model=TransferCostModel(dram_bandwidth=20e9, ssd_bandwidth=2e9))
    c = Conductor(cfg)
    for i in (1, 2, 3):
        c.add_prefill(i)
    c.add_decode(100)
    hasher = PrefixHasher(bs)
    toks = list(range(64 * bs))
    hashes = hasher.hash(toks)
    for slot, medium in ((1, "CPU"), (2, "GPU"), (3, "DISK")):
        Ingestor(TierTarget(c.index), slot=slot, hasher=hasher).apply(
            decode_payload(encode_batch([BlockStored(list(range(64)), None, toks, bs, None, medium)])))
    d = c.preview(1, hashes, len(toks), 0.0)
    assert d.prefill == 2 and d.reused_blocks == 64 and d.est_transfer_s == 0.0
    c.remove_instance(2)
    d = c.preview(2, hashes, len(toks), 0.0)
    assert d.prefill == 1 and d.est_transfer_s > 0.0  # the DRAM copy beats the disk read


def test_hash_map_is_bounded_and_evicted_blocks_leave_the_index():
    hasher = PrefixHasher(BS)
    target = MediumIndex()
    ing = Ingestor(target, slot=0, hasher=hasher, map_capacity=8)
    rng = random.Random(1)
    seqs = []
    for i in range(10):
        toks = [rng.randrange(50_000) for _ in range(2 * BS)]
        seqs.append(toks)
        ing.apply(decode_payload(encode_batch([BlockStored([i * 2, i * 2 + 1], None, toks, BS, None, "GPU")])))
        assert len(ing.map) <= 8
    gpu = target.indexes["GPU"]
    # The index holds exactly the blocks the map still tracks (the newest 8).
    assert len(gpu) == 8 and ing.stats().evicted == 12
    for toks in seqs[-4:]:
        assert gpu.match_prefix(hasher.hash(toks)) == {0: 2}
    assert gpu.match_prefix(hasher.hash(seqs[0])) == {}
    with pytest.raises(InvalidArgument):
        EngineHashMap(0)


def test_engine_hash_reuse_replaces_the_old_block():
    hasher = PrefixHasher(BS)
    target = MediumIndex()
    ing = Ingestor(target, slot=0, hasher=hasher)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ing.apply(decode_payload(encode_batch([BlockStored([9], None, a, BS, None, "GPU"),
                                           BlockStored([9], None, b, BS, None, "GPU")])))
    gpu = target.indexes["GPU"]
    assert gpu.match_prefix(hasher.hash(a)) == {} and gpu.match_prefix(hasher.hash(b)) == {0: 1}


def test_conductor_routes_on_external_engine_events():
    # Events of an engine we did not write feed the conductor's own index (TierTarget):
    # the request goes to the instance that holds its prefix, and follows load again
    # once that instance evicts it.
    from mooncake_rs import Conductor, ConductorConfig

    bs = 16
    c = Conductor(ConductorConfig(block_size=bs, policy="local_cache_aware"))
    for i in (1, 2):
        c.add_prefill(i)
    c.add_decode(100)
    hasher = PrefixHasher(bs)
    ing = Ingestor(TierTarget(c.index), slot=2, hasher=hasher)
    toks = list(range(64 * bs))
    ing.apply(decode_payload(encode_batch([BlockStored(list(range(64)), None, toks, bs, None, "GPU")])))
    hashes = hasher.hash(toks)
    d = c.preview(1, hashes, len(toks), 0.0)
    assert d.prefill == 2 and d.reused_blocks == 64
    ing.apply(decode_payload(encode_batch([BlockRemoved(list(range(64)), "GPU")])))
    d = c.preview(2, hashes, len(toks), 0.0)
    assert d.reused_blocks == 0 and d.prefill == 1  # no cache anywhere: lowest id on a tie
    c.check_integrity()


def test_random_bytes_only_ever_raise_malformed_event():
    # Anything off the wire either decodes or raises MalformedEvent: no other exception,
    # no crash (the Rust token decoder included).
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mooncake_rs._core import msgpack_tokens

    good = encode_batch(sample_events())
    ing = Ingestor(MediumIndex(), 0, PrefixHasher(BS))

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=200), st.integers(0, len(good)), st.integers(0, 255))
    def check(junk, cut, byte):
        for data in (junk, good[:cut], good[:cut] + bytes([byte]) + good[cut + 1:]):
            for raw in (False, True):
                try:
                    b = decode_payload(data, raw_tokens=raw)
                except MalformedEvent:
                    continue
                try:
                    ing.apply(b)
                except MalformedEvent:
                    pass
            try:
                msgpack_tokens(data)
            except InvalidArgument:
                pass

    check()


def _vllm_032_payload() -> bytes:
    """A batch exactly as vLLM 0.32 publishes it: positional, with map events (fields
    and order as seen on the wire, the newer keys included)."""
    stored = {"type": "BlockStored", "block_hashes": [8310088433979127863, 7814626718447254132],
              "parent_block_hash": None, "token_ids": list(range(10, 74)), "block_size": 32, "lora_id": None,
              "medium": "GPU", "lora_name": None, "extra_keys": [["tenant-a"], None], "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
    removed = {"type": "BlockRemoved", "block_hashes": [7814626718447254132], "medium": "GPU", "group_idx": 0}
    return msgspec.msgpack.encode([1796391668.112084, [stored, removed, {"type": "AllBlocksCleared"}], 0])


@pytest.mark.parametrize("raw_tokens", [False, True])
def test_vllm_032_batches_take_the_typed_fast_path(monkeypatch, raw_tokens):
    from mooncake_rs.kv_events import events

    def slow(*_a, **_k):
        raise AssertionError("a vLLM 0.32 batch fell back to event-by-event decoding")

    monkeypatch.setattr(events, "_decode_slow", slow)
    batch = decode_payload(_vllm_032_payload(), raw_tokens=raw_tokens)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_size == 32 and stored.medium == "GPU"
    assert stored.extra_keys == [["tenant-a"], None] and stored.group_idx == 0
    tokens = bytes(stored.token_ids) if raw_tokens else list(stored.token_ids)
    assert tokens == (msgspec.msgpack.encode(list(range(10, 74))) if raw_tokens else list(range(10, 74)))
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [7814626718447254132]
    assert isinstance(cleared, AllBlocksCleared) and batch.data_parallel_rank == 0
