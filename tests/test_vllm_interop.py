"""Our KV-event path against the real vLLM (CPU build): what the indexer reports must be
what vLLM itself reuses (its ``usage.prompt_tokens_details.cached_tokens``), and
``serve --upstream`` must send a shared prefix to the engine that holds it.

Two servers for the whole run (``vllm_pair``): ``a`` with a normal cache, ``b`` with a
64-block cache (``--num-gpu-blocks-override``), so evictions happen on CPU too. Every
test uses prompts of its own (random token ids from its own seed), so the servers'
caches carry nothing from one test into another's assertions.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import pytest

from mooncake_rs.interop.indexer import Indexer
from mooncake_rs.interop.indexer_api import RegisterRequest
from vllm_support import BLOCK_SIZE as BS
from vllm_support import MODEL_NAME, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB = 300  # below the tiny tokenizer's vocabulary (320), above its special tokens


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def reusable(hit_tokens: int, prompt_len: int) -> int:
    """What vLLM can reuse of a ``hit_tokens`` prefix hit: it always computes the prompt's
    last token, so a hit never covers a whole prompt that ends on a block boundary."""
    return min(hit_tokens, (prompt_len - 1) // BS * BS)


def wait_for(cond, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class Watched:
    """An indexer subscribed to both servers, answering in tokens."""

    def __init__(self, servers, **kw):
        self.indexer = Indexer(hash="mooncake", **kw)
        self.names = []
        for name, s in zip("ab", servers):
            self.indexer.register(RegisterRequest(endpoint=s.events_endpoint, type="vLLM", modelname=MODEL_NAME,
                                                  instance_id=name, block_size=BS,
                                                  replay_endpoint=s.replay_endpoint))
            self.names.append(name)

    def hit(self, name: str, ids: list[int], **extra) -> int:
        from mooncake_rs.interop.indexer_api import QueryRequest

        got = self.indexer.query(QueryRequest(model=MODEL_NAME, block_size=BS, token_ids=ids, **extra))
        return int(got["default"].get(name, {}).get("longest_matched", 0))

    def settle(self, name: str, ids: list[int], blocks: int, **extra) -> None:
        """Wait until the indexer has applied the events that put ``blocks`` leading blocks of ``ids`` on ``name``."""
        wait_for(lambda: self.hit(name, ids, **extra) >= blocks * BS, what=f"{blocks} blocks on {name}")

    def close(self) -> None:
        self.indexer.close()


@pytest.fixture
def watched(vllm_pair):
    w = Watched(vllm_pair)
    try:
        yield w
    finally:
        w.close()


def check(w: Watched, server, name: str, ids: list[int], **salt) -> int:
    """Ask the indexer, then vLLM: the indexer's hit (capped as vLLM caps it) equals vLLM's reuse."""
    predicted = reusable(w.hit(name, ids, **salt), len(ids))
    cached = server.cached_tokens(ids, **salt)
    assert predicted == cached, f"indexer said {predicted} reusable tokens on {name}, vLLM reused {cached}"
    return cached


def test_indexer_hits_equal_vllm_cached_tokens(vllm_pair, watched):
    a, b = vllm_pair
    doc = prompt(1, 10 * BS + 5)
    assert check(watched, a, "a", doc) == 0  # unshared: nothing anywhere
    watched.settle("a", doc, 10)
    assert check(watched, a, "a", doc) == 10 * BS  # the same prompt again
    follow = doc[: 6 * BS + 7] + prompt(2, 40)  # a shared prefix, then its own tokens
    assert check(watched, a, "a", follow) == 6 * BS
    assert check(watched, b, "b", doc) == 0  # the other engine holds none of it
    watched.settle("b", doc, 10)
    assert check(watched, b, "b", doc) == 10 * BS


def test_salted_prompts_are_their_own_blocks(vllm_pair, watched):
    a, _ = vllm_pair
    doc = prompt(3, 4 * BS + 3)
    check(watched, a, "a", doc)
    watched.settle("a", doc, 4)
    # The same tokens under a tenant's salt: vLLM reuses nothing, and neither do we.
    assert check(watched, a, "a", doc, cache_salt="tenant-a") == 0
    watched.settle("a", doc, 4, cache_salt="tenant-a")
    assert check(watched, a, "a", doc, cache_salt="tenant-a") == 4 * BS
    assert check(watched, a, "a", doc, cache_salt="tenant-b") == 0
    assert check(watched, a, "a", doc) == 4 * BS  # the plain copy is still there


def test_decode_filled_blocks(vllm_pair, watched):
    a, _ = vllm_pair
    doc = prompt(4, 2 * BS + 20)
    out = a.complete(doc, max_tokens=3 * BS, return_token_ids=True)
    generated = out["choices"][0]["token_ids"]
    assert len(generated) == 3 * BS
    full = doc + generated
    # Blocks filled while decoding are cached (and published) with their generated tokens:
    # every full block of the tokens that have KV (all but the last generated one, never
    # fed back). Waiting for fewer let the check ask the indexer before the last block's
    # event was applied (128 tokens indexed, 160 reused).
    watched.settle("a", full, (len(full) - 1) // BS)
    assert check(watched, a, "a", full + prompt(5, 10)) >= 4 * BS


def test_evictions_follow_the_engine(vllm_pair, watched):
    _, b = vllm_pair  # 64 blocks of cache
    doc = prompt(6, 8 * BS + 1)
    check(watched, b, "b", doc)
    watched.settle("b", doc, 8)
    for i in range(12):  # 12 x 9 blocks through a 64-block cache: doc's blocks are evicted
        b.complete(prompt(100 + i, 9 * BS), max_tokens=1)
    wait_for(lambda: watched.hit("b", doc) < 8 * BS, what="the evictions to reach the index")
    check(watched, b, "b", doc)  # whatever is left of it, both agree


def test_an_indexer_started_later_catches_up_through_replay(vllm_pair):
    a, _ = vllm_pair
    doc = prompt(7, 5 * BS + 2)
    a.complete(doc, max_tokens=1)  # cached before any indexer of this test exists
    late = Watched(vllm_pair)
    try:
        # No new request: only the replay buffer can have told it.
        late.settle("a", doc, 5)
        stats = late.indexer.stats()
        assert stats["a|default|0"]["replayed"] >= 1 and stats["a|default|0"]["replay_failures"] == 0
        assert check(late, a, "a", doc) == 5 * BS
    finally:
        late.close()


def test_a_restarted_engine_loses_its_entries(vllm_pair, watched):
    a, _ = vllm_pair
    doc = prompt(8, 3 * BS + 1)
    check(watched, a, "a", doc)
    watched.settle("a", doc, 3)
    a.stop()
    try:
        # Its publisher went away: its entries go at once, not at its next event.
        wait_for(lambda: watched.hit("a", doc) == 0, timeout_s=10, what="a's entries to be dropped")
    finally:
        a.start()
    assert check(watched, a, "a", doc) == 0  # a fresh engine: nothing to reuse, and we say so
    watched.settle("a", doc, 3)  # its new events are ingested again
    assert check(watched, a, "a", doc) == 3 * BS


# --- serve --upstream over the two engines --------------------------------------------


@pytest.fixture
def proxy(vllm_pair, vllm_model_dir, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "mooncake_rs", "serve", "--tokenizer", str(vllm_model_dir), "--port", str(port),
           "--host", "127.0.0.1"]
    for name, s in zip("ab", vllm_pair):
        cmd += ["--upstream", f"{name}={s.url},events={s.events_endpoint},replay={s.replay_endpoint}"]
    log = open(tmp_path / "proxy.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"serve --upstream exited: {(tmp_path / 'proxy.log').read_text()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    return True
            except OSError:
                return False

        wait_for(up, timeout_s=60, what="serve --upstream to listen")
        # Each subscriber first replays what its engine still buffers (earlier tests' blocks);
        # a count read during that replay would let old blocks pass for a test's new ones.
        wait_for(lambda: all(s["events"]["caught_up"] for s in proxy_stats(url).values()), timeout_s=30,
                 what="the router to catch up on the engines' event history")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def post(url: str, path: str, body: dict, stream: bool = False) -> tuple[str, str]:
    """(the upstream that served it, the text) through the proxy."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": stream}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        upstream = r.headers["X-Mooncake-Upstream"]
        raw = r.read().decode()
    if not stream:
        return upstream, raw
    chunks = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]", raw[-200:]
    return upstream, "".join(chunks[:-1])


