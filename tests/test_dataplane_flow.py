"""The data-plane call sequence serving is meant to use (issue 11), end to end without
engines: hash once into BlockHashes, schedule with it, carry keys / offsets / store events
across a (msgpack) wire as bytes, and feed the conductor the drained events directly.
Checked against the list-of-ints path it replaces."""

from __future__ import annotations

import msgspec
import numpy as np

import mooncake_rs as mr

BS = 16
BB = 4096
PREFILL, DECODE = 1, 2


def wire(msg: dict) -> dict:  # what a worker socket does to a control message
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


def test_serving_sequence() -> None:
    hasher = mr.PrefixHasher(BS, seed=0)
    c = mr.Conductor(mr.ConductorConfig(block_size=BS, ttft_slo_s=1e9, tbt_slo_s=1e9, rejection="none"))
    c.add_prefill(PREFILL)
    c.add_decode(DECODE)
    store = mr.Store(BB, 64 * BB)
    toks = np.random.default_rng(0).integers(0, 32_000, 20 * BS + 3, dtype=np.int32)

    # cluster.submit: hash once, schedule with the buffer (no int per block)
    keys = hasher.hash_blocks(toks)
    assert keys.tolist() == hasher.hash(toks.tolist())
    d = c.schedule(1, keys, len(toks), 0.0)
    assert d.prefill == PREFILL and d.reused_blocks == 0

    # router -> prefill instance: the keys travel as bytes
    msg = wire({"op": "prefill", "rid": 1, "keys": bytes(keys), "local": d.reused_blocks})
    wkeys = mr.BlockHashes(msg["keys"])
    assert wkeys == keys

    # prefill: nothing local yet; compute and commit every block (commit returns the
    # leased block: no second lookup by key)
    with store.lookup_prefix_run(wkeys[: msg["local"]]) as run:
        assert len(run) == 0
    held = []
    for i in range(len(wkeys)):
        wb = store.reserve(wkeys[i])
        wb.write(np.full(BB, i, np.uint8))
        blk = wb.commit()
        assert blk is not None and blk.offset == store.slot_offset(wkeys[i])
        held.append(blk)

    # instance -> router: the drained events as bytes; the router applies them as they are
    ev = store.drain_events_batch()
    assert len(ev) == len(keys)
    out = wire({"op": "store", "events": ev.to_bytes()})
    applied = c.apply_store_events(PREFILL, out["events"])
    assert (applied.inserted, applied.removed) == (len(keys), 0)
    c.on_prefill_started(1, 0.1)
    c.on_prefill_finished(1, 0.2)
    c.on_decode_started(1, 0.2)
    c.on_decode_finished(1, 4, 0.3)
    for b in held:
        b.release()

    # a second request with the same prefix: the index saw the blocks through the events
    keys2 = hasher.hash_blocks(np.concatenate([toks[: 10 * BS], np.arange(5 * BS, dtype=np.int32)]))
    d2 = c.schedule(2, keys2, 15 * BS, 1.0)
    assert d2.prefill == PREFILL and d2.reused_blocks == 10

    # export (a peer fetches the prefix): pin the held run, send its offsets as bytes
    run = store.lookup_prefix_run(keys2)
    reply = wire({"op": "exported", "rid": 2, "offsets": bytes(run)})
    offsets = np.frombuffer(reply["offsets"], "<u8")
    assert offsets.tolist() == [store.slot_offset(k) for k in keys2.tolist()[:10]]
    assert np.asarray(run.block(3))[0] == 3  # block 3's bytes, through its own lease
    run.release()  # "unpin"
    c.check_integrity()
    store.check_integrity()
