"""KV events out: a Cluster's prefill instance publishes its store events in the vLLM/SGLang
ZMQ wire format, and our own subscriber rebuilds exactly what the conductor's index holds
for it (both tiers, after evictions), from token_ids alone."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("torch")

from mooncake_rs import BlockHashes as BlockHashesOf  # noqa: E402
from mooncake_rs import BlockIndex, InvalidArgument, PrefixHasher  # noqa: E402
from mooncake_rs.engine import ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.kv_events import Ingestor, KVEventSubscriber  # noqa: E402
from mooncake_rs.kv_events.targets import TierTarget  # noqa: E402
from mooncake_rs.serving.kv_events import endpoints_for  # noqa: E402
from ports import free_port, free_port_pair  # noqa: E402
from serving_helpers import BLOCK  # noqa: E402

GREEDY = SamplingParams(max_tokens=4)


def _ours(index: BlockIndex, hashes: list[int], inst: int) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for h in hashes:
        tiers = {t for i, t in index.holders(h) if i == inst}
        if tiers:
            out[h] = tiers
    return out


def test_published_events_rebuild_the_conductor_index(tmp_path):
    from mooncake_rs import Cluster

    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(10 * BLOCK)] + [k] for k in range(3)]
    prompts.append(prompts[0][:6 * BLOCK] + [rng.randrange(256) for _ in range(3 * BLOCK)] + [9])  # shared prefix
    hasher = PrefixHasher(BLOCK, seed=0)  # what the cluster hashes prompts with
    every = sorted({h for p in prompts for h in hasher.hash(p)})
    port = free_port_pair()
    mine = BlockIndex()
    # 16 DRAM blocks and an SSD tier: the prompts' 33 distinct blocks evict and demote
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, dram_bytes_per_instance=16 * 8192,
                 ssd_path=str(tmp_path), ssd_bytes_per_instance=12 * 8192, seed=3,
                 kv_events=f"tcp://127.0.0.1:{port}") as c:
        pub, replay = c.kv_event_endpoints["prefill-0"]
        assert (pub, replay) == (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
        ing = Ingestor(TierTarget(mine), 0, PrefixHasher(BLOCK, seed=0))
        sub = KVEventSubscriber(pub, ing, replay_endpoint=replay)
        sub.start()
        try:
            time.sleep(0.2)  # a late join is caught up through the replay anyway
            for p in prompts + [prompts[0]]:  # the last one promotes its blocks back from SSD
                c.generate([p], GREEDY)
            assert c.instance_stats()[0]["evictions"] > 0
            deadline = time.monotonic() + 20
            while True:
                want, got = _ours(c.conductor.index, every, 0), _ours(mine, every, 0)
                if want == got or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert got == want
            assert any("ssd" in t for t in want.values()) and any("dram" in t for t in want.values())
            assert len(want) < len(every)  # some blocks left both tiers
            assert len(mine) == len(c.conductor.index)  # nothing the cluster does not list
            st = ing.stats()
            assert st.orphans == st.mismatched == st.resets == 0
            assert st.removed_blocks > 0 and st.stored_blocks > 0
            deadline = time.monotonic() + 10
            while sub.stats.messages == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            c.close()  # the instance says AllBlocksCleared as it stops
            deadline = time.monotonic() + 10
            while len(mine) and time.monotonic() < deadline:
                time.sleep(0.05)
            sub.stop()
    assert len(mine) == 0
    assert ing.stats().cleared == 1


def _commit(store, key: int) -> None:
    blk = store.reserve(key).commit()
    if blk is not None:
        blk.release()


def test_publisher_events_from_a_real_store():
    """Store events -> wire events: runs of a chain in one BlockStored with the right tokens,
    evictions as BlockRemoved, forgotten tokens not published, AllBlocksCleared on close."""
    import zmq

    from mooncake_rs import Store
    from mooncake_rs.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_message
    from mooncake_rs.serving.kv_events import KVEventsOut

    bs = 4
    hasher = PrefixHasher(bs, seed=0)
    prompt = list(range(100, 100 + 3 * bs)) + [7]
    keys = hasher.hash(prompt)
    other = [5] * bs
    okey = hasher.hash(other)[0]
    port = free_port_pair()
    out = KVEventsOut(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", bs, capacity=3)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(out.endpoint)
    try:
        # PUB drops messages until the SUB has joined: probe until one arrives
        deadline = time.monotonic() + 10
        store = Store(4096, 2 * 4096)
        out.learn(BlockHashesOf(keys), prompt)
        while True:
            out._send([AllBlocksCleared()])
            if sub.poll(100):
                sub.recv_multipart()
                break
            assert time.monotonic() < deadline
        while sub.poll(100):
            sub.recv_multipart()
        for k in keys:  # 2 slots: the first block is evicted when the third comes
            _commit(store, k)
        out.on_store_events(store.drain_events_batch().to_bytes())
        msg = decode_message(sub.recv_multipart())
        evs = msg.batch.events
        assert msg.batch.ts > 1e9  # stamped with the wall clock, as engines do
        assert [isinstance(e, t) for e, t in zip(evs, (BlockStored, BlockRemoved, BlockStored))] == [True] * 3
        assert len(evs) == 3
        first, gone, third = evs
        assert first.block_hashes == [k.to_bytes(16, "big") for k in keys[:2]]
        assert first.parent_block_hash is None and first.token_ids == prompt[:2 * bs]
        assert first.medium == "CPU" and first.block_size == bs
        assert gone.block_hashes == [keys[0].to_bytes(16, "big")] and gone.medium == "CPU"
        assert third.parent_block_hash == keys[1].to_bytes(16, "big") and third.token_ids == prompt[2 * bs:3 * bs]
        # the map holds 3 blocks: learning a 4th forgets the prompt's first
        out.learn(BlockHashesOf([okey]), other)
        store2 = Store(4096, 4 * 4096)
        _commit(store2, keys[0])
        _commit(store2, okey)
        out.on_store_events(store2.drain_events_batch().to_bytes())
        (only,) = decode_message(sub.recv_multipart()).batch.events
        assert only.block_hashes == [okey.to_bytes(16, "big")] and only.token_ids == other
        assert out.untracked == 1
        n = msg.seq
    finally:
        out.close()
    frames = sub.recv_multipart() if sub.poll(2000) else None
    sub.close(0)
    ctx.term()
    assert frames is not None
    last = decode_message(frames)
    assert last.seq == n + 2 and len(last.batch.events) == 1 and isinstance(last.batch.events[0], AllBlocksCleared)


def test_publisher_port_taken():
    from mooncake_rs.serving.kv_events import KVEventsOut

    port = free_port_pair()
    first = KVEventsOut(f"tcp://127.0.0.1:{port}", None, 4)
    try:
        with pytest.raises(InvalidArgument, match="pick free ports"):
            KVEventsOut(f"tcp://127.0.0.1:{port}", None, 4)
    finally:
        first.close()


def test_endpoints_for():
    names = ["prefill-0", "prefill-1"]
    assert endpoints_for(None, names) == {}
    assert endpoints_for("tcp://127.0.0.1:6000", names) == {
        "prefill-0": ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"),
        "prefill-1": ("tcp://127.0.0.1:6002", "tcp://127.0.0.1:6003")}
    assert endpoints_for({"prefill-1": "tcp://127.0.0.1:7000"}, names) == {
        "prefill-1": ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001")}
    for bad in ("127.0.0.1:6000", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://:6000", "tcp://h:65535",
                {"decode-0": "tcp://127.0.0.1:7000"}, {"prefill-0": "tcp://127.0.0.1:x"}, 6000):
        with pytest.raises(InvalidArgument):
            endpoints_for(bad, names)


def test_bad_kv_events_fails_before_starting():
    from mooncake_rs import Cluster

    with pytest.raises(InvalidArgument, match="tcp://HOST:PORT"):
        Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=BLOCK, kv_events="localhost:5557")


def test_worker_processes_publish_too():
    """``processes=True``: each worker process binds its own publisher (the spec carries it)."""
    from mooncake_rs import Cluster

    rng = random.Random(8)
    prompts = [[rng.randrange(256) for _ in range(4 * BLOCK)] + [k] for k in range(2)]
    port = free_port(span=4)  # each of the two prefill instances binds a pair
    mine = BlockIndex()
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, processes=True, kv_events=f"tcp://127.0.0.1:{port}") as c:
        subs = []
        for slot, name in enumerate(["prefill-0", "prefill-1"]):
            pub, replay = c.kv_event_endpoints[name]
            sub = KVEventSubscriber(pub, Ingestor(TierTarget(mine), slot, PrefixHasher(BLOCK, seed=0)),
                                    replay_endpoint=replay)
            sub.start()
            subs.append(sub)
        try:
            for p in prompts:
                c.generate([p], GREEDY)
            every = [h for p in prompts for h in PrefixHasher(BLOCK, seed=0).hash(p)]
            deadline = time.monotonic() + 20
            while True:
                want = {i: _ours(c.conductor.index, every, i) for i in (0, 1)}
                got = {i: _ours(mine, every, i) for i in (0, 1)}
                if (want == got and sum(len(v) for v in got.values()) == len(every)) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert got == want
            assert sum(len(v) for v in got.values()) == len(every)  # nothing evicted: every block listed
        finally:
            for sub in subs:
                sub.stop()


def test_fetched_blocks_are_published_with_their_tokens():
    """A prefill instance that fetches a prefix from its peer publishes those blocks too
    (their tokens come from the request's prompt): both instances' indexes match."""
    from mooncake_rs import Cluster

    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(6 * BLOCK)]
    filler_prompt = [rng.randrange(256) for _ in range(1500)]
    prompts = [prefix + [1, 2, 3], prefix + [9, 9]]
    every = sorted({h for p in prompts + [filler_prompt] for h in PrefixHasher(BLOCK, seed=0).hash(p)})
    port = free_port_pair()
    mine = BlockIndex()
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=BLOCK, dram_bytes_per_instance=8 << 20,
                 seed=3, kv_events=f"tcp://127.0.0.1:{port}") as c:
        subs = []
        for slot in (0, 1):
            pub, replay = c.kv_event_endpoints[f"prefill-{slot}"]
            sub = KVEventSubscriber(pub, Ingestor(TierTarget(mine), slot, PrefixHasher(BLOCK, seed=0)),
                                    replay_endpoint=replay)
            sub.start()
            subs.append(sub)
        try:
            holder = c.generate([prompts[0]], GREEDY)[0].metrics.prefill_instance
            filler = c.submit(filler_prompt, SamplingParams(max_tokens=2))
            out = c.submit(prompts[1], GREEDY).result(60)
            filler.result(60)
            assert out.metrics.prefill_instance != holder and out.metrics.fetched_tokens > 0
            fetcher = 1 - holder
            deadline = time.monotonic() + 20
            while True:
                want = {i: _ours(c.conductor.index, every, i) for i in (0, 1)}
                got = {i: _ours(mine, every, i) for i in (0, 1)}
                if want == got or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert got == want
            first = PrefixHasher(BLOCK, seed=0).hash(prefix)
            assert all(h in got[fetcher] for h in first)  # the fetched prefix, rebuilt from tokens
        finally:
            for sub in subs:
                sub.stop()
