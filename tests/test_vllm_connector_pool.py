"""The connector on the cluster-wide pool (``store: "pool"``) without a vLLM model: the
pool worker's save -> pool -> load round trip on vLLM-shaped CPU KV tensors through a
``DistributedStore`` (embedded, and a ``mooncake-rs store`` node found through etcd in
another process), against the simple reference (each block's value is its layers'
bytes, layer after layer, then their CRC-32); the scheduler counts the leading blocks the
pool holds; a block changed or lost in the pool is reported, not used; a full pool skips
saves and counts them."""

from __future__ import annotations

import uuid
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")  # the metadata classes subclass vLLM's
torch = pytest.importorskip("torch")

import mooncake_rs as mc  # noqa: E402
from mooncake_rs.errors import InvalidArgument  # noqa: E402
from mooncake_rs.integrations.vllm.config import ConnectorSettings  # noqa: E402
from mooncake_rs.integrations.vllm.metadata import (  # noqa: E402
    LoadSpec,
    MooncakeRsConnectorMetadata,
    SaveSpec,
)
from mooncake_rs.integrations.vllm.pool_store import PoolBlocks  # noqa: E402
from mooncake_rs.integrations.vllm.pool_worker import PoolConnectorWorker  # noqa: E402
from mooncake_rs.integrations.vllm.scheduler import ConnectorScheduler  # noqa: E402
from mooncake_rs.pool import DistributedStore  # noqa: E402

TOKEN = "pool-test-token-0123456789abcdef"
BS = 16
CLUSTER = "vllmpool"


def _settings(**kw):
    args = dict(pool="", auth_token=TOKEN, advertise="pool", role="kv_both", model_id="t", store="pool",
                etcd="http://127.0.0.1:1", namespace=f"vllm-kv/test-{uuid.uuid4().hex[:8]}")
    args.update(kw)
    return ConnectorSettings(**args)


def _kv(num_blocks: int, layers: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # vLLM's CPU layout: [num_blocks, 2 (K/V), block tokens, kv heads * head dim], bf16
    return {f"model.layers.{i}.attn": torch.randn(num_blocks, 2, BS, 4 * 32, generator=g).to(torch.bfloat16)
            for i in range(layers)}


def _block_value(kv, block_id: int) -> bytes:
    """The reference: the block's bytes layer after layer, then their CRC-32 (LE)."""
    body = b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in kv.values())
    return body + zlib.crc32(body).to_bytes(4, "little")


@pytest.fixture(scope="module")
def remote_pool(tmp_path_factory):
    """A store node in another process, registered in a real etcd."""
    from pool_helpers import local_pool

    with local_pool(tmp_path_factory.mktemp("etcd"), CLUSTER) as url:
        yield url


@pytest.fixture(params=["embedded", "remote"])
def blocks(request):
    """(PoolBlocks, a second PoolBlocks on the same pool as another process would open it)."""
    ns = f"vllm-kv/test-{uuid.uuid4().hex[:8]}"
    if request.param == "embedded":
        store = DistributedStore.embedded(64 << 20)
        yield PoolBlocks(store, ns), PoolBlocks(store, ns)
        store.close()
        return
    url = request.getfixturevalue("remote_pool")
    s = _settings(etcd=url, cluster=CLUSTER, namespace=ns, transports=("tcp",))
    a, b = PoolBlocks.open(s), PoolBlocks.open(s)
    yield a, b
    a.close()
    b.close()


def _save(w, kv, ids, keys):
    w.begin_step(MooncakeRsConnectorMetadata(saves=[SaveSpec("r", ids, bytes(mc.BlockHashes(keys)))]))
    for name in kv:
        w.save_kv_layer(name)
    w.wait_for_save()


def _load(w, kv, ids, keys):
    w.start_load_kv(MooncakeRsConnectorMetadata(loads=[LoadSpec("r2", "pool", ids, [], [],
                                                                bytes(mc.BlockHashes(keys)))]))
    for name in kv:
        w.wait_for_layer_load(name)
    return w.get_block_ids_with_load_errors()


def test_pool_worker_round_trip_is_byte_exact(blocks):
    saver_blocks, loader_blocks = blocks
    kv = _kv(16)
    saver = PoolConnectorWorker(_settings(), 16, saver_blocks)
    saver.register_kv_caches(kv)
    keys = [uuid.uuid4().int for _ in range(4)]
    _save(saver, kv, [0, 3, 5, 6], keys)
    assert saver.counters["blocks_saved"] == 4
    # what the pool holds for each key is the reference value
    for k, b in zip(keys, [0, 3, 5, 6]):
        assert saver_blocks.store.get(saver_blocks.key(k)) == _block_value(kv, b)
    # another worker (another instance's KV tensors) loads them into other blocks
    kv2 = _kv(16, seed=9)
    loader = PoolConnectorWorker(_settings(), 16, loader_blocks)
    loader.register_kv_caches(kv2)
    assert loader_blocks.leading(keys + [uuid.uuid4().int]) == 4
    assert _load(loader, kv2, [8, 9, 10, 11], keys) == set()
    for name in kv:
        assert torch.equal(kv2[name][[8, 9, 10, 11]], kv[name][[0, 3, 5, 6]])
    assert loader.counters["blocks_loaded"] == 4 and loader.counters["blocks_load_failed"] == 0


