"""The serving control protocol (serving/protocol.py): every message round-trips, and
the decoder turns any bad frame (random bytes, a truncated or oversized frame, valid
msgpack of the wrong shape, an unknown op) into its own ``ProtocolError``, nothing else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_rs.base.params import SamplingParams
from mooncake_rs.errors import MooncakeError
from mooncake_rs.serving import protocol as p

EP = p.Endpoint("decode-0", "127.0.0.1:4242", 7)
KEYS = p.pack_keys([1, (1 << 128) - 1, 0x1234_5678_9ABC_DEF0_1122_3344_5566_7788])
REPORT = p.PrefillReport(2, 1, 65536, 1.5, 1.75, 2.0)
FETCH = p.Fetch(1, EP, [0, 8192], p.pack_keys([5, 6]))
DEST = p.Dest(EP, [None, 4096, 8192], 12288)
FETCH2 = p.Fetch(4, p.Endpoint("prefill-4", "127.0.0.1:4343", 2), [16384, 4096], p.pack_keys([5, 6]))
SPEC = p.InstanceSpec(3, "decode", "decode-0", {"vocab_size": 256, "eos_token_ids": [1, 2]}, 16, 1 << 20,
                      seed=5, link_bandwidth=1e9, engine_kwargs={"num_pages": 64, "dtype": "bfloat16"},
                      ssd_path="ssd/decode-0", ssd_bytes=1 << 22, heartbeat_s=0.5)

SAMPLES: list[p.Message] = [
    p.Init(p.PROTOCOL_VERSION, SPEC, "ab" * 32, {0: 5, 1: 6}),
    p.Ready(p.PROTOCOL_VERSION, EP, 1234, 8192, 512, 4096),
    p.InitFailed("RuntimeError: no"),
    p.Beat(),
    p.Beat(8, 3, 5, 64, 1 << 20, 1, 0, link_out_bytes=4096.0, link_in_bytes=0.0, link_t=12.5, link_age_s=0.25),
    p.Expect(9, [1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=(3,)), KEYS, 1, FETCH, 0),
    p.Expect(9, [1], SamplingParams(), b"", 0, None, 1),
    p.Prefill(9, [1, 2, 3], SamplingParams(temperature=0.5, seed=7), KEYS, 1, None, DEST, 3),
    p.KvReady(9, 17, "prefill", REPORT),
    p.KvReady(9, None, "length", REPORT),
    p.Export(9, KEYS),
    p.Exported(9, EP, [0, 8192]),
    p.Unpin(9),
    p.Replicate(-(1 << 40), FETCH),
    p.Fetched(9),
    p.Started(9),
    p.Tokens(9, [4, 5], None, REPORT),
    p.Tokens(9, [], "stop"),
    p.Step([p.Tokens(9, [4], None), p.Tokens(10, [5], "length", REPORT)]),
    p.Failed(9, "StoreFull: no slot"),
    p.Failed(None, "measure failed"),
    p.Cancel(9),
    p.Cancelled(9),
    p.PeerLost(2, "bad frame: junk"),
    p.StoreEvents(b"MCE1" + bytes(18)),
    p.Stats(),
    p.StatsReply({"copied_bytes": 1.0, "requests": 0.0}),
    p.Measure([(16, 0), (32, 16)], 2),
    p.Timings([(16, 0, 0.01)]),
    p.Stop(),
    p.SwitchRole("decode"),
    p.RoleSwitched("prefill", EP),
    p.Ready(p.PROTOCOL_VERSION, EP, 1234, 8192, 512, 4096, vocab_size=256, max_positions=2048, max_num_seqs=8),
    p.Attach(p.PROTOCOL_VERSION, 3, "prefill-a"),
    p.Relay(2, p.KvReady(9, 17, "prefill", REPORT)),
    p.Relay(4, p.Prefill(9, [1, 2, 3], SamplingParams(), KEYS, 1, None, DEST, 3)),
    # a multi-source fetch (Cluster(multipath=True)): the other holders and the split
    p.Expect(9, [1, 2, 3], SamplingParams(), KEYS, 1, FETCH, 0, fetch_also=[FETCH2], fetch_split=[1, 1]),
    p.Prefill(9, [1, 2, 3], SamplingParams(), KEYS, 1, FETCH, DEST, 3, fetch_also=[FETCH2], fetch_split=[0, 2]),
    p.Tokens(9, [4], None, p.PrefillReport(2, 2, 65536, 1.5, 1.75, 2.0, sources=2, busy_s=0.004)),
]


def test_every_message_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(p.Message.__args__)
    assert set(p.TO_INSTANCE) | set(p.FROM_INSTANCE) | set(p.PEER) | set(p.TO_REMOTE) | set(p.FROM_REMOTE) \
        == set(p.Message.__args__)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: p.op_of(m))
def test_round_trip(msg):
    c = p.Codec()
    frame = c.encode(msg)
    assert c.decode(frame) == msg
    assert p.op_of(msg) in frame[4:].decode("latin-1")  # the tag is on the wire


def test_multipath_fields_are_additive():
    """At their defaults the new fields are not on the wire: what an older peer sends and
    reads, byte for byte (no version bump)."""
    c = p.Codec()
    for msg in (p.Expect(9, [1], SamplingParams(), KEYS, 1, FETCH, 0), p.Prefill(9, [1], SamplingParams(), KEYS, 1, FETCH, DEST, 3),
                p.KvReady(9, 1, "prefill", REPORT)):
        body = c.encode(msg)[4:]
        for name in (b"fetch_also", b"fetch_split", b"sources", b"busy_s"):
            assert name not in body
        assert c.decode(c.encode(msg)) == msg


def test_multipath_fields_are_checked():
    with pytest.raises(ValueError, match="one count >= 0 per source"):
        p.Expect(9, [1], SamplingParams(), KEYS, 1, FETCH, 0, fetch_also=[FETCH2], fetch_split=[2, 1])
    with pytest.raises(ValueError, match="another run"):
        p.Expect(9, [1], SamplingParams(), KEYS, 1, FETCH, 0, fetch_also=[p.Fetch(4, EP, [0], p.pack_keys([5]))])
    with pytest.raises(ValueError, match="need a primary fetch"):
        p.Prefill(9, [1], SamplingParams(), KEYS, 1, None, DEST, 3, fetch_also=[FETCH2])
    c = p.Codec()  # and on the wire: a bad split is a ProtocolError, like any bad field
    body = msgspec.msgpack.encode({"op": "expect", "rid": 1, "prompt": [1], "params": {}, "keys": KEYS, "local": 0,
                                   "fetch": msgspec.to_builtins(FETCH, builtin_types=(bytes,)), "prefill": 0,
                                   "fetch_also": [msgspec.to_builtins(FETCH2, builtin_types=(bytes,))], "fetch_split": [5, 5]})
    with pytest.raises(p.ProtocolError, match="fetch_split"):
        c.decode(len(body).to_bytes(4, "big") + body)


def test_sampling_params_are_the_wire_type_and_are_validated_on_decode():
    """A request's parameters travel as the public ``SamplingParams`` itself: they come
    back equal, and a value its constructor refuses is a ProtocolError on the wire."""
    c = p.Codec()
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=(2, 5),
                            ignore_eos=True)
    got = c.decode(c.encode(p.Expect(1, [1, 2], params, KEYS, 0, None, 0)))
    assert isinstance(got.params, SamplingParams) and got.params == params
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_k": 0}, {"stop_token_ids": [-1]}, {"seed": "x"}):
        body = msgspec.msgpack.encode({"op": "expect", "rid": 1, "prompt": [1], "params": bad, "keys": b"",
                                       "local": 0, "fetch": None, "prefill": 0})
        with pytest.raises(p.ProtocolError):
            c.decode(len(body).to_bytes(4, "big") + body)


def test_keys_pack_as_16_byte_little_endian():
    keys = [0, 1, (1 << 128) - 1, 1 << 64]
    buf = p.pack_keys(keys)
    assert len(buf) == 64 and buf[16] == 1
    assert p.unpack_keys(buf) == keys


def test_protocol_error_is_a_mooncake_error():
    assert issubclass(p.ProtocolError, MooncakeError)


def _expect_protocol_error(c: p.Codec, frame: bytes) -> None:
    try:
        c.decode(frame)
    except p.ProtocolError:
        pass


def test_oversized_and_truncated_frames():
    c = p.Codec(max_frame=1024)
    with pytest.raises(p.ProtocolError, match="exceeds"):
        c.body_length((1 << 20).to_bytes(4, "big"))
    with pytest.raises(p.ProtocolError, match="exceeds"):
        c.encode(p.Expect(1, list(range(1000)), SamplingParams(), b"", 0, None, 0))
    frame = c.encode(p.Cancel(3))
    with pytest.raises(p.ProtocolError):
        c.decode(frame[:2])
    with pytest.raises(p.ProtocolError):
        c.decode(frame[:-1])
    with pytest.raises(p.ProtocolError):
        c.decode(frame + b"\x00")


def test_wrong_shapes_and_unknown_ops_are_refused():
    c = p.Codec()
    enc = msgspec.msgpack.encode
    for bad in ({"op": "launch_missiles"}, {"op": "cancel"}, {"op": "cancel", "rid": "1"},
                {"op": "cancel", "rid": 1, "extra": 2}, {"rid": 1}, [1, 2], 5, None,
                {"op": "expect", "rid": 1, "prompt": [1], "params": {}, "keys": b"x" * 15, "local": 0,
                 "fetch": None, "prefill": 0},
                {"op": "init", "version": 1, "auth_token": "t",
                 "spec": {"id": 0, "role": "root", "name": "x", "model": "tiny", "block_size": 16,
                          "dram_bytes": 1}}):
        body = enc(bad)
        with pytest.raises(p.ProtocolError):
            c.decode(len(body).to_bytes(4, "big") + body)
    with pytest.raises(p.ProtocolError):  # pickle is not msgpack
        import pickle

        body = pickle.dumps({"op": "cancel", "rid": 1})
        c.decode(len(body).to_bytes(4, "big") + body)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    c = p.Codec(max_frame=4096)
    _expect_protocol_error(c, data)
    _expect_protocol_error(c, len(data).to_bytes(4, "big") + data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_truncated_and_flipped_valid_frames(msg, data):
    c = p.Codec()
    frame = c.encode(msg)
    cut = data.draw(st.integers(0, len(frame) - 1))
    _expect_protocol_error(c, frame[:cut])
    i = data.draw(st.integers(4, len(frame) - 1))
    flipped = bytearray(frame)
    flipped[i] ^= data.draw(st.integers(1, 255))
    try:
        c.decode(bytes(flipped))  # may still be a valid message of another shape
    except p.ProtocolError:
        pass


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                     st.text(max_size=8), st.binary(max_size=40),
                     st.sampled_from([p.op_of(m) for m in SAMPLES]))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=20)
_fields = st.sampled_from(["op", "rid", "prompt", "params", "keys", "local", "fetch", "prefill", "dest", "decode",
                           "tokens", "finish", "report", "version", "spec", "arena", "offsets", "error", "runs"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_fields, _values, max_size=8), st.sampled_from([p.op_of(m) for m in SAMPLES]))
def test_fuzz_valid_msgpack_of_wrong_shapes(fields, op):
    c = p.Codec()
    for obj in (fields, dict(fields, op=op)):
        body = msgspec.msgpack.encode(obj)
        _expect_protocol_error(c, len(body).to_bytes(4, "big") + body)


# ---- links: a bad frame closes that connection, never the process
def _link_pair(allowed):
    import queue
    import socket

    from mooncake_rs.serving.control import SocketChannel

    a, b = socket.socketpair()
    sink: queue.Queue = queue.Queue()
    return SocketChannel(a, 4, sink, allowed, name="test-link"), b, sink


@pytest.mark.parametrize("garbage", [
    b"\x00\x00\x00\x05hello",  # not msgpack
    (1 << 30).to_bytes(4, "big"),  # oversized: refused before the body is read
    b"\x00\x00\x00\x01\xc1",  # a reserved msgpack byte
], ids=["not-msgpack", "oversized", "reserved-byte"])
def test_a_link_closes_on_garbage_and_says_why(garbage, caplog):
    import logging

    from mooncake_rs.serving.control import Lost

    link, other, sink = _link_pair(p.FROM_INSTANCE)
    with caplog.at_level(logging.WARNING, logger="mooncake_rs.serving"):
        other.sendall(p.Codec().encode(p.Fetched(1)) + garbage)
        assert sink.get(timeout=10) == (4, p.Fetched(1))  # what came before still counts
        src, lost = sink.get(timeout=10)
    assert src == 4 and isinstance(lost, Lost) and lost.reason.startswith("bad frame")
    assert "closing the connection" in caplog.text
    assert other.recv(16) == b""  # the connection is closed
    assert not link.alive
    link.close()
    other.close()


def test_a_link_refuses_a_message_of_the_wrong_direction():
    from mooncake_rs.serving.control import Lost

    link, other, sink = _link_pair(p.FROM_INSTANCE)
    other.sendall(p.Codec().encode(p.Expect(1, [1], SamplingParams(), b"", 0, None, 0)))  # cluster -> decode only
    src, lost = sink.get(timeout=10)
    assert isinstance(lost, Lost) and "not expected" in lost.reason
    link.close()
    other.close()


def test_a_link_reports_eof_mid_frame_as_closed():
    from mooncake_rs.serving.control import Lost

    link, other, sink = _link_pair(p.FROM_INSTANCE)
    other.sendall(p.Codec().encode(p.Cancelled(3))[:-2])
    other.close()
    src, lost = sink.get(timeout=10)
    assert isinstance(lost, Lost) and lost.reason == "closed"
    link.close()


@pytest.mark.timeout(240)
def test_garbage_to_a_worker_kills_only_that_instance():
    pytest.importorskip("torch")
    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig, SamplingParams

    params = SamplingParams(max_tokens=4)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=2, block_size=16, dram_bytes_per_instance=4 << 20,
                 processes=True, seed=5) as c:
        ref = c.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
        victim = 1
        pid = c.pid_of(victim)
        c._core.members[victim].ch.sock.sendall(b"\x00\x00\x00\x04junk")  # the worker's reader gets garbage
        # (the worker drops the link and exits; the cluster sees the link close, fences
        # the process and routes around it)
        deadline = __import__("time").monotonic() + 60
        while victim in c.instances():
            assert __import__("time").monotonic() < deadline, "the worker did not drop its link"
            __import__("time").sleep(0.05)
        outs = c.generate([[1, 2, 3, 4, 5]] * 3, params)
        assert [o.token_ids for o in outs] == [ref] * 3
        assert {o.metrics.decode_instance for o in outs} == {2}
        import os

        def gone() -> bool:
            return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

        while not gone():
            assert __import__("time").monotonic() < deadline, "the worker did not exit"
            __import__("time").sleep(0.05)


# ---- hops: control messages per request
@pytest.mark.timeout(240)
@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "workers"])
def test_control_messages_per_request(processes):
    """One request without a fetch: new, expect, prefill, started, kv_ready and the token
    stream (its first message carries the prefill's report; the last one, the finish): 6
    control hops. Store-event batches feed the index and are counted apart. The same with worker
    processes (their own counts come back through ``instance_stats``)."""
    pytest.importorskip("torch")
    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig, SamplingParams

    n = 5
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, dram_bytes_per_instance=4 << 20,
                 seed=5, processes=processes) as c:
        for i in range(3):
            before = c.message_counts()
            out = c.generate([[i + 1] * 40], params)[0]
            assert len(out.token_ids) == n
            after = c.message_counts()
            diff = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
            store = diff.pop("store", 0)
            assert store <= 1
            assert diff == {"new": 1, "expect": 1, "prefill": 1, "started": 1, "kv_ready": 1, "tokens": n}
            control = diff["new"] + diff["expect"] + diff["prefill"] + diff["started"] + diff["kv_ready"] + 1
            assert control == 6  # + the final tokens
        # a prompt that ends on the first token (max_tokens=1): exactly the 6 hops
        before = c.message_counts()
        c.generate([[9] * 40], SamplingParams(max_tokens=1))
        after = c.message_counts()
        diff = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        diff.pop("store", None)
        assert diff == {"new": 1, "expect": 1, "prefill": 1, "started": 1, "kv_ready": 1, "tokens": 1}


# ---- the Ready message's block bytes price transfers
@pytest.mark.timeout(240)
def test_transfer_cost_uses_the_block_bytes_instances_report():
    pytest.importorskip("torch")
    from mooncake_rs import Cluster
    from mooncake_rs.engine import BlockLayout, ModelConfig, SamplingParams

    cfg = ModelConfig.tiny()
    f32 = BlockLayout.for_model(cfg, 16, "float32").block_nbytes
    bf16 = BlockLayout.for_model(cfg, 16, "bfloat16").block_nbytes
    assert bf16 * 2 == f32
    with Cluster(cfg, prefill=1, decode=1, block_size=16, dram_bytes_per_instance=4 << 20, seed=5,
                 engine_kwargs={"dtype": "bfloat16"}) as c:
        assert c.conductor.config.transfer_model.bytes_per_token == pytest.approx(bf16 / 16)
        assert len(c.generate([[1, 2, 3] * 7], SamplingParams(max_tokens=3))[0].token_ids) == 3
        # recalibrating keeps the reported bytes (and swaps on the router thread)
        c.calibrate([(16, 0), (32, 0), (64, 0), (16, 16), (32, 32)], repeats=1)
        assert c.conductor.config.transfer_model.bytes_per_token == pytest.approx(bf16 / 16)
        assert len(c.generate([[1, 2, 3] * 7], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_no_pickle_in_the_serving_layer():
    """Nothing in serving/ pickles or unpickles (the control links carry msgpack only)."""
    import ast
    import pathlib

    import mooncake_rs.serving as serving

    for f in pathlib.Path(serving.__file__).parent.glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name not in ("pickle", "cPickle", "dill", "marshal") for a in node.names), f
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("pickle", "dill", "marshal", "multiprocessing.reduction"), f


@pytest.mark.timeout(240)
def test_a_lost_peer_link_fences_that_peer():
    """An instance that reports its peer link to another instance lost (``PeerLost``):
    the cluster kills that peer, whose death takes the usual path; the rest serve on."""
    pytest.importorskip("torch")
    import time

    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig, SamplingParams

    params = SamplingParams(max_tokens=4)
    with Cluster(ModelConfig.tiny(), prefill=1, decode=2, block_size=16, dram_bytes_per_instance=4 << 20,
                 processes=True, seed=5) as c:
        ref = c.generate([[3, 1, 4, 1, 5]], params)[0].token_ids
        victim = 2
        c._core.router.events.put((0, p.PeerLost(victim, "bad frame: test")))  # as prefill-0's worker would
        deadline = time.monotonic() + 60
        while victim in c.instances():
            assert time.monotonic() < deadline, "the peer was not fenced"
            time.sleep(0.05)
        outs = c.generate([[3, 1, 4, 1, 5]] * 3, params)
        assert [o.token_ids for o in outs] == [ref] * 3
        assert {o.metrics.decode_instance for o in outs} == {1}


@pytest.mark.timeout(240)
def test_control_messages_with_a_prefix_fetch():
    """A request that fetches its prefix from the other prefill instance adds export,
    exported, fetched and unpin: 10 control hops (a filler request, 6 hops of its own,
    keeps the holder busy so the conductor fetches)."""
    pytest.importorskip("torch")
    import random

    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig, SamplingParams

    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(6 * 16)]
    g = SamplingParams(max_tokens=4)
    with Cluster(ModelConfig.tiny(), prefill=2, decode=1, block_size=16, dram_bytes_per_instance=8 << 20,
                 seed=3) as c:
        holder = c.generate([prefix + [1, 2, 3]], g)[0].metrics.prefill_instance
        before = c.message_counts()
        filler = c.submit([rng.randrange(256) for _ in range(1500)], SamplingParams(max_tokens=2))
        out = c.submit(prefix + [9, 9], g).result(60)
        filler.result(60)
        after = c.message_counts()
        assert out.metrics.prefill_instance != holder and out.metrics.fetched_tokens > 0
        diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        control = {k: diff.get(k, 0) for k in ("new", "expect", "prefill", "started", "kv_ready", "export", "exported",
                                               "fetched", "unpin")}
        assert control == {"new": 2, "expect": 2, "prefill": 2, "started": 2, "kv_ready": 2, "export": 1,
                           "exported": 1, "fetched": 1, "unpin": 1}


def test_no_import_cycle_among_serving_modules():
    """No serving module imports one that imports it back, counting function-level
    imports too (the router knows the cluster only through its port; the roles do not
    import the instance)."""
    import ast
    import pathlib

    import mooncake_rs.serving as serving

    root = pathlib.Path(serving.__file__).parent
    mods = {f.stem for f in root.glob("*.py") if f.stem != "__init__"}
    deps: dict[str, set[str]] = {}
    for m in mods:
        found = set()
        for node in ast.walk(ast.parse((root / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mooncake_rs.serving."):
                found.add(node.module.split(".")[2])
        deps[m] = found & mods

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in deps[a])

    cycles = sorted(m for m in mods if reaches(m, m, {m}))
    assert not cycles, {m: deps[m] for m in cycles}
