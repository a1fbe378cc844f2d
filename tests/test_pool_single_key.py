"""The single-key paths of a small call (the facade's ``put`` / ``get``, ``DistributedStore
.put_status`` / ``get_or_none``, ``RemoteBackend.put_one`` / ``get_one``) against the batch
paths they skip, as references: the same statuses, values and errors on random inputs, and
on a node answering short, refusing or not at all; and the node's dispatch by message type
against every type of the request union."""

from __future__ import annotations

import random
import typing

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN

from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.node import StoreNode
from mooncake_rs.pool.protocol import (INLINE_MAX, Answer, Exists, Failure, GetValue, Leased, Lookup, NodeRequest,
                                       PutInline, Request, Value)
from mooncake_rs.pool.remote import RemoteBackend

pytestmark = [pytest.mark.timeout(120)]

PREFIX = "/mooncake/single"


@pytest.fixture
def node(etcd_url):
    with StoreNode(name="single", listen="127.0.0.1:0", dram_bytes=16 << 20, auth_token=TOKEN, etcd=etcd_url,
                   prefix=PREFIX, chunk_bytes=64 << 10) as n:
        yield n


def _facade(pool: DistributedStore) -> MooncakeDistributedStore:
    f = MooncakeDistributedStore()
    f._store = pool
    return f


def test_single_key_calls_answer_as_the_batch_calls_against_a_node(etcd_url, node):
    """Random keys, values of every kind and size (inline, past INLINE_MAX, empty, not a
    buffer), bad keys, replica counts: the facade's ``put`` returns what ``put_batch`` of
    one key returns, ``get`` what ``get_batch`` returns; ``put_status`` / ``get_or_none``
    what the batch calls return, or the same exception."""
    rng = random.Random(24)
    with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX, transports=("tcp",)) as pool:
        f = _facade(pool)
        keys = [f"k{i}" for i in range(40)] + ["", 7, None, b"bytes-key"]
        made = [lambda b: b, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8)]
        for trial in range(300):
            key = rng.choice(keys)
            size = rng.choice([0, 1, 128, INLINE_MAX, INLINE_MAX + 1, 20_000])
            value: typing.Any = rng.choice(made)(rng.randbytes(size)) if trial % 23 else 12345
            replicas = rng.choice([1, 1, 2, 0])
            cfg = None
            if replicas != 1:
                from mooncake_rs.compat.mooncake_store import ReplicateConfig

                cfg = ReplicateConfig()
                cfg.replica_num = replicas
            twin = f"twin-{trial}" if isinstance(key, str) and key else key  # (a fresh key for the reference)
            assert f.put(key, value, cfg) == f.put_batch([twin], [value], cfg), (key, size, replicas)
            assert f.get(key) == f.get_batch([key])[0]
            assert f.get(twin) == f.get_batch([twin])[0]
            try:
                want: typing.Any = pool.batch_put_values([twin], [value], replicas=max(replicas, 1))[0]
            except Exception as e:  # noqa: BLE001 - the same type is expected below
                want = type(e)
            try:
                got: typing.Any = pool.put_status(key, value, max(replicas, 1))
            except Exception as e:  # noqa: BLE001
                got = type(e)
            assert got == want, (key, size)
            try:
                want = pool.batch_get_bytes([key])[0]
            except Exception as e:  # noqa: BLE001
                want = type(e)
            try:
                got = pool.get_or_none(key)
            except Exception as e:  # noqa: BLE001
                got = type(e)
            assert got == want
        with pytest.raises(InvalidArgument):
            pool.put_status("r", b"v", 0)  # (replicas < 1, as the batch call refuses it)
        assert f.get("never-put") == b"" and pool.get_or_none("never-put") is None


class _OneNode:
    """A one-node pool's links that answer each request with what the test set."""

    def __init__(self) -> None:
        self.answer: typing.Any = None
        self.asked: list[tuple[type, dict]] = []

    def live(self) -> list[str]:
        return ["one"]

    def ask_one(self, node: str, make: type, **fields: typing.Any) -> typing.Any:
        self.asked.append((make, fields))
        return self.answer


