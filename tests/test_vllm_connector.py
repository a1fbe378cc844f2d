"""MooncakeRsConnector with real vLLM instances (CPU): a prefix pool between two instances,
P/D through ``serve --upstream`` with roles, and faults. Outputs are compared token for
token with one vLLM computing alone (a request under a cache_salt nobody else uses: its
blocks hash apart, so neither vLLM's own cache nor the pool can serve it).

Two vLLM instances (A, B) share one KV pool (in this process) for the whole module;
every test uses prompts of its own, so what one test stored never helps another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKEN = "test-cluster-token-0123456789abcdef"
BS = 32


def _prompt(seed: int, n: int) -> list[int]:
    # ids 10..299: inside the tests' tokenizer vocabulary (320), clear of its special tokens
    return [int(x) for x in np.random.default_rng(seed).integers(10, 300, n)]


@pytest.fixture(scope="module")
def pool():
    from mooncake_rs.integrations.pool import KVPoolServer, PoolConfig

    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=256 << 20)) as p:
        yield p


@pytest.fixture(scope="module")
def pair(vllm_model_dir, pool, tmp_path_factory):
    from vllm_support import running, vllm_server

    ktc = {"kv_connector": "MooncakeRsConnector", "kv_connector_module_path": "mooncake_rs.integrations.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"pool": pool.address, "auth_token": TOKEN}}
    logs = tmp_path_factory.mktemp("vllm-connector-logs")
    servers = [vllm_server(vllm_model_dir, kv_transfer_config=ktc, cpu=str(i % (os.cpu_count() or 1)), log_dir=logs)
               for i in range(2)]
    with running(servers):
        yield servers


def _complete(server_or_url, prompt, max_tokens=8, **extra):
    import httpx

    url = server_or_url if isinstance(server_or_url, str) else server_or_url.url
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _tokens(resp) -> list[int]:
    return list(resp.json()["choices"][0]["token_ids"])


def _cached(resp) -> int:
    return int((resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _metric(server, name: str) -> float:
    """A counter of the server's /metrics, summed over its labels."""
    import httpx

    total = 0.0
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def _reference(server, prompt, max_tokens=8) -> list[int]:
    r = _complete(server, prompt, max_tokens, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert _cached(r) == 0
    return _tokens(r)


# --- a full pool (first: it runs its own vLLM before the module's pair starts) ------------


def test_store_full_skips_saves_and_serving_goes_on(vllm_model_dir, tmp_path):
    from mooncake_rs.integrations.pool import KVPoolServer, PoolConfig
    from vllm_support import start_vllm

    # a pool of 4 blocks: a 10-block prompt cannot all be saved
    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=4 * 16384)) as small:
        ktc = {"kv_connector": "MooncakeRsConnector", "kv_connector_module_path": "mooncake_rs.integrations.vllm",
               "kv_role": "kv_both", "kv_connector_extra_config": {"pool": small.address, "auth_token": TOKEN}}
        s = start_vllm(vllm_model_dir, kv_transfer_config=ktc, log_dir=tmp_path)
        try:
            prompt = _prompt(4, 10 * BS + 1)
            r = _complete(s, prompt)
            assert len(_tokens(r)) == 8
            st = small.stats()
            assert st["saves_skipped_full"] > 0
            assert st["saves_stored"] <= 4
            assert _tokens(_complete(s, _prompt(5, 3 * BS))) == _reference(s, _prompt(5, 3 * BS))
        finally:
            s.stop()


# --- the prefix pool --------------------------------------------------------------------


def test_prefix_pool_b_loads_what_only_a_computed(pair, pool):
    a, b = pair
    prompt = _prompt(1, 7 * BS + 9)
    ra = _complete(a, prompt)
    assert _cached(ra) == 0
    before = pool.stats()["lookups"]
    rb = _complete(b, prompt)
    # B never saw the prompt: vLLM's own count of reused tokens is what came from the pool
    assert _cached(rb) == 7 * BS
    assert _tokens(rb) == _tokens(ra) == _reference(b, prompt)
    assert pool.stats()["lookups"] > before


def test_prefix_pool_is_tenant_safe(pair, pool):
    a, b = pair
    prompt = _prompt(2, 4 * BS + 3)
    _complete(a, prompt, cache_salt="tenant-a")
    # the same prompt under another tenant's salt: nothing of tenant-a's is loaded
    assert _cached(_complete(b, prompt, cache_salt="tenant-b")) == 0
    assert _cached(_complete(b, prompt, cache_salt="tenant-a")) == 4 * BS


