"""The Mooncake Conductor Indexer API: answers against a brute-force model of random event
streams, registration, errors, and the whole path from a ZMQ publisher."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from mooncake_rs import Xxh3RollingHasher  # noqa: E402
from mooncake_rs.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload, encode_batch  # noqa: E402
from mooncake_rs.interop.http import create_app  # noqa: E402
from mooncake_rs.interop.indexer import Indexer  # noqa: E402
from ports import free_port  # noqa: E402


pytestmark = pytest.mark.timeout(120)

BS = 4
MODEL = "m"
MEDIA = ["GPU", "CPU", "DISK"]
WIRE_MEDIUM = {"GPU": [None, "GPU", "gpu"], "CPU": ["CPU", "cpu", "CPU_PINNED"], "DISK": ["DISK", "disk"]}
# (tenant, instance, dp): instance "b" has two DP ranks; tenant t2 has its own "a".
PUBS = [("default", "a", 0), ("default", "b", 0), ("default", "b", 1), ("default", "c", 0), ("t2", "a", 0)]


def reg_body(tenant, inst, dp, **kw):
    body = {"endpoint": "tcp://127.0.0.1:1", "type": "vLLM", "modelname": MODEL, "tenant_id": tenant,
            "instance_id": inst, "block_size": BS, "dp_rank": dp}
    body.update(kw)
    return body


def engine_hash(pub, prefix):
    """An engine's opaque hash of a prefix: ints for some publishers, bytes for others."""
    d = hashlib.sha256(repr((pub, prefix)).encode()).digest()
    return d if pub[1] == "b" else int.from_bytes(d[:8], "little") - (1 << 63)  # i64, like old vLLM


class Model:
    """What every (publisher, medium) holds, as sets of token-prefix tuples."""

    def __init__(self):
        self.held = {(p, m): set() for p in PUBS for m in MEDIA}
        self.known = {p: set() for p in PUBS}  # engine hashes we can still translate

    def answer(self, tenant, tokens, instance=None):
        n = len(tokens) // BS
        prefixes = [tuple(tokens[: (k + 1) * BS]) for k in range(n)]

        def longest(cells):
            L = 0
            while L < n and any(prefixes[L] in self.held[c] for c in cells):
                L += 1
            return L * BS

        out = {}
        for inst in sorted({p[1] for p in PUBS if p[0] == tenant}):
            if instance is not None and inst != instance:
                continue
            pubs = [p for p in PUBS if p[0] == tenant and p[1] == inst]
            e = {"longest_matched": longest([(p, m) for p in pubs for m in MEDIA])}
            for m in MEDIA:
                e[m] = longest([(p, m) for p in pubs])
            e["DP"] = {str(p[2]): longest([(p, m) for m in MEDIA]) for p in pubs}
            out[inst] = e
        return {tenant: out}


def random_stream(rng, model, docs, steps):
    """Yields (publisher, batch payload) and updates the model as the engine would."""
    for _ in range(steps):
        pub = rng.choice(PUBS)
        r = rng.random()
        events = []
        for _ in range(rng.randint(1, 3)):
            medium = rng.choice(MEDIA)
            if r < 0.6:  # store a run of consecutive blocks whose parent we know
                doc = rng.choice(docs)
                nb = len(doc) // BS
                starts = [i for i in range(nb) if i == 0 or tuple(doc[:i * BS]) in model.known[pub]]
                i = rng.choice(starts)
                j = rng.randint(i + 1, min(nb, i + 4))
                prefixes = [tuple(doc[:(k + 1) * BS]) for k in range(i, j)]
                parent = None if i == 0 else engine_hash(pub, tuple(doc[:i * BS]))
                events.append(BlockStored([engine_hash(pub, p) for p in prefixes], parent, doc[i * BS:j * BS], BS,
                                          None, rng.choice(WIRE_MEDIUM[medium])))
                model.held[(pub, medium)].update(prefixes)
                model.known[pub].update(prefixes)
            elif r < 0.95:  # evict some blocks (plus one we never stored)
                held = sorted(model.held[(pub, medium)])
                gone = rng.sample(held, min(len(held), rng.randint(1, 4)))
                hashes = [engine_hash(pub, p) for p in gone] + [engine_hash(pub, ("never",))]
                events.append(BlockRemoved(hashes, rng.choice(WIRE_MEDIUM[medium])))
                model.held[(pub, medium)].difference_update(gone)
            else:
                events.append(AllBlocksCleared())
                for m in MEDIA:
                    model.held[(pub, m)].clear()
                model.known[pub].clear()
        yield pub, encode_batch(events, form=rng.choice(["positional", "map"]), dp_rank=pub[2])