def _backend() -> RemoteBackend:
    rb = object.__new__(RemoteBackend)
    rb.nodes = _OneNode()  # type: ignore[assignment]
    rb.under_replicated = rb.replicas_lost = 0
    return rb


def test_put_one_maps_the_answer_as_put_values_does():
    """A node answering random codes, a short answer, none: ``put_one`` returns what
    ``put_values`` of one key returns, counts under-replication the same, and sends the
    same request."""
    rng = random.Random(13)
    codes = [0, 0, 0, int(KeyStatus.NO_SPACE), int(KeyStatus.INVALID), int(KeyStatus.MISSING)]
    for trial in range(300):
        answer = None if trial % 11 == 0 else Answer(1, [rng.choice(codes) for _ in range(rng.randint(0, 2))])
        replicas = rng.choice([1, 2, 3])
        fast, ref = _backend(), _backend()
        fast.nodes.answer = ref.nodes.answer = answer  # type: ignore[attr-defined]
        value = rng.randbytes(rng.randint(1, INLINE_MAX))
        assert fast.put_one("k", value, replicas, trial % 2 == 0) == ref.put_values(["k"], [value], replicas,
                                                                                      trial % 2 == 0)[0]
        assert fast.under_replicated == ref.under_replicated
        (fmake, ffields), (rmake, rfields) = fast.nodes.asked[0], ref.nodes.asked[0]  # type: ignore[attr-defined]
        assert fmake is rmake is PutInline
        assert ffields["keys"] == rfields["keys"] and ffields["pin"] == rfields["pin"]
        assert [bytes(v) for v in ffields["values"]] == [bytes(v) for v in rfields["values"]]


def test_get_one_maps_the_answer_as_the_ranked_path_does():
    """A node answering a hit (inline bytes), a miss, an error status, or not at all:
    ``get_one`` returns what the ranked many-key path returns for the key, and counts a
    node that could not answer the same."""
    rng = random.Random(17)
    for trial in range(200):
        kind = rng.choice(["hit", "miss", "error", "none"])
        data = rng.randbytes(rng.randint(1, INLINE_MAX))
        st = {"hit": 0, "miss": int(KeyStatus.MISSING), "error": int(KeyStatus.RPC_FAILED), "none": 0}[kind]
        leased = Leased(1, [st], [0], [len(data) if st == 0 else 0], [0], [0], [[]], [data if st == 0 else b""])
        value = Value(1, st, len(data), data) if st == 0 else Value(1, st)
        fast, ref = _backend(), _backend()
        fast.nodes.answer = None if kind == "none" else value  # type: ignore[attr-defined]
        ref.nodes.answer = None if kind == "none" else leased  # type: ignore[attr-defined]
        ref.ranked = __import__("mooncake_rs.pool.ranked", fromlist=["RankedAsks"]).RankedAsks(ref.nodes)
        got, want = fast.get_one("k"), ref._get_bytes_ranked(["k"])[0]
        assert got == want == (data if kind == "hit" else None)
        assert fast.replicas_lost == ref.replicas_lost
        assert fast.nodes.asked == [(GetValue, {"key": "k"})]  # type: ignore[attr-defined]
        assert ref.nodes.asked[0][0] is Lookup  # type: ignore[attr-defined]


