"""Large remote batches cut into waves (pool/waves.py): the cut itself, and a node
answering a waved batch exactly as it answers the same batch sent whole (statuses, bytes,
put-if-absent, missing keys, a too-small buffer, a full node)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, value_of

import mooncake_rs.pool.waves as waves_mod
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import Lookup, Reserve
from mooncake_rs.pool.waves import WAVE_MIN_BYTES, waves

pytestmark = [pytest.mark.timeout(120)]


def test_waves_cover_the_batch_in_order_small_first_and_last():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(0, 40)
        nbytes = [rng.choice([1, 5000, 300_000, 600_000, 5 << 20]) for _ in range(n)]
        idx = sorted(rng.sample(range(n), rng.randrange(0, n + 1))) if n else []
        out = waves(idx, nbytes)
        assert [i for w in out for i in w] == idx  # every key once, in order
        assert all(out)  # no empty wave
        assert len(out) <= 5
        if sum(nbytes[i] for i in idx) < WAVE_MIN_BYTES or len(idx) < 2:
            assert len(out) == (1 if idx else 0)
    even = waves(list(range(32)), [512 << 10] * 32)
    assert [len(w) for w in even] == [4, 8, 8, 8, 4]  # 1/8, 1/4, 1/4, 1/4, 1/8 of the bytes


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="w", listen="127.0.0.1:0", dram_bytes=48 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix="/mooncake/waves", chunk_bytes=64 << 10) as n:
        yield n


def _scenario(s: DistributedStore, tag: str) -> tuple[list, list, list[bytes]]:
    """Puts and gets a batch of ~12 MB with keys held already, then reads it back with
    missing keys and a buffer too small; returns (put statuses, get statuses, bytes)."""
    sizes = [300_000 + 40_961 * i for i in range(24)]
    keys = [f"{tag}-{i}" for i in range(len(sizes))]
    held = [keys[3], keys[11], keys[22]]
    for k in held:  # put-if-absent: these keep their first bytes
        first = value_of("first-" + k, 70_000)
        assert s.batch_put_from([k], [[first.ctypes.data]], [[first.nbytes]]) == [KeyStatus.OK]
    vals = [value_of(k, n) for k, n in zip(keys, sizes)]
    put = s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals])
    want = keys[:5] + [f"{tag}-missing-a"] + keys[5:17] + [f"{tag}-missing-b"] + keys[17:]
    room = [70_000 if k in held else (sizes[keys.index(k)] if k in keys else 1000) for k in want]
    room[want.index(keys[8])] -= 1  # too small for its value: INVALID, nothing read
    dst = [np.zeros(n, np.uint8) for n in room]
    got = s.batch_get_into(want, [[d.ctypes.data] for d in dst], [[d.nbytes] for d in dst])
    return [int(x) for x in put], [int(x) for x in got], [d.tobytes() for d in dst]


def test_a_waved_batch_answers_as_the_whole_batch_does(etcd_url, node, monkeypatch):
    with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/waves", transports=("tcp",)) as s:
        sent: list[tuple[str, int]] = []
        asked = s.backend.nodes.asked

        def counting(n, make, **fields):
            if make in (Reserve, Lookup):
                sent.append((make.__name__, len(fields["keys"])))
            return asked(n, make, **fields)

        monkeypatch.setattr(s.backend.nodes, "asked", counting)
        waved = _scenario(s, "a")
        assert sum(1 for m, _ in sent if m == "Reserve") > 1 and sum(1 for m, _ in sent if m == "Lookup") > 1
        sent.clear()
        monkeypatch.setattr(waves_mod, "WAVE_MIN_BYTES", 1 << 62)  # the reference: one request a node
        whole = _scenario(s, "b")
        assert sum(1 for m, _ in sent if m == "Reserve") == 1 + 3  # the batch, and the three held keys
    assert waved[0] == whole[0] == [int(KeyStatus.OK)] * 24
    assert waved[1] == whole[1]
    assert waved[1][9] == int(KeyStatus.INVALID) and waved[1][5] == waved[1][18] == int(KeyStatus.MISSING)
    # byte for byte against the values themselves (keys differ by tag between the runs)
    for tag, (_, got, data) in (("a", waved), ("b", whole)):
        sizes = [300_000 + 40_961 * i for i in range(24)]
        keys = [f"{tag}-{i}" for i in range(24)]
        want = keys[:5] + [None] + keys[5:17] + [None] + keys[17:]
        for k, g, d in zip(want, got, data):
            if k is None or g < 0:
                continue
            i = keys.index(k)
            ref = value_of("first-" + k, 70_000) if i in (3, 11, 22) else value_of(k, sizes[i])
            assert d == ref.tobytes(), k


def test_a_waved_batch_on_a_full_node_refuses_the_same_keys(etcd_url, node, monkeypatch):
    outcomes = []
    for tag, min_bytes in (("full-a", WAVE_MIN_BYTES), ("full-b", 1 << 62)):
        monkeypatch.setattr(waves_mod, "WAVE_MIN_BYTES", min_bytes)
        with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/waves",
                                      transports=("tcp",)) as s:
            s.remove_all()
            keys = [f"{tag}-{i}" for i in range(20)]
            vals = [value_of(k, 3_000_000) for k in keys]  # 60 MB into a 48 MB node, pinned: some refused
            st = s.batch_put_from(keys, [[v.ctypes.data] for v in vals], [[v.nbytes] for v in vals], pin=True)
            outcomes.append([int(x) for x in st])
            dst = [np.zeros(v.nbytes, np.uint8) for v in vals]
            got = s.batch_get_into(keys, [[d.ctypes.data] for d in dst], [[d.nbytes] for d in dst])
            for k, g, d, v in zip(keys, got, dst, vals):
                assert (g == v.nbytes and np.array_equal(d, v)) or (g < 0 and not d.any()), k
            s.remove_all()
    assert outcomes[0] == outcomes[1]
    assert int(KeyStatus.NO_SPACE) in outcomes[0] and int(KeyStatus.OK) in outcomes[0]