@pytest.fixture
def client():
    indexer = Indexer(subscribe=False)
    with TestClient(create_app(indexer)) as c:
        for p in PUBS:
            r = c.post("/register", json=reg_body(*p))
            assert r.status_code == 200, r.text
            assert r.json() == {"status": "registered successfully", "instance_id": p[1]}
        yield c, indexer


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_answers_match_brute_force_on_random_streams(client, seed):
    c, indexer = client
    rng = random.Random(seed)
    # Documents sharing prefixes: a few roots, each extended in several ways.
    roots = [[rng.randrange(500) for _ in range(rng.randint(1, 3) * BS)] for _ in range(3)]
    docs = [r + [rng.randrange(500) for _ in range(rng.randint(1, 5) * BS)] for r in roots for _ in range(3)]
    model = Model()
    hasher = Xxh3RollingHasher(BS, 0)
    for step, (pub, payload) in enumerate(random_stream(rng, model, docs, 300)):
        indexer.ingest(*pub, decode_payload(payload))
        if step % 10:
            continue
        doc = rng.choice(docs)
        q = doc[: rng.randint(0, len(doc))] + [rng.randrange(500) for _ in range(rng.randint(0, 2 * BS))]
        for tenant in ("default", "t2"):
            body = {"model": MODEL, "block_size": BS, "token_ids": q, "tenant_id": tenant}
            got = c.post("/query", json=body)
            assert got.status_code == 200, got.text
            assert got.json() == model.answer(tenant, q)
            byhash = c.post("/query_by_hash", json={"model": MODEL, "block_size": BS, "tenant_id": tenant,
                                                    "seq_hashes": hasher.hash(q)})
            assert byhash.json() == model.answer(tenant, q)
        one = c.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": q, "instance_id": "b"})
        assert one.json() == model.answer("default", q, instance="b")
    for inst in indexer._groups.values():
        for idx in inst.media.indexes.values():
            idx.check_integrity()


def test_union_across_media_goes_past_the_longest_medium(client):
    c, indexer = client
    doc = list(range(3 * BS))
    a = ("default", "a", 0)
    h = [engine_hash(a, tuple(doc[:(k + 1) * BS])) for k in range(3)]
    indexer.ingest(*a, decode_payload(encode_batch([
        BlockStored(h[:3], None, doc, BS, None, "GPU"),
        BlockStored(h[1:2], h[0], doc[BS:2 * BS], BS, None, "CPU"),
        BlockRemoved(h[1:2], "GPU")])))
    got = c.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": doc}).json()["default"]["a"]
    # GPU holds blocks 0 and 2, CPU block 1: 3 blocks over both media.
    assert got == {"longest_matched": 3 * BS, "GPU": BS, "CPU": 0, "DISK": 0, "DP": {"0": 3 * BS}}


