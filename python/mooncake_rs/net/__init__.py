"""Transport pieces with no serving knowledge, shared by a cluster's links, its remote
clients, the deployment and the KV pool (torch-free; docs/design.md, the layers):

- ``framing.py``: msgpack messages of a tagged union in length-prefixed frames.
- ``channel.py``: ``FramedChannel``, a socket link whose reader thread delivers into a sink.
- ``auth_socket.py`` / ``sealed.py``: TCP connections authenticated by the cluster token,
  then sealed (AES-256-GCM records under keys bound to the handshake).
- ``etcd.py``: a small etcd v3 client over its JSON gateway, standard library only.
"""
