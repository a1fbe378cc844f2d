"""Deployment across hosts: membership on etcd (issue 12's foundation).

- ``net/etcd.py`` (below this package; ``EtcdClient`` re-exported here): a small etcd v3
  client over its JSON gateway (leases, keys, a create-if-absent transaction, prefix
  watches; etcd's user/password and TLS), standard library only.
- ``records.py``: what a worker announces (``WorkerRecord``, ``ModelFingerprint``), the
  key layout under a cluster prefix, and the records' signatures (cluster token).
- ``lease.py``: a lease kept alive by a thread.
- ``registration.py``: a worker's registration (fingerprint check, unique name, rejoin
  after an outage).
- ``membership.py``: the live set of workers as the conductor sees it (watch + resync,
  last known view while etcd is down).
- ``election.py``: leader election among ``serve`` processes.
- ``net/auth_socket.py``: TCP control connections authenticated by the cluster token
  (mutual HMAC challenge-response); ``net/sealed.py``: the sealed session that follows
  (AES-256-GCM records under keys bound to the handshake). Both below this package: the
  KV pool and ``RemoteCluster`` use them too.
- ``worker.py`` / ``worker_link.py``: ``mooncake-rs worker``, one instance on a host, and
  the control links its conductors open to it.
- ``service.py`` / ``service_clients.py`` / ``serve.py``: ``mooncake-rs serve --etcd``, the
  conductor over the workers in etcd, its client endpoint, and the leader election
  around it.
- ``client/remote.py`` / ``client/protocol.py`` (below ``serving``; ``RemoteCluster``
  re-exported here): ``Cluster.connect``'s Python client of a running deployment, and
  what it says on the wire.

See docs/deploy.md.
"""

from .election import LeaderElection
from ..net.etcd import EtcdClient
from .membership import Membership
from ..client.records import ModelFingerprint, WorkerRecord
from .registration import WorkerRegistration
from ..client.remote import RemoteCluster

__all__ = ["EtcdClient", "LeaderElection", "Membership", "ModelFingerprint", "RemoteCluster", "WorkerRecord",
           "WorkerRegistration"]