def test_corrupted_block_is_detected_and_recomputed(pair, pool):
    import mooncake_rs as mc
    from mooncake_rs.integrations.pool import PoolClient

    a, b = pair
    prompt = _prompt(3, 5 * BS + 4)
    ra = _complete(a, prompt)
    # find the prompt's blocks in the pool through A's events-free path: a lookup of the
    # keys the connector uses (same hasher settings as the scheduler side)
    from mooncake_rs import PrefixHasher

    model_id = str(a.model_dir)
    keys = PrefixHasher(block_size=BS, seed=0, extra=b"\x00".join(x.encode() for x in (model_id, "", ""))).hash_blocks(prompt)
    client = PoolClient(pool.address, TOKEN)
    found = client.lookup(bytes(keys))
    assert found.count == 5
    # a stray writer flips bytes of block 2 in the store
    eng = pool.engine
    junk = eng.allocate(64)
    np.asarray(junk)[:] = 0xA5
    req = mc.TransferRequest("write", junk, 0, eng.connect(eng.name), pool.region_id, found.offsets[2] + 100, 64)
    assert all(s.ok for s in eng.submit([req]).wait())
    before = pool.stats()["corrupt_removed"]
    rb = _complete(b, prompt)
    assert _tokens(rb) == _tokens(ra)  # wrong KV was never used
    assert pool.stats()["corrupt_removed"] == before + 1
    client.close()


# --- P/D through serve --upstream ----------------------------------------------------------


