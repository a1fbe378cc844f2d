"""KV events in over ZMQ: the SUB subscriber, sequence gaps with and without replay,
catch-up, restarts, malformed messages (a stand-in publisher on 127.0.0.1)."""

from __future__ import annotations

import random

import pytest

from mooncake_rs import InvalidArgument, PrefixHasher
from mooncake_rs.kv_events import BlockStored, Ingestor, MediumIndex, encode_batch

pytestmark = pytest.mark.timeout(60)

BS = 4

zmq = pytest.importorskip("zmq")

from interop_helpers import FakePublisher, pump  # noqa: E402

from mooncake_rs.kv_events.subscriber import KVEventSubscriber  # noqa: E402


def _store(i, toks, parent=None):
    return encode_batch([BlockStored([1000 + i], parent, toks, BS, None, "GPU")], ts=float(i), dp_rank=0)


def _stream(n, seed=0):
    """n one-block stores chained into one sequence; returns (payloads, our hashes)."""
    rng = random.Random(seed)
    toks = [rng.randrange(1000) for _ in range(n * BS)]
    pays = [_store(i, toks[i * BS:(i + 1) * BS], None if i == 0 else 1000 + i - 1) for i in range(n)]
    return pays, toks


@pytest.fixture
def pub_replay():
    p = FakePublisher(replay=True)
    yield p
    p.close()


@pytest.fixture
def pub_plain():
    p = FakePublisher(replay=False)
    yield p
    p.close()


def _subscriber(pub, replay=True, joined=True):
    """``joined``: the subscriber has done its join catch-up (on an empty buffer), so
    what a test publishes next is seen live (and ``pub.replay_requests`` starts empty)."""
    hasher = PrefixHasher(BS)
    target = MediumIndex()
    ing = Ingestor(target, slot=5, hasher=hasher)
    sub = KVEventSubscriber(pub.endpoint, ing, replay_endpoint=pub.replay_endpoint if replay else None,
                            replay_timeout_s=2.0)
    pub.wait_subscriber()
    if joined:
        sub.poll(0)
        pub.replay_requests.clear()
    return sub, ing, target, hasher


def test_subscriber_in_order(pub_plain):
    sub, ing, target, hasher = _subscriber(pub_plain, replay=False)
    with sub:
        pays, toks = _stream(6)
        for i, p in enumerate(pays):
            pub_plain.publish(i, p)
        pump(sub, lambda: sub.last_seq == 5)
        assert target.indexes["GPU"].match_prefix(hasher.hash(toks)) == {5: 6}
        assert sub.stats.gaps == 0 and sub.stats.messages == 6


def test_gap_with_replay_recovers_every_block(pub_replay):
    sub, ing, target, hasher = _subscriber(pub_replay)
    with sub:
        pays, toks = _stream(8)
        for i, p in enumerate(pays):
            pub_replay.publish(i, p, send=i not in (3, 4, 5))  # 3..5 lost on the PUB
        pump(sub, lambda: sub.last_seq == 7)
        assert pub_replay.replay_requests == [3]
        assert sub.stats.gaps == 1 and sub.stats.replayed >= 3 and sub.stats.replay_failures == 0
        assert ing.stats().resets == 0
        assert target.indexes["GPU"].match_prefix(hasher.hash(toks)) == {5: 8}


def test_gap_without_replay_drops_the_instance_and_rebuilds(pub_plain):
    sub, ing, target, hasher = _subscriber(pub_plain, replay=False)
    with sub:
        pays, toks = _stream(6)
        for i in range(3):
            pub_plain.publish(i, pays[i])
        pump(sub, lambda: sub.last_seq == 2)
        gpu = target.indexes["GPU"]
        assert gpu.match_prefix(hasher.hash(toks)) == {5: 3}
        # seq 3 lost; seq 4 chains on block 3, which we never saw: after the reset it is
        # an orphan; a fresh root store (seq 5) is indexed again.
        pub_plain.publish(4, pays[4])
        fresh = [7, 7, 7, 7]
        pub_plain.publish(5, _store(50, fresh))
        pump(sub, lambda: sub.last_seq == 5)
        assert sub.stats.gaps == 1 and sub.stats.replay_failures == 1 and ing.stats().resets == 1
        assert ing.stats().orphans == 1
        assert gpu.match_prefix(hasher.hash(toks)) == {}
        assert gpu.match_prefix(hasher.hash(fresh)) == {5: 1}