def proxy_stats(proxy_url: str) -> dict:
    with urllib.request.urlopen(proxy_url + "/stats", timeout=10) as r:
        return json.loads(r.read())


def stored_blocks(proxy_url: str, name: str) -> int:
    """How many blocks the proxy's router has ingested from upstream ``name``'s events."""
    return int(proxy_stats(proxy_url)[name]["ingest"]["stored_blocks"])


def seeded(proxy_url: str, name: str, send, blocks: int) -> None:
    """Run ``send`` (a request straight to upstream ``name``) and wait until the router
    has ingested the ``blocks`` blocks it stored (events take their time under load)."""
    before = stored_blocks(proxy_url, name)
    send()
    wait_for(lambda: stored_blocks(proxy_url, name) >= before + blocks, timeout_s=30,
             what=f"the router to see {blocks} new blocks on {name}")


@pytest.mark.parametrize("stream", [False, True])
def test_serve_upstream_sends_shared_prefixes_to_their_holder(vllm_pair, proxy, stream):
    servers = dict(zip("ab", vllm_pair))
    seed = 20 + int(stream) * 10
    for holder in "ba":  # b first: a fresh router would pick a on a tie
        doc = prompt(seed + ord(holder), 12 * BS)
        # Seeded directly, not through the proxy: only the engine's events can tell the router.
        seeded(proxy, holder, lambda: servers[holder].complete(doc, max_tokens=1), 11)
        for i in range(3):
            follow = doc + prompt(seed + 100 + i, 17)
            got, _ = post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": follow, "max_tokens": 2,
                                                     "temperature": 0, "ignore_eos": True}, stream)
            assert got == holder, f"a follow-up of a prefix held by {holder} went to {got}"


