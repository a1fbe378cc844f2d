"""A remote worker's pieces on their own: what its store holds (``Store.held_events``,
re-announced to each conductor that attaches), the control links conductors open to it
(``ConductorLinks``: one conductor at a time, a replaced one's messages dropped), and
``mooncake-rs worker --kv-events`` publishing its store events (vLLM's ZMQ format) while
it serves a conductor."""

from __future__ import annotations

import random
import socket
import tempfile

import numpy as np
import pytest

from mooncake_rs import Conductor, ConductorConfig, Store, StoreEvents
from mooncake_rs.deploy.worker_link import ConductorLinks
from mooncake_rs.serving.control import CLUSTER, Detached
from mooncake_rs.base.params import SamplingParams
from mooncake_rs.serving.protocol import Attach, Codec, Expect, KvReady, PrefillReport, Relay, Stats

BLOCK_BYTES = 4096


def _indexed(events: bytes, keys: list[int]) -> dict[int, set[str]]:
    """What a fresh conductor's index says instance 7 holds after ``events``."""
    cond = Conductor(ConductorConfig(block_size=16))
    cond.add_prefill(7)
    cond.apply_store_events(7, StoreEvents.from_bytes(events))
    out: dict[int, set[str]] = {}
    for k in keys:
        for i, t in cond.index.holders(k):
            if i == 7:
                out.setdefault(k, set()).add(t)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_events_index_like_every_event_through_eviction_demotion_and_removal(seed: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as ssd:
        store = Store(block_bytes=BLOCK_BYTES, dram_bytes=8 * BLOCK_BYTES, ssd_path=ssd, ssd_bytes=16 * BLOCK_BYTES)
        keys = [rng.getrandbits(128) for _ in range(60)]
        data = np.zeros(BLOCK_BYTES, dtype=np.uint8)
        log = b"MCE1"  # every event, in order: what a conductor there from the start applied
        mid, after = b"", b"MCE1"  # a snapshot taken mid-way, and the events drained after it
        for step in range(300):
            k = rng.choice(keys)
            op = rng.random()
            if op < 0.6:
                store.put(k, data)
            elif op < 0.8:
                blk = store.get(k)  # a hit promotes an SSD block
                if blk is not None:
                    blk.release()
            else:
                store.remove(k)
            if step == 150:  # events from before it are still queued: drained after it
                mid = bytes(store.held_events())
            if step % 7 == 0 or step == 299:
                store.flush()
                batch = bytes(store.drain_events_batch())
                log += batch[4:]
                if mid:
                    after += batch[4:]
        # a conductor that attaches now, told only the snapshot, indexes what one that
        # saw every event does; so does one told the mid-way snapshot and what followed
        want = _indexed(log, keys)
        assert _indexed(bytes(store.held_events()), keys) == want
        assert _indexed(mid + after[4:], keys) == want
        assert len(store.drain_events_batch()) == 0  # held_events drains nothing
        # and every block the store holds is in it (in its tier)
        for k in keys:
            if store.tier_of(k) is not None:
                assert store.tier_of(k) in want[k]


def _conductor_end(links: ConductorLinks) -> socket.socket:
    """A conductor's end of a new control link to ``links`` (what AuthListener hands over)."""
    ours, theirs = socket.socketpair()
    links.accept(theirs, "test")
    return ours


def _expect(rid: int) -> Expect:
    return Expect(rid, [1, 2, 3], SamplingParams(), b"", 0, None, 0)


def _recv(links: ConductorLinks, timeout: float = 5.0):
    got = links.recv(timeout)
    assert got is not None, "nothing delivered"
    return got


def test_conductor_links_serve_one_conductor_and_drop_a_replaced_ones_messages() -> None:
    codec = Codec()
    links = ConductorLinks("w")
    a = _conductor_end(links)
    a.sendall(codec.encode(_expect(1)))  # before Attach: not taken
    a.sendall(codec.encode(Attach(1, 5, "w")))
    assert _recv(links) == (CLUSTER, Attach(1, 5, "w"))
    links.adopt()
    a.sendall(codec.encode(_expect(2)) + codec.encode(Stats()))
    assert _recv(links) == (CLUSTER, _expect(2))
    assert _recv(links) == (CLUSTER, Stats())
    # a new leader connects and attaches: the old one is cut off, its late words dropped
    b = _conductor_end(links)
    a.sendall(codec.encode(_expect(3)))
    b.sendall(codec.encode(Attach(1, 0, "w")))
    src, msg = _recv(links)
    while msg != Attach(1, 0, "w"):  # _expect(3) may come first: it is still the current link's
        assert msg == _expect(3)
        src, msg = _recv(links)
    links.adopt()
    b.sendall(codec.encode(_expect(4)))
    assert _recv(links) == (CLUSTER, _expect(4))
    a.settimeout(5)
    try:  # the replaced link was closed (a reset when our last frame was still unread there)
        assert a.recv(1) == b""
    except ConnectionResetError:
        pass
    # what the worker sends goes to the current conductor only
    links.send(Stats())
    b.settimeout(5)
    hdr = b.recv(4)
    body = b.recv(codec.body_length(hdr))
    assert codec.decode_body(body) == Stats()
    # its link closing detaches the worker (it keeps running, waiting for the next one)
    b.close()
    src, msg = _recv(links)
    assert src == CLUSTER and isinstance(msg, Detached)
    assert not links.attached
    links.close()


def test_relayed_peer_messages_carry_their_source() -> None:
    codec = Codec()
    links = ConductorLinks("w")
    a = _conductor_end(links)
    a.sendall(codec.encode(Attach(1, 1, "w")))
    _recv(links)
    links.adopt()
    ready = KvReady(7, 42, "prefill", PrefillReport(0, 0, 0, 0.0, 0.0, 0.0))
    a.sendall(codec.encode(Relay(4, ready)))
    assert _recv(links) == (4, ready)
    links.peers.get(4).send(ready)  # to peer 4, through the conductor
    a.settimeout(5)
    hdr = a.recv(4)
    assert codec.decode_body(a.recv(codec.body_length(hdr))) == Relay(4, ready)
    links.close()


def test_a_reopened_store_announces_what_it_recovered() -> None:
    """A worker restarted on its SSD directory re-announces the blocks that survived: the
    store reports each recovered block as stored in the ssd tier."""
    with tempfile.TemporaryDirectory() as ssd:
        store = Store(block_bytes=BLOCK_BYTES, dram_bytes=2 * BLOCK_BYTES, ssd_path=ssd, ssd_bytes=16 * BLOCK_BYTES)
        keys = list(range(1, 9))
        for k in keys:
            store.put(k, np.full(BLOCK_BYTES, k, dtype=np.uint8))
        store.flush()
        del store
        reopened = Store(block_bytes=BLOCK_BYTES, dram_bytes=2 * BLOCK_BYTES, ssd_path=ssd,
                         ssd_bytes=16 * BLOCK_BYTES)
        announced = bytes(reopened.drain_events_batch())
        survived = {k for k in keys if reopened.tier_of(k) == "ssd"}
        assert survived and (len(announced) - 4) // 18 == len(survived) == reopened.stats().recovered
        assert _indexed(announced, keys) == {k: {"ssd"} for k in survived}
        assert _indexed(bytes(reopened.held_events()), keys) == {k: {"ssd"} for k in survived}