def test_changed_or_lost_blocks_are_reported_not_used(blocks):
    pb, _ = blocks
    kv = _kv(8, layers=2, seed=3)
    w = PoolConnectorWorker(_settings(), 8, pb)
    w.register_kv_caches(kv)
    keys = [uuid.uuid4().int for _ in range(3)]
    _save(w, kv, [0, 1, 2], keys)
    # the second block's value is replaced by one with a byte flipped in its last layer;
    # the third is removed (evicted after the scheduler counted it)
    bad = bytearray(_block_value(kv, 1))
    bad[-5] ^= 0xFF
    pb.store.remove(pb.key(keys[1]))
    pb.store.put(pb.key(keys[1]), bytes(bad))
    pb.store.remove(pb.key(keys[2]))
    before = {n: t.clone() for n, t in kv.items()}
    assert _load(w, kv, [4, 5, 6], keys) == {5, 6}
    assert w.counters["blocks_corrupt"] == 1 and w.counters["blocks_loaded"] == 1
    assert not pb.store.exists(pb.key(keys[1]))  # the corrupt block is gone from the pool
    for n in kv:
        assert torch.equal(kv[n][4], before[n][0])  # the good one is in
    # a value of another size (another layout under the key) is refused too
    pb.store.put(pb.key(keys[2]), b"x" * 100)
    assert _load(w, kv, [7], keys[2:]) == {7}


def test_scheduler_plans_the_leading_blocks_the_pool_holds():
    store = DistributedStore.embedded(16 << 20)
    try:
        s = _settings()
        sched = ConnectorScheduler(s, BS, blocks=PoolBlocks(store, s.namespace))
        prompt = list(range(10, 10 + 5 * BS + 3))  # 5 full blocks and 3 tokens
        req = SimpleNamespace(request_id="a", prompt_token_ids=prompt, lora_request=None, cache_salt=None,
                              kv_transfer_params=None, block_hashes=[])
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        keys = sched._reqs["a"].keys.tolist()
        kv = _kv(8, layers=2)
        w = PoolConnectorWorker(s, 8, PoolBlocks(store, s.namespace))
        w.register_kv_caches(kv)
        _save(w, kv, [0, 1, 2], keys[:3])  # the first 3 blocks
        sched.request_finished(req)
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
        sched.request_finished(req)
        _save(w, kv, [3, 4, 5], keys[3:5] + [uuid.uuid4().int])
        # all 5 full blocks are there; the last token is vLLM's to compute: still 5 blocks
        assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
        assert sched.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, False)  # 2 blocks local already
        # another tenant (cache salt) sees none of it
        other = SimpleNamespace(**{**vars(req), "request_id": "b", "cache_salt": "tenant-2"})
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        assert sched.take_events() == []
    finally:
        store.close()


def test_a_full_pool_skips_saves_and_counts_them():
    """The pool evicts (LRU) to make room; it is full only when what is left is pinned:
    then the saves are skipped and counted, and saving goes on once there is room."""
    from mooncake_rs.errors import StoreFull

    store = DistributedStore.embedded(4 << 20, chunk_bytes=64 << 10)
    try:
        pinned = 0
        with pytest.raises(StoreFull):
            for pinned in range(1000):
                store.put(f"pinned/{pinned}", b"p" * (64 << 10), pin=True)
        kv = _kv(16, layers=2)
        w = PoolConnectorWorker(_settings(), 16, PoolBlocks(store, "vllm-kv/full"))
        w.register_kv_caches(kv)
        _save(w, kv, list(range(4)), [uuid.uuid4().int for _ in range(4)])
        assert w.counters["saves_skipped_full"] == 4 and w.counters["blocks_saved"] == 0
        for i in range(8):
            store.remove(f"pinned/{i}")
        keys = [uuid.uuid4().int for _ in range(4)]
        _save(w, kv, list(range(4, 8)), keys)
        assert w.counters["blocks_saved"] == 4 and w.blocks.leading(keys) == 4
    finally:
        store.close()


def test_settings_choose_the_pool_and_refuse_bad_ones():
    def cfg(extra):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both"),
                               model_config=SimpleNamespace(model="m", dtype="bfloat16"),
                               cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"))

    s = ConnectorSettings.from_vllm(cfg({"store": "pool", "etcd": "http://h:2379", "auth_token": "t",
                                         "cluster": "c1", "replicas": 2}))
    assert s.uses_pool and s.cluster == "c1" and s.replicas == 2 and s.namespace.startswith("vllm-kv/")
    # the namespace follows the KV's dtype and block size
    other = ConnectorSettings.from_vllm(cfg({"store": "pool", "etcd": "http://h:2379", "auth_token": "t"}))
    assert other.namespace == s.namespace
    c = cfg({"store": "pool", "etcd": "http://h:2379", "auth_token": "t"})
    c.model_config.dtype = "float16"
    assert ConnectorSettings.from_vllm(c).namespace != s.namespace
    assert not ConnectorSettings.from_vllm(cfg({"pool": "127.0.0.1:1", "auth_token": "t"})).uses_pool
    for extra, match in [({"store": "pool", "auth_token": "t"}, "etcd"),
                         ({"store": "disk", "etcd": "x", "auth_token": "t"}, "store"),
                         ({"store": "pool", "etcd": "x", "auth_token": "t", "replicas": 0}, "replicas"),
                         ({"auth_token": "t"}, "pool")]:
        with pytest.raises(InvalidArgument, match=match):
            ConnectorSettings.from_vllm(cfg(extra))
