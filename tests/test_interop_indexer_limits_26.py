"""Issue 26, item 5: the indexer API's resource limits. Bodies are capped, registrations
are capped, engine hashes given as bytes are bounded, and bad values are 400 naming the
field (``block_size`` >= 2**63 was a 500 with a reset connection)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
import msgspec  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from mooncake_rs.errors import MalformedEvent  # noqa: E402
from mooncake_rs.interop.indexer import Indexer  # noqa: E402
from mooncake_rs.interop.indexer_api import RegisterRequest  # noqa: E402
from mooncake_rs.kv_events.events import MAX_ENGINE_HASH_BYTES, decode_payload  # noqa: E402
from mooncake_rs.interop.http import MAX_BODY, create_app  # noqa: E402
from mooncake_rs.interop.indexer_api import MAX_QUERY_HASHES, MAX_QUERY_TOKENS  # noqa: E402


def reg(i: int, **kw):
    return {"endpoint": f"tcp://127.0.0.1:{5000 + i}", "type": "vLLM", "modelname": "m", "instance_id": f"i{i}",
            "block_size": 16, **kw}


@pytest.fixture
def client():
    with TestClient(create_app(Indexer(subscribe=False, max_publishers=4)), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path, body, field", [
    ("/register", reg(0, block_size=2 ** 63), "block_size"),
    ("/register", reg(0, block_size=0), "block_size"),
    ("/register", reg(0, dp_rank=2 ** 40), "dp_rank"),
    ("/register", reg(0, instance_id="x" * 5000), "instance_id"),
    ("/query", {"model": "m", "block_size": 2 ** 63, "token_ids": [1, 2]}, "block_size"),
    ("/query", {"model": "m", "block_size": 2 ** 64 + 5, "token_ids": [1, 2]}, "block_size"),
    ("/query", {"model": "m", "block_size": 16, "token_ids": [1, 2 ** 40]}, "token_ids"),
    ("/query", {"model": "m", "block_size": 16, "token_ids": [0] * (MAX_QUERY_TOKENS + 1)}, "token_ids"),
    ("/query_by_hash", {"model": "m", "block_size": 2 ** 63, "seq_hashes": [1]}, "block_size"),
    ("/query_by_hash", {"model": "m", "block_size": 16, "seq_hashes": [1] * (MAX_QUERY_HASHES + 1)},
     "seq_hashes"),
    ("/unregister", {"instance_id": "i0", "dp_rank": -1}, "dp_rank"),
])
def test_bad_values_are_400_naming_the_field(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]


def test_a_body_past_the_cap_is_413_without_reading_it_whole(client):
    big = b'{"model": "m", "block_size": 16, "token_ids": [' + b"1," * (MAX_BODY // 2) + b"1]}"
    r = client.post("/query", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]

    def chunks():  # no Content-Length: the stream is cut at the cap
        for _ in range(MAX_BODY // (1 << 16) + 2):
            yield b" " * (1 << 16)

    r = client.post("/query", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_registrations_are_capped_and_a_reregistration_is_no_new_one(client):
    for i in range(4):
        assert client.post("/register", json=reg(i)).status_code == 200
    assert client.post("/register", json=reg(0)).status_code == 200  # replaces i0
    r = client.post("/register", json=reg(9))
    assert r.status_code == 429 and "max-publishers" in r.json()["error"]
    assert client.post("/unregister", json={"instance_id": "i1"}).status_code == 200
    assert client.post("/register", json=reg(9)).status_code == 200
    assert len(client.get("/stats").json()) == 4


def test_engine_hashes_as_bytes_are_bounded():
    ok = msgspec.msgpack.encode([1.0, [["BlockRemoved", [b"\x01" * MAX_ENGINE_HASH_BYTES]]]])
    assert decode_payload(ok).events[0].block_hashes == [b"\x01" * MAX_ENGINE_HASH_BYTES]
    long = msgspec.msgpack.encode([1.0, [["BlockRemoved", [b"\x01" * 65536]]]])
    with pytest.raises(MalformedEvent):
        decode_payload(long)
    indexer = Indexer(subscribe=False)
    indexer.register(msgspec.convert(reg(0), type=RegisterRequest))
    member = indexer._member("default", "i0", 0)
    with pytest.raises(MalformedEvent):  # the Rust decoder of the subscriber's fast path
        member.ingestor.apply_payload(long)
    assert len(member.ingestor.map) == 0
