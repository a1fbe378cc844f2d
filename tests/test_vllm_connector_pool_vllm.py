"""MooncakeRsConnector on the cluster-wide pool (``store: "pool"``) with real vLLM
instances (CPU): two vLLMs, each its own processes, share one pool of ``mooncake-rs
store`` nodes found through etcd (a node in a third process). B answers a prompt only A
computed with its full blocks read from the pool (vLLM's own ``cached_tokens``), tokens
equal to one vLLM computing alone; P/D through ``serve --upstream`` (A prefills, B
decodes from the pool); a block changed in the pool is detected and recomputed (tokens
still equal)."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "pool-test-token-0123456789abcdef"  # pool_helpers' node token
CLUSTER = "vllmconn"


def _prompt(seed: int, n: int) -> list[int]:
    # ids 10..299: inside the tests' tokenizer vocabulary (320), clear of its special tokens
    return [int(x) for x in np.random.default_rng(seed).integers(10, 300, n)]


@pytest.fixture(scope="module")
def pool_etcd(tmp_path_factory):
    from pool_helpers import local_pool

    with local_pool(tmp_path_factory.mktemp("etcd"), CLUSTER, dram="256MB") as url:
        yield url


@pytest.fixture(scope="module")
def pair(vllm_model_dir, pool_etcd, tmp_path_factory):
    from vllm_support import running, vllm_server

    ktc = {"kv_connector": "MooncakeRsConnector", "kv_connector_module_path": "mooncake_rs.integrations.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"store": "pool", "etcd": pool_etcd, "cluster": CLUSTER,
                                         "auth_token": TOKEN, "transports": ["tcp"]}}
    logs = tmp_path_factory.mktemp("vllm-pool-logs")
    servers = [vllm_server(vllm_model_dir, kv_transfer_config=ktc, cpu=str(i % (os.cpu_count() or 1)), log_dir=logs)
               for i in range(2)]
    with running(servers):
        yield servers


@pytest.fixture(scope="module")
def pool(pool_etcd):
    from mooncake_rs.client.records import cluster_prefix
    from mooncake_rs.pool import DistributedStore

    with DistributedStore.connect(pool_etcd, auth_token=TOKEN, prefix=cluster_prefix(CLUSTER),
                                  transports=("tcp",)) as p:
        yield p


def _tokens(resp) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def _cached(resp) -> int:
    return int((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _complete(server, prompt, **extra):
    return server.complete(prompt, max_tokens=8, return_token_ids=True, **extra)


def _reference(server, prompt) -> list[int]:
    r = _complete(server, prompt, cache_salt=f"ref-{uuid.uuid4().hex}")  # hashes apart: nothing reused
    assert _cached(r) == 0
    return _tokens(r)


def _pool_keys(server, prompt) -> list[str]:
    """The pool keys the connector uses for the prompt's full blocks (its scheduler's
    hasher and namespace, for the servers' model, dtype and block size)."""
    import torch

    from mooncake_rs import PrefixHasher
    from mooncake_rs.integrations.vllm.config import pool_namespace

    model_id = str(server.model_dir)
    bs = server.block_size
    keys = PrefixHasher(block_size=bs, seed=0, extra=b"\x00".join(x.encode() for x in (model_id, "", "")))
    cfg = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16),
                          cache_config=SimpleNamespace(cache_dtype="auto", block_size=bs))
    ns = pool_namespace(model_id, cfg)
    return [f"{ns}/{k:032x}" for k in keys.hash_blocks(prompt).tolist()]


def test_b_loads_through_the_pool_a_prefix_only_a_computed(pair, pool):
    a, b = pair
    bs = a.block_size
    prompt = _prompt(11, 7 * bs + 9)
    ra = _complete(a, prompt)
    assert _cached(ra) == 0
    assert all(pool.batch_exists(_pool_keys(a, prompt)))  # A's 7 full blocks are in the pool
    rb = _complete(b, prompt)
    # B never saw the prompt: vLLM's own count of reused tokens is what came from the pool
    assert _cached(rb) == 7 * bs, b.log_tail()
    assert _tokens(rb) == _tokens(ra) == _reference(b, prompt)
    # and the other way: A extends a prefix B computed
    prompt2 = _prompt(12, 4 * bs + 2)
    rb2 = _complete(b, prompt2)
    ra2 = _complete(a, prompt2 + _prompt(13, bs))
    assert _cached(ra2) == 4 * bs
    assert _tokens(ra2) == _reference(a, prompt2 + _prompt(13, bs))
    assert _cached(rb2) == 0


def test_a_block_changed_in_the_pool_is_detected_and_recomputed(pair, pool):
    a, b = pair
    bs = a.block_size
    prompt = _prompt(21, 5 * bs + 4)
    ra = _complete(a, prompt)
    keys = _pool_keys(a, prompt)
    assert all(pool.batch_exists(keys))
    # a stray writer changes block 2's bytes in the pool
    value = bytearray(pool.get(keys[2]))
    value[100:164] = b"\xa5" * 64
    pool.remove(keys[2])
    pool.put(keys[2], bytes(value))
    rb = _complete(b, prompt)
    assert _tokens(rb) == _tokens(ra)  # wrong KV was never used
    assert not pool.exists(keys[2])  # B's worker removed the corrupt block


def _external_hits(server) -> float:
    """vLLM's count of prompt tokens its connector supplied, summed over its labels."""
    import httpx

    total = 0.0
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:external_prefix_cache_hits_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("blocks,extra", [(1, 7), (12, 5)])
def test_pd_through_serve_upstream_decodes_from_the_pool(pair, vllm_model_dir, tmp_path, blocks, extra):
    import httpx
    from test_vllm_connector import _start_proxy

    a, b = pair
    bs = a.block_size
    proc, url = _start_proxy([f"prefill:a={a.url},events={a.events_endpoint}", f"decode:b={b.url}"], vllm_model_dir,
                             tmp_path)
    try:
        prompt = _prompt(300 + blocks * 41 + extra, blocks * bs + extra)
        hits = _external_hits(b)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0.0, "ignore_eos": True,
                                                      "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-mooncake-prefill"] == "a" and r.headers["x-mooncake-decode"] == "b"
        # the decode computed only the last partial block: every full block came from the pool
        assert _external_hits(b) - hits == (len(prompt) - 1) // bs * bs
        assert list(r.json()["choices"][0]["token_ids"]) == _reference(b, prompt)
    finally:
        proc.terminate()
        proc.wait(20)
