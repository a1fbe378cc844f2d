"""``serve --upstream`` without a model: ``--upstream`` parsing, the router on events fed
in the vLLM wire format (prefix hit, eviction, load), the stand-in's events and replay,
and the proxy app against model-free engines (429, unreachable upstreams, broken
streams, bad input). End to end with stand-in engines: test_interop_upstream_e2e.py."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from mooncake_rs.errors import InvalidArgument, Overloaded  # noqa: E402
from mooncake_rs.kv_events import BlockRemoved, BlockStored, decode_payload, encode_batch  # noqa: E402
from mooncake_rs.interop.upstream import UpstreamRouter, UpstreamSpec, parse_upstream  # noqa: E402
from upstream_helpers import BS, free_port, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ---- parsing -------------------------------------------------------------------------

def test_parse_upstream():
    s = parse_upstream("a=http://127.0.0.1:8001/,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558")
    assert s == UpstreamSpec("a", "http://127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert parse_upstream("b=http://h:1") == UpstreamSpec("b", "http://h:1")


@pytest.mark.parametrize("bad, words", [
    ("http://h:1", "NAME=http"),
    ("a=h:1", "http://"),
    ("a=http://h:1,evnts=tcp://x:1", "unknown option"),
    ("a=http://h:1,replay=tcp://x:1", "needs events"),
    ("a=http://h:1,events=tcp://x:1,events=tcp://x:2", "twice"),
])
def test_parse_upstream_refuses(bad, words):
    with pytest.raises(InvalidArgument, match=words):
        parse_upstream(bad)


def test_router_refuses_duplicate_and_missing_upstreams():
    with pytest.raises(InvalidArgument, match="at least one"):
        UpstreamRouter([], subscribe=False)
    with pytest.raises(InvalidArgument, match="twice"):
        UpstreamRouter([UpstreamSpec("a", "http://h:1"), UpstreamSpec("a", "http://h:2")], subscribe=False)


# ---- the router on wire-format events ------------------------------------------------

def _feed(router, name, events, form):
    router.ingestor(name).apply(decode_payload(encode_batch(events, form=form), raw_tokens=True))


def _router(**kw):
    return UpstreamRouter([UpstreamSpec("a", "http://127.0.0.1:1"), UpstreamSpec("b", "http://127.0.0.1:2")],
                          block_size=BS, subscribe=False, **kw)


@pytest.mark.parametrize("form", ["positional", "map"])
def test_router_follows_the_prefix_then_the_load(form):
    r = _router()
    prefix = list(range(100, 116))  # 4 blocks
    # b holds the prefix (engine hashes are opaque bytes here)
    _feed(r, "b", [BlockStored(block_hashes=[b"h%d" % i for i in range(4)], token_ids=prefix, block_size=BS)], form)
    assert r.held_blocks("b", prefix + [1, 2]) == 4 and r.held_blocks("a", prefix) == 0
    x = r.route(prefix + [1, 2, 3])
    assert (x.name, x.reused_blocks) == ("b", 4)
    r.first_token(x)
    r.finish(x, 3)
    # b evicts two blocks: its hit shrinks; evicting all sends routing back to the load
    _feed(r, "b", [BlockRemoved(block_hashes=[b"h2", b"h3"])], form)
    assert r.held_blocks("b", prefix) == 2
    _feed(r, "b", [BlockRemoved(block_hashes=[b"h0", b"h1"])], form)
    assert r.held_blocks("b", prefix) == 0
    y = r.route(prefix + [4])
    assert y.name == "a"  # both idle: the lowest slot
    z = r.route(prefix + [5])
    assert z.name == "b"  # a has y queued (no first token yet): the load decides
    r.finish(y, failed=True)
    r.finish(z, failed=True)
    assert r.route(prefix + [6]).name == "a"
    st = r.stats()
    assert st["a"]["in_flight"] == 1 and st["b"]["in_flight"] == 0 and st["b"]["failures"] == 1
    assert st["b"]["ingest"]["removed_blocks"] == 4


@pytest.mark.parametrize("form", ["positional", "map"])
def test_router_sees_the_engines_media_as_tiers(form):
    r = _router()
    p = list(range(200, 212))  # 3 blocks
    hashes = [11, 12, 13]
    _feed(r, "a", [BlockStored(block_hashes=hashes, token_ids=p, block_size=BS, medium="CPU"),
                   BlockStored(block_hashes=hashes[:2], token_ids=p[:8], block_size=BS, medium="DISK")], form)
    keys = r.hasher.hash_blocks(p)
    m = r.conductor.index.match_prefix_tiers(keys)[0]
    assert (m.dram, m.ssd, m.total) == (3, 0, 3)  # a block in both tiers counts as DRAM
    _feed(r, "a", [BlockRemoved(block_hashes=hashes, medium="CPU")], form)  # the DISK copies stay
    m = r.conductor.index.match_prefix_tiers(keys)[0]
    assert (m.dram, m.ssd) == (0, 2)
    assert r.route(p + [1]).reused_blocks == 2  # routed on the disk-held prefix


def test_router_overloaded_when_the_conductor_refuses():
    r = _router(rejection="early", ttft_slo_s=1e-9)
    with pytest.raises(Overloaded) as e:
        r.route(list(range(10)))
    assert e.value.reason == "ttft_slo"
    assert r.stats()["a"]["in_flight"] == 0


# ---- the stand-in's events (no model) ------------------------------------------------

@pytest.mark.parametrize("form, bytes_hashes", [("positional", False), ("map", True)])
def test_standin_cache_events_and_replay_to_a_late_subscriber(form, bytes_hashes):
    from mooncake_rs.kv_events import AllBlocksCleared, decode_message
    from standin import _PrefixCache

    from mooncake_rs.kv_events.publisher import EventPublisher

    cache = _PrefixCache(BS, capacity_blocks=6, bytes_hashes=bytes_hashes)
    p1, p2 = list(range(10, 22)), list(range(10, 18)) + [7, 7, 7, 7, 9]  # 3 blocks; 2 shared + 1 new
    ev1 = cache.store(p1)
    assert len(ev1) == 1 and isinstance(ev1[0], BlockStored) and ev1[0].parent_block_hash is None
    assert ev1[0].token_ids == p1 and all(isinstance(h, bytes if bytes_hashes else int) for h in ev1[0].block_hashes)
    ev2 = cache.store(p2)  # only the third block is new; it chains on the second
    assert len(ev2) == 1 and ev2[0].parent_block_hash == ev1[0].block_hashes[1]
    assert ev2[0].token_ids == [7, 7, 7, 7] and ev2[0].block_size == BS
    ev3 = cache.store(list(range(50, 62)))  # 3 more: 7 > 6, the oldest block goes
    assert isinstance(ev3[-1], BlockRemoved) and ev3[-1].block_hashes == [ev1[0].block_hashes[2]]

    pub = EventPublisher(form=form)
    try:
        for ev in (ev1, ev2, ev3):
            pub.publish(ev)
        wait_for(lambda: pub.sent == 3, what="3 batches sent")
        # joining late: nothing on the SUB yet; the next message (seq 3) triggers the
        # catch-up replay of 0..2 from the ROUTER
        r = UpstreamRouter([UpstreamSpec("s", "http://127.0.0.1:1", pub.endpoint, pub.replay_endpoint)],
                           block_size=BS)
        try:
            def caught_up():
                if r.stats()["s"]["ingest"]["batches"] >= 4:
                    return True
                pub.publish([BlockRemoved(block_hashes=[b"none" if bytes_hashes else 1])])  # harmless
                time.sleep(0.05)
                return False
            wait_for(caught_up, what="the catch-up replay")
            st = r.stats()["s"]
            assert st["events"]["replayed"] >= 3 and st["ingest"]["orphans"] == 0  # + the fillers lost while joining
            assert r.held_blocks("s", p2) == 3 and r.held_blocks("s", p1) == 2  # p1's block 3 was evicted
            assert r.held_blocks("s", list(range(50, 62))) == 3
            pub.publish([AllBlocksCleared()])
            wait_for(lambda: r.held_blocks("s", p2) == 0, what="AllBlocksCleared")
        finally:
            r.close()
    finally:
        pub.close()
    # the frames on the wire decode as the form we asked for
    import msgspec

    payload = encode_batch(ev2, form=form)
    wire = msgspec.msgpack.decode(payload)
    assert isinstance(wire, list if form == "positional" else dict)
    ev = (wire[1] if form == "positional" else wire["events"])[0]
    assert (ev[0] if form == "positional" else ev["type"]) == "BlockStored"
    got = decode_message([b"", (0).to_bytes(8, "big"), payload]).batch.events
    assert [msgspec.structs.asdict(e) for e in got] == [msgspec.structs.asdict(e) for e in ev2]


# ---- the proxy app without engines ---------------------------------------------------

class _NoTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True):
        return [ord(c) for m in messages for c in m["content"]]


def _client(router, **kw):
    from starlette.testclient import TestClient

    from mooncake_rs.http.upstream.proxy import create_proxy_app

    return TestClient(create_proxy_app(router, _NoTokenizer(), connect_timeout_s=2.0, **kw))


def test_proxy_429_with_retry_after():
    r = _router(rejection="early", ttft_slo_s=1e-9)
    with _client(r) as c:
        resp = c.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 2})
    assert resp.status_code == 429
    assert int(resp.headers["retry-after"]) >= 1
    err = resp.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "ttft_slo" and "Retry-After" in err["message"]


def test_proxy_unreachable_upstream_is_502_and_frees_its_slot():
    port = free_port()  # nothing listens there
    r = UpstreamRouter([UpstreamSpec("down", f"http://127.0.0.1:{port}")], block_size=BS, subscribe=False)
    with _client(r) as c:
        resp = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 502
        err = resp.json()["error"]
        assert err["code"] == "upstream_unreachable" and "'down'" in err["message"]
        assert resp.headers["x-mooncake-upstream"] == "down"
        assert c.get("/v1/models").status_code == 502
    st = r.stats()["down"]
    assert st["in_flight"] == 0 and st["failures"] == 1


def _fake_engine():
    """A minimal OpenAI-shaped engine (no model): answers every completion with "ok"."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mooncake_rs.http.server import ServerThread

    seen = []

    async def completions(request):
        seen.append(await request.json())
        return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    return ServerThread(None, app=app).start(), seen


