"""Transport pieces with no serving knowledge, shared by a cluster's links, its remote
clients, the deployment and the KV pool: msgpack framing (framing.py) and a socket
channel with a reader thread (channel.py). Torch-free (see docs/design.md, the layers)."""