def test_groups_isolate_models_block_sizes_lora_and_salt(client):
    c, indexer = client
    doc = list(range(2 * BS))
    a = ("default", "a", 0)
    indexer.ingest(*a, decode_payload(encode_batch([BlockStored([1, 2], None, doc, BS, None, "GPU")])))
    base = {"model": MODEL, "block_size": BS, "token_ids": doc}
    assert c.post("/query", json=base).json()["default"]["a"]["longest_matched"] == 2 * BS
    for other in ({"model": "other"}, {"block_size": 2 * BS}):
        assert c.post("/query", json={**base, **other}).json() == {"default": {}}
    # A request's adapter or salt, with no group registered under it, is folded into the
    # hashes as vLLM folds it (one engine, many adapters and tenants): the plain group's
    # instances answer, and its unsalted blocks are no hit.
    for other in ({"lora_name": "sql"}, {"cache_salt": "w8a8"}, {"lora_name": "sql", "cache_salt": "w8a8"}):
        got = c.post("/query", json={**base, **other}).json()["default"]
        assert got["a"] == {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}}
        assert all(v["longest_matched"] == 0 for v in got.values())
    # A salted registration is its own group.
    assert c.post("/register", json=reg_body("default", "s", 0, additionalsalt="w8a8")).status_code == 200
    got = c.post("/query", json={**base, "cache_salt": "w8a8"}).json()
    assert got == {"default": {"s": {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}}}}


def test_unregister_and_reregister(client):
    c, indexer = client
    doc = list(range(BS))
    indexer.ingest("default", "b", 1, decode_payload(encode_batch([BlockStored([b"x"], None, doc, BS, None, None)])))
    q = {"model": MODEL, "block_size": BS, "token_ids": doc}
    assert c.post("/query", json=q).json()["default"]["b"]["DP"] == {"0": 0, "1": BS}
    r = c.post("/unregister", json={"type": "vLLM", "modelname": MODEL, "instance_id": "b", "block_size": BS,
                                    "dp_rank": 1})
    assert r.json() == {"status": "unregistered successfully", "removed_instances": ["b|default|1"]}
    got = c.post("/query", json=q).json()["default"]["b"]
    assert got["DP"] == {"0": 0} and got["longest_matched"] == 0
    r = c.post("/unregister", json={"instance_id": "b"})  # every remaining DP rank
    assert r.json()["removed_instances"] == ["b|default|0"]
    assert "b" not in c.post("/query", json=q).json()["default"]
    assert c.post("/unregister", json={"instance_id": "b"}).json()["removed_instances"] == []
    # Registering again replaces the old subscription and its entries.
    indexer.ingest("default", "a", 0, decode_payload(encode_batch([BlockStored([5], None, doc, BS, None, None)])))
    assert c.post("/register", json=reg_body("default", "a", 0)).status_code == 200
    assert c.post("/query", json=q).json()["default"]["a"]["longest_matched"] == 0
    assert "a|default|0" in c.get("/stats").json()


def test_bad_requests_are_400_with_a_reason(client):
    c, _ = client
    bad = [
        ("/register", b"{not json"),
        ("/register", {"endpoint": "tcp://x:1"}),  # required fields missing
        ("/register", reg_body("default", "z", 0, block_size=0)),
        ("/register", reg_body("default", "z", -1)),
        ("/query", {"model": MODEL, "block_size": BS}),
        ("/query", {"model": MODEL, "block_size": BS, "token_ids": ["a"]}),
        ("/query", {"model": MODEL, "block_size": BS, "token_ids": [-1, 2, 3, 4]}),
        ("/query", {"model": MODEL, "block_size": 0, "token_ids": []}),
        ("/query", {"model": MODEL, "block_size": BS, "token_ids": [], "lora_id": 3}),
        ("/query_by_hash", {"model": MODEL, "block_size": BS}),
        ("/query_by_hash", {"model": MODEL, "block_size": BS, "seq_hashes": [2**64]}),
        ("/unregister", {}),
    ]
    for path, body in bad:
        r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]
    # The older name of seq_hashes is accepted.
    r = c.post("/query_by_hash", json={"model": MODEL, "block_size": BS, "block_hash": [1, 2]})
    assert r.status_code == 200 and r.json()["default"]["a"]["longest_matched"] == 0
    assert c.get("/health").json() == {"status": "ok"}


