"""A transfer-engine peer process for the cross-process tests and the benchmark.

Started as ``python tests/transfer_peer.py CONFIG_JSON``; creates an engine, allocates
the regions the config names, fills them with seeded random bytes, prints one JSON line
``{"address": ..., "regions": {name: id}}`` and then answers commands read from stdin,
one per line: ``sum ID`` (sha256 of a region), ``stats``, ``grant ID PEER OFFSET LENGTH``
(a write grant on a region with ``"restricted": true``; prints its id), ``revoke ID PEER``
(prints how many grants went), ``quit``. It exits by itself
after ``lifetime_s`` seconds or when stdin closes, so it can never outlive its test.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys

import numpy as np

import mooncake_rs as mc


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.alarm(int(cfg.get("lifetime_s", 60)))
    eng = mc.TransferEngine(
        cfg.get("name", "peer"),
        listen=cfg.get("listen", "127.0.0.1:0"),
        auth_token=cfg.get("auth_token"),
        transports=cfg.get("transports", ["local", "shm", "tcp"]),
        wire_protection=cfg.get("wire_protection"),
    )
    regions: dict[str, mc.Region] = {}
    keep = []
    for i, spec in enumerate(cfg.get("regions", [])):
        if spec.get("shared", True):
            r = eng.allocate(
                spec["length"], readonly=spec.get("readonly", False), restricted=spec.get("restricted", False)
            )
        else:
            buf = bytearray(spec["length"])
            keep.append(buf)
            r = eng.register(buf, readonly=spec.get("readonly", False), restricted=spec.get("restricted", False))
        a = np.asarray(r) if spec.get("shared", True) else np.frombuffer(keep[-1], dtype=np.uint8)
        if spec.get("fill", True):
            a[:] = np.random.default_rng(spec.get("seed", i)).integers(0, 256, a.size, dtype=np.uint8)
        regions[spec["name"]] = r
    by_id = {r.id: r for r in regions.values()}
    print(json.dumps({"address": eng.address, "regions": {n: r.id for n, r in regions.items()}}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "sum":
            print(hashlib.sha256(memoryview(by_id[int(cmd[1])])).hexdigest(), flush=True)
        elif cmd[0] == "stats":
            s = eng.stats()
            keys = ("auth_failures", "bad_frames", "refused", "bytes_served", "grant_refusals", "bytes_staged",
                    "bytes_staged_read")
            print(json.dumps({k: getattr(s, k) for k in keys}), flush=True)
        elif cmd[0] == "grant":
            print(eng.grant(int(cmd[1]), cmd[2], int(cmd[3]), int(cmd[4])), flush=True)
        elif cmd[0] == "revoke":
            print(eng.revoke(int(cmd[1]), cmd[2]), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
