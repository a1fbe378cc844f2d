"""vLLM's per-block ``extra_keys`` (cache salt, LoRA, multimodal) folded into our chain:
the hashing API, ``vllm_block_extras`` against vLLM's own functions, and the ingest
(Rust and the reference) keeping salted and plain copies of a prompt apart."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from mooncake_rs import BlockIndex, InvalidArgument, PrefixHasher, Xxh3RollingHasher
from mooncake_rs.kv_events import Ingestor, MediumIndex, TierTarget, decode_payload
from mooncake_rs.kv_events.extra_keys import encode_extra_keys, vllm_block_extras
from mooncake_rs.kv_events.ingest_ref import ReferenceIngestor

BS = 4
enc = msgspec.msgpack.Encoder()
HASHERS = [PrefixHasher(BS, seed=3), PrefixHasher(BS, algorithm="blake3"), PrefixHasher(BS, algorithm="xxh3-64-rfc"),
           Xxh3RollingHasher(BS, seed=3)]


def stored(hashes, tokens, parent=None, extra_keys=None, medium=None, group=None, kind=None, lora=None):
    """A vLLM 0.32 BlockStored event (a map inside a positional batch)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": BS, "lora_id": None, "medium": medium, "lora_name": lora, "extra_keys": extra_keys,
          "group_idx": group, "kv_cache_spec_kind": kind}
    return ev


def removed(hashes, medium=None, group=None):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": group}


def payload(*events):
    return enc.encode([0.0, list(events), 0])


@pytest.mark.parametrize("h", HASHERS, ids=repr)
def test_extras_change_exactly_the_blocks_they_key(h):
    toks = list(range(3 * BS))
    plain = h.hash(toks)
    assert h.hash(toks, extras=[]) == plain == h.hash(toks, extras=[None, None, None])
    salted = h.hash(toks, extras=vllm_block_extras(3, cache_salt="tenant-a"))
    other = h.hash(toks, extras=vllm_block_extras(3, cache_salt="tenant-b"))
    assert len(set(salted) | set(plain) | set(other)) == 9  # every block differs
    mid = h.hash(toks, extras=[None, b"\x91\xa1x"])
    assert mid[0] == plain[0] and mid[1] != plain[1] and mid[2] != plain[2]
    # a chain continues from a parent with the remaining blocks' extras
    ex = vllm_block_extras(3, lora_name="ad")
    assert h.hash(toks[BS:], parent=h.hash(toks, extras=ex)[0], extras=ex[1:]) == h.hash(toks, extras=ex)[1:]
    if isinstance(h, PrefixHasher):
        assert list(h.hash_blocks(toks, extras=ex)) == h.hash(toks, extras=ex)
    with pytest.raises(InvalidArgument, match="extras has 4 entries but the tokens make 3 full blocks"):
        h.hash(toks, extras=[None] * 4)
    with pytest.raises(InvalidArgument, match=r"extras\[1\] must be bytes or None, got str"):
        h.hash(toks, extras=[None, "salt"])
    with pytest.raises(InvalidArgument, match="a sequence"):
        h.hash(toks, extras=b"salt")


def test_vllm_block_extras_are_what_vllm_publishes():
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    for salt in (None, "", "tenant-a"):
        for lora in (None, "adapter-1"):
            lora_request = None if lora is None else SimpleNamespace(lora_name=lora, lora_path="/adapters/1")
            request = SimpleNamespace(mm_features=[], lora_request=lora_request, cache_salt=salt, prompt_embeds=None)
            keys = [kcu.generate_block_hash_extra_keys(request, i * BS, (i + 1) * BS, 0)[0] for i in range(3)]
            published = kcu.to_event_extra_keys(keys)
            want = [encode_extra_keys(e) for e in published] if published else [None] * 3
            assert vllm_block_extras(3, cache_salt=salt, lora_name=lora) == want, (salt, lora)
    assert vllm_block_extras(0, cache_salt="s") == []
    with pytest.raises(InvalidArgument):
        vllm_block_extras(-1)
    with pytest.raises(InvalidArgument, match="cache_salt must be a str"):
        vllm_block_extras(1, cache_salt=b"x")  # type: ignore[arg-type]


def ingestors(hasher, cap=1 << 20):
    ref_t, fast_t = MediumIndex(), MediumIndex()
    return [(ReferenceIngestor(ref_t, 5, hasher, cap), ref_t), (Ingestor(fast_t, 5, hasher, cap), fast_t)]


def feed(ing, p):
    if isinstance(ing, ReferenceIngestor):
        ing.apply(decode_payload(p, raw_tokens=True))
    else:
        ing.apply_payload(p)


@pytest.mark.parametrize("hasher", HASHERS, ids=repr)
def test_a_salted_and_a_plain_copy_are_distinct_blocks(hasher):
    toks = list(range(100, 100 + 3 * BS))
    plain_q = hasher.hash(toks)
    salted_q = hasher.hash(toks, extras=vllm_block_extras(3, cache_salt="tenant-a"))
    lora_q = hasher.hash(toks, extras=vllm_block_extras(3, lora_name="ad", cache_salt="tenant-a"))
    for ing, target in ingestors(hasher):
        def held(h, target=target):
            return [slot for slot, _ in target.indexes["GPU"].holders(h)]

        # only the salted copy: a plain query must not hit
        feed(ing, payload(stored([11, 12, 13], toks, extra_keys=[["tenant-a"], None, None])))
        assert [held(h) for h in plain_q] == [[]] * 3
        assert all(held(h) == [5] for h in salted_q)
        # the plain copy too (other engine hashes), and a LoRA copy chained block by block
        feed(ing, payload(stored([21, 22, 23], toks)))
        feed(ing, payload(stored([31], toks[:BS], extra_keys=[["ad", "tenant-a"]], lora="ad"),
                          stored([32, 33], toks[BS:], parent=31, extra_keys=[["ad"], ["ad"]], lora="ad")))
        assert all(held(h) == [5] for h in plain_q + salted_q + lora_q)
        # evicting the salted copy keeps the plain and the LoRA one
        feed(ing, payload(removed([11, 12, 13])))
        assert [held(h) for h in salted_q] == [[]] * 3
        assert all(held(h) == [5] for h in plain_q + lora_q)
        # more entries than blocks: skipped, counted
        feed(ing, payload(stored([41], toks[:BS], extra_keys=[None, None])))
        assert ing.stats().mismatched == 1 and 41 not in ing.map


def test_object_path_folds_extras_like_the_payload_path():
    hasher = PrefixHasher(BS)
    toks = list(range(2 * BS))
    p = payload(stored([1, 2], toks, extra_keys=[["s"], None]))
    a, b = Ingestor(TierTarget(BlockIndex()), 1, hasher), Ingestor(TierTarget(BlockIndex()), 1, hasher)
    a.apply_payload(p)
    b.apply(decode_payload(p))
    assert list(a.map.items()) == list(b.map.items())
    assert [o for _, o, _ in a.map.items()] == hasher.hash(toks, extras=vllm_block_extras(2, cache_salt="s"))