def test_events_from_a_zmq_publisher_reach_the_query():
    pytest.importorskip("zmq")
    from interop_helpers import FakePublisher

    pub = FakePublisher(replay=True)
    indexer = Indexer(subscribe=True)
    try:
        with TestClient(create_app(indexer)) as c:
            r = c.post("/register", json=reg_body("default", "vllm-0", 0, endpoint=pub.endpoint,
                                                  replay_endpoint=pub.replay_endpoint))
            assert r.status_code == 200
            pub.wait_subscriber()
            # The subscriber catches up at join (a replay from the start) on its thread; wait
            # for that request, so what follows is live and seq 1 is a gap, not history (under
            # load the join could otherwise come after the three publishes below).
            deadline = time.monotonic() + 10
            while not pub.replay_requests:
                assert time.monotonic() < deadline, "the subscriber never caught up at join"
                time.sleep(0.01)
            doc = list(range(100, 100 + 3 * BS))
            pub.publish(0, encode_batch([BlockStored([10, 11], None, doc[:2 * BS], BS, None, "GPU")]))
            pub.publish(1, encode_batch([BlockStored([12], 11, doc[2 * BS:], BS, None, "CPU")], form="map"),
                        send=False)  # lost: recovered by replay
            pub.publish(2, encode_batch([BlockRemoved([10], "GPU")]))
            q = {"model": MODEL, "block_size": BS, "token_ids": doc}
            deadline = time.monotonic() + 10
            while True:
                stats = c.get("/stats").json()["vllm-0|default|0"]
                done = stats["stored_blocks"] == 3 and stats["removed_blocks"] == 1 and stats["messages"] == 2
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            # seq 1 came back through the replay (seq 2 with it; its SUB copy is a duplicate).
            assert stats["gaps"] == 1 and stats["replayed"] >= 1 and stats["resets"] == 0
            assert stats["stored_blocks"] == 3 and stats["removed_blocks"] == 1
            got = c.post("/query", json=q).json()["default"]["vllm-0"]
            # Block 0 left the GPU: nothing matches from the start...
            assert got["longest_matched"] == 0
            # ...but a prompt whose chain passes through it would; check the index directly.
            hs = Xxh3RollingHasher(BS).hash(doc)
            media = next(iter(indexer._groups.values())).media.indexes
            assert media["GPU"].match_prefix(hs[1:2]) and media["CPU"].match_prefix(hs[2:])
    finally:
        indexer.close()
        pub.close()


def test_cli_indexer_serves_http():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_rs", "indexer", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        assert r.json() == {"status": "ok"}
        r = httpx.post(f"http://127.0.0.1:{port}/query", json={"model": "x", "block_size": 4, "token_ids": [1]})
        assert r.json() == {"default": {}}
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "mooncake_rs", "indexer", "--listen", "nohost"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


def test_mooncake_hash_option_and_bad_options():
    from mooncake_rs import InvalidArgument, PrefixHasher

    indexer = Indexer(hash="mooncake", seed=5, subscribe=False)
    with TestClient(create_app(indexer)) as c:
        assert c.post("/register", json=reg_body("default", "a", 0)).status_code == 200
        doc = list(range(3 * BS))
        indexer.ingest("default", "a", 0, decode_payload(encode_batch([BlockStored([1, 2, 3], None, doc, BS)])))
        want = {"default": {"a": {"longest_matched": 3 * BS, "GPU": 3 * BS, "CPU": 0, "DISK": 0,
                                  "DP": {"0": 3 * BS}}}}
        assert c.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": doc}).json() == want
        ours = PrefixHasher(BS, seed=5).hash(doc)  # 128-bit hashes are accepted in this mode
        got = c.post("/query_by_hash", json={"model": MODEL, "block_size": BS, "seq_hashes": ours})
        assert got.json() == want
    for bad in ({"hash": "md5"}, {"seed": -1}):
        with pytest.raises(InvalidArgument):
            Indexer(subscribe=False, **bad)