def test_gap_whose_data_is_gone_from_the_replay_buffer_resets():
    pub = FakePublisher(replay=True, keep=2)  # the engine keeps only 2 batches
    try:
        sub, ing, target, hasher = _subscriber(pub)
        with sub:
            pays, toks = _stream(8)
            pub.publish(0, pays[0])
            pump(sub, lambda: sub.last_seq == 0)
            for i in range(1, 8):
                pub.publish(i, pays[i], send=i == 7)
            pump(sub, lambda: sub.last_seq == 7)
            assert sub.stats.gaps == 1 and sub.stats.replay_failures == 1 and ing.stats().resets == 1
            assert target.indexes["GPU"].match_prefix(hasher.hash(toks)) == {}
    finally:
        pub.close()


@pytest.mark.parametrize("keep", [None, 2])
def test_joining_a_running_engine_catches_up_from_its_replay_buffer(keep):
    pub = FakePublisher(replay=True, keep=keep)
    try:
        pays, toks = _stream(6)
        for i in range(5):
            pub.publish(i, pays[i], send=False)  # published before we subscribed
        sub, ing, target, hasher = _subscriber(pub, joined=False)
        with sub:
            pub.publish(5, pays[5])
            pump(sub, lambda: sub.last_seq == 5)
            gpu = target.indexes["GPU"]
            assert pub.replay_requests == [0] and ing.stats().resets == 0 and sub.stats.gaps == 0
            if keep is None:
                assert gpu.match_prefix(hasher.hash(toks)) == {5: 6}
            else:  # the engine kept only seq 4..5: their parents are unknown to us
                assert sub.stats.replayed == 2 and ing.stats().orphans == 2 and len(gpu) == 0
    finally:
        pub.close()


def test_restart_and_malformed_messages(pub_plain):
    sub, ing, target, hasher = _subscriber(pub_plain, replay=False)
    with sub:
        pays, toks = _stream(3)
        for i in range(3):
            pub_plain.publish(i, pays[i])
        pump(sub, lambda: sub.last_seq == 2)
        pub_plain.send_raw([b"", (3).to_bytes(8, "big"), b"\x93\x01"])  # truncated batch
        pub_plain.send_raw([b"only one frame"])
        pump(sub, lambda: sub.stats.malformed == 2)
        assert sub.last_seq == 3 and ing.stats().resets == 0  # no gap: seq 3 was seen
        pub_plain.publish(0, _store(0, [9, 9, 9, 9]))  # the engine restarted
        pump(sub, lambda: sub.stats.restarts == 1)
        gpu = target.indexes["GPU"]
        assert ing.stats().resets == 1 and gpu.match_prefix(hasher.hash(toks)) == {}
        assert gpu.match_prefix(hasher.hash([9, 9, 9, 9])) == {5: 1}


def test_background_thread_stops(pub_plain):
    sub, ing, target, hasher = _subscriber(pub_plain, replay=False)
    sub.start()
    try:
        pays, toks = _stream(4)
        for i, p in enumerate(pays):
            pub_plain.publish(i, p)
        import time

        deadline = time.monotonic() + 5
        while sub.last_seq != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert target.indexes["GPU"].match_prefix(hasher.hash(toks)) == {5: 4}
    finally:
        sub.stop()
    assert sub._thread is None


def test_subscriber_bad_arguments():
    ing = Ingestor(MediumIndex(), 0, PrefixHasher(BS))
    with pytest.raises(InvalidArgument):
        KVEventSubscriber("", ing)
    with pytest.raises(InvalidArgument):
        KVEventSubscriber("not-an-endpoint", ing)
    with pytest.raises(InvalidArgument):
        KVEventSubscriber("tcp://127.0.0.1:1", ing, replay_timeout_s=0)


# --- what vLLM 0.32 really does --------------------------------------------------------


def test_gap_recovered_from_a_vllm_shaped_replay():
    """vLLM's ROUTER answers [topic, seq, payload] and ends with [b"", END, b""]."""
    pub = FakePublisher(replay=True, reply_shape="vllm")
    try:
        sub, ing, target, hasher = _subscriber(pub)
        pays, toks = _stream(6, seed=3)
        for i, p in enumerate(pays):
            pub.publish(i, p, send=i not in (2, 3))  # 2 and 3 are lost on the wire
        pump(sub, lambda: sub.last_seq == 5)
        assert sub.stats.replayed >= 2 and sub.stats.replay_failures == 0 and sub.stats.gaps == 1
        assert target.index("GPU").match_prefix(hasher.hash(toks)) == {5: 6}
        sub.stop()
    finally:
        pub.close()