def _start_proxy(specs, tokenizer_dir, tmp_path):
    import httpx
    from upstream_helpers import free_port, wait_for

    port = free_port()
    cmd = [sys.executable, "-m", "mooncake_rs", "serve", "--tokenizer", str(tokenizer_dir), "--block-size", str(BS),
           "--port", str(port)]
    for s in specs:
        cmd += ["--upstream", s]
    log = open(tmp_path / f"proxy-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"serve --upstream exited {proc.returncode}: "
                                 f"{(tmp_path / f'proxy-{port}.log').read_text()}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout_s=60, what="serve --upstream with roles")
    return proc, url


@pytest.fixture(scope="module")
def pd(pair, vllm_model_dir, tmp_path_factory):
    a, b = pair
    proc, url = _start_proxy([f"prefill:a={a.url},events={a.events_endpoint}", f"decode:b={b.url}"], vllm_model_dir,
                             tmp_path_factory.mktemp("pd"))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize("blocks,extra", [(0, 5), (1, 0), (1, 7), (12, 5), (29, 31)])
def test_pd_completions_equal_one_vllm(pair, pd, blocks, extra):
    a, b = pair
    prompt = _prompt(100 + blocks * 37 + extra, blocks * BS + extra)
    hits = _metric(b, EXTERNAL_HITS)
    r = _complete(pd, prompt, max_tokens=8)
    assert r.headers["x-mooncake-prefill"] == "a" and r.headers["x-mooncake-decode"] == "b"
    # the decode computed only the last partial block (at least one token is always
    # computed): vLLM's own count of tokens its connector supplied. (Its usage's
    # cached_tokens reports the prefill's cache hits for a P/D request.)
    assert _metric(b, EXTERNAL_HITS) - hits == (len(prompt) - 1) // BS * BS
    assert _tokens(r) == _reference(b, prompt)


def test_pd_streaming_and_chat(pair, pd):
    import httpx

    a, b = pair
    prompt = _prompt(7, 3 * BS + 11)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    streamed: list[int] = []
    with httpx.stream("POST", pd + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    streamed += ch[0].get("token_ids") or []
    assert streamed == _reference(b, prompt)

    messages = [{"role": "user", "content": "tell me about blocks of KV " * 12}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    hits = _metric(b, EXTERNAL_HITS)
    got = httpx.post(pd + "/v1/chat/completions", json=chat, timeout=120)
    assert got.status_code == 200, got.text
    assert _metric(b, EXTERNAL_HITS) - hits >= BS
    ref = httpx.post(b.url + "/v1/chat/completions", json={**chat, "cache_salt": uuid.uuid4().hex}, timeout=120)
    assert got.json()["choices"][0]["message"]["content"] == ref.json()["choices"][0]["message"]["content"]
    chunks = []
    with httpx.stream("POST", pd + "/v1/chat/completions", json={**chat, "stream": True,
                                                                "messages": messages + [{"role": "user", "content": "more"}]},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    chunks.append(ch[0]["delta"].get("content") or "")
    ref2 = httpx.post(b.url + "/v1/chat/completions", json={**chat, "cache_salt": uuid.uuid4().hex,
                                                             "messages": messages + [{"role": "user", "content": "more"}]},
                      timeout=120)
    assert "".join(chunks) == ref2.json()["choices"][0]["message"]["content"]


def test_conductor_sends_a_shared_prefix_follow_up_to_the_prefill_holding_it(pair, vllm_model_dir, tmp_path):
    import httpx
    from upstream_helpers import wait_for

    a, b = pair
    proc, url = _start_proxy([f"prefill:a={a.url},events={a.events_endpoint}",
                              f"prefill:b={b.url},events={b.events_endpoint}", f"decode:b={b.url}"],
                             vllm_model_dir, tmp_path)
    try:
        shared = _prompt(9, 8 * BS)
        # A computes the shared prefix on its own (vLLM's events tell the conductor)
        _complete(a, shared + _prompt(10, 5))
        stats = lambda: httpx.get(url + "/stats").json()["prefill"]["a"]["ingest"]["stored_blocks"]  # noqa: E731
        wait_for(lambda: stats() >= 8, timeout_s=30, what="A's KV events at the conductor")
        for i in range(2):
            r = _complete(url, shared + _prompt(20 + i, 9))
            assert r.headers["x-mooncake-prefill"] == "a"
    finally:
        proc.terminate()
        proc.wait(20)


def test_take_events_publishes_the_pool_blocks_as_vllm_events(pair):
    """The blocks an instance saved show up in its own KV event stream, medium CPU, with
    vLLM's block hashes and tokens (what a KV-event consumer indexes)."""
    import zmq

    from mooncake_rs.kv_events.events import BlockStored, decode_payload
    from upstream_helpers import wait_for

    a, _ = pair
    prompt = _prompt(13, 3 * BS + 2)
    _complete(a, prompt)

    def pool_blocks():
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        time.sleep(0.2)  # a replay is the whole stream so far: not every 20 ms
        s.connect(a.replay_endpoint)
        try:
            s.send_multipart([b"", (0).to_bytes(8, "big")])  # the REQ envelope, as interop/subscriber.py
            found = []
            while True:
                frames = s.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                # [topic,] seq, payload; seq 0xffff_ffff_ffff_ffff ends the replay
                if int.from_bytes(frames[-2], "big") == (1 << 64) - 1:
                    return found
                for ev in decode_payload(frames[-1]).events:
                    if isinstance(ev, BlockStored) and ev.medium == "CPU":
                        found.append(list(ev.token_ids))
        finally:
            s.close()

    wait_for(lambda: all(prompt[i * BS:(i + 1) * BS] in pool_blocks() for i in range(3)), timeout_s=30,
             what="the pool's blocks in A's KV events")


def test_pd_prefill_killed_the_request_completes_or_fails_within_10s(pair, pd, vllm_model_dir):
    """Last of the module: it stops A (the prefill)."""
    import httpx

    a, b = pair
    prompt = _prompt(11, 6 * BS + 3)
    ref = _reference(b, prompt, 16)
    # the prefill dies once its first token is out: the decode loads from the pool, which outlives it
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    got: list[int] = []
    t0 = time.monotonic()
    with httpx.stream("POST", pd + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    if not got:
                        a.stop()
                    got += ch[0].get("token_ids") or []
    assert time.monotonic() - t0 < 60
    assert got == ref
    # with the prefill gone, a request is re-run on the decode alone within 10 s
    prompt2 = _prompt(12, 2 * BS + 3)
    t0 = time.monotonic()
    r2 = httpx.post(pd + "/v1/completions", json={"model": "tiny", "prompt": prompt2, "max_tokens": 4,
                                                  "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                    timeout=30)
    assert time.monotonic() - t0 < 10
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-mooncake-prefill"] == "none"
    assert r2.json()["choices"][0]["token_ids"] == _reference(b, prompt2, 4)

