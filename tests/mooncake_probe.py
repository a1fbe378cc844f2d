"""The same sequence of Mooncake Store calls against either implementation, printed as
JSON (name -> what came back), so tests/test_compat_vs_mooncake.py can compare them.

    python tests/mooncake_probe.py ours                 # mooncake_rs's facade (embedded)
    $MC_PEER_VENV/bin/python tests/mooncake_probe.py mooncake   # the real wheel + its master

Runs with only numpy and the implementation under test importable (the peer venv has no
mooncake_rs). Everything binds 127.0.0.1; the master is killed at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from ports import free_port

MiB = 1 << 20
SEG = 64 * MiB


def wait_port(port: int, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def open_store(impl: str):
    """(store, ReplicateConfig, cleanup)."""
    if impl == "ours":
        from mooncake_rs.compat import install_as_mooncake

        install_as_mooncake()
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", SEG, SEG, "tcp", "", "127.0.0.1:50051") == 0
        return s, ReplicateConfig, lambda: None
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    rpc, metrics, http = free_port(), free_port(), free_port()
    master = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    log = open(os.environ.get("MOONCAKE_PROBE_LOG", os.devnull), "ab")
    proc = subprocess.Popen([master, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
                             f"--metrics_port={metrics}", "--rpc_thread_num=2", "--logtostderr=true",
                             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                             f"--http_metadata_server_port={http}"], stdout=log, stderr=log)
    if not (wait_port(rpc) and wait_port(http)):
        proc.kill()
        raise RuntimeError("mooncake_master did not start")
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", SEG, SEG, "tcp", "", f"127.0.0.1:{rpc}")
    assert rc == 0, rc

    def cleanup() -> None:
        s.close()
        proc.kill()
        proc.wait(10)

    return s, ReplicateConfig, cleanup


def probe(s, ReplicateConfig) -> dict:  # noqa: N803 - the class, as Mooncake names it
    r: dict = {}
    buf = np.zeros(4 * MiB, dtype=np.uint8)
    r["register_buffer"] = s.register_buffer(buf.ctypes.data, buf.nbytes)
    cfg = ReplicateConfig()
    r["ReplicateConfig.replica_num"] = cfg.replica_num
    r["ReplicateConfig.with_hard_pin"] = cfg.with_hard_pin
    # missing keys
    r["get(missing)"] = repr(s.get("missing"))
    r["get_batch(missing x2)"] = repr(s.get_batch(["missing", "missing2"]))
    r["get_into(missing)"] = s.get_into("missing", buf.ctypes.data, buf.nbytes)
    r["batch_get_into(missing)"] = s.batch_get_into(["missing"], [buf.ctypes.data], [buf.nbytes])
    r["batch_get_into_multi_buffers(missing)"] = s.batch_get_into_multi_buffers(
        ["missing"], [[buf.ctypes.data, buf.ctypes.data + 4096]], [[4096, 4096]])
    r["get_size(missing)"] = s.get_size("missing")
    r["is_exist(missing)"] = s.is_exist("missing")
    r["batch_is_exist(missing)"] = s.batch_is_exist(["missing"])
    r["remove(missing)"] = s.remove("missing")
    # puts and reads
    r["put(dup, 1000 A)"] = s.put("dup", b"A" * 1000)
    r["put(dup, 2000 B) again"] = s.put("dup", b"B" * 2000)
    g = s.get("dup")
    r["get(dup) after 2nd put"] = [len(g), g[:1].decode()]
    r["get_size(dup)"] = s.get_size("dup")
    r["is_exist(dup)"] = s.is_exist("dup")
    val = (np.arange(4 * MiB, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
    keys = [f"bp-{i}" for i in range(4)]
    r["batch_put_from(4 x 1 MiB)"] = s.batch_put_from(keys, [val.ctypes.data + i * MiB for i in range(4)], [MiB] * 4)
    r["batch_put_from(dup again)"] = s.batch_put_from(keys[:1], [buf.ctypes.data], [MiB])
    out = np.zeros(4 * MiB, dtype=np.uint8)
    r["register_buffer(out)"] = s.register_buffer(out.ctypes.data, out.nbytes)
    r["batch_get_into(4 x 1 MiB)"] = s.batch_get_into(keys, [out.ctypes.data + i * MiB for i in range(4)], [MiB] * 4)
    r["batch_get_into bytes equal"] = bool((out == val).all())
    r["batch_is_exist(4 + missing)"] = s.batch_is_exist(keys + ["nope"])
    # multi-buffer objects: 3 pieces each
    pieces = [[val.ctypes.data + 3 * MiB + j * 65536 for j in range(3)] for _ in range(2)]
    r["batch_put_from_multi_buffers(2 x 3 pieces)"] = s.batch_put_from_multi_buffers(
        ["mb-0", "mb-1"], pieces, [[65536, 1000, 65536]] * 2)
    out[:] = 0
    dst = [[out.ctypes.data + j * 200000 for j in range(3)], [out.ctypes.data + MiB + j * 200000 for j in range(3)]]
    r["batch_get_into_multi_buffers(2 x 3 pieces)"] = s.batch_get_into_multi_buffers(
        ["mb-0", "mb-1"], dst, [[65536, 1000, 65536]] * 2)
    src = val[3 * MiB: 3 * MiB + 3 * 65536]
    r["multi_buffers bytes equal"] = bool((out[:65536] == src[:65536]).all()
                                          and (out[200000:201000] == src[65536:66536]).all()
                                          and (out[400000:465536] == src[131072:196608]).all())
    r["get_size(mb-0)"] = s.get_size("mb-0")
    r["put_from + get_into bytes"] = [s.put_from("pf", val.ctypes.data, 12345), s.get_into("pf", out.ctypes.data, MiB)]
    r["get_into(too small buffer)"] = s.get_into("pf", out.ctypes.data, 100) < 0
    # too big for the pool
    big = np.zeros(96 * MiB, dtype=np.uint8)
    s.register_buffer(big.ctypes.data, big.nbytes)
    r["put_from(96 MiB into 64 MiB)"] = s.put_from("huge", big.ctypes.data, big.nbytes)
    s.unregister_buffer(big.ctypes.data)
    r["remove_all(force) count"] = s.remove_all(True)
    time.sleep(0.5)
    r["batch_is_exist after remove_all"] = s.batch_is_exist(keys)
    # a pool full of pinned objects: -200, then room again after removals
    hp = ReplicateConfig()
    hp.with_hard_pin = True
    v4 = np.full(4 * MiB, 7, dtype=np.uint8)
    s.register_buffer(v4.ctypes.data, v4.nbytes)
    rcs = [s.put_from(f"hp-{i:02d}", v4.ctypes.data, v4.nbytes, hp) for i in range(18)]
    r["18 x 4 MiB pinned: first result"] = rcs[0]
    r["18 x 4 MiB pinned: last result"] = rcs[-1]
    r["18 x 4 MiB pinned: count ok"] = sum(1 for x in rcs if x == 0)
    r["unpinned put when full of pins"] = s.put_from("more", v4.ctypes.data, v4.nbytes)
    r["batch_put_from when full of pins"] = s.batch_put_from(["more-b"], [v4.ctypes.data], [v4.nbytes])
    r["remove(pinned, force)"] = [s.remove(f"hp-{i:02d}", True) for i in range(3)]
    time.sleep(0.5)
    r["put after removals"] = s.put_from("more", v4.ctypes.data, v4.nbytes)
    r["get_into after removals"] = s.get_into("more", buf.ctypes.data, buf.nbytes)
    s.remove_all(True)
    r["close"] = s.close()
    return r


def main() -> None:
    impl = sys.argv[1]
    s, rc, cleanup = open_store(impl)
    try:
        print(json.dumps(probe(s, rc)))
    finally:
        cleanup()


if __name__ == "__main__":
    main()
