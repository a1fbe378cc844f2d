"""A pool client that hangs holding a lease (run by test_pool_leases.py in its own
process): ``ETCD PREFIX KEY SIZE``. It leases KEY on the only node, prints the lease as
one JSON line, then waits for a line on stdin (the test stops it with SIGSTOP meanwhile,
its connection open); then it reads the leased slots late with its transfer engine and
prints what happened: the transfer's status and the bytes it got."""

from __future__ import annotations

import json
import sys

import numpy as np

from pool_helpers import TOKEN, value_of

from mooncake_rs import TransferRequest
from mooncake_rs.pool import DistributedStore
from mooncake_rs.pool.protocol import Lookup


def main() -> None:
    _, etcd, prefix, key, size = sys.argv
    n = int(size)
    with DistributedStore.connect(etcd, auth_token=TOKEN, prefix=prefix, transports=("tcp",)) as s:
        be = s.backend
        node = be.nodes.live()[0]
        link = be.nodes.link(node)
        rep = link.call(Lookup, keys=[key], engine=be.name)
        assert rep.statuses == [0] and rep.lease_ids[0] > 0, rep
        print(json.dumps({"lease": rep.lease_ids[0], "offsets": rep.offsets[0]}), flush=True)
        sys.stdin.readline()  # (stopped here by the test)
        dst = np.zeros(n, np.uint8)
        local = be.te.register(dst)
        first = min(n, rep.chunk_bytes[0])
        st = be.te.submit([TransferRequest("read", local, 0, link.peer, rep.regions[0], rep.offsets[0][0], first)],
                          timeout_s=10).wait()[0]
        print(json.dumps({"ok": st.ok, "code": st.code, "untouched": not dst.any(),
                          "own_bytes": bool(np.array_equal(dst[:first], value_of(key, n)[:first]))}), flush=True)


if __name__ == "__main__":
    main()