def test_a_replay_that_never_ends_is_cut_off_and_live_events_go_on():
    pub = FakePublisher(replay=True, endless=True)
    try:
        hasher = PrefixHasher(BS)
        target = MediumIndex()
        ing = Ingestor(target, slot=5, hasher=hasher)
        sub = KVEventSubscriber(pub.endpoint, ing, replay_endpoint=pub.replay_endpoint, replay_max_s=0.5,
                                catch_up=False)
        pub.wait_subscriber()
        pays, toks = _stream(2, seed=4)
        fresh = [random.Random(40 + i).sample(range(1000), BS) for i in (2, 3, 4)]
        pub.publish(0, pays[0])
        pub.publish(1, pays[1], send=False)  # lost: the replay is asked, and never ends
        for i, t in zip((2, 3, 4), fresh):
            pub.publish(i, _store(i, t))  # new prompts (roots), published while it replays
        pump(sub, lambda: sub.last_seq == 4)
        assert sub.stats.replay_failures == 1 and sub.stats.gaps == 1 and ing.stats().resets == 1
        gpu = target.index("GPU")
        assert gpu.match_prefix(hasher.hash(toks)) == {}  # the gap reset what came before it
        for t in fresh:  # what came after it was applied
            assert gpu.match_prefix(hasher.hash(t)) == {5: 1}
        sub.stop()
    finally:
        pub.close()


def test_stop_interrupts_a_replay_in_progress():
    import threading
    import time

    pub = FakePublisher(replay=True, endless=True)
    try:
        ing = Ingestor(MediumIndex(), slot=5, hasher=PrefixHasher(BS))
        sub = KVEventSubscriber(pub.endpoint, ing, replay_endpoint=pub.replay_endpoint, replay_max_s=60.0,
                                catch_up=False)
        pub.wait_subscriber()
        pays, _ = _stream(3, seed=5)
        pub.publish(0, pays[0])
        pub.publish(1, pays[1], send=False)
        sub.start()
        pub.publish(2, pays[2])  # the gap: a replay that would run for a minute
        deadline = time.monotonic() + 5
        while not pub.replay_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.replay_requests, "the subscriber never asked for a replay"
        thread = sub._thread
        assert isinstance(thread, threading.Thread)
        t0 = time.monotonic()
        sub.stop(timeout_s=5.0)
        assert not thread.is_alive() and time.monotonic() - t0 < 3.0
    finally:
        pub.close()


def test_joining_catches_up_before_any_live_message(pub_replay):
    pays, toks = _stream(4, seed=6)
    for i, p in enumerate(pays):
        pub_replay.publish(i, p, send=False)  # published before we joined; nothing live follows
    sub, ing, target, hasher = _subscriber(pub_replay, joined=False)
    assert not sub.stats.caught_up  # what /stats shows a client until the history is in
    sub.poll(0.2)
    assert target.index("GPU").match_prefix(hasher.hash(toks)) == {5: 4}
    assert sub.stats.replayed == 4 and sub.last_seq == 3 and sub.stats.caught_up
    sub.stop()


def test_a_publisher_that_goes_away_takes_its_entries_with_it():
    pub = FakePublisher(replay=False)
    sub, ing, target, hasher = _subscriber(pub, replay=False)
    pays, toks = _stream(3, seed=7)
    for i, p in enumerate(pays):
        pub.publish(i, p)
    pump(sub, lambda: sub.last_seq == 2)
    assert target.index("GPU").match_prefix(hasher.hash(toks)) == {5: 3}
    pub.close()  # the engine stopped: its cache is gone
    pump(sub, lambda: sub.stats.disconnects == 1)
    assert target.index("GPU").match_prefix(hasher.hash(toks)) == {}
    assert sub.last_seq is None
    sub.stop()


def test_a_block_size_mismatch_is_said_once_with_both_sizes(pub_plain, caplog):
    sub, ing, target, hasher = _subscriber(pub_plain)
    wrong = [encode_batch([BlockStored([i], None, list(range(2 * BS)), 2 * BS, None, "GPU")]) for i in range(3)]
    with caplog.at_level("WARNING", logger="mooncake_rs.kv_events"):
        for i, p in enumerate(wrong):
            pub_plain.publish(i, p)
        pump(sub, lambda: sub.last_seq == 2)
    said = [r.getMessage() for r in caplog.records if "blocks of" in r.getMessage()]
    assert len(said) == 1 and f"blocks of {2 * BS} tokens, we hash blocks of {BS}" in said[0]
    assert ing.stats().mismatched == 3
    sub.stop()
