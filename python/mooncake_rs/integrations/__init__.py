"""Adapters that let engines we did not write use our parts.

- ``integrations.pool``: the KV pool service (a :class:`~mooncake_rs.Store` behind an
  authenticated control socket, its arena reachable through our
  :class:`~mooncake_rs.TransferEngine`); torch-free.
- ``integrations.vllm``: ``MooncakeRsConnector``, a vLLM KV connector on that pool (the
  only place that imports torch and vLLM).

Nothing below this package imports it.
"""