def test_proxy_routes_around_an_unreachable_upstream():
    live, seen = _fake_engine()
    try:
        r = UpstreamRouter([UpstreamSpec("down", f"http://127.0.0.1:{free_port()}"), UpstreamSpec("live", live.url)],
                           block_size=BS, subscribe=False, down_cooldown_s=3600)
        with _client(r) as c:
            for mt in (1, 10**12):  # the first one is retried on "live"; then "down" is out of routing
                resp = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": mt})
                assert resp.status_code == 200 and resp.headers["x-mooncake-upstream"] == "live"
                assert resp.json()["choices"][0]["text"] == "ok"
            h = c.get("/health").json()
            assert h["down"] == ["down"] and h["status"] == "ok"
        assert len(seen) == 2 and seen[0]["prompt"] == "hello"  # the body went through unchanged
        st = r.stats()
        assert st["down"]["failures"] == 1 and st["down"]["down"] and st["down"]["routed"] == 1
        assert st["live"]["routed"] == 2 and st["live"]["in_flight"] == 0
    finally:
        live.stop()


def test_proxy_stream_that_breaks_ends_with_an_error_event():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from mooncake_rs.http.server import ServerThread

    async def frames():
        yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        raise RuntimeError("the engine died mid-stream")

    async def completions(request):
        await request.body()
        return StreamingResponse(frames(), media_type="text/event-stream")

    eng = ServerThread(None, app=Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])).start()
    try:
        r = UpstreamRouter([UpstreamSpec("e", eng.url)], block_size=BS, subscribe=False)
        with _client(r) as c:
            resp = c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(ln[6:]) for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events[0]["choices"][0]["text"] == "a"
        assert events[-1]["error"]["code"] == "upstream_stream_broken"
        st = r.stats()["e"]
        assert st["in_flight"] == 0 and st["failures"] == 1
    finally:
        eng.stop()


