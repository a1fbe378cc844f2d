"""A pool client in its own process (run on a namespace host by test_pool_netns.py):
``put ETCD CLUSTER N SIZE REPLICAS`` stores keys ``k0..`` with pool_helpers.value_of."""

from __future__ import annotations

import sys

from pool_helpers import TOKEN, value_of

from mooncake_rs.client.records import cluster_prefix
from mooncake_rs.pool import DistributedStore, KeyStatus


def main() -> None:
    _, op, etcd, cluster, n, size, replicas = sys.argv
    with DistributedStore.connect(etcd, auth_token=TOKEN, prefix=cluster_prefix(cluster), wait_nodes=3,
                                  transports=("tcp",)) as s:
        vals = [value_of(f"k{i}", int(size) + i) for i in range(int(n))]
        st = s.batch_put_from([f"k{i}" for i in range(int(n))], [[v.ctypes.data] for v in vals],
                              [[v.nbytes] for v in vals], replicas=int(replicas))
        assert all(x == KeyStatus.OK for x in st), st
    print("done", flush=True)


if __name__ == "__main__":
    main()
