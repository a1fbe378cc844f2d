"""Real vLLM instances on different "hosts" sharing one KV pool over TCP: the pool
(``mooncake-rs kv-pool``) in network namespace 0, vLLM A in namespace 1 and vLLM B in
namespace 2 (veth pairs on a bridge, tests/netns_helpers.py), both loading our connector
with ``transports: ["tcp"]`` and the pool's address on the bridge. B answers a prompt that
only A computed with the prefix loaded from the pool (vLLM's own ``cached_tokens``) and
the same greedy tokens as B computing it alone; and P/D through ``serve --upstream``
with A as the prefill and B as the decode. The test process talks to every host
from the root namespace through the bridge, as a client on another machine would.

Where ``test_vllm_connector_netns.py`` drives the connector's worker directly, this runs
the whole vLLM engine on each side (scheduler hooks, metadata, the forward's save and
load) across the namespaces."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from netns_helpers import TestHosts, require

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKEN = "netns-vllm-token-0123456789abcdef"
BS = 32
POOL_PORT, DATA_PORT = 7611, 7612


def _prompt(seed: int, n: int) -> list[int]:
    # ids 10..299: inside the tests' tokenizer vocabulary, clear of its special tokens
    return [int(x) for x in np.random.default_rng(seed).integers(10, 300, n)]


def _complete(server, prompt, max_tokens=8, **extra):
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    cached = int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return list(body["choices"][0]["token_ids"]), cached


@pytest.fixture(scope="module")
def hosts():
    require()  # skips without namespaces, fails instead under MOONCAKE_REQUIRE_NETNS=1
    with TestHosts(3) as h:
        yield h


@pytest.fixture(scope="module")
def pool(hosts):
    ip = hosts.ip(0)
    proc = hosts.popen(0, [sys.executable, "-m", "mooncake_rs", "kv-pool", "--listen", f"{ip}:{POOL_PORT}",
                           "--data-listen", f"{ip}:{DATA_PORT}", "--memory", "128M"],
                       env={**os.environ, "MOONCAKE_AUTH_TOKEN": TOKEN}, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    line = proc.stderr.readline().decode()  # bounded: the pool prints it or exits
    assert "KV pool on" in line, line
    yield f"{ip}:{POOL_PORT}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def pair(vllm_model_dir, hosts, pool, tmp_path_factory):
    from vllm_support import running, vllm_server

    ktc = {"kv_connector": "MooncakeRsConnector", "kv_connector_module_path": "mooncake_rs.integrations.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"pool": pool, "auth_token": TOKEN, "transports": ["tcp"]}}
    logs = tmp_path_factory.mktemp("vllm-netns-logs")
    servers = [vllm_server(vllm_model_dir, kv_transfer_config=ktc, kv_events=False, log_dir=logs,
                           cpu=str(i % (os.cpu_count() or 1)), host=hosts.ip(i + 1),
                           launcher=("ip", "netns", "exec", hosts.names[i + 1]))
               for i in range(2)]
    with running(servers):
        yield servers


def test_b_on_another_host_loads_over_tcp_what_only_a_computed(pair):
    a, b = pair
    prompt = _prompt(31, 6 * BS + 5)
    tokens_a, cached_a = _complete(a, prompt)
    assert cached_a == 0
    tokens_b, cached_b = _complete(b, prompt)
    # B never saw the prompt: what vLLM counts as reused came from the pool, over the bridge
    assert cached_b == 6 * BS
    alone, cached_alone = _complete(b, prompt, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert cached_alone == 0
    assert tokens_b == tokens_a == alone


def test_a_loads_a_prefix_b_computed_and_extends_it(pair):
    a, b = pair
    head = _prompt(32, 4 * BS)
    _complete(b, head + _prompt(33, 7))
    # A shares only the first four blocks of B's prompt: it loads those and computes the rest
    longer = head + _prompt(34, 2 * BS + 3)
    tokens, cached = _complete(a, longer)
    assert cached == 4 * BS
    alone, _ = _complete(a, longer, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert tokens == alone


def _external_hits(server) -> float:
    """vLLM's count of prompt tokens its KV connector supplied (summed over labels)."""
    import httpx

    name = "vllm:external_prefix_cache_hits_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_pd_across_hosts_through_serve_upstream(pair, vllm_model_dir, tmp_path):
    """P/D with the prefill on one host and the decode on another: ``serve --upstream`` (in
    the test's namespace) sends the prefill request, then the decode request with the
    returned ``kv_transfer_params``; the decode loads every full block over TCP."""
    import httpx
    from upstream_helpers import free_port, wait_for

    a, b = pair
    port = free_port()
    log = tmp_path / "proxy.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mooncake_rs", "serve", "--tokenizer", str(vllm_model_dir),
                                 "--block-size", str(BS), "--port", str(port), "--upstream", f"prefill:a={a.url}",
                                 "--upstream", f"decode:b={b.url}"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, f"serve --upstream exited {proc.returncode}: {log.read_text()}"
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout_s=60, what="serve --upstream with roles")
        prompt = _prompt(35, 5 * BS + 7)
        hits = _external_hits(b)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-mooncake-prefill"] == "a" and r.headers["x-mooncake-decode"] == "b"
        assert _external_hits(b) - hits == 5 * BS  # the decode computed only the partial last block
        alone, _ = _complete(b, prompt, cache_salt=f"ref-{uuid.uuid4().hex}")
        assert list(r.json()["choices"][0]["token_ids"]) == alone
    finally:
        proc.terminate()
        proc.wait(20)