def test_pd_stream_that_breaks_ends_with_an_error_event():
    """The P/D proxy relays the decode's stream through the same passthrough as the
    KV-aware proxy: what came before the break, then one error event; the decode's
    slot is freed and the failure counted."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from mooncake_rs.http.server import ServerThread
    from mooncake_rs.interop.pd import PDRouter
    from mooncake_rs.http.upstream.pd_app import create_pd_app

    seen = []

    async def frames():
        yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        raise RuntimeError("the engine died mid-stream")

    async def completions(request):
        body = await request.json()
        seen.append(body)
        if not body.get("stream"):  # the prefill step
            return JSONResponse({"choices": [{"index": 0, "text": "a"}], "kv_transfer_params": {"k": 1}})
        return StreamingResponse(frames(), media_type="text/event-stream")

    eng = ServerThread(None, app=Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])).start()
    try:
        with PDRouter([f"prefill:p={eng.url}", f"decode:d={eng.url}"], block_size=BS, subscribe=False) as r:
            with TestClient(create_pd_app(r, _NoTokenizer(), connect_timeout_s=2.0)) as c:
                resp = c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                events = [json.loads(ln[6:]) for ln in resp.text.splitlines() if ln.startswith("data: ")]
            assert events[0]["choices"][0]["text"] == "a"
            assert events[-1]["error"]["code"] == "upstream_stream_broken" and "decode 'd'" in events[-1]["error"]["message"]
            assert seen[1]["kv_transfer_params"] == {"k": 1}  # the prefill's params went to the decode
            st = r.stats()["decode"]["d"]
            assert st["in_flight"] == 0 and st["failures"] == 1
    finally:
        eng.stop()


@pytest.mark.parametrize("cooldown, second", [(3600, 503), (0, 502)])
def test_proxy_only_upstream_down(cooldown, second):
    r = UpstreamRouter([UpstreamSpec("down", f"http://127.0.0.1:{free_port()}")], block_size=BS, subscribe=False,
                       down_cooldown_s=cooldown)
    with _client(r) as c:
        body = {"model": "m", "prompt": "hello"}
        assert c.post("/v1/completions", json=body).status_code == 502
        # out of routing: no upstream can serve (503) until the cooldown ends, then tried again (502)
        resp = c.post("/v1/completions", json=body)
        assert resp.status_code == second and "error" in resp.json()
        assert c.get("/health").status_code == (503 if cooldown else 200)


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, True]}, "prompt"),
])
def test_proxy_bad_prompts_are_400(body, param):
    with _client(_router()) as c:
        resp = c.post("/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param
        assert c.post("/v1/completions", content=b"{nope").status_code == 400
        assert c.post("/v1/chat/completions", json={"model": "m"}).json()["error"]["param"] == "messages"


def test_proxy_api_key():
    with _client(_router(), api_key="k") as c:
        resp = c.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_cli_serve_upstream_needs_a_tokenizer(capsys):
    from mooncake_rs.cli import main

    assert main(["serve", "--upstream", "a=http://127.0.0.1:1,events=tcp://127.0.0.1:2"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "--model is required" in capsys.readouterr().err


def test_serve_chooses_the_upstream_mode_by_the_specs(capsys):
    """``cli._serve`` alone picks the mode: any ``prefill:``/``decode:`` role goes to the
    P/D proxy (which then refuses a spec without a role), plain specs to the KV-aware
    proxy (which then asks for its tokenizer). Both refuse before listening."""
    from mooncake_rs.cli import main

    assert main(["serve", "--upstream", "prefill:p=http://127.0.0.1:9", "--upstream", "a=http://127.0.0.1:9"]) == 2
    assert "has no role" in capsys.readouterr().err
    assert main(["serve", "--upstream", "a=http://127.0.0.1:9"]) == 2
    assert "needs --tokenizer" in capsys.readouterr().err


def test_an_upstream_router_prices_fetches_at_dequeue_unless_told() -> None:
    """Upstream engines load a prefix when their own scheduler takes the request."""
    one = [UpstreamSpec("a", "http://127.0.0.1:9")]
    r = UpstreamRouter(one, block_size=16, subscribe=False)
    assert r.conductor.config.prefetch_staging_bytes == 0.0
    r2 = UpstreamRouter(one, block_size=16, subscribe=False, prefetch_staging_bytes=1e9)
    assert r2.conductor.config.prefetch_staging_bytes == 1e9
