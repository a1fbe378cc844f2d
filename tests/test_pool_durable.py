"""A pool segment with an SSD tier survives its process: put, SIGKILL, reopen (embedded and
as a ``mooncake-rs store`` node restarted with the same --ssd-path and --name), every key
byte for byte; a damaged slot file makes its object missing, never wrong bytes."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from etcd_helpers import etcd, etcd_url  # noqa: F401,F811 (the fixtures)
from pool_helpers import TOKEN, env, start_node

from mooncake_rs.errors import BlockNotFound
from mooncake_rs.pool import DistributedStore, KeyStatus
from mooncake_rs.pool.durable import MANIFEST_BYTES, decode_manifest, encode_manifest
from mooncake_rs.pool.objects import ObjectMeta

pytestmark = [pytest.mark.timeout(180)]

MiB = 1 << 20
CHUNK = 64 << 10
# small (one slot), exactly a chunk, chunks + a tail, several chunks
SIZES = [1, 128, 4096, 5000, CHUNK, 3 * CHUNK + 17, MiB + 5]


def value(i: int, size: int) -> bytes:
    return np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8).tobytes()


def expected() -> dict[str, bytes]:
    return {f"key-{i}-{n}": value(i, n) for i, n in enumerate(SIZES)}


def damage_one_slot(slot_file: Path, block_bytes: int) -> None:
    """Flips one data byte of the first written slot (the slot file's layout: a 4 KiB
    file header, then page-aligned slots of a 64-byte header and the block)."""
    stride = -(-(64 + block_bytes) // 4096) * 4096
    data = bytearray(slot_file.read_bytes())
    for off in range(4096, len(data), stride):
        if any(data[off:off + 64]):
            data[off + 64 + block_bytes // 2] ^= 0x10
            slot_file.write_bytes(bytes(data))
            return
    raise AssertionError(f"no written slot in {slot_file}")


def test_manifest_round_trip_and_rejections():
    meta = ObjectMeta(7 << 24, 12345, 1, 3, True)
    rec = encode_manifest("ключ/with-utf8", meta)
    assert rec is not None and len(rec) == MANIFEST_BYTES
    assert decode_manifest(meta.oid, rec) == ("ключ/with-utf8", meta)
    assert decode_manifest(8 << 24, rec) is None, "a manifest names its own oid"
    assert decode_manifest(meta.oid, bytes(MANIFEST_BYTES)) is None
    assert encode_manifest("k" * MANIFEST_BYTES, meta) is None


def test_embedded_segment_survives_sigkill_and_drops_a_damaged_object(tmp_path):
    ssd = tmp_path / "ssd"
    # the writer puts every key, says so, and is SIGKILLed by itself: no close, no flush
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_pool_durable import expected
        from mooncake_rs.pool import DistributedStore
        s = DistributedStore.embedded(8 << 20, ssd_path={str(ssd)!r}, ssd_bytes=64 << 20, chunk_bytes={CHUNK})
        for k, v in expected().items():
            s.put(k, v)
        s.put("pinned", b"p" * 70000, pin=True)
        s.put("removed", b"r" * 70000)
        s.remove("removed")
        print("stored", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    assert "stored" in r.stdout and r.returncode == -signal.SIGKILL, r.stderr
    want = expected()
    with DistributedStore.embedded(8 << 20, ssd_path=str(ssd), ssd_bytes=64 << 20, chunk_bytes=CHUNK) as s:
        for k, v in want.items():
            assert s.get(k) == v, k
        assert s.get("pinned") == b"p" * 70000
        assert s.batch_exists(["removed"]) == [False]
        m = s.metrics()
        assert m.objects_recovered == len(want) + 1 and m.objects_recovery_dropped == 0
        # still a working segment: put-if-absent on a recovered key, new keys, removal
        s.put("key-0-1", b"other")
        assert s.get("key-0-1") == want["key-0-1"]
        s.put("new", b"n" * 9000)
        s.remove("key-1-128")
    del s
    gc.collect()  # the slot files have one owner: the first segment must be gone
    damage_one_slot(ssd / "large" / "blocks.slots", CHUNK)
    with DistributedStore.embedded(8 << 20, ssd_path=str(ssd), ssd_bytes=64 << 20, chunk_bytes=CHUNK) as s:
        missing = []
        for k, v in {**want, "new": b"n" * 9000}.items():
            if k == "key-1-128":
                continue
            try:
                got = s.get(k)
            except BlockNotFound:
                missing.append(k)
                continue
            assert got == v, f"{k}: wrong bytes served"
        assert len(missing) == 1, missing
        assert s.batch_exists(["key-1-128"]) == [False]
        assert s.metrics().objects_recovery_dropped == 1


def _node(etcd_url: str, ssd: Path) -> subprocess.Popen:
    p, _ = start_node(subprocess.Popen, etcd_url, "127.0.0.1", 0, "durable", "restart", dram="16MB",
                      extra=("--ssd-path", str(ssd), "--ssd-bytes", "64MB", "--chunk-bytes", str(CHUNK)))
    return p


def _get_all(etcd_url: str, keys: list[str]) -> dict[str, bytes | int]:
    """Each key's bytes, or the status of reading it (the node may still be registering)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/restart") as s:
                out: dict[str, bytes | int] = {}
                for k in keys:
                    try:
                        out[k] = s.get(k)
                    except BlockNotFound:
                        out[k] = KeyStatus.MISSING
                return out
        except Exception:  # noqa: BLE001 - the old record or no record yet: retry until the deadline
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_store_node_restarted_with_its_ssd_path_serves_its_keys_again(etcd_url, tmp_path):
    ssd = tmp_path / "ssd"
    want = expected()
    p = _node(etcd_url, ssd)
    try:
        with DistributedStore.connect(etcd_url, auth_token=TOKEN, prefix="/mooncake/restart") as s:
            for k, v in want.items():
                s.put(k, v)
            assert s.metrics().keys == len(want)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    p = _node(etcd_url, ssd)
    try:
        assert _get_all(etcd_url, list(want)) == want
    finally:
        p.terminate()
        p.wait(10)
    damage_one_slot(ssd / "large" / "blocks.slots", CHUNK)
    p = _node(etcd_url, ssd)
    try:
        got = _get_all(etcd_url, list(want))
        lost = [k for k, v in got.items() if v == KeyStatus.MISSING]
        assert len(lost) == 1, lost
        assert {k: v for k, v in got.items() if k not in lost} == {k: v for k, v in want.items() if k not in lost}
    finally:
        p.terminate()
        p.wait(10)
