"""The connector's copy path without a vLLM model: ``copy_segments`` (Rust gather/scatter
with each block's CRC-32 in the same pass) against a numpy / zlib reference, and the
worker's save -> pool -> load round trip on a vLLM-shaped CPU KV tensor, through the
direct path (the pool's arena mapped here) and through the transfer engine (TCP): the
bytes loaded are the bytes saved, the pool's checksums are the slots' CRC-32s, and a
block changed in the pool is reported, not used."""

from __future__ import annotations

import uuid
import zlib

import numpy as np
import pytest

import mooncake_rs as mc
from mooncake_rs._core import copy_segments, crc32
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.integrations.pool import KVPoolServer, PoolConfig

TOKEN = "copy-test-token-0123456789abcdef"


@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streaming"])
def test_copy_segments_equals_a_numpy_gather_and_zlib_checksums(streaming):
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for length in (1, 100, 127, 128, 129, 4096, 65536 + 3):
        n = 8
        so = rng.choice((len(src) - length) // 7, n, replace=False).astype(np.uint64) * 7
        # destinations at odd addresses too (streaming stores start at the first 16-aligned byte)
        to = np.arange(n, dtype=np.uint64)[::-1] * np.uint64(length) + np.uint64(3)
        dst = np.zeros(n * length + 5, np.uint8)
        crcs = np.zeros(n // 2, np.uint32)
        copy_segments(src, so, dst, to.copy(), length, crcs, 2, streaming)
        want = np.zeros_like(dst)
        for s, t in zip(so.tolist(), to.tolist()):
            want[t:t + length] = src[s:s + length]
        assert np.array_equal(dst, want)
        plain = np.zeros_like(dst)
        copy_segments(src, so, plain, to.copy(), length, None, 1, streaming=streaming)
        assert np.array_equal(plain, want)
        for g in range(n // 2):
            ref = 0
            for i in (2 * g, 2 * g + 1):
                ref = zlib.crc32(src[int(so[i]):int(so[i]) + length], ref)
            assert int(crcs[g]) == ref
        # checksums only (no destination), continued from a start value
        more = np.full(n, 7, np.uint32)
        copy_segments(src, so, None, [], length, more, 1)
        assert [int(c) for c in more] == [zlib.crc32(src[int(s):int(s) + length], 7) for s in so]
    assert crc32(src) == zlib.crc32(src) and crc32(b"123456789") == 0xCBF43926
    assert crc32(src[5:1000], 99) == zlib.crc32(src[5:1000], 99)


def test_copy_segments_refuses_bad_input_with_typed_errors_before_copying():
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, np.uint8)
    with pytest.raises(InvalidArgument, match="ends past"):
        copy_segments(src, [0, 990], dst, [0, 100], 20)
    with pytest.raises(InvalidArgument, match="one each"):
        copy_segments(src, [0, 10], dst, [0], 10)
    with pytest.raises(InvalidArgument, match="share memory"):
        copy_segments(src, [0], src[500:], [0], 10)
    with pytest.raises(InvalidArgument, match="checksums"):
        copy_segments(src, [0, 10, 20], dst, [0, 10, 20], 10, np.zeros(2, np.uint32), 2)
    with pytest.raises(InvalidArgument, match="writable"):
        copy_segments(src, [0], b"\0" * 100, [0], 10)
    assert not dst.any()


# --- the worker against a real pool -----------------------------------------------------


@pytest.fixture
def pool():
    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=64 << 20)) as p:
        yield p


def pool_bytes(pool) -> np.ndarray:
    """The pool's arena, mapped here (it is a shared-memory segment)."""
    import mmap
    import os

    region = pool.store.region()
    fd = os.open("/dev/shm/" + region.shm_name.lstrip("/"), os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, region.length), dtype=np.uint8)
    finally:
        os.close(fd)


def _worker(address: str, num_blocks: int, kv, transports=None):
    pytest.importorskip("vllm")  # the metadata classes subclass vLLM's
    from mooncake_rs.integrations.vllm.config import ConnectorSettings
    from mooncake_rs.integrations.vllm.worker import ConnectorWorker

    settings = ConnectorSettings(pool=address, auth_token=TOKEN, advertise=address, role="kv_both", model_id="t",
                                 transports=transports)
    w = ConnectorWorker(settings, num_blocks)
    w.register_kv_caches(kv)
    return w


