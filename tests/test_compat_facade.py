"""The Mooncake-Store facade: the codes integrations read, and the same probe run against
the real Mooncake Store (the peer venv of shared/peers/mooncake, when installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mooncake_rs.compat import install_as_mooncake, shim_path

HERE = Path(__file__).resolve().parent
PEER_VENV = Path(os.environ.get("MC_PEER_VENV", "/tmp/peer-mc"))

#: probe entries where the two differ on purpose (docs/store-service.md lists why)
KNOWN_DIFFERENCES = {
    # usable capacity: our small-value class takes 1/16 of the segment, Mooncake's
    # allocator fits 16 x 4 MiB in 64 MiB (15 in the peer README's run)
    "18 x 4 MiB pinned: count ok",
}


def run_probe(python: str, impl: str) -> dict:
    env = dict(os.environ)
    r = subprocess.run([python, str(HERE / "mooncake_probe.py"), impl], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_probe_codes_of_the_facade():
    got = run_probe(sys.executable, "ours")
    assert got["get(missing)"] == "b''"
    assert got["get_into(missing)"] == -704 and got["batch_get_into(missing)"] == [-704]
    assert got["is_exist(missing)"] == 0 and got["remove(missing)"] == -704
    assert got["put(dup, 2000 B) again"] == 0 and got["get(dup) after 2nd put"] == [1000, "A"]
    assert got["batch_get_into(4 x 1 MiB)"] == [1 << 20] * 4 and got["batch_get_into bytes equal"]
    assert got["multi_buffers bytes equal"] and got["get_size(mb-0)"] == 65536 * 2 + 1000
    assert got["put_from(96 MiB into 64 MiB)"] == -200
    assert got["unpinned put when full of pins"] == -200 and got["batch_put_from when full of pins"] == [-200]
    assert got["put after removals"] == 0 and got["get_into after removals"] == 4 << 20


@pytest.mark.skipif(not (PEER_VENV / "bin" / "mooncake_master").exists(),
                    reason="the real Mooncake wheel is not installed (see shared/peers/mooncake/README.md)")
def test_facade_against_the_real_mooncake_store():
    ours = run_probe(sys.executable, "ours")
    theirs = run_probe(str(PEER_VENV / "bin" / "python"), "mooncake")
    assert set(ours) == set(theirs)
    differ = {k for k in theirs if ours[k] != theirs[k]}
    assert differ <= KNOWN_DIFFERENCES, {k: (ours[k], theirs[k]) for k in differ - KNOWN_DIFFERENCES}


def test_install_as_mooncake_makes_the_import_work(monkeypatch):
    for name in ("mooncake", "mooncake.store"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    mod = install_as_mooncake()
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: F401

    import mooncake

    assert sys.modules["mooncake.store"] is mod and mooncake.store is mod
    assert hasattr(ReplicateConfig, "group_ids")  # vLLM/SGLang probe the class for it


def test_shim_path_serves_another_process():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim_path(), os.environ.get("PYTHONPATH", "")]))
    code = ("from mooncake.store import MooncakeDistributedStore as M; import mooncake_rs.compat.mooncake_store as m;"
            "print(M is m.MooncakeDistributedStore)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "True", r.stderr


def _store(tmp_path, **cfg):
    from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "127.0.0.1:50051", "protocol": "tcp",
                                "global_segment_size": "32MB", "local_buffer_size": "16MB", **cfg}))
    return s, path


def test_setup_reads_mooncake_config_path(tmp_path, monkeypatch):
    s, path = _store(tmp_path)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    assert s.setup() == 0
    assert s.pool.metrics().capacity_dram == 32 << 20
    assert s.put("k", b"v" * 10) == 0 and s.get("k") == b"v" * 10
    assert s.close() == 0


def test_setup_refuses_an_embedded_pool_without_memory():
    from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "127.0.0.1:50051") == -600
    assert s.put("k", b"v") == -1 and s.get("k") == b"" and s.batch_is_exist(["k"]) == [-1]


def test_bad_arguments_are_codes_not_exceptions():
    from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "x") == 0
    assert s.batch_put_from(["a", "b"], [1], [1]) == [-600, -600]
    assert s.put("", b"x") == -600
    assert s.put_batch(["a"], [b""]) == -600
    buf = np.zeros(64, np.uint8)
    assert s.batch_get_into([""], [buf.ctypes.data], [64]) == [-600]


def test_lmcache_calls_put_parts_and_batch_get_buffer():
    from mooncake_rs.compat.mooncake_store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "x") == 0
    head, body = b"H" * 28, np.arange(100000, dtype=np.uint8) % 251
    assert s.put_parts("lm", head, body) == 0
    got = s.batch_get_buffer(["lm", "missing"])
    assert got[1] is None and bytes(got[0]) == head + body.tobytes()
    assert s.upsert("lm", b"new") == 0 and s.get("lm") == b"new"
    assert s.get_buffer("missing") is None
