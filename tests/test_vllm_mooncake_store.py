"""Real vLLM on CPU with its own ``MooncakeStoreConnector`` on our pool: the connector
imports ``mooncake.store`` unchanged and gets mooncake_rs's facade (the shim directory of
``mooncake_rs.compat`` first on the servers' PYTHONPATH), which talks to a ``mooncake-rs
store`` node found through etcd. A first server computes a prompt and saves its KV to
the pool; a second server, started fresh, loads that prefix from the pool (vLLM's own
``cached_tokens``) and gives the same greedy output."""

from __future__ import annotations

import json
import os
import time

import pytest

from pool_helpers import TOKEN, local_pool
from vllm_support import BLOCK_SIZE, package_root, vllm_server

from mooncake_rs.compat import shim_path
from mooncake_rs.client.records import cluster_prefix
from mooncake_rs.pool import DistributedStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CLUSTER = "vllm"


@pytest.fixture
def pool_node(tmp_path):
    with local_pool(tmp_path / "etcd", CLUSTER, dram="256MB") as url:
        yield url


def test_a_second_vllm_loads_the_first_ones_prefix_from_the_pool(vllm_model_dir, pool_node, tmp_path):
    etcd_url = pool_node
    cfg = tmp_path / "mooncake.json"
    host = etcd_url[len("http://"):]
    cfg.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": f"etcd://{host}",
                               "master_server_address": f"etcd://{host}", "protocol": "tcp", "device_name": "",
                               "global_segment_size": "64MB", "local_buffer_size": "64MB"}))
    env = {"PYTHONPATH": os.pathsep.join([shim_path(), package_root(), os.environ.get("PYTHONPATH", "")]),
           "MOONCAKE_CONFIG_PATH": str(cfg), "MOONCAKE_AUTH_TOKEN": TOKEN, "MOONCAKE_CLUSTER": CLUSTER}
    ktc = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    prompt = [(i * 37) % 200 + 3 for i in range(6 * BLOCK_SIZE + 5)]

    first = vllm_server(vllm_model_dir, kv_transfer_config=ktc, env=env, kv_events=False, log_dir=tmp_path)
    first.start()
    try:
        out_a = first.complete(prompt, max_tokens=8)
        with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix=cluster_prefix(CLUSTER)) as pool:
            deadline = time.monotonic() + 60
            while pool.metrics().keys == 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            saved = pool.metrics().keys
        assert saved > 0, first.log_tail()
    finally:
        first.stop()

    second = vllm_server(vllm_model_dir, kv_transfer_config=ktc, env=env, kv_events=False, log_dir=tmp_path)
    second.start()
    try:
        out_b = second.complete(prompt, max_tokens=8)
        cached = int((out_b["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        log = second.log_tail(200)
    finally:
        second.stop()
    print(f"prompt {len(prompt)} tokens, second server cached_tokens={cached}, pool keys after the first={saved}")
    assert out_b["choices"][0]["text"] == out_a["choices"][0]["text"]
    assert cached >= 5 * BLOCK_SIZE, (cached, log)
