"""``serve --upstream``: routing external OpenAI-compatible engines on their KV events.

Unit part (no model): ``--upstream`` parsing, the router on events fed in the vLLM wire
format (prefix hit, eviction, load), 429 and an unreachable upstream through the proxy
app. End to end (tiny model, 127.0.0.1): two stand-in engines publishing vLLM-format
events over ZMQ (one positional with int hashes, one map with bytes hashes), the proxy
in front, shared-prefix prompts.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from mooncake_rs.errors import InvalidArgument, Overloaded  # noqa: E402
from mooncake_rs.interop import BlockRemoved, BlockStored, decode_payload, encode_batch  # noqa: E402
from mooncake_rs.interop.upstream import UpstreamRouter, UpstreamSpec, parse_upstream  # noqa: E402

pytestmark = pytest.mark.timeout(240)

BS = 4


def wait_for(pred, timeout_s=30.0, what="condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_router_overloaded_when_the_conductor_refuses():
    r = _router(rejection="early", ttft_slo_s=1e-9)
    with pytest.raises(Overloaded) as e:
        r.route(list(range(10)))
    assert e.value.reason == "ttft_slo"
    assert r.stats()["a"]["in_flight"] == 0


# ---- the stand-in's events (no model) ------------------------------------------------

@pytest.mark.parametrize("form, bytes_hashes", [("positional", False), ("map", True)])
def test_standin_cache_events_and_replay_to_a_late_subscriber(form, bytes_hashes):
    from mooncake_rs.interop import AllBlocksCleared, decode_message
    from mooncake_rs.interop.standin import EventPublisher, _PrefixCache

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

    from mooncake_rs.interop.proxy import create_proxy_app

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


# ---- end to end: two stand-in engines ------------------------------------------------

@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pytest.importorskip("torch")
    import text_helpers as th

    from mooncake_rs.http.server import ServerThread
    from mooncake_rs.interop.proxy import create_proxy_app
    from mooncake_rs.interop.standin import StandIn
    from mooncake_rs.text import Tokenizer

    d = th.write_model_dir(tmp_path_factory.mktemp("models") / "tiny-chat")
    a = StandIn(d, block_size=BS, form="positional", bytes_hashes=False, model_name="tiny")
    b = None
    router = server = None
    try:
        b = StandIn(d, block_size=BS, form="map", bytes_hashes=True, model_name="tiny")
        router = UpstreamRouter([parse_upstream(a.spec("a")), parse_upstream(b.spec("b"))], block_size=BS)
        for name, s in (("a", a), ("b", b)):
            # The slow joiner: the SUB sees nothing sent before its subscription reached
            # the PUB, so publish (harmless) clears until one arrives.
            def joined(name=name, s=s):
                if router.ingestor(name).stats().batches:
                    return True
                s.clear()
                time.sleep(0.05)
                return False
            wait_for(joined, what=f"the subscriber of {name}")
        tok = Tokenizer.from_dir(d)
        server = ServerThread(None, app=create_proxy_app(router, tok)).start()
        yield a, b, router, server, tok, d
    finally:
        if server is not None:
            server.stop()
        if router is not None:
            router.close()
        for s in (a, b):
            if s is not None:
                s.close()


PREFIX = "the quick brown fox jumps over the lazy dog and then the quick brown fox sleeps"


def _complete(url, prompt, **kw):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                   "temperature": 0, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_end_to_end_prefix_then_eviction_then_load(fleet):
    a, b, router, server, tok, _ = fleet
    url = server.url
    ids = tok.encode(PREFIX)
    full = len(ids) // BS
    assert full >= 3
    # 1. a is busy (a request waits on it): a shared-prefix request goes to b by load
    a.hold()
    blocker: dict = {}
    t = threading.Thread(target=lambda: blocker.update(r=_complete(url, "zebra zebra zebra zebra zebra")))
    t.start()
    try:
        wait_for(lambda: a.waiting == 1, what="the blocker waiting on a")
        r1 = _complete(url, PREFIX + " one")
        assert r1.headers["x-mooncake-upstream"] == "b"
    finally:
        a.release()
        t.join(60)
    assert blocker["r"].headers["x-mooncake-upstream"] == "a"
    # b published the prompt's blocks (map form, bytes hashes): the index has them
    wait_for(lambda: router.held_blocks("b", ids) >= full - 1, what="b's BlockStored in the index")
    # 2. both idle: the second shared-prefix request follows the prefix to b
    r2 = _complete(url, PREFIX + " two")
    assert r2.headers["x-mooncake-upstream"] == "b"
    assert r2.json()["object"] == "text_completion" and r2.json()["usage"]["completion_tokens"] == 2
    # 3. b evicts (BlockRemoved): routing follows the load again (both idle: a)
    b.evict()
    wait_for(lambda: router.held_blocks("b", ids) == 0, what="b's BlockRemoved in the index")
    r3 = _complete(url, PREFIX + " three")
    assert r3.headers["x-mooncake-upstream"] == "a"
    wait_for(lambda: router.held_blocks("a", ids) >= full - 1, what="a's BlockStored in the index")
    # 4. a holds the prefix but is busy: the load wins over a short prefix
    a.hold()
    t = threading.Thread(target=lambda: blocker.update(r=_complete(url, "yak yak yak yak yak yak")))
    t.start()
    try:
        wait_for(lambda: a.waiting == 1, what="the second blocker waiting on a")
        r4 = _complete(url, PREFIX + " four")
        assert r4.headers["x-mooncake-upstream"] == "b"
    finally:
        a.release()
        t.join(60)
    st = router.stats()
    assert st["a"]["in_flight"] == 0 and st["b"]["in_flight"] == 0
    assert st["b"]["ingest"]["removed_blocks"] >= full - 1
    assert st["a"]["ingest"]["orphans"] == 0 and st["b"]["ingest"]["orphans"] == 0


def test_end_to_end_streaming_passthrough_and_chat(fleet):
    a, b, router, server, tok, _ = fleet
    url = server.url
    whole = _complete(url, "a streaming prompt", max_tokens=4, ignore_eos=True).json()["choices"][0]["text"]
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "a streaming prompt", "max_tokens": 4, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
    assert text == whole  # both engines hold the same weights: greedy text matches
    messages = [{"role": "user", "content": PREFIX}]
    c = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2},
                   timeout=60)
    assert c.status_code == 200 and c.json()["object"] == "chat.completion"
    name = c.headers["x-mooncake-upstream"]
    chat_ids = tok.encode_chat(messages, add_generation_prompt=True)
    # the blocks we hash for a chat prompt are the ones the engine published
    wait_for(lambda: router.held_blocks(name, chat_ids) == len(chat_ids) // BS, what="the chat prompt's blocks")
    # an upstream error answer passes through (unknown model: the engine's 400)
    bad = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "model_not_found"
    assert all(v["in_flight"] == 0 for v in router.stats().values())


def test_end_to_end_client_going_away_frees_the_slot(fleet):
    a, b, router, server, tok, _ = fleet
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        name = r.headers["x-mooncake-upstream"]
        next(r.iter_raw())  # the first chunk, then hang up
    wait_for(lambda: router.stats()[name]["in_flight"] == 0, what="the abandoned stream's slot")
    # the engine behind it let the request go too (its front saw the disconnect)
    s = a if name == "a" else b
    wait_for(lambda: s.front.metrics.totals["disconnects"] >= 1, what="the upstream's disconnect")


def test_cli_serve_upstream_end_to_end(fleet):
    import os
    import subprocess
    import sys

    a, b, router, server, tok, d = fleet
    port = free_port()
    cmd = [sys.executable, "-m", "mooncake_rs", "serve", "--upstream", a.spec("a"), "--upstream", b.spec("b"),
           "--tokenizer", str(d), "--block-size", str(BS), "--port", str(port)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"serve --upstream exited {proc.returncode}: {proc.stderr.read()}")
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, timeout_s=60, what="serve --upstream")
        assert httpx.get(url + "/health").json()["upstreams"] == ["a", "b"]
        r = _complete(url, "cli " + PREFIX)
        assert r.headers["x-mooncake-upstream"] in ("a", "b")
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        # the CLI's own index learns the engine's blocks from its events too
        st = lambda: httpx.get(url + "/stats").json()[r.headers["x-mooncake-upstream"]]["ingest"]["stored_blocks"]
        wait_for(lambda: st() > 0, what="the CLI's ingest")
    finally:
        proc.terminate()
        proc.wait(20)
