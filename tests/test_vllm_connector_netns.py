"""The connector across "hosts" (network namespaces joined by veth pairs and a bridge,
tests/netns_helpers.py): a KV pool (``mooncake-rs kv-pool``) on host 0, a prefill-side
worker on host 1 saving a vLLM-shaped CPU KV cache into it over TCP, and a decode-side
worker in the test's own namespace loading those blocks over TCP into another KV tensor:
the bytes loaded are the bytes saved, checked by the pool's CRC-32s (the saver's, taken
while it copied) and byte for byte here. Then a block changed in the pool is reported for
recompute, never used. No vLLM model runs; the worker is driven as vLLM drives it."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from netns_helpers import TestHosts, require

pytest.importorskip("vllm")  # the connector's metadata classes subclass vLLM's

TOKEN = "netns-connector-token-0123456789ab"
NUM_BLOCKS = 24
SAVED = [1, 4, 5, 9, 10, 17]  # the prefill's vLLM blocks (not in order, not contiguous)
LOADED = [20, 2, 3, 11, 12, 0]  # where the decode puts them

# One definition of the KV both sides use: vLLM's CPU layout [blocks, 2, block, heads*dim]
# in bf16, seeded (the decode regenerates the prefill's to compare).
_KV = textwrap.dedent("""
    import torch
    def make_kv(seed, layers=3):
        g = torch.Generator().manual_seed(seed)
        return {f"model.layers.{i}.self_attn.attn": torch.randn(%d, 2, 16, 8 * 64, generator=g).to(torch.bfloat16)
                for i in range(layers)}
""" % NUM_BLOCKS)

_SAVER = _KV + textwrap.dedent("""
    import json, sys
    from mooncake_rs.integrations.vllm.config import ConnectorSettings
    from mooncake_rs.integrations.vllm.metadata import MooncakeRsConnectorMetadata, SaveSpec
    from mooncake_rs.integrations.vllm.worker import ConnectorWorker
    pool, token, keys, blocks = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), json.loads(sys.argv[4])
    kv = make_kv(7)
    s = ConnectorSettings(pool=pool, auth_token=token, advertise=pool, role="kv_producer", model_id="m",
                          transports=("tcp",), timeout_s=20.0)
    w = ConnectorWorker(s, %d)
    w.register_kv_caches(kv)
    w.begin_step(MooncakeRsConnectorMetadata(saves=[SaveSpec("p", blocks, keys)]))
    for name in kv:
        w.save_kv_layer(name)
    w.wait_for_save()
    print(json.dumps({"direct": w._pools[pool].arena is not None, "counters": w.counters}), flush=True)
    w.shutdown()
""" % NUM_BLOCKS)


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    require()  # skips without namespaces, fails instead under MOONCAKE_REQUIRE_NETNS=1


def _start_pool(hosts: TestHosts) -> tuple[subprocess.Popen[bytes], str]:
    ip = hosts.ip(0)
    env = {**os.environ, "MOONCAKE_AUTH_TOKEN": TOKEN}
    proc = hosts.popen(0, [sys.executable, "-m", "mooncake_rs", "kv-pool", "--listen", f"{ip}:7611",
                           "--data-listen", f"{ip}:7612", "--memory", "64M"], env=env, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    line = proc.stderr.readline().decode()  # bounded: the process prints it or exits
    assert "KV pool on" in line, line
    return proc, f"{ip}:7611"


def test_decode_host_loads_blocks_a_prefill_host_saved_over_tcp(tmp_path):
    import torch

    from mooncake_rs import BlockHashes
    from mooncake_rs.integrations.vllm.config import ConnectorSettings
    from mooncake_rs.integrations.vllm.metadata import LoadSpec, MooncakeRsConnectorMetadata
    from mooncake_rs.integrations.vllm.worker import ConnectorWorker

    scope: dict = {}
    exec(_KV, scope)  # noqa: S102 (the same seeded KV definition the saver runs)
    make_kv = scope["make_kv"]
    keys = bytes(BlockHashes([uuid.uuid4().int for _ in SAVED]))
    with TestHosts(2) as hosts:
        _, pool = _start_pool(hosts)
        saver = hosts.popen(1, [sys.executable, "-c", _SAVER, pool, TOKEN, keys.hex(), json.dumps(SAVED)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = saver.communicate(timeout=120)
        assert saver.returncode == 0, err.decode()[-2000:]
        saved = json.loads(out.decode().strip().splitlines()[-1])
        assert not saved["direct"]  # TCP, not the shared arena
        assert saved["counters"]["blocks_saved"] == len(SAVED) and saved["counters"]["saves_failed"] == 0

        # the decode host: an empty cache, the pool reached over the bridge
        kv = {name: torch.zeros_like(t) for name, t in make_kv(7).items()}
        s = ConnectorSettings(pool=pool, auth_token=TOKEN, advertise=pool, role="kv_consumer", model_id="m",
                              transports=("tcp",), timeout_s=20.0)
        w = ConnectorWorker(s, NUM_BLOCKS)
        try:
            w.register_kv_caches(kv)
            assert w._pools[pool].arena is None
            client = w._pools[pool].client
            found = client.lookup(keys, lease_s=30)
            assert found.count == len(SAVED) and all(c >= 0 for c in found.checksums)
            spec = LoadSpec("d", pool, LOADED, list(found.offsets), list(found.checksums), keys)
            w.start_load_kv(MooncakeRsConnectorMetadata(loads=[spec]))
            for name in kv:
                w.wait_for_layer_load(name)
            assert w.get_block_ids_with_load_errors() == set()
            want = make_kv(7)
            for name, t in kv.items():
                assert torch.equal(t[LOADED], want[name][SAVED]), name
            assert w.counters["blocks_loaded"] == len(SAVED)
            client.release(found.lease)

            # one byte of block 3 changes in the pool host's memory (the namespaces share
            # this machine's /dev/shm, so the test can reach the arena): the decode sees the
            # mismatch, reports the block for recompute and has the pool drop it
            opened = client.open(w.layout.block_bytes, w.layout.fingerprint)
            fd = os.open("/dev/shm/" + opened.shm_name.lstrip("/"), os.O_RDWR)
            try:
                arena = mmap.mmap(fd, opened.slots * opened.slot_stride)
            finally:
                os.close(fd)
            arena[found.offsets[3] + 5] ^= 0x40
            arena.close()
            for t in kv.values():
                t.zero_()
            spec = LoadSpec("d2", pool, LOADED, list(found.offsets), list(found.checksums), keys)
            w.start_load_kv(MooncakeRsConnectorMetadata(loads=[spec]))
            assert w.get_block_ids_with_load_errors() == {LOADED[3]}
            assert w.counters["blocks_corrupt"] == 1
            assert client.lookup(keys).count == 3  # the block was removed from the pool; the run stops there
        finally:
            w.shutdown()