def test_a_get_value_off_the_wire_answers_as_a_one_key_lookup(etcd_url, node):
    """A node answers ``GetValue`` with what a one-key ``Lookup`` without leases answers,
    in ``Value``'s three fields: the bytes of a small value, the size alone of one past
    ``INLINE_MAX`` (the client then reads it as the batch path does), the missing code."""
    rng = random.Random(19)
    with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX, transports=("tcp",)) as pool:
        link = pool.backend.nodes.link("single")
        for i in range(60):
            key = f"gv{i}"
            size = rng.choice([1, 128, INLINE_MAX, INLINE_MAX + 1, 70_000])
            if i % 5:
                assert pool.batch_put_values([key], [rng.randbytes(size)]) == [KeyStatus.OK]
            ref = link.call(Lookup, keys=[key], inline_max=INLINE_MAX, lease_large=False)
            got = link.call(GetValue, key=key)
            assert isinstance(got, Value) and got.rid != ref.rid
            assert (got.status, got.size if got.status == 0 else 0) == (ref.statuses[0], ref.sizes[0])
            assert got.data == (ref.data[0] if got.status == 0 and got.size <= INLINE_MAX else b"")
            assert pool.get_or_none(key) == pool.batch_get_bytes([key])[0]


def test_the_node_dispatches_every_request_type_and_refuses_others(etcd_url, node):
    """Each type of the Request union has a handler (a type left out would be refused as
    "unexpected"); a message of another type raises InvalidArgument."""
    assert set(StoreNode._handlers) == set(typing.get_args(Request)) | set(typing.get_args(NodeRequest))
    with pytest.raises(InvalidArgument, match="unexpected message"):
        node._handle(Answer(1, [0]), None)


def test_an_exists_off_the_wire_answers_as_the_list_path_and_refuses_a_bad_key_list(etcd_url, node):
    """The node answers ``Exists`` from the frame's msgpack key list (Rust): the same 1/0
    list as the in-process list path, on random keys; a key list that is not a list of str
    gets a typed refusal (the connection stays usable)."""
    import msgspec

    rng = random.Random(5)
    with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX, transports=("tcp",)) as pool:
        held = [f"e{i}" for i in range(150)]
        assert pool.batch_put_values(held, [b"v"] * 150) == [KeyStatus.OK] * 150
        link = pool.backend.nodes.link("single")
        for n in (0, 1, 15, 16, 100, 300):
            keys = rng.choices(held + [f"no{i}" for i in range(150)] + ["é" * 40], k=n)
            want = node._handle(Exists(1, keys), None).values
            assert link.call(Exists, keys=keys).values == want == [int(k in held) for k in keys]
        body = msgspec.msgpack.encode({"op": "exists", "rid": 99, "keys": ["e1", 2]})
        with link._send_lock:
            link.sock.sendall(len(body).to_bytes(4, "big") + body)
        refused = link.io.recv()
        assert isinstance(refused, Failure) and refused.rid == 99 and refused.kind == "InvalidArgument"
        assert "key 1 of the list is not a msgpack str" in refused.message
        assert link.call(Exists, keys=["e1", "zz"]).values == [1, 0]


def test_str_subclass_keys_are_their_plain_str_against_a_node(etcd_url, node):
    """A key of a str subclass (``numpy.str_``, a ``StrEnum`` member: what an integration
    may pass) names the same object as the plain str of its characters, through the facade's
    single-key and batch calls: msgpack encodes str itself only, so the client turns them
    into plain str (before, a facade ``get`` raised TypeError and a ``put`` returned -600)."""
    import enum

    class Kind(enum.StrEnum):
        A = "sub-a"

    class Tagged(str):
        def __str__(self) -> str:  # (an override must not change the key)
            return "not-the-key"

    with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=PREFIX, transports=("tcp",)) as pool:
        f = _facade(pool)
        for i, key in enumerate([np.str_("sub-np"), Kind.A, Tagged("sub-tagged")]):
            plain = "".join(key)
            value = bytes([i + 1]) * 128
            assert f.put(key, value) == 0
            assert f.get(plain) == f.get(key) == value
            assert f.is_exist(key) == 1
            assert f.batch_is_exist([plain, key]) == [1, 1]
            assert f.get_batch([key, plain]) == [value, value]
            assert f.put_batch([key], [b"other"]) == f.put_batch([plain], [b"other"])  # (put-if-absent: kept)
            assert pool.get_or_none(plain) == pool.batch_get_bytes([key])[0] == value
            assert f.remove(key) == 0 and f.get(plain) == b""