def test_serve_upstream_routes_chat_follow_ups(vllm_pair, proxy):
    _, b = vllm_pair
    system = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
    first = [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}]
    seeded(proxy, "b", lambda: b.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": first,
                                                               "max_tokens": 1, "temperature": 0}), 2)
    for stream in (False, True):
        follow = first + [{"role": "assistant", "content": "hello cluster"},
                          {"role": "user", "content": "a cache of keys" + (" again" if stream else "")}]
        got, _ = post(proxy, "/v1/chat/completions", {"model": MODEL_NAME, "messages": follow, "max_tokens": 2,
                                                      "temperature": 0}, stream)
        assert got == "b"


def test_the_block_size_is_learned_from_the_engine(vllm_pair):
    """serve --upstream without --block-size asks the engines (vLLM's 32, not our 16)."""
    from mooncake_rs.interop.engine_info import block_size_from_metrics, block_size_from_replay

    a, _ = vllm_pair
    assert block_size_from_metrics(a.url) == BS
    a.complete(prompt(9, 2 * BS), max_tokens=1)
    assert block_size_from_replay(a.replay_endpoint) == BS
    # The indexer API's /register without block_size: learned from the replay buffer.
    indexer = Indexer(hash="mooncake", subscribe=False)
    indexer.register(RegisterRequest(endpoint=a.events_endpoint, type="vLLM", modelname=MODEL_NAME,
                                     instance_id="a", replay_endpoint=a.replay_endpoint))
    assert [g[2] for g in indexer._groups] == [BS]
    indexer.close()