def _kv(num_blocks: int, layers: int = 3, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    # vLLM's CPU layout: [num_blocks, 2 (K/V), block tokens, kv heads * head dim], bf16
    return {f"model.layers.{i}.attn": torch.randn(num_blocks, 2, 16, 4 * 32, generator=g).to(torch.bfloat16)
            for i in range(layers)}


def save_and_load(w, kv, save_ids, load_ids, pool_address):
    """Saves ``save_ids`` as vLLM does (reserve, each layer in order, commit), then loads
    them into ``load_ids``; returns (pool checksums, load errors)."""
    from mooncake_rs.integrations.vllm.metadata import LoadSpec, MooncakeRsConnectorMetadata, SaveSpec

    keys = bytes(mc.BlockHashes([uuid.uuid4().int for _ in save_ids]))
    w.begin_step(MooncakeRsConnectorMetadata(saves=[SaveSpec("r", save_ids, keys)]))
    for name in kv:
        w.save_kv_layer(name)
    w.wait_for_save()
    client = w._pools[pool_address].client
    found = client.lookup(keys)
    assert found.count == len(save_ids)
    spec = LoadSpec("r2", pool_address, load_ids, list(found.offsets), list(found.checksums), keys)
    w.start_load_kv(MooncakeRsConnectorMetadata(loads=[spec]))
    for name in kv:
        w.wait_for_layer_load(name)
    return found, w.get_block_ids_with_load_errors()


@pytest.mark.parametrize("transports", [None, ["tcp"], "stream-loads"],
                         ids=["direct", "engine-tcp", "direct-streaming-loads"])
def test_worker_round_trip_is_byte_exact_and_checksums_are_the_slots(pool, transports, monkeypatch):
    import torch

    if transports == "stream-loads":  # the direct path with every load in streaming stores (as large ones are)
        from mooncake_rs.integrations.vllm import worker

        monkeypatch.setattr(worker, "STREAM_LOADS_FROM_BYTES", 0)
        transports = None
    kv = _kv(16)
    w = _worker(pool.address, 16, kv, transports)
    try:
        assert (w._pools[pool.address].arena is not None) == (transports is None)
        found, errors = save_and_load(w, kv, [0, 3, 5, 6], [8, 9, 10, 11], pool.address)
        assert errors == set()
        for t in kv.values():
            assert torch.equal(t[[8, 9, 10, 11]], t[[0, 3, 5, 6]])
        # the checksums the worker took while copying are the CRC-32s of the pool's slots,
        # and the slots hold each layer's bytes of the block, layer after layer
        arena = pool_bytes(pool)
        for j, off in enumerate(found.offsets):
            slot = arena[off:off + w.layout.block_bytes]
            assert found.checksums[j] == zlib.crc32(slot)
            want = b"".join(kv[name][[0, 3, 5, 6][j]].contiguous().view(torch.uint8).numpy().tobytes() for name in kv)
            assert slot.tobytes() == want
        assert w.counters["blocks_saved"] == 4 and w.counters["blocks_loaded"] == 4
    finally:
        w.shutdown()


@pytest.mark.parametrize("transports", [None, ["tcp"]], ids=["direct", "engine-tcp"])
def test_a_block_changed_in_the_pool_is_reported_and_removed(pool, transports):
    from mooncake_rs.integrations.vllm.metadata import LoadSpec, MooncakeRsConnectorMetadata, SaveSpec

    kv = _kv(8, layers=2, seed=3)
    w = _worker(pool.address, 8, kv, transports)
    try:
        keys = bytes(mc.BlockHashes([uuid.uuid4().int for _ in range(3)]))
        w.begin_step(MooncakeRsConnectorMetadata(saves=[SaveSpec("r", [0, 1, 2], keys)]))
        for name in kv:
            w.save_kv_layer(name)
        w.wait_for_save()
        client = w._pools[pool.address].client
        found = client.lookup(keys)
        # flip one byte of the second block's last layer, in the pool's own memory
        pool_bytes(pool)[found.offsets[1] + w.layout.block_bytes - 1] ^= 0xFF
        spec = LoadSpec("r2", pool.address, [4, 5, 6], list(found.offsets), list(found.checksums), keys)
        w.start_load_kv(MooncakeRsConnectorMetadata(loads=[spec]))
        errors = w.get_block_ids_with_load_errors()
        assert errors == {5}
        assert w.counters["blocks_corrupt"] == 1
        assert client.lookup(keys).count == 1  # the bad block is gone; the first still leads
    finally:
        w.shutdown()


@pytest.mark.parametrize("advice", ["populate_write", "unknown_to_the_kernel"])
def test_the_arena_mapping_is_populated_without_changing_a_byte(advice, monkeypatch):
    # a client maps an arena that already holds committed blocks: making its page tables
    # (MADV_POPULATE_WRITE, or MAP_POPULATE where the kernel refuses that advice) must
    # leave every byte as it was, and stores through the mapping reach the segment
    import os

    from mooncake_rs.integrations.pool import shared_arena

    if advice != "populate_write":
        monkeypatch.setattr(shared_arena, "MADV_POPULATE_WRITE", 0x7FFF)  # EINVAL: the fallback
    path = f"/dev/shm/mooncake-test-arena-{uuid.uuid4().hex}"
    data = np.random.default_rng(3).integers(0, 256, 3 * 4096 + 100, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        m = shared_arena._map_populated(fd, len(data))
        view = np.frombuffer(m, np.uint8)
        assert np.array_equal(view, data)
        view[4096:4100] = [1, 2, 3, 4]
        del view
        m.close()
        with open(path, "rb") as f:
            back = np.frombuffer(f.read(), np.uint8)
        assert list(back[4096:4100]) == [1, 2, 3, 4]
        assert np.array_equal(back[:4096], data[:4096]) and np.array_equal(back[4100:], data[4100:])
    finally:
        os.close(fd)
        os.unlink(path)
