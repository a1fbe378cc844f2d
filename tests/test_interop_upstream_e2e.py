"""``serve --upstream`` end to end (tiny model, 127.0.0.1 only): two stand-in engines
publishing vLLM-format KV events over ZMQ (one positional with int hashes, one map with
bytes hashes), the proxy in front, shared-prefix prompts; and the command itself."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from mooncake_rs.interop.upstream import UpstreamRouter, parse_upstream  # noqa: E402
from upstream_helpers import BS, free_port, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# ---- end to end: two stand-in engines ------------------------------------------------

@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pytest.importorskip("torch")
    import text_helpers as th

    from mooncake_rs.http.server import ServerThread
    from mooncake_rs.http.upstream.proxy import create_proxy_app
    from standin import StandIn
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


def _while_busy(engine, url, blocker_prompt, prompt):
    """``prompt``'s response while ``engine`` holds a request (``blocker_prompt``) in
    flight, then that blocker's response once the engine is let go."""
    engine.hold()
    blocker: dict = {}
    t = threading.Thread(target=lambda: blocker.update(r=_complete(url, blocker_prompt)))
    t.start()
    try:
        wait_for(lambda: engine.waiting == 1, what="the blocker waiting on the busy engine")
        response = _complete(url, prompt)
    finally:
        engine.release()
        t.join(60)
    return response, blocker["r"]


def test_end_to_end_prefix_then_eviction_then_load(fleet):
    a, b, router, server, tok, _ = fleet
    url = server.url
    ids = tok.encode(PREFIX)
    full = len(ids) // BS
    assert full >= 3
    # 1. a is busy (a request waits on it): a shared-prefix request goes to b by load
    r1, blocked = _while_busy(a, url, "zebra zebra zebra zebra zebra", PREFIX + " one")
    assert r1.headers["x-mooncake-upstream"] == "b"
    assert blocked.headers["x-mooncake-upstream"] == "a"
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
    r4, _ = _while_busy(a, url, "yak yak yak yak yak yak", PREFIX + " four")
    assert r4.headers["x-mooncake-upstream"] == "b"
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
